"""The engine from token ids (the OpenAI-compatible API's view): ``score_ids`` is ``score``,
its top tokens are the augmented distribution's (checked against the whole (V,) mixture),
its nearest neighbours are the memorised positions; generations report their top tokens;
the tokenizer's ids, text, special tokens and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memlm.encoder import Encoder
from memlm.engine import Engine, EngineInputError
from memlm.engine.generation import GenerateConfig, top_tokens
from memlm.knnlm import KnnParams

TEXT = "The harbour authority in Port Elsinore announced a new ferry timetable on Monday."
OTHER = "Snow closed the schools of the northern islands for a second day on Friday."


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder.load("tiny-llama", threads=1)


@pytest.fixture
def engine(tmp_path: Path, encoder: Encoder) -> Engine:
    e = Engine.open(
        tmp_path / "data", encoder=encoder, knn=KnnParams(k=8, temperature=1.0, lmbda=0.5)
    )
    e.process_document(1, TEXT, 19000, policy="fullmem")
    return e


def test_score_ids_is_score(engine: Engine) -> None:
    text = TEXT + " " + OTHER
    assert engine.score_ids(engine.tokenize(text)) == engine.score(text)
    with pytest.raises(EngineInputError):
        engine.score_ids(engine.tokenize("The")[:1])


def _mixture(engine: Engine, ids: list[int], lambdas: list[float]) -> np.ndarray:
    """(n, V) log p of (1 - lambda) p_LM + lambda p_kNN at every scored position, whole."""
    out = engine.encoder.encode_ids(ids, engine.window)
    lm = np.exp(engine.encoder.full_logprobs(out.hidden).astype(np.float64))
    dist, eids, vals = engine.memory.search(out.keys, engine.knn.k)
    knn = np.zeros_like(lm)
    for r in range(len(out)):
        ok = eids[r] >= 0
        if ok.any():
            w = np.exp(-(dist[r, ok] - dist[r, ok].min()) / engine.knn.temperature)
            np.add.at(knn[r], vals[r, ok], w / w.sum())
    lam = np.asarray(lambdas)[:, None]
    return np.log((1 - lam) * lm + lam * knn)


def test_top_tokens_are_the_whole_mixtures(engine: Engine) -> None:
    # memorised and unseen positions: the memory leads in the first, the LM in the second
    ids = engine.tokenize(TEXT + " " + OTHER)
    s = engine.score_ids(ids, top=4)
    assert s.top is not None
    whole = _mixture(engine, ids, s.lambdas)
    assert sorted(set(s.lambdas)) == [0.5]  # every position found a neighbour
    for r, top in enumerate(s.top):
        best = np.argsort(-whole[r], kind="stable")[:4]
        assert [t for t, _, _ in top] == best.tolist(), r
        assert [name for _, name, _ in top] == engine.token_strings(best.tolist())
        # float32 logits: the head's log-softmax and logit minus log-sum-exp differ by ~2e-6
        np.testing.assert_allclose([lp for _, _, lp in top], whole[r, best], rtol=0, atol=1e-5)
        if top[0][0] == ids[r + 1]:  # the scored token is the most probable one ...
            assert top[0][2] == s.logprobs[r]  # ... with score's own number
    memorised = len(engine.tokenize(TEXT)) - 1
    assert [top[0][0] for top in s.top[:memorised]] == ids[1 : memorised + 1]
    one = engine.score_ids(ids, top=1)  # from the LM argmax the encoder kept
    assert one.top == [top[:1] for top in s.top]


def test_nearest_neighbours_are_the_memorised_positions(engine: Engine) -> None:
    ids = engine.tokenize(TEXT)
    s = engine.score_ids(ids, nearest=True)
    assert s.nearest is not None
    assert [(n.doc_id, n.position, n.token_id, n.day) for n in s.nearest if n is not None] == [
        (1, p, ids[p], 19000) for p in range(1, len(ids))
    ]
    empty = Engine.open(engine.data_dir.parent / "empty", encoder=engine.encoder)
    assert empty.score_ids(ids, nearest=True).nearest == [None] * (len(ids) - 1)


def test_a_generation_reports_its_top_tokens(engine: Engine) -> None:
    context = TEXT[: TEXT.index(" ferry")]
    cfg = GenerateConfig(max_tokens=3, top=5)
    by_ids = engine.start_generation_ids(engine.tokenize(context), cfg).step(3)
    by_text = engine.start_generation(context, cfg).step(3)
    assert by_ids == by_text
    assert [t.token for t in by_ids] == [" ferry", " timetable", " on"]  # the memory's
    for t in by_ids:
        assert len(t.top) == 5 and t.top[0] == (t.token_id, t.token, t.prob)
        assert [p for _, _, p in t.top] == sorted((p for _, _, p in t.top), reverse=True)
        assert [name for _, name, _ in t.top] == engine.token_strings([i for i, _, _ in t.top])
    assert engine.start_generation(context, GenerateConfig(max_tokens=1)).step(1)[0].top == ()


def test_top_tokens_of_a_distribution() -> None:
    prob = np.array([0.1, 0.4, 0.05, 0.4, 0.05])
    assert top_tokens(prob, 3) == [1, 3, 0]
    assert top_tokens(prob, 0) == []


def test_the_tokenizer(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = engine.tokenize(TEXT)
    assert engine.detokenize(ids) == TEXT
    assert engine.token_strings(ids[:2]) == ["The", " harbour"]
    assert engine.vocab_size == 49152
    info = engine.tokenizer_info()
    assert (info["eos_token"], info["bos_token"], info["max_positions"]) == (
        "<|im_end|>",
        "<|im_start|>",
        1024,
    )
    messages = [{"role": "user", "content": "Hello"}]
    tok: Any = engine.encoder.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    chat = engine.chat_ids(messages)
    assert chat == engine.tokenize(text)
    assert engine.detokenize(chat) == text
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(EngineInputError, match="no chat template"):
        engine.chat_ids(messages)


@pytest.mark.milvus
def test_generation_and_echo_on_milvus(tmp_path: Path, encoder: Encoder, milvus_url: str) -> None:
    """The memory behind the protocol: a generation read the faiss index's version, which a
    Milvus memory has none of (a 500 on /generate and /v1); it has none to report."""
    (tmp_path / "data").mkdir()  # the service's data directory (lexical statistics)
    e = Engine.open(
        tmp_path / "data",
        encoder=encoder,
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        memory_url=milvus_url,
    )
    e.process_document(1, TEXT, 19000, policy="fullmem")
    gen = e.start_generation_ids(e.tokenize(TEXT[: TEXT.index(" ferry")]), GenerateConfig(3))
    assert [t.token for t in gen.step(3)] == [" ferry", " timetable", " on"]
    assert gen.index_version is None
    ids = e.tokenize(TEXT)
    s = e.score_ids(ids, top=1, nearest=True)
    assert s.nearest is not None and s.top is not None
    assert [(n.doc_id, n.position) for n in s.nearest if n is not None] == [
        (1, p) for p in range(1, len(ids))
    ]
    assert [top[0][0] for top in s.top] == ids[1:]
