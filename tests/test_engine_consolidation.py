"""Consolidation and the memory budget in the engine's nightly build, on every backend:
a build killed at each consolidation point leaves the previous version served and counts
nothing twice; the budget holds after a build; a forget between two builds stays gone;
the build record and the stats say what was retired and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memlm.calibrator.heldout import HeldOutConfig
from memlm.engine import Engine
from memlm.knnlm import KnnParams
from memlm.memory import SimulatedCrash
from memlm.memory.consolidation import CONSOLIDATE_CRASH_POINTS, ConsolidationConfig
from tests.test_engine_backends import DAY, TEXTS, memory_url, opened, tiny  # noqa: F401

BUDGET = 60  # below what the re-test leaves of the duplicated stream (~117)


def _open(data_dir: Path, encoder: Any, url: str | None) -> Engine:
    """MoNIM with delta 0 stores every token (so usage is counted from its searches);
    consolidation re-tests against MoNIM's usual -1.5 with lambda 0.5."""
    data_dir.mkdir(parents=True, exist_ok=True)  # the service's settings create it
    return Engine.open(
        data_dir,
        encoder=encoder,
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        policy="monim",
        delta=0.0,
        grid=None,
        heldout=HeldOutConfig(enabled=False),
        memory_url=url,
        shared=True,
        consolidation=ConsolidationConfig(sample=10_000, delta=-1.5, budget=BUDGET),
    )


def _ingest(engine: Engine) -> int:
    """Six documents, each twice (a near-duplicate stream): returns the entries stored."""
    n = 0
    for i, t in enumerate(TEXTS[:6]):
        n += engine.process_document(2 * i + 1, t, DAY).tokens_stored
        n += engine.process_document(2 * i + 2, t, DAY).tokens_stored
    return n


def test_a_build_killed_at_each_consolidation_point(
    tmp_path: Path,
    tiny: Any,  # noqa: F811
    memory_url: str | None,  # noqa: F811
    opened: list[Engine],  # noqa: F811
) -> None:
    data = tmp_path / "data"
    engine = _open(data, tiny, memory_url)
    opened.append(engine)
    engine.process_document(100, TEXTS[11], DAY)
    assert engine.rebuild().version == 1  # 1 document: under budget, nothing redundant
    stored = _ingest(engine) + engine.memory.count()
    assert stored > BUDGET
    for point in CONSOLIDATE_CRASH_POINTS:
        with pytest.raises(SimulatedCrash):
            engine.rebuild(crash_at=point)
        engine.memory.close()
        opened.remove(engine)
        engine = _open(data, tiny, memory_url)
        opened.append(engine)
        assert engine.reconcile_index({1}, delete=True) == []
        assert engine.served_version == 1, point
    info = engine.rebuild()
    assert info.version == 2 and engine.served_version == 2
    cons = info.consolidation
    assert cons is not None and cons["budget"] == BUDGET
    # the crashed nights retired (the last one down to the budget); this one found those
    # entries gone (nothing counted twice), re-tested what is left against the smaller
    # memory, and kept the budget
    live = engine.memory.count()
    assert live <= BUDGET and live == info.entries == cons["live_after"]
    assert cons["retired"]["test"] + cons["retired"]["budget"] == cons["live_before"] - live
    assert cons["live_before"] <= BUDGET  # the crash after the budget's retirement held
    stats = engine.stats()["consolidation"]
    assert stats["budget"] == BUDGET and stats["last"]["live_after"] == live
    assert stats["usage"]["retrievals"] > 0


def test_duplicates_retire_and_a_forget_stays_gone(
    tmp_path: Path,
    tiny: Any,  # noqa: F811
    memory_url: str | None,  # noqa: F811
    opened: list[Engine],  # noqa: F811
) -> None:
    engine = _open(tmp_path / "data", tiny, memory_url)
    engine.consolidation = ConsolidationConfig(sample=10_000, delta=-1.5)  # no budget
    opened.append(engine)
    stored = _ingest(engine)
    engine.forget_document(1)  # the first copy of TEXTS[0]: its twin now stands alone
    left = engine.memory.count()
    info = engine.rebuild()
    cons = info.consolidation
    assert cons is not None and cons["failed"] > 0
    # the twins of documents 3..12 are exact duplicates: one of each pair fails
    assert cons["retired"]["test"] >= (stored - left) * 5 // 2
    assert engine.memory.count() == left - cons["retired"]["test"] == info.entries
    for doc in (1,):  # forgotten: absent from every answer after consolidation and build
        found = engine.predict(TEXTS[0][:60], top_n=5, neighbours=8)
        assert doc not in {n.doc_id for n in found.neighbours}


def test_a_document_retried_after_a_failed_append_counts_its_usage_once(
    tmp_path: Path,
    tiny: Any,  # noqa: F811
    memory_url: str | None,  # noqa: F811
    opened: list[Engine],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usage of a document's search is counted with its lexical statistics, once: a
    put that fails (a full disk) and the worker's retry together count the document's one
    search once (the oracle: that search, counted alone); preparing counts nothing."""
    from memlm.memory.usage import Usage

    engine = _open(tmp_path / "data", tiny, memory_url)
    opened.append(engine)
    engine.process_document(1, TEXTS[0], DAY)
    once = Usage(engine.usage.block)
    prep = engine.prepare_document(2, TEXTS[1], DAY)  # preparing counts nothing
    assert prep.usage is not None
    once.add(*prep.usage)
    assert once.totals()["retrievals"] > 0
    before = engine.usage.totals()

    real_put = engine.memory.put_document

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine.memory, "put_document", full_disk)
    with pytest.raises(OSError):
        engine.process_document(2, TEXTS[1], DAY)
    monkeypatch.setattr(engine.memory, "put_document", real_put)
    engine.process_document(2, TEXTS[1], DAY)  # the retry: stored now
    after = engine.usage.totals()
    for key in ("retrievals", "hits"):
        assert after[key] - before[key] == once.totals()[key], key


def test_the_engine_keeps_each_stored_entrys_lm_logprob_across_a_restart(
    tmp_path: Path,
    tiny: Any,  # noqa: F811
    memory_url: str | None,  # noqa: F811
    opened: list[Engine],  # noqa: F811
) -> None:
    """The oracle: the encoder's log p_LM of each stored token, by (document, position)."""
    import numpy as np

    engine = _open(tmp_path / "data", tiny, memory_url)
    engine.consolidation = ConsolidationConfig()  # nothing retired: every entry checked
    opened.append(engine)
    texts = {1: TEXTS[0], 2: TEXTS[1]}
    for doc, text in texts.items():
        engine.process_document(doc, text, DAY)
    want: dict[tuple[int, int], float] = {}
    for doc, text in texts.items():
        out = engine.prepare_document(99, text, DAY).outputs
        want |= {
            (doc, int(p)): float(v) for p, v in zip(out.positions, out.target_logprob, strict=True)
        }

    def check(e: Engine) -> None:
        ids, _ = e.memory.live_days()
        prov = e.memory.provenance(ids)
        got = e.entry_lm.of(ids)
        expect = [
            want[(int(d), int(p))] for d, p in zip(prov.documents, prov.positions, strict=True)
        ]
        assert len(ids) == len(e.entry_lm) and not np.isnan(got).any()
        np.testing.assert_allclose(got, expect, rtol=2e-3, atol=2e-3)  # float16

    check(engine)
    engine.rebuild()  # saves them beside the usage counts
    engine.close()
    opened.remove(engine)
    again = _open(tmp_path / "data", tiny, memory_url)
    opened.append(again)
    check(again)
