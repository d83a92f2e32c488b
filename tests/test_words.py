import numpy as np
import pytest

from memlm.encoder import Encoder
from memlm.engine import Engine
from memlm.knnlm import KnnParams, MemoryOptions
from memlm.knnlm.words import Distributions, WordConfig, complete_words, continuation_mask

# A toy vocabulary: " a" and " ab" start words, "b" and "c" continue them, "." ends.
TOKENS = [" a", "b", "c", ".", " ab"]
CONT = continuation_mask(TOKENS)
# next-token distribution after each prefix (token ids after the context)
TABLE = {
    (): [0.4, 0.0, 0.0, 0.25, 0.35],
    (0,): [0.1, 0.5, 0.2, 0.2, 0.0],  # " a" -> "b" 0.5, "c" 0.2; ends with 0.3
    (0, 1): [0.5, 0.0, 0.0, 0.5, 0.0],  # " ab" ends
    (0, 2): [0.2, 0.4, 0.0, 0.4, 0.0],  # " ac" ends with 0.6 or continues with "b"
    (0, 2, 1): [1.0, 0.0, 0.0, 0.0, 0.0],
    (3,): [1.0, 0.0, 0.0, 0.0, 0.0],
    (4,): [0.5, 0.0, 0.0, 0.5, 0.0],
}
# the memory alone always predicts "."
KNN = [0.0, 0.0, 0.0, 1.0, 0.0]


