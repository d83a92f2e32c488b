"""`memlm migrate-memory`: a faiss memory moved into Milvus keeps its live entries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from memlm.cli import app
from memlm.index import IndexParams
from memlm.memory import open_faiss, open_milvus

pytestmark = pytest.mark.milvus

DIM = 24


def test_migrate_memory_moves_live_entries(tmp_path: Path, milvus_url: str) -> None:
    rng = np.random.default_rng(0)
    fa = open_faiss(tmp_path / "memory", DIM)
    for doc in range(6):
        n = 50 + 10 * doc
        fa.append(
            rng.standard_normal((n, DIM)).astype(np.float16),
            rng.integers(0, 900, n),
            np.full(n, doc),
            np.arange(n) + 3,
            np.full(n, 17_000 + doc),
        )
    assert fa.delete_document(2) == 70  # forgotten: stays behind
    live = fa.count()
    q = rng.standard_normal((10, DIM)).astype(np.float32)
    fd, fi, fv = fa.search(q, 12)
    pf = fa.provenance(fi.reshape(-1))
    fa.close()

    runner = CliRunner()
    res = runner.invoke(app, ["migrate-memory", "--to", milvus_url, "--data-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert f"copied {live} entries" in res.output

    mem = open_milvus(milvus_url, DIM)
    try:
        assert mem.count() == live == 6 * 50 + 150 - 70
        assert mem.params == IndexParams.exact()  # small: FLAT, as the faiss memory
        md, mi, mv = mem.search(q, 12)
        pm = mem.provenance(mi.reshape(-1))
        assert mv.tolist() == fv.tolist()
        assert pm.documents.tolist() == pf.documents.tolist()
        assert pm.positions.tolist() == pf.positions.tolist()
        assert pm.days.tolist() == pf.days.tolist()
        np.testing.assert_allclose(md, fd, rtol=1e-4, atol=1e-3)
        assert 2 not in set(pm.documents.tolist())
    finally:
        mem.close()

    # a second run into the same (now full) collection is refused, nothing is doubled
    res = runner.invoke(app, ["migrate-memory", "--to", milvus_url, "--data-dir", str(tmp_path)])
    assert res.exit_code == 1
    assert "already holds" in res.output


def test_migrate_memory_refuses_bad_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["migrate-memory", "--to", "faiss", "--data-dir", str(tmp_path)])
    assert res.exit_code == 2 and "milvus://" in res.output
    res = runner.invoke(
        app, ["migrate-memory", "--to", "milvus://h/c", "--data-dir", str(tmp_path)]
    )
    assert res.exit_code == 2 and "no faiss memory" in res.output
