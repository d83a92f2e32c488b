import datetime as dt
import json

import numpy as np
import pytest

from memlm.corpus import Document
from memlm.encoder import Encoder, WindowConfig
from memlm.evaluate import (
    EvalConfig,
    SplitError,
    TokenCache,
    TuneGrid,
    evaluate,
    plan_from_split,
    plan_stream,
    run_policy,
    split_of,
    token_logprobs,
    tune,
)
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import FullMem, MoNIM, RandMem

WORDS = [
    "the",
    "council",
    "voted",
    "on",
    "the",
    "new",
    "budget",
    "for",
    "schools",
    "and",
    "roads",
    "in",
    "the",
    "city",
    "today",
]


def _stream(days=3, per_day=6, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(days):
        for i in range(per_day):
            text = " ".join(rng.choice(WORDS, 30))
            docs.append(Document(f"d{d}-{i}", text, dt.date(2021, 1, 1) + dt.timedelta(d), "src"))
    return docs


@pytest.fixture(scope="module")
def enc():
    return Encoder.load("tiny-llama", threads=1)


def test_plan_is_seeded_disjoint_and_sliced():
    docs = _stream(days=3, per_day=10)
    a = plan_stream(docs, dev_share=0.1, test_share=0.2, seed=3)
    b = plan_stream(docs, dev_share=0.1, test_share=0.2, seed=3)
    assert [[d.id for d in p.dev + p.test + p.train] for p in a] == [
        [d.id for d in p.dev + p.test + p.train] for p in b
    ]
    for p in a:
        assert (len(p.dev), len(p.test), len(p.train)) == (1, 2, 7)
        assert not {d.id for d in p.dev} & {d.id for d in p.test} | {d.id for d in p.train} & {
            d.id for d in p.test
        }
    sliced = plan_stream(docs, dev_share=0.1, test_share=0.2, seed=3, days=2, max_docs_per_day=3)
    assert len(sliced) == 2 and all(len(p.train) == 3 for p in sliced)
    assert [d.id for d in sliced[0].test] == [d.id for d in a[0].test]  # same held-out docs
    late = plan_stream(docs, start=dt.date(2021, 1, 2))
    assert late[0].day == dt.date(2021, 1, 2)


def test_tune_prefers_a_useful_memory():
    n = 50
    gold = np.arange(n) % 7
    split = {
        "target_lm_logprob": np.full(n, np.log(0.01)),
        "distances": np.tile([1.0, 5.0], (n, 1)).astype(np.float32),
        "values": np.stack([gold, (gold + 1) % 7], 1).astype(np.int32),
        "gold": gold,
    }
    grid = TuneGrid(ks=(1, 2), temperatures=(1.0,), lambdas=(0.1, 0.9))
    params, p = tune(split, grid)
    assert (params.k, params.lmbda) == (1, 0.9)
    assert p == pytest.approx(1 / (0.1 * 0.01 + 0.9))
    assert np.exp(-token_logprobs(split, params).mean()) == pytest.approx(p)
    # a useless memory (never the gold token): the smallest lambda wins
    split["values"] = ((gold + 3) % 7)[:, None].repeat(2, 1).astype(np.int32)
    params, _ = tune(split, grid)
    assert params.lmbda == 0.1


def test_run_policy_counts(tmp_path, enc):
    docs = _stream()
    plans = plan_stream(docs, dev_share=0.2, test_share=0.2)
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path / "cache")
    full = run_policy(FullMem(), plans, cache, tmp_path / "w1", ingest_params=KnnParams(), k_max=8)
    seen = sum(len(o) for p in plans for o in cache.get_many([d.text for d in p.train]))
    assert full.tokens_seen == seen and full.tokens_stored == seen and full.entries == seen
    assert full.memrate == 1.0
    assert sum(d.tokens_stored for d in full.days) == seen
    assert full.test["distances"].shape[1] == 8
    assert (full.test["values"] >= 0).all()
    # the first day's held-out tokens see only that day's memory: distances from a store
    rand = run_policy(
        RandMem(0.0), plans, cache, tmp_path / "w2", ingest_params=KnnParams(), k_max=8
    )
    assert rand.entries == 0 and (rand.test["values"] == -1).all()
    bare = run_policy(None, plans, cache, tmp_path / "w3", ingest_params=KnnParams(), k_max=8)
    assert bare.tokens_seen == seen and bare.entries == 0


