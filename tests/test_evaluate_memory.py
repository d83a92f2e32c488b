"""The harness on any memory (memlm.evaluate.memories): the same stream ingested into the
faiss files and into Milvus collections gives the same MemRate and perplexities with
exact indexes (issue 32, "ppl parity")."""

from __future__ import annotations

import datetime as dt
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memlm.corpus import Document
from memlm.encoder import Encoder
from memlm.evaluate import evaluate
from memlm.evaluate.checkpoint import SimulatedInterruption
from memlm.evaluate.memories import FAISS, MilvusRunMemory, identity_of, run_memory
from memlm.knnlm import KnnParams
from memlm.memory import open_milvus
from memlm.memory.embedded import EmbeddedMilvus
from tests.test_evaluate_stream import _cfg, _text

# one token each in tiny-llama's vocabulary (the test checks)
OPENINGS = [
    "budget",
    "roads",
    "city",
    "today",
    "river",
    "bridge",
    "market",
    "rain",
    "storm",
    "court",
    "trial",
    "museum",
    "opened",
    "winter",
    "music",
    "league",
    "match",
    "goal",
    "season",
    "transfer",
    "bank",
    "rates",
    "inflation",
    "factory",
    "workers",
]


@pytest.fixture(scope="module")
def enc() -> Encoder:
    return Encoder.load("tiny-llama", threads=1)


def test_each_policy_gets_a_collection_of_its_own() -> None:
    assert run_memory(None, "monim") is FAISS and run_memory("faiss", "monim") is FAISS
    memory = run_memory("milvus://h:7/pre?index=hnsw&rerank=1", "monim+cons")
    assert isinstance(memory, MilvusRunMemory)
    assert (memory.url.host, memory.url.port) == ("h", 7)
    assert (memory.url.collection, memory.url.index, memory.url.rerank) == (
        "pre_monim_cons",
        "hnsw",
        True,
    )
    # a resumed run must use the same collections and index, on any address
    assert identity_of(None) is None and identity_of("faiss") is None
    assert identity_of("milvus://a:1/pre") == identity_of("milvus://b:2/pre")
    assert identity_of("milvus://a:1/pre") != identity_of("milvus://a:1/other")
    assert identity_of("milvus://a:1/pre") != identity_of("milvus://a:1/pre?index=ivf_pq")


def _stream(enc: Encoder, days: int, per_day: int = 6) -> list[Document]:
    """Documents that open with a token of their own: no two share a prefix, so no two
    keys are identical and no neighbour ties are left for the two engines to break
    differently (with a random LM the memory decides most of a token's probability, and
    one gold neighbour more or less moves the ppl by percents)."""
    assert all(len(enc.tokenize(w)) == 1 for w in OPENINGS[: days * per_day])
    rng = np.random.default_rng(5)
    return [
        Document(
            f"d{d}-{i}",
            f"{OPENINGS[d * per_day + i]} {_text(rng, 30)}",
            dt.date(2021, 1, 31) + dt.timedelta(d),  # crosses a month's end
            "src",
        )
        for d in range(days)
        for i in range(per_day)
    ]


def _collections(server: EmbeddedMilvus, prefix: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pymilvus import connections, utility

    alias = f"list-{prefix}"
    connections.connect(alias=alias, host=server.host, port=server.port)
    try:
        return sorted(n for n in utility.list_collections(using=alias) if n.startswith(prefix))
    finally:
        connections.disconnect(alias)


@pytest.fixture
def prefix(milvus_server: EmbeddedMilvus) -> Iterator[str]:
    """A collection prefix of the test's own; whatever is left of it is dropped after."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    for policy in ("fullmem", "monim"):
        memory = run_memory(f"{milvus_server.url}/{name}", policy)
        assert isinstance(memory, MilvusRunMemory)
        memory._drop()


def _numbers(report: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "memrate": r["memrate"],
            "entries": r["entries"],
            "test_ppl": r["test_ppl"],
            "dev_ppl": r["dev_ppl"],
            "per_day": [(d["stored"], d["entries"]) for d in report["per_day"][name]],
        }
        for name, r in report["results"].items()
    }


@pytest.mark.milvus
def test_the_harness_gives_the_same_numbers_on_faiss_and_milvus(
    milvus_server: EmbeddedMilvus,
    prefix: str,
    enc: Encoder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FullMem and MoNIM (which decides against the memory) with exact indexes: the same
    stores, MemRate, and dev and test ppl on both backends; a MoNIM run interrupted on
    Milvus resumes there; a leftover collection of a policy's name is dropped first."""
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(
        policies=("fullmem", "monim"),
        forgetting_policies=("monim",),
        index_kind="flat",
        # a random LM's log p is ~-10: MoNIM skips a token only where the memory lifts it
        # (~70% stored), so its decisions depend on what each backend finds
        delta=-5.0,
        ingest=KnnParams(k=16, temperature=10.0, lmbda=0.9),
    )
    docs = _stream(enc, days=2)  # (every evening's build on Milvus waits 2-8 s for the server)
    faiss = evaluate(cfg, docs, tmp_path / "faiss", encoder=enc, echo=str)
    url = f"{milvus_server.url}/{prefix}"
    leftover = open_milvus(f"{url}_fullmem", enc.dim)  # an earlier run's entries
    leftover.append(np.ones((3, enc.dim)), [1, 2, 3], [999, 999, 999], [0, 1, 2], [1, 1, 1])
    leftover.close()
    on_milvus = replace(cfg, memory_url=url)
    with pytest.raises(SimulatedInterruption):
        evaluate(
            replace(on_milvus, crash_at=("monim", 0)), docs, tmp_path / "m", encoder=enc, echo=str
        )
    milvus = evaluate(replace(on_milvus, resume=True), docs, tmp_path / "m", encoder=enc, echo=str)

    want, got = _numbers(faiss), _numbers(milvus)
    assert set(got) == {"bare", "fullmem", "monim"}
    for name in want:
        assert got[name]["per_day"] == want[name]["per_day"], name
        assert got[name]["memrate"] == want[name]["memrate"], name
        assert got[name]["entries"] == want[name]["entries"], name
        # (the distances agree to ~1e-5: float32 sums in another order)
        for split in ("test_ppl", "dev_ppl"):
            assert got[name][split] == pytest.approx(want[name][split], rel=1e-4), (name, split)
    assert 0.5 < want["monim"]["memrate"] < 0.9
    for day in range(2):
        with (
            np.load(tmp_path / "faiss" / "work" / "monim" / "eval" / f"day-{day:04d}.npz") as a,
            np.load(tmp_path / "m" / "work" / "monim" / "eval" / f"day-{day:04d}.npz") as b,
        ):
            np.testing.assert_allclose(b["test_distances"], a["test_distances"], atol=1e-4)
            np.testing.assert_array_equal(b["test_values"], a["test_values"])
    # the month-end re-scores of the test sets went through the Milvus memory too
    assert sorted(p.name for p in (tmp_path / "m" / "work" / "monim" / "rescore").iterdir()) == [
        "2021-01.npz",
        "2021-02.npz",
    ]
    assert faiss["settings"]["memory"] == {"backend": "faiss", "url": None}
    memory = milvus["settings"]["memory"]
    assert (memory["backend"], memory["url"]) == ("milvus", url)
    assert memory["collections"] == {p: f"{url}_{p}" for p in ("fullmem", "monim")}
    # the stores of finished runs are dropped (not --keep-stores), the records with them
    assert _collections(milvus_server, prefix) == []
    assert not (tmp_path / "m" / "work" / "monim" / "index").exists()
