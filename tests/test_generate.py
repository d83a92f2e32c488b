"""memlm.engine.generation over a real engine (tiny random Llama): the cached loop gives exactly the
distribution a full re-run gives, the memory steers it, sampling is seeded, stop strings
and text deltas add up."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from memlm.engine import Engine
from memlm.engine.generation import GenerateConfig, Generation, StopText, choose, generate

TEXT = (
    "The central bank of Ireland raised its key interest rate on Tuesday, citing "
    "stronger growth in Dublin and a tight labour market across the country."
)
PROMPT = "The central bank of Ireland"


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


@pytest.fixture
def engine(tmp_path: Path, tiny: Any) -> Engine:
    eng = Engine(tmp_path / "data", tiny)
    eng.process_document(1, TEXT, 0, policy="fullmem")
    return eng


def test_cached_steps_equal_a_full_rerun_of_each_prefix(engine: Engine) -> None:
    enc = engine.encoder
    ids = enc.tokenize(PROMPT)
    cfg = GenerateConfig(max_tokens=6)
    gen, toks = generate(engine, ids, cfg)
    assert gen.finish_reason == "length" and len(toks) == 6
    seq = list(ids)
    for t in toks:
        keys, hidden, _ = enc.start([seq])
        full = engine._next_token(keys[0, -1:], hidden[0, -1:], np.array([seq[-1]]), k=engine.knn.k)
        assert t.token_id == int(np.argmax(full.prob[0]))
        assert t.prob == pytest.approx(float(full.prob[0, t.token_id]), rel=1e-4)
        assert t.lm_prob == pytest.approx(float(full.lm[0, t.token_id]), rel=1e-4)
        assert t.knn_prob == pytest.approx(float(full.knn[0, t.token_id]), abs=1e-6)
        seq.append(t.token_id)


def test_the_memory_steers_greedy_generation_and_names_its_neighbours(
    engine: Engine, tiny: Any
) -> None:
    ids = tiny.tokenize(PROMPT)
    gen, toks = generate(engine, ids, GenerateConfig(max_tokens=8, neighbour=True))
    # a random LM is near uniform: the stored document's continuation wins every step
    assert gen.text == TEXT[len(PROMPT) :][: len(gen.text)]
    assert gen.text.startswith(" raised its key interest rate")
    assert [t.knn_prob for t in toks] == pytest.approx([1.0] * 8, abs=1e-4)
    assert [t.lam for t in toks] == pytest.approx([engine.knn.lmbda] * 8)
    # position of the value in the document: the prompt's tokens come first
    assert [(t.neighbour.doc_id, t.neighbour.position) for t in toks] == [
        (1, len(ids) + i) for i in range(8)
    ]
    assert "".join(t.text for t in toks) == gen.text
    # the bare LM (empty memory) continues differently
    bare = Engine(engine.data_dir.parent / "bare", tiny)
    other, _ = generate(bare, ids, GenerateConfig(max_tokens=8))
    assert other.text != gen.text


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(engine: Engine, tiny: Any) -> None:
    ids = tiny.tokenize("Heavy snow closed")

    def run(**kw: Any) -> list[int]:
        return [t.token_id for t in generate(engine, ids, GenerateConfig(max_tokens=8, **kw))[1]]

    a, b = run(temperature=1.0, seed=3), run(temperature=1.0, seed=3)
    assert a == b
    assert run(temperature=1.0, seed=4) != a
    assert run(temperature=1.0, top_p=1e-9, seed=5) == run()
    gen = Generation.start(engine, ids, GenerateConfig(max_tokens=2, temperature=0.7))
    assert gen.seed is not None  # drawn, and reported so the call can be replayed
    replay = Generation.start(
        engine, ids, GenerateConfig(max_tokens=2, temperature=0.7, seed=gen.seed)
    )
    assert [t.token_id for t in gen.step(2)] == [t.token_id for t in replay.step(2)]


def test_stop_string_ends_the_text_before_it(engine: Engine, tiny: Any) -> None:
    ids = tiny.tokenize(PROMPT)
    cfg = GenerateConfig(max_tokens=20, stop=(" interest", "Dublin"))
    gen, toks = generate(engine, ids, cfg)
    assert (gen.finish_reason, gen.stop_matched, gen.text) == (
        "stop",
        " interest",
        " raised its key",
    )
    assert "".join(t.text for t in toks) == gen.text
    assert tiny.tokenizer.decode([toks[-1].token_id]) == " interest"


def test_steps_in_pieces_and_interleaved_calls_share_nothing(engine: Engine, tiny: Any) -> None:
    ids_a, ids_b = tiny.tokenize(PROMPT), tiny.tokenize("Heavy snow closed schools")
    cfg = GenerateConfig(max_tokens=7, temperature=0.9, seed=11)
    alone_a = [t.token_id for t in generate(engine, ids_a, cfg)[1]]
    alone_b = [t.token_id for t in generate(engine, ids_b, cfg)[1]]
    ga, gb = Generation.start(engine, ids_a, cfg), Generation.start(engine, ids_b, cfg)
    got_a: list[int] = []
    got_b: list[int] = []
    while not (ga.done and gb.done):  # alternating pieces of 1 and 3 tokens
        got_a += [t.token_id for t in ga.step(1)]
        got_b += [t.token_id for t in gb.step(3)]
    assert (got_a, got_b) == (alone_a, alone_b)
    # and from two threads at once (the per-call key capture keeps each forward's keys)
    results: dict[str, list[int]] = {}

    def run(name: str, ids: list[int]) -> None:
        results[name] = [t.token_id for t in generate(engine, ids, cfg)[1]]

    threads = [threading.Thread(target=run, args=(n, i)) for n, i in (("a", ids_a), ("b", ids_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"a": alone_a, "b": alone_b}


def test_stop_text_holds_back_a_possible_stop_and_incomplete_characters() -> None:
    pieces = ["Hel", "lo wo", "r", "ld", "!"]
    st = StopText(lambda ids: "".join(pieces[i] for i in ids), ("world",))
    deltas = [st.push(range(i + 1), last=False) for i in range(4)]
    assert deltas == ["Hel", "lo ", "", ""] and st.final == "Hello " and st.matched == "world"
    st = StopText(lambda ids: "".join(["ab", "\ufffd", "c"][i] for i in ids), ())
    assert [st.push(range(1), False), st.push(range(2), False), st.push(range(3), True)] == [
        "ab",
        "",
        "\ufffdc",
    ]


def test_choose_greedy_and_top_p() -> None:
    p = np.array([0.1, 0.6, 0.3])
    assert choose(p, GenerateConfig(), None) == 1
    rng = np.random.default_rng(0)
    cfg = GenerateConfig(temperature=1.0, top_p=0.8)  # keeps 0.6 and 0.3
    draws = {choose(p, cfg, rng) for _ in range(200)}
    assert draws == {1, 2}
    cold = GenerateConfig(temperature=0.05)
    assert {choose(p, cold, rng) for _ in range(50)} == {1}


@pytest.mark.parametrize(
    "kw", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"stop": ("",)}]
)
def test_config_refuses_nonsense(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GenerateConfig(**kw)


def test_engine_refuses_empty_and_too_long_contexts(engine: Engine) -> None:
    from memlm.engine import EngineInputError

    with pytest.raises(EngineInputError, match="empty"):
        engine.start_generation("", GenerateConfig())
    too_long = "word " * engine.generation_positions
    with pytest.raises(EngineInputError, match="positions"):
        engine.start_generation(too_long, GenerateConfig(max_tokens=1))
    assert torch.is_inference_mode_enabled() is False


def test_the_nucleus_from_the_top_tokens_is_the_full_sorts() -> None:
    """top-p looks for its nucleus among the most probable tokens first: the kept set,
    its order and the seeded draw equal the whole vocabulary's stable sort, for peaked
    and flat distributions, ties at the cut, and masses the prefix cannot reach."""
    from memlm.engine.generation import nucleus

    def full(q: np.ndarray, top_p: float) -> np.ndarray:
        order = np.argsort(-q, kind="stable")
        return order[np.cumsum(q[order]) - q[order] < top_p]

    rng = np.random.default_rng(0)
    vocab = 49_152
    cases = []
    for scale in (0.3, 1.0, 3.0, 8.0):  # flat to peaked logits
        z = rng.standard_normal(vocab) * scale
        q = np.exp(z - z.max())
        cases.append(q / q.sum())
    tied = np.full(vocab, 1.0)
    tied[:300] = 50.0  # 300 tokens tied across the 256-token prefix's edge
    cases.append(tied / tied.sum())
    for q in cases:
        for top_p in (1e-9, 0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999999):
            np.testing.assert_array_equal(nucleus(q, top_p), full(q, top_p))
        cfg = GenerateConfig(temperature=1.0, top_p=0.9)
        drawn = [choose(q, cfg, np.random.default_rng(s)) for s in range(20)]
        keep = full(q, 0.9)
        q2 = np.zeros_like(q)
        q2[keep] = q[keep]
        want = [int(np.random.default_rng(s).choice(vocab, p=q2 / q2.sum())) for s in range(20)]
        assert drawn == want