class ToyModel:
    """A step function over TABLE that records how many rows each step was asked for."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = [()]
        self.calls: list[int] = []

    def first(self) -> Distributions:
        p = np.array([TABLE[()]])
        return Distributions(p, p / 2, np.array([KNN]))

    def step(self, parents: np.ndarray, tokens: np.ndarray) -> Distributions:
        self.rows = [self.rows[p] + (int(t),) for p, t in zip(parents, tokens, strict=True)]
        self.calls.append(len(self.rows))
        p = np.array([TABLE[r] for r in self.rows])
        return Distributions(p, p / 2, np.array([KNN] * len(self.rows)))


def decode(ids: list[int] | tuple[int, ...]) -> str:
    return "".join(TOKENS[i] for i in ids)


def test_continuation_mask() -> None:
    assert CONT.tolist() == [False, True, True, False, False]
    mask = continuation_mask(["ing", " the", "\n", "'s", "'", "\u2019t", "7", "\ufffd", "", "-"])
    assert mask.tolist() == [True, False, False, True, False, True, True, True, False, False]


def test_word_probabilities_multiply_tokens_and_the_end_mass() -> None:
    toy = ToyModel()
    words = complete_words(toy.first(), toy.step, CONT, decode, n=10)[0]
    got = {w.word: w.prob for w in words}
    # " ab" has two tokenisations: " a"+"b" (0.4 * 0.5 * 1.0) and " ab" (0.35 * 1.0)
    assert got == pytest.approx(
        {" ab": 0.55, ".": 0.25, " a": 0.12, " ac": 0.048, " acb": 0.032}, abs=1e-12
    )
    assert sum(got.values()) == pytest.approx(1.0)
    assert [w.word for w in words] == [" ab", ".", " a", " ac", " acb"]
    ab = words[0]
    assert ab.token_ids == (4,) and ab.tokens == (" ab",)  # the more probable tokenisation
    # the LM half of the table gives each path (1/2)^(tokens + 1); the memory only "."
    assert ab.lm_prob == pytest.approx(0.4 * 0.5 * 1.0 / 8 + 0.35 * 1.0 / 4)
    assert {w.word: w.knn_prob for w in words} == {" ab": 0, ".": 1.0, " a": 0, " ac": 0, " acb": 0}


def test_prefixes_that_cannot_win_are_not_extended() -> None:
    toy = ToyModel()
    [words] = complete_words(toy.first(), toy.step, CONT, decode, n=1)
    # After one step " ab" (one token) is finished with 0.35; " a"+"b" (0.2) and " a"+"c"
    # (0.08) cannot beat it, so the model is asked nothing more. What the pruned paths
    # would have added to " ab" is not counted: probabilities are lower bounds.
    assert toy.calls == [3]
    assert [(w.word, w.prob) for w in words] == [(" ab", pytest.approx(0.35))]


def test_max_tokens_and_beam_limit_the_search() -> None:
    toy = ToyModel()
    words = complete_words(toy.first(), toy.step, CONT, decode, n=10, cfg=WordConfig(max_tokens=2))
    assert " acb" not in {w.word for w in words[0]} and " ac" in {w.word for w in words[0]}
    assert toy.calls == [3, 2]
    toy = ToyModel()
    words = complete_words(toy.first(), toy.step, CONT, decode, n=10, cfg=WordConfig(beam=1))
    assert toy.calls == [1, 1]  # " a" only, then " ab" only
    assert [w.word for w in words[0]] == [" ab", " a"]


# --- the engine: cached beam steps against full forwards -----------------------------------

TEXT = "The harbour authority in Port Elsinore announced a new ferry timetable on Monday. " * 3


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    enc = Encoder.load(request.param, threads=1)
    eng = Engine.open(
        tmp_path_factory.mktemp("words") / "data",
        encoder=enc,
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
    )
    eng.process_document(3, TEXT, 19000, policy="fullmem")
    return eng


def _full_forward(eng: Engine, ids: list[int], memory: MemoryOptions | None) -> Distributions:
    """The next-token distributions of one token sequence, from a forward of all of it."""
    keys, hidden, _ = eng.encoder.start([ids])
    n = len(ids)
    mems = [eng._context_memory(ids, keys[0, : n - 1], ids, memory)] if memory else None
    d = eng._next_token(
        keys[0, n - 1 :],
        hidden[0, n - 1 :],
        np.array([ids[-1]]),
        k=eng.knn.k,
        mems=mems,
        tau=memory.tau if memory else 1.0,
    )
    return Distributions(d.prob, d.lm, d.knn)


@pytest.mark.parametrize("memory", [None, MemoryOptions(local=True, tau=0.5)])
def test_engine_words_equal_chains_of_full_forwards(
    engine: Engine, memory: MemoryOptions | None
) -> None:
    # contexts of different lengths: the cached steps continue right-padded rows
    contexts = ["The harbour authority in Port", "a new ferry"]
    preds = engine.predict_batch(contexts, top_n=3, words=4, memory=memory)
    ends = ~engine.encoder.continues_word
    for ctx, pred in zip(contexts, preds, strict=True):
        assert len(pred.words) == 4
        for w in pred.words:
            seq = engine.encoder.tokenize(ctx)
            chain = np.ones(3)
            for t in w.token_ids:
                d = _full_forward(engine, seq, memory)
                chain *= [d.prob[0, t], d.lm_prob[0, t], d.knn_prob[0, t]]
                seq.append(t)
            d = _full_forward(engine, seq, memory)
            chain *= [x[0, ends].sum() for x in (d.prob, d.lm_prob, d.knn_prob)]
            assert [w.prob, w.lm_prob, w.knn_prob] == pytest.approx(chain.tolist(), rel=1e-4)
            assert w.word == engine.encoder.tokenizer.decode(list(w.token_ids))
    # the memory alone completes the stored name, three tokens long, with certainty
    found = {w.word: w for w in preds[0].words}
    assert len(found[" Elsinore"].token_ids) == 3
    assert found[" Elsinore"].knn_prob == pytest.approx(1.0, abs=1e-3)


def test_words_do_not_change_the_token_suggestions(engine: Engine) -> None:
    plain = engine.predict("The harbour authority in Port", top_n=5, neighbours=2)
    with_words = engine.predict("The harbour authority in Port", top_n=5, neighbours=2, words=3)
    assert with_words.suggestions == plain.suggestions
    assert with_words.neighbours == plain.neighbours and with_words.lam == plain.lam
    assert plain.words == [] and len(with_words.words) == 3