def test_cache_reuses_encodings(tmp_path, enc):
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path)
    texts = ["a b c d e f g", "the council voted"]
    first = cache.get_many(texts)
    assert cache.encoded_tokens == sum(len(o) for o in first)
    again = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path)
    second = again.get_many(texts)
    assert again.encoded_tokens == 0
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.prev_tokens, b.prev_tokens)
        np.testing.assert_array_equal(a.target_logprob, b.target_logprob)


def test_an_interrupted_encode_keeps_the_chunks_it_finished(tmp_path, enc, monkeypatch):
    texts = [f"story {i} about the council and the vote number {i}" for i in range(5)]
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path)
    cache.chunk_docs = 2
    real, calls = enc.encode_many, []

    def dies_on_the_second_chunk(docs, *a, **kw):
        calls.append(len(docs))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(docs, *a, **kw)

    monkeypatch.setattr(enc, "encode_many", dies_on_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        cache.get_many(texts, progress=True)
    assert calls == [2, 2] and len(list(tmp_path.glob("*/*.npz"))) == 2
    assert not list(tmp_path.glob("*/*.tmp.npz"))
    monkeypatch.setattr(enc, "encode_many", real)
    again = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path)
    got = again.get_many(texts)
    assert again.encoded_tokens == sum(len(o) for o in got[2:])  # the first chunk was kept
    fresh = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path / "fresh")
    for a, b in zip(got, fresh.get_many(texts), strict=True):
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.targets, b.targets)


def test_an_encode_skips_what_another_process_wrote_after_it_started(tmp_path, enc, monkeypatch):
    texts = [f"story {i} about the council and the vote number {i}" for i in range(4)]
    window = WindowConfig(context=32, stride=16)
    cache = TokenCache(enc, window, root=tmp_path)
    cache.chunk_docs = 1
    other = TokenCache(enc, window, root=tmp_path)  # another process sharing the cache
    real, encoded = enc.encode_many, []

    def meanwhile(docs, *a, **kw):  # while this one encodes text 0, the other writes 1 and 2
        encoded.extend(docs)
        if len(encoded) == 1:
            other.get_many(texts[1:3])
        return real(docs, *a, **kw)

    monkeypatch.setattr(enc, "encode_many", meanwhile)
    lengths = cache.lengths(texts, progress=True)
    ids = [enc.tokenize(t) for t in texts]
    # text 0 here, 1 and 2 by the other, then 3 here: nothing encoded twice
    assert [list(d) for d in encoded] == ids
    assert cache.encoded_tokens == lengths[0] + lengths[3]
    assert other.encoded_tokens == lengths[1] + lengths[2]
    monkeypatch.setattr(enc, "encode_many", real)
    fresh = TokenCache(enc, window, root=tmp_path / "fresh")
    assert lengths == [len(o) for o in fresh.get_many(texts)]


def test_cache_lengths_encode_what_is_missing_and_read_only_headers(tmp_path, enc):
    texts = [f"the council met on day {i} and voted " * (i + 1) for i in range(5)]
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path)
    cache.chunk_docs = 2
    cache.get_many(texts[:2])
    lengths = cache.lengths(texts, progress=True)
    assert cache.encoded_tokens == sum(lengths)  # the first two counted once, when encoded
    assert lengths == [len(o) for o in cache.get_many(texts)]
    assert lengths == sorted(lengths) and lengths[0] > 0


