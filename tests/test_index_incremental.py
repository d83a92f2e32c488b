"""Incremental index builds: a copy of the CURRENT version minus what was forgotten,
compacted or truncated since, plus what was appended; retrains when they must."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import faiss
import numpy as np
import numpy.typing as npt
import pytest

from memlm.datastore import Datastore
from memlm.index import (
    INDEX_FILE,
    BuildInfo,
    IndexParams,
    MemoryIndex,
    build_index,
    load_version,
    retrain_reason,
)

DIM = 16
FLAT = IndexParams.exact()
PQ = IndexParams(kind="ivfpq", nlist=16, m=4, nprobe=16, train_size=2000, rerank_factor=8)


def append(ds: Datastore, n: int, seed: int, docs: tuple[int, int]) -> None:
    """``n`` clustered keys, spread over documents [docs[0], docs[1])."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(0).standard_normal((20, ds.dim)) * 3
    keys = centers[rng.integers(0, 20, n)] + rng.standard_normal((n, ds.dim))
    ds.append(
        keys.astype(np.float16),
        rng.integers(0, 1000, n),
        rng.integers(docs[0], docs[1], n),
        np.arange(n),
        0,
    )


def brute_force(ds: Datastore, q: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    ids = np.arange(len(ds))
    ids = ids[ds.live_mask(ids)]
    x = ds.keys(ids).astype(np.float64)
    d = ((q[:, None, :].astype(np.float64) - x[None]) ** 2).sum(-1)
    return ids[np.argsort(d, axis=1, kind="stable")[:, :k]]


def indexed_ids(root: Path, version: int) -> npt.NDArray[np.int64]:
    index, _ = load_version(root, version)
    if isinstance(index, faiss.IndexIDMap):
        return np.sort(faiss.vector_to_array(index.id_map))
    invlists = index.invlists
    parts = [
        faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
        for i in range(index.nlist)
    ]
    return np.sort(np.concatenate(parts))


def queries(n: int, seed: int) -> npt.NDArray[np.float32]:
    return (np.random.default_rng(seed).standard_normal((n, DIM)) * 3).astype(np.float32)


@pytest.fixture
def ds(tmp_path: Path) -> Datastore:
    return Datastore.open(tmp_path / "ds", dim=DIM, max_segment_entries=700)


def test_flat_incremental_removes_forgotten_and_adds_appended(ds: Datastore, tmp_path: Path):
    root = tmp_path / "ix"
    append(ds, 1000, 1, (0, 10))
    first = build_index(ds, root, FLAT, progress=False)
    assert (first.mode, first.reason, first.added, first.trained_entries) == (
        "full",
        "first build",
        1000,
        1000,
    )
    append(ds, 400, 2, (10, 14))
    gone = len(ds.entries_of_document(3)) + len(ds.entries_of_document(11))
    ds.delete_document(3)
    ds.delete_document(11)  # appended after the build: never added
    info = build_index(ds, root, FLAT, progress=False)
    assert (info.mode, info.base_version, info.version) == ("incremental", 1, 2)
    assert info.entries == ds.num_live == 1400 - gone
    assert info.added == 400 - len(ds.entries_of_document(11))
    assert info.removed == len(ds.entries_of_document(3))
    assert BuildInfo.read(info.path).to_json() == info.to_json()  # meta.json says it all
    live = np.arange(len(ds))[ds.live_mask(np.arange(len(ds)))]
    np.testing.assert_array_equal(indexed_ids(root, 2), live)
    mem = MemoryIndex(ds, root)
    assert mem.stats()["fresh_entries"] == 0
    q = queries(20, 3)
    np.testing.assert_array_equal(mem.search(q, 25)[1], brute_force(ds, q, 25))
    assert info.record()["mode"] == "incremental" and "remove_seconds" in info.record()


def test_ivfpq_incremental_keeps_the_trained_quantizer(
    ds: Datastore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "ix"
    append(ds, 2000, 4, (0, 20))
    full = build_index(ds, root, PQ, progress=False)
    append(ds, 1500, 5, (20, 30))
    ds.delete_document(7)
    info = build_index(ds, root, progress=False)  # no params: keeps the base's
    assert (info.mode, info.params, info.trained_entries) == ("incremental", PQ, 2000)
    assert info.train_seconds == 0 and info.added == 1500
    a, _ = load_version(root, full.version)
    b, _ = load_version(root, info.version)
    # the same coarse centroids and PQ codebooks: nothing was retrained
    np.testing.assert_array_equal(
        a.quantizer.reconstruct_n(0, PQ.nlist), b.quantizer.reconstruct_n(0, PQ.nlist)
    )
    np.testing.assert_array_equal(
        faiss.vector_to_array(a.pq.centroids), faiss.vector_to_array(b.pq.centroids)
    )
    assert b.use_precomputed_table == 1  # served, the nlist*m*256 table fits the budget
    monkeypatch.setenv("MEMLM_PQ_TABLE_MB", "0")
    assert load_version(root, info.version)[0].use_precomputed_table == -1  # none in RAM
    live = np.arange(len(ds))[ds.live_mask(np.arange(len(ds)))]
    np.testing.assert_array_equal(indexed_ids(root, info.version), live)
    mem = MemoryIndex(ds, root)
    q = ds.keys(live[::97]).astype(np.float32)
    _, i = mem.search(q, 1)
    np.testing.assert_array_equal(i[:, 0], live[::97])  # each key finds itself (re-rank)


def test_growth_forces_a_retrain_with_params_for_the_size(ds: Datastore, tmp_path: Path):
    root = tmp_path / "ix"
    append(ds, 1000, 6, (0, 10))
    build_index(ds, root, PQ, progress=False)
    append(ds, 2000, 7, (10, 20))  # 3x: still incremental
    assert build_index(ds, root, progress=False).mode == "incremental"
    append(ds, 1000, 8, (20, 30))  # 4x the 1000 trained on
    info = build_index(ds, root, progress=False)
    assert info.mode == "full" and "grew 4.0x" in info.reason
    # for_size(4000) is exact: the size change picks the parameters
    assert info.params == IndexParams.for_size(4000, DIM) and info.trained_entries == 4000
    forced = build_index(ds, root, retrain=True, progress=False)
    assert (forced.mode, forced.reason) == ("full", "retrain requested")
    other = build_index(ds, root, PQ, progress=False)
    assert (other.mode, other.reason) == ("full", "other index parameters requested")


def test_retrain_reasons() -> None:
    base = BuildInfo(3, 1000, 1000, PQ, 1.0, 1.0, Path("v000003"), dim=DIM, trained_entries=1000)
    assert retrain_reason(None, 10, DIM, None, False) == "first build"
    assert retrain_reason(base, 3999, DIM, None, False) == ""
    assert retrain_reason(base, 3999, DIM, PQ, False) == ""
    assert "grew" in retrain_reason(base, 4000, DIM, None, False)
    assert "shrank" in retrain_reason(base, 250, DIM, None, False)
    assert "dimension" in retrain_reason(base, 1000, DIM + 1, None, False)
    flat = replace(base, params=FLAT)
    assert retrain_reason(flat, 40_000, DIM, None, False) == ""  # exact: nothing trained
    assert "outgrew" in retrain_reason(flat, 60_000, DIM, None, False)
    big = replace(base, trained_entries=60_000)
    assert retrain_reason(big, 40_000, DIM, None, False) == ""  # IVF-PQ while < 4x apart


def test_incremental_after_truncate_and_compaction(ds: Datastore, tmp_path: Path):
    root = tmp_path / "ix"
    append(ds, 1200, 9, (0, 12))
    build_index(ds, root, FLAT, progress=False)
    ds.truncate(1000)  # ids 1000..1199 of v1 now name nothing ...
    append(ds, 300, 10, (12, 15))  # ... then other entries
    ds.delete_document(5)
    assert ds.compact().rows_removed > 0  # the rows are gone from disk: never read again
    info = build_index(ds, root, progress=False)
    assert info.mode == "incremental"
    live = np.arange(len(ds))[ds.live_mask(np.arange(len(ds)))]
    np.testing.assert_array_equal(indexed_ids(root, info.version), live)
    q = queries(15, 11)
    np.testing.assert_array_equal(MemoryIndex(ds, root).search(q, 30)[1], brute_force(ds, q, 30))


def test_unreadable_current_version_retrains(ds: Datastore, tmp_path: Path):
    root = tmp_path / "ix"
    append(ds, 500, 12, (0, 5))
    first = build_index(ds, root, FLAT, progress=False)
    (first.path / "meta.json").write_text("{", encoding="utf-8")
    info = build_index(ds, root, FLAT, progress=False)
    assert info.mode == "full" and "cannot be read" in info.reason
    # a base whose file does not match its meta is not built on: trained from scratch
    append(ds, 10, 13, (5, 6))
    index, _ = load_version(root, info.version)
    index.remove_ids(faiss.IDSelectorRange(0, 10))
    faiss.write_index(index, str(info.path / INDEX_FILE))
    again = build_index(ds, root, FLAT, progress=False)
    assert again.mode == "full" and "index has 490" in again.reason
    assert again.entries == 510
    (again.path / INDEX_FILE).write_bytes(b"")
    assert "cannot be read" in build_index(ds, root, FLAT, progress=False).reason
