"""The same documents through the ``faiss`` and the ``milvus`` memories: the same
neighbours on an exact index, recall >= 0.9 at k=64 on IVF_PQ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memlm.index import IndexParams
from memlm.memory import open_faiss, open_milvus

pytestmark = pytest.mark.milvus

DIM = 32


def _docs(rng: np.random.Generator, n_docs: int, per_doc: int):
    """Clustered keys (as LM keys are): 64 centres, unit noise; one append per document."""
    centres = rng.standard_normal((64, DIM)).astype(np.float32) * 4
    for doc in range(n_docs):
        c = centres[rng.integers(0, 64, per_doc)]
        keys = (c + rng.standard_normal((per_doc, DIM))).astype(np.float32)
        # float16 round trip: the faiss datastore keeps float16 keys, Milvus float32
        keys = keys.astype(np.float16).astype(np.float32)
        values = rng.integers(0, 5000, per_doc).astype(np.int32)
        yield keys, values, np.full(per_doc, doc), np.arange(per_doc), np.full(per_doc, 100 + doc)


def _fill(tmp_path: Path, url: str, n_docs: int, per_doc: int, seed: int):
    rng = np.random.default_rng(seed)
    fa = open_faiss(tmp_path / "faiss", DIM)
    mi = open_milvus(url, DIM)
    # all documents in one call each (a Milvus call per document costs a delete round trip)
    cols = [np.concatenate(c) for c in zip(*_docs(rng, n_docs, per_doc), strict=True)]
    ids_f = fa.append(*cols)
    ids_m = mi.append(*cols)
    # faiss id -> milvus id, to compare neighbour lists entry by entry
    f2m = dict(zip(ids_f.tolist(), ids_m.tolist(), strict=True))
    return fa, mi, cols[0], f2m, rng


def test_exact_index_same_neighbours(tmp_path: Path, milvus_url: str) -> None:
    fa, mi, keys, f2m, rng = _fill(tmp_path, milvus_url, 12, 150, seed=0)
    try:
        fa.build_index(IndexParams.exact())
        mi.build_index(IndexParams.exact())
        assert fa.count() == mi.count() == 1800
        q = (keys[rng.integers(0, len(keys), 40)] + rng.standard_normal((40, DIM))).astype(
            np.float32
        )
        fd, fi, fv = fa.search(q, 16)
        md, mi_ids, mv = mi.search(q, 16)
        assert [[f2m[int(i)] for i in row] for row in fi] == mi_ids.tolist()
        assert fv.tolist() == mv.tolist()
        np.testing.assert_allclose(fd, md, rtol=1e-4, atol=1e-3)
        # provenance agrees entry by entry
        pf, pm = fa.provenance(fi[0]), mi.provenance(mi_ids[0])
        assert pf.documents.tolist() == pm.documents.tolist()
        assert pf.positions.tolist() == pm.positions.tolist()
        assert pf.days.tolist() == pm.days.tolist()
        # forgetting a document removes the same entries from both
        assert fa.delete_document(3) == mi.delete_document(3) == 150
        _, fi, _ = fa.search(q, 16)
        _, mi_ids, _ = mi.search(q, 16)
        assert [[f2m[int(i)] for i in row] for row in fi] == mi_ids.tolist()
        assert fa.stats()["entries"] == mi.stats()["entries"] == 1650
    finally:
        fa.close()
        mi.close()


def test_ivfpq_recall_at_64(tmp_path: Path, milvus_url: str) -> None:
    fa, mi, keys, _, rng = _fill(tmp_path, milvus_url, 20, 1000, seed=1)
    try:
        # what IndexParams.for_size picks near 20k entries, at DIM=32 (m must divide it)
        params = IndexParams(kind="ivfpq", nlist=512, m=16, nprobe=16, train_size=20_000)
        fa.build_index(params)
        info = mi.build_index(params)
        assert info["params"]["kind"] == "ivfpq"
        q = (keys[rng.integers(0, len(keys), 200)] + rng.standard_normal((200, DIM))).astype(
            np.float32
        )
        d = ((q[:, None, :] - keys[None, :, :]) ** 2).sum(-1)
        truth = np.argsort(d, axis=1)[:, :64]  # row numbers == faiss ids (append order)
        _, fi, _ = fa.search(q, 64)
        _, mids, _ = mi.search(q, 64)
        # milvus ids are doc * 2**24 + position: back to row numbers
        rows = (mids >> 24) * 1000 + (mids & ((1 << 24) - 1))

        def recall(found: np.ndarray) -> float:
            return float(
                np.mean([len(set(f) & set(t)) / 64 for f, t in zip(found, truth, strict=True)])
            )

        r_f, r_m = recall(fi), recall(rows)
        print(f"recall@64 faiss {r_f:.3f} milvus {r_m:.3f}")
        assert r_f >= 0.9
        assert r_m >= 0.9
    finally:
        fa.close()
        mi.close()