def test_evaluate_writes_report(tmp_path, enc, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = EvalConfig(
        corpus="synthetic",
        model="tiny-llama",
        window=WindowConfig(context=32, stride=16),
        policies=("fullmem", "monim", "randmem"),
        dev_share=0.2,
        test_share=0.2,
        k_max=16,
        grid=TuneGrid(ks=(4, 16), temperatures=(1.0, 10.0), lambdas=(0.1, 0.5)),
    )
    report = evaluate(cfg, _stream(), tmp_path / "out", encoder=enc, echo=lambda s: None)
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(on_disk["results"]) == {"bare", "fullmem", "monim", "randmem"}
    r = report["results"]
    assert r["fullmem"]["memrate"] == 1.0
    assert r["bare"]["entries"] == 0 and r["bare"]["lambda"] == 0.0
    # RandMem ran at MoNIM's measured rate
    assert report["settings"]["rand_rate"] == pytest.approx(r["randmem"]["memrate"])
    assert abs(r["randmem"]["memrate"] - r["monim"]["memrate"]) < 0.1
    for name in ("fullmem", "monim", "randmem"):
        assert r[name]["entries"] == round(r[name]["memrate"] * r[name]["tokens_seen"])
    rows = report["per_day"]["fullmem"]
    assert len(rows) == 3 and rows[-1]["memrate_cumulative"] == 1.0
    assert rows[-1]["test_ppl_so_far"] == pytest.approx(r["fullmem"]["test_ppl"])
    for f in ("report.md", "memrate.png", "memory_growth.png", "perplexity.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0
    assert "| fullmem |" in (tmp_path / "out" / "report.md").read_text()


def test_trime_local_memory_is_tuned_on_dev(tmp_path, enc, monkeypatch):
    from memlm.evaluate import TrimeSpec

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    # repetitive documents: earlier tokens of the same window predict later ones
    docs = [
        Document(f"d{d}-{i}", "alpha beta gamma delta " * 12, dt.date(2021, 1, 1 + d), "s")
        for d in range(2)
        for i in range(4)
    ]
    cfg = EvalConfig(
        window=WindowConfig(context=32, stride=16),
        policies=("fullmem",),
        dev_share=0.25,
        test_share=0.25,
        k_max=8,
        grid=TuneGrid(ks=(8,), temperatures=(1.0,), lambdas=(0.1,)),
        trime=TrimeSpec(long_segments=1, taus=(0.05, 1.0, 50.0)),
        dedup=False,  # the documents are copies of one text by design
    )
    plain = evaluate(
        EvalConfig(**{**cfg.__dict__, "trime": None}), docs, tmp_path / "a", encoder=enc, echo=str
    )
    report = evaluate(cfg, docs, tmp_path / "b", encoder=enc, echo=str)
    assert report["settings"]["trime"] == {"long_segments": 1, "taus": (0.05, 1.0, 50.0)}
    bare = report["results"]["bare"]
    assert bare["tau"] in (0.05, 1.0, 50.0)
    # the random tiny LM knows nothing; copying from earlier tokens of the input helps a lot
    assert bare["test_ppl"] < plain["results"]["bare"]["test_ppl"] / 2
    assert (
        "TRIME memory in the LM's softmax: local + 1 earlier windows"
        in (tmp_path / "b" / "report.md").read_text()
    )


def test_split_file_round_trip_and_errors():
    docs = _stream(days=3, per_day=6)
    plans = plan_stream(docs, dev_share=0.2, test_share=0.2, seed=5)
    split = split_of(plans)
    again = plan_from_split(docs, split)
    assert [
        (p.day, [d.id for d in p.train], [d.id for d in p.dev], [d.id for d in p.test])
        for p in again
    ] == [
        (p.day, [d.id for d in p.train], [d.id for d in p.dev], [d.id for d in p.test])
        for p in plans
    ]
    # the file's order is the ingest order; days without any listed document are skipped
    custom = plan_from_split(docs, {"memory": ["d2-1", "d2-0"], "dev": ["d0-3"], "test": []})
    assert [(p.day.day, [d.id for d in p.train], [d.id for d in p.dev]) for p in custom] == [
        (1, [], ["d0-3"]),
        (3, ["d2-1", "d2-0"], []),
    ]
    assert len(plan_from_split(docs, split, days=2)) == 2
    with pytest.raises(SplitError, match="'d0-1' is in both memory and test"):
        plan_from_split(docs, {"memory": ["d0-1"], "test": ["d0-1"]})
    with pytest.raises(SplitError, match="1 ids of the split are not in the corpus: \\['zz'\\]"):
        plan_from_split(docs, {"memory": ["zz"]})
    with pytest.raises(SplitError, match="unknown split keys \\['train'\\]"):
        plan_from_split(docs, {"train": ["d0-1"]})


def test_monim_ingests_with_the_served_interpolation_of_each_day(tmp_path, enc):
    """Day 1 scores with the default; each later day with what the dev tokens so far chose
    (the service's nightly choice); a fixed ingest constant stays as given."""
    from memlm.calibrator.constant import TuneGrid as Grid
    from memlm.calibrator.constant import choose_constant

    docs = _stream(days=3, per_day=6)
    plans = plan_stream(docs, dev_share=0.2, test_share=0.2)
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path / "cache")
    grid = Grid(ks=(4, 8), temperatures=(1.0, 10.0), lambdas=(0.0, 0.3, 0.9))
    default = KnnParams(k=8, temperature=5.0, lmbda=0.02)
    run = run_policy(
        MoNIM(),
        plans,
        cache,
        tmp_path / "w",
        ingest_params=None,
        k_max=8,
        served_grid=grid,
        served_default=default,
        served_min_tokens=1,
    )
    asked = [d.ingest for d in run.days]
    assert asked[0] == {"k": 8, "temperature": 5.0, "lambda": 0.02, "source": "default"}
    dnum = [int(x) for x in sorted(set(run.dev["day"].tolist()))]
    for i in (1, 2):  # the choice on the dev tokens of the days before
        upto = {
            k: v[run.dev["day"] <= dnum[i - 1]]
            for k, v in run.dev.items()
            if len(v) == len(run.dev["day"])
        }
        want = choose_constant(upto, grid, default, min_tokens=1)
        assert want.source == "tuned"
        assert asked[i] == {
            "k": want.params.k,
            "temperature": want.params.temperature,
            "lambda": want.params.lmbda,
            "source": want.source,
        }
    fixed = run_policy(MoNIM(), plans, cache, tmp_path / "w2", ingest_params=default, k_max=8)
    assert [d.ingest["source"] for d in fixed.days] == ["fixed"] * 3
    assert {d.ingest["lambda"] for d in fixed.days} == {0.02}


def test_monim_served_decides_with_what_each_evenings_build_serves(tmp_path, enc):
    """--lambda served: MoNIM decides with lambda and T per token from the evening's build
    (the evidence, the calibrator where the combination serves), as the service's worker
    does; a day's stores equal MoNIM's decision recomputed from that evening's files."""
    from memlm.calibrator.constant import TuneGrid as Grid
    from memlm.evaluate.served import EveningBuilds

    docs = _stream(days=3, per_day=6)
    plans = plan_stream(docs, dev_share=0.2, test_share=0.2)
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path / "cache")
    grid = Grid(ks=(4, 8), temperatures=(1.0, 10.0), lambdas=(0.0, 0.3, 0.9))
    default = KnnParams(k=8, temperature=5.0, lmbda=0.02)
    kw = dict(
        ingest_params=None, k_max=16, served_grid=grid, served_default=default, served_min_tokens=1
    )
    run = run_policy(
        MoNIM(),
        plans,
        cache,
        tmp_path / "w",
        ingest_served=True,
        calibrator_min_tokens=1,
        **kw,
    )
    asked = [d.ingest for d in run.days]
    assert {a["lambda"] for a in asked} == {"served"}
    assert asked[0]["lambda_source"] == "evidence"  # the prior: no build yet
    # the decisions of day 3, recomputed from the files of evening 2's build; the memory
    # of day 3's morning is rebuilt by a second run stopped after day 2
    from memlm.evaluate.checkpoint import SimulatedInterruption

    with pytest.raises(SimulatedInterruption):
        run_policy(
            MoNIM(),
            plans,
            cache,
            tmp_path / "w2",
            ingest_served=True,
            calibrator_min_tokens=1,
            crash_at=1,
            **kw,
        )
    from memlm.calibrator.lexical import LexicalStats
    from memlm.evaluate import checkpoint
    from memlm.evaluate.run import _resume

    state = checkpoint.load(tmp_path / "w2")
    # evening 2's build serves the dev tokens of days 1-2
    assert state.served["version"] == int(sorted(set(run.dev["day"].tolist()))[1])
    evenings = EveningBuilds(
        tmp_path / "w2" / "served", enc.vocab_size, grid, default, min_tokens=1
    )
    evenings.load(int(state.served["version"]))
    assert asked[2]["lambda_source"] == evenings.served.lambda_source
    assert asked[2]["k"] == evenings.served.params.k
    ds, index = _resume(tmp_path / "w2", cache, state)
    lexical = LexicalStats.load(tmp_path / "w2" / "lexical.npz", enc.vocab_size)
    stored = 0
    for o in cache.get_many([d.text for d in plans[2].train]):
        lexical.update(np.concatenate([o.prev_tokens[:1], o.targets]))

        def search(width, o_=o):
            return index.search_values(o_.keys, width)

        # the scores the service's worker computes (memlm.engine.core ``_scores``)
        scores, *_ = evenings.served.scores(enc, o, search, lexical)
        mask = MoNIM().decide(scores)
        stored += int(mask.sum())
        if mask.any():  # the morning's memory grows as the day's documents are stored
            ds.append(
                o.keys[mask].astype(np.float16),
                o.targets[mask].astype(np.int32),
                np.zeros(int(mask.sum()), np.int64),
                o.positions[mask],
                np.zeros(int(mask.sum()), np.int32),
            )
            index.refresh()
    assert stored == run.days[2].tokens_stored


def test_run_policy_with_pointers_counts_its_searches_and_keeps_the_stores(tmp_path, enc):
    """Pointers change what the held-out tokens and MoNIM see only where they answer: the
    days count the searches they saved; a memory holding the held-out text repeats it."""
    from memlm.knnlm.policy import MoNIM
    from memlm.memory.pointers import PointerConfig

    docs = _stream(days=2, per_day=6)
    plans = plan_stream(docs, dev_share=0.2, test_share=0.2)
    for p in plans:  # the memory holds every held-out text: the pointers can follow it
        p.train = p.train + p.dev + p.test
    cache = TokenCache(enc, WindowConfig(context=32, stride=16), root=tmp_path / "cache")
    args = {"ingest_params": KnnParams(k=8), "k_max": 8}
    full = run_policy(MoNIM(), plans, cache, tmp_path / "full", **args)
    ptr = run_policy(
        MoNIM(), plans, cache, tmp_path / "ptr", pointers=PointerConfig(min_hits=2), **args
    )
    assert all(d.searched is None for d in full.days)
    counted = [d.searched for d in ptr.days]
    assert all(c is not None and 0 < c["searched"] < c["tokens"] for c in counted)
    held = sum(len(o) for p in plans for o in cache.get_many([d.text for d in p.dev + p.test]))
    searched_tokens = sum(c["tokens"] for c in counted if c is not None)
    assert searched_tokens == held + sum(d.tokens_seen for d in ptr.days)
    from memlm.evaluate.checkpoint import load as load_checkpoint

    saved = load_checkpoint(tmp_path / "ptr")
    assert saved is not None and [d.searched for d in saved.days] == counted  # resumable
    followed = ptr.test["values"][:, 0] >= 0
    assert followed.all() and full.test["values"].shape == ptr.test["values"].shape
