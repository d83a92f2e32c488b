"""The full-stream machinery of `memlm eval`: dedup, bootstrap, resume, name tokens, report."""

import datetime as dt
import gc
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from memlm.corpus import Document
from memlm.datastore import Datastore
from memlm.encoder import Encoder, WindowConfig
from memlm.evaluate import DayPlan, EvalConfig, TuneGrid, evaluate
from memlm.evaluate.bootstrap import ci, doc_sums, resampled_ppl, win_share
from memlm.evaluate.checkpoint import SimulatedInterruption
from memlm.evaluate.dedup import dedup_stream, ngrams, screen_held_out, text_hash
from memlm.evaluate.harness import ResumeMismatch
from memlm.evaluate.names import name_words, pieces_of

DAY = dt.date(2021, 3, 1)
VOCAB = [
    "council",
    "voted",
    "budget",
    "schools",
    "roads",
    "city",
    "today",
    "river",
    "bridge",
    "market",
    "farmers",
    "rain",
    "storm",
    "police",
    "court",
    "judge",
    "trial",
    "museum",
    "opened",
    "exhibit",
    "winter",
    "festival",
    "music",
    "theatre",
    "league",
    "match",
    "goal",
    "coach",
    "injury",
    "season",
    "transfer",
    "bank",
    "rates",
    "inflation",
    "exports",
    "factory",
    "workers",
]


def _text(rng: np.random.Generator, n: int = 40) -> str:
    return " ".join(rng.choice(VOCAB, n))


def _doc(i: str, text: str, day: dt.date = DAY) -> Document:
    return Document(i, text, day, "src")


# --- dedup -------------------------------------------------------------------------------


def test_exact_duplicates_are_found_through_case_and_punctuation():
    assert text_hash("The Council voted, today.") == text_hash("the council  voted today")
    assert text_hash("the council voted") != text_hash("the council voted today")


def test_dedup_drops_exact_and_near_duplicates_keeping_the_first():
    rng = np.random.default_rng(0)
    a, b = _text(rng, 60), _text(rng, 60)
    near = " ".join(a.split()[:45] + _text(rng, 15).split())  # 33 of its 48 13-grams are a's
    far = " ".join(a.split()[:20] + _text(rng, 40).split())  # 8 of 48
    docs = [_doc("a", a), _doc("b", b), _doc("a2", a.upper() + "!"), _doc("n", near)]
    docs.append(_doc("f", far))
    res = dedup_stream(docs, near_threshold=0.5)
    assert [d.id for d in res.kept] == ["a", "b", "f"]
    kinds = {d.doc_id: (d.kind, d.duplicate_of) for d in res.dropped}
    assert kinds == {"a2": ("exact", "a"), "n": ("near", "a")}
    near_drop = next(d for d in res.dropped if d.doc_id == "n")
    shared = np.isin(ngrams(near), ngrams(a)).sum()
    assert near_drop.overlap == pytest.approx(shared / len(ngrams(near)))
    assert res.summary()["dropped_exact"] == 1 and res.summary()["dropped_near"] == 1


def test_held_out_documents_overlapping_memory_are_excluded():
    rng = np.random.default_rng(1)
    train = [_doc(f"t{i}", _text(rng, 80)) for i in range(3)]
    leaky = _doc("leaky", " ".join(train[1].text.split()[:20] + _text(rng, 60).split()))
    clean = _doc("clean", _text(rng, 80))
    plans = [DayPlan(DAY, train, [clean], [leaky, clean])]
    new, rows = screen_held_out(plans, threshold=0.05)
    assert [d.id for d in new[0].test] == ["clean"] and [d.id for d in new[0].dev] == ["clean"]
    by = {(r["doc_id"], r["split"]): r for r in rows}
    assert by[("leaky", "test")]["excluded"] is True
    assert by[("leaky", "test")]["overlap"] == pytest.approx(8 / 68, abs=1e-4)
    assert by[("clean", "test")]["overlap"] == 0.0


def test_the_bundled_stream_has_its_known_duplicate_removed():
    from memlm.corpus import load_news

    docs = load_news()
    res = dedup_stream(docs)
    dropped = {d.doc_id: d for d in res.dropped}
    assert dropped["news-02825"].kind == "exact"
    assert dropped["news-02825"].duplicate_of == "news-02823"


# --- bootstrap ---------------------------------------------------------------------------


def test_bootstrap_matches_a_direct_computation():
    rng = np.random.default_rng(3)
    keys = np.repeat(np.array([7, 3, 9, 1, 4]), [5, 2, 8, 3, 6])
    lp = -rng.gamma(2.0, 1.5, len(keys))
    b = lp - rng.normal(0.2, 0.3, len(keys))
    sums, counts = doc_sums(lp, keys)
    order = [7, 3, 9, 1, 4]  # first appearance
    assert counts.tolist() == [5, 2, 8, 3, 6]
    assert sums.tolist() == pytest.approx([lp[keys == k].sum() for k in order])
    draws = np.random.default_rng(11).integers(0, 5, size=(200, 5))
    direct = []
    for row in draws:
        toks = np.concatenate([lp[keys == order[j]] for j in row])
        direct.append(np.exp(-toks.mean()))
    got = resampled_ppl(lp, keys, resamples=200, seed=11)
    assert got == pytest.approx(np.array(direct))
    lo, hi = ci(lp, keys, resamples=200, seed=11)
    assert (lo, hi) == pytest.approx((np.quantile(direct, 0.025), np.quantile(direct, 0.975)))
    direct_b = [np.exp(-np.concatenate([b[keys == order[j]] for j in row]).mean()) for row in draws]
    share = np.mean(np.array(direct) < np.array(direct_b))
    assert win_share(lp, b, keys, resamples=200, seed=11) == pytest.approx(share)


# --- name tokens ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def enc():
    return Encoder.load("tiny-llama", threads=1)


def test_name_tokens_are_capitalised_words_inside_sentences(enc):
    pieces = pieces_of(enc.tokenizer, enc.vocab_size)
    text = (
        "Yesterday the minister met Angela Merkel in Berlin. She said that Mr. Trump "
        'and I agreed. "We will talk," said Macron.\nTalks go on in Paris'
    )
    ids = enc.tokenize(text)
    words = name_words(ids, pieces)
    assert sorted(set(words.values())) == [
        "Angela",
        "Berlin",
        "Macron",
        "Merkel",
        "Mr",  # a title is a capitalised word inside the sentence too
        "Paris",
        "Trump",
    ]
    for pos, w in words.items():  # each is the first token of its word
        assert w.startswith(enc.tokenizer.decode(ids[pos : pos + 1]).strip())


# --- the whole run: resume, report ---------------------------------------------------------


def _stream(days: int = 4, per_day: int = 6, words: int = 30) -> list[Document]:
    rng = np.random.default_rng(5)
    docs = []
    for d in range(days):
        day = dt.date(2021, 1, 30) + dt.timedelta(d)  # crosses a month's end
        for i in range(per_day):
            docs.append(_doc(f"d{d}-{i}", "Mr. Obama met " + _text(rng, words), day))
    return docs


def _cfg(**kw):
    base = dict(
        corpus="synthetic",
        model="tiny-llama",
        window=WindowConfig(context=32, stride=16),
        policies=("fullmem", "monim", "randmem"),
        dev_share=0.2,
        test_share=0.2,
        k_max=16,
        index_kind="flat",
        grid=TuneGrid(ks=(4, 16), temperatures=(1.0, 10.0), lambdas=(0.1, 0.5)),
        bootstrap_resamples=200,
    )
    return EvalConfig(**{**base, **kw})


def _numbers(report):
    """The report without wall times."""
    r = json.loads(json.dumps(report))
    r.pop("timing")
    r["settings"].pop("seconds")
    r["settings"].pop("encoded_tokens_this_run")
    for rows in r["per_day"].values():
        for row in rows:
            row.pop("seconds")
    return r


def test_an_interrupted_run_resumes_to_identical_numbers(tmp_path, enc, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    docs = _stream()
    whole = evaluate(_cfg(), docs, tmp_path / "whole", encoder=enc, echo=str)
    out = tmp_path / "cut"
    with pytest.raises(SimulatedInterruption):
        evaluate(_cfg(crash_at=("monim", 1)), docs, out, encoder=enc, echo=str)
    gc.collect()  # the interrupted run's datastore handle (a new process in real life)
    ckpt = json.loads((out / "work" / "monim" / "checkpoint.json").read_text())
    assert len(ckpt["days"]) == 2 and not ckpt["finished"]
    # the next day had begun: entries appended after the checkpoint are cut on resume
    with Datastore.open(out / "work" / "monim" / "datastore", dim=enc.dim) as ds:
        ds.append(np.ones((5, enc.dim), np.float16), np.arange(5), 99, np.arange(5), 0)
    with pytest.raises(ResumeMismatch, match="other delta"):
        evaluate(_cfg(resume=True, delta=-2.0), docs, out, encoder=enc, echo=str)
    resumed = evaluate(_cfg(resume=True), docs, out, encoder=enc, echo=str)
    assert resumed["settings"]["encoded_tokens_this_run"] == 0  # nothing re-encoded
    assert _numbers(resumed) == _numbers(whole)
    # the days that ran before the interruption still count in each policy's wall time
    for name, rows in resumed["per_day"].items():
        assert resumed["timing"][name]["seconds"] >= sum(r["seconds"] for r in rows) - 0.1 * len(
            rows
        )


def test_policies_run_apart_merge_into_the_report_of_one_run(tmp_path, enc, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    docs = _stream()
    whole = evaluate(_cfg(), docs, tmp_path / "whole", encoder=enc, echo=str)
    rate = whole["results"]["monim"]["memrate"]
    evaluate(_cfg(policies=("monim",)), docs, tmp_path / "a", encoder=enc, echo=str)
    b = _cfg(policies=("fullmem", "randmem"), rand_rate=rate, crash_at=("randmem", 1))
    with pytest.raises(SimulatedInterruption):  # B's RandMem stops half way
        evaluate(b, docs, tmp_path / "b", encoder=enc, echo=str)
    gc.collect()
    evaluate(_cfg(policies=("monim",), delta=-2.0), docs, tmp_path / "c", encoder=enc, echo=str)
    with pytest.raises(ResumeMismatch, match="other delta"):
        evaluate(
            _cfg(merge_from=(str(tmp_path / "a"), str(tmp_path / "c"))),
            docs,
            tmp_path / "bad",
            encoder=enc,
            echo=str,
        )
    said: list[str] = []
    merged = evaluate(
        _cfg(merge_from=(str(tmp_path / "a"), str(tmp_path / "b"))),
        docs,
        tmp_path / "merged",
        encoder=enc,
        echo=said.append,
    )
    assert any("--merge: randmem from" in s and "(2 of 4 days)" in s for s in said)
    assert _numbers(merged) == _numbers(whole)  # RandMem's last two days ran here
    with pytest.raises(ResumeMismatch, match="holds no run"):
        evaluate(_cfg(merge_from=(str(tmp_path),)), docs, tmp_path / "m2", encoder=enc, echo=str)


def test_encode_shards_fill_the_cache_the_run_then_reads(tmp_path, enc, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    docs = _stream()
    shards = [
        evaluate(_cfg(encode_shard=(i, 2)), docs, tmp_path / f"s{i}", encoder=enc, echo=str)
        for i in range(2)
    ]
    assert all(s["encoded_tokens"] > 0 for s in shards)
    assert not (tmp_path / "s0" / "report.json").exists()  # a shard only encodes
    again = evaluate(_cfg(encode_shard=(0, 2)), docs, tmp_path / "s0", encoder=enc, echo=str)
    assert again["encoded_tokens"] == 0 and again["documents"] == shards[0]["documents"]
    report = evaluate(_cfg(), docs, tmp_path / "run", encoder=enc, echo=str)
    assert report["settings"]["encoded_tokens_this_run"] == 0  # the shards encoded it all


def test_a_key_ce_encode_serves_a_run_without_monim_kl(tmp_path, enc, monkeypatch):
    # --encode-shard with the default --policies (monim-kl among them) fills the key-CE
    # cache; `--policies fullmem` afterwards must read it, not encode everything again
    docs = _stream(days=2)
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "own"))
    own = evaluate(_cfg(), docs, tmp_path / "own-run", encoder=enc, echo=str)
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "kce"))
    shard = _cfg(policies=("monim-kl",), encode_shard=(0, 1))
    assert evaluate(shard, docs, tmp_path / "shard", encoder=enc, echo=str)["encoded_tokens"]
    assert enc.compute_key_ce is False  # turned on for MoNIM(KL) during the run only
    (cached,) = {f.parent for f in (tmp_path / "kce").rglob("*.npz")}
    assert cached.name.endswith("-kce")
    with np.load(next(cached.glob("*.npz"))) as z:
        assert np.isfinite(z["key_ce"]).all()  # computed, not NaN
    served = evaluate(_cfg(), docs, tmp_path / "run", encoder=enc, echo=str)
    assert served["settings"]["encoded_tokens_this_run"] == 0
    assert _numbers(served) == _numbers(own)  # the key-CE pass changes no other output


def test_the_finetuned_model_is_scored_out_of_domain_after_the_stream(tmp_path, enc, monkeypatch):
    import memlm.evaluate.harness

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(11)
    ood = {c: [_doc(f"{c}-{i}", _text(rng, 50)) for i in range(2)] for c in ("wikipedia", "kjv")}
    monkeypatch.setattr(memlm.evaluate.harness, "load_ood", lambda *a: ood)
    cfg = _cfg(policies=("bare",), forgetting_policies=(), ood_dir="unused", finetune_lr=1e-3)
    report = evaluate(cfg, _stream(), tmp_path / "out", encoder=enc, echo=str)
    ft = report["finetune"]["ood"]
    assert set(ft) == {"wikipedia", "kjv"} and all(np.isfinite(list(ft.values())))
    # trained on the stream, the model no longer scores the other corpora as bare does
    assert all(ft[c] != report["ood"]["bare"][c]["ppl"] for c in ft)
    assert "Fine-tuned model out of domain" in (tmp_path / "out" / "report.md").read_text()


def test_the_finetune_is_paired_with_the_policies_on_the_same_test_tokens(
    tmp_path, enc, monkeypatch
):
    """With a zero learning rate the fine-tuned model is the bare model: its per-document
    sums must equal bare's, document for document, which only holds when both score the
    same tokens in the same order; it then never wins a resample against bare."""
    from memlm.evaluate.paired import compare_runs

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(policies=("fullmem",), forgetting_policies=(), names=False, finetune_lr=0.0)
    report = evaluate(cfg, _stream(), tmp_path / "still", encoder=enc, echo=str)
    docs = json.loads((tmp_path / "still" / "test_documents.json").read_text())
    sums = docs["logprob_sums"]
    assert set(sums) == {"bare", "fullmem", "finetune"}
    assert sums["finetune"] == pytest.approx(sums["bare"], rel=1e-5)
    split = json.loads((tmp_path / "still" / "split.json").read_text())
    assert sorted(d["id"] for d in docs["documents"]) == sorted(split["test"])
    assert sum(d["tokens"] for d in docs["documents"]) == report["finetune"]["test_tokens"]
    bare = report["results"]["bare"]["test_ppl"]
    assert report["finetune"]["test_ppl"] == pytest.approx(bare, rel=1e-5)
    shares = report["finetune"]["win_share"]
    assert set(shares) == {"bare", "fullmem"} and all(0 <= w <= 1 for w in shares.values())
    # a model that learns the stream beats bare in (nearly) every resample, and says so
    cfg = replace(cfg, finetune_lr=3e-3)
    learnt = evaluate(cfg, _stream(), tmp_path / "learnt", encoder=enc, echo=str)
    assert learnt["finetune"]["test_ppl"] < bare
    assert learnt["finetune"]["win_share"]["bare"] > 0.9
    assert (
        "Paired bootstrap on the same test documents"
        in (tmp_path / "learnt" / "report.md").read_text()
    )
    # the two runs share their split: they pair after the fact, bare with bare exactly
    both = compare_runs({"still": tmp_path / "still", "learnt": tmp_path / "learnt"})
    assert both["documents"] == len(docs["documents"])
    assert both["systems"]["still/bare"] == both["systems"]["learnt/bare"]
    assert both["win_share"]["learnt/finetune"]["still/finetune"] > 0.9
    assert both["systems"]["learnt/finetune"]["ppl"] == pytest.approx(
        learnt["finetune"]["test_ppl"],
        rel=1e-6,  # sums are kept to 6 decimals
    )


def test_systems_of_different_test_sets_are_not_paired():
    from memlm.evaluate.paired import PairedScores

    scores = PairedScores(np.array([0, 0, 1]))
    scores.add("bare", np.array([-1.0, -2.0, -3.0]))
    with pytest.raises(ValueError, match="do not share one test set"):
        scores.add("finetune", np.array([-1.0, -2.0]))
    scores.add("better", np.array([-0.5, -1.0, -1.0]))
    assert scores.win_shares("better", ["bare", "better", "absent"], resamples=50) == {"bare": 1.0}


def test_report_schema(tmp_path, enc, monkeypatch):
    import memlm.evaluate.harness

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(9)
    ood = {c: [_doc(f"{c}-{i}", _text(rng, 50)) for i in range(2)] for c in ("wikipedia", "kjv")}
    monkeypatch.setattr(memlm.evaluate.harness, "load_ood", lambda *a: ood)
    cfg = _cfg(lambda_mode="calibrated", ood_dir="unused")
    report = evaluate(cfg, _stream(), tmp_path / "out", encoder=enc, echo=str)
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(on_disk) == {
        "settings",
        "results",
        "per_day",
        "leakage",
        "forgetting",
        "names",
        "ood",
        "timing",
    }
    for name in ("fullmem", "monim", "randmem"):
        r = report["results"][name]
        lo, hi = r["constant_lambda_test_ppl_ci95"]
        assert lo <= r["constant_lambda_test_ppl"] <= hi
        for corpus in ("wikipedia", "kjv"):
            o = report["ood"][name][corpus]
            assert o["bare"] == report["ood"]["bare"][corpus]["ppl"]
            assert o["constant_vs_bare"] == pytest.approx(o["ppl_constant"] / o["bare"] - 1)
            assert "ppl_calibrated" in o or r["lambda"] == 0
    for name, r in report["results"].items():
        lo, hi = r["test_ppl_ci95"]
        assert lo <= r["test_ppl"] <= hi
        assert r["bytes"] == r["entries"] * (2 * enc.dim + 20)
        others = {"fullmem", "randmem"} - {name}
        assert set(r["win_share"]) == others and all(0 <= w <= 1 for w in r["win_share"].values())
    assert set(report["forgetting"]) == {"fullmem", "monim", "bare"}
    assert list(report["forgetting"]["fullmem"]) == ["2021-01", "2021-02"]
    bare_months = report["results"]["bare"]["test_ppl_per_month"]
    assert report["forgetting"]["bare"]["2021-01"] == pytest.approx(bare_months)
    for row in report["forgetting"]["fullmem"].values():
        assert set(row) == set(bare_months) and all(np.isfinite(list(row.values())))
    subsets = report["names"]["subsets"]
    assert set(subsets) == {"all tokens", "names", "names seen", "names unseen"}
    assert subsets["names"]["bare"]["tokens"] > 0  # "Obama" after "Mr." in every document
    assert (
        subsets["names seen"]["bare"]["tokens"] + subsets["names unseen"]["bare"]["tokens"]
        == (subsets["names"]["bare"]["tokens"])
    )
    assert subsets["all tokens"]["bare"]["ppl"] == pytest.approx(
        report["results"]["bare"]["test_ppl"]
    )
    assert [row["memrate_day"] for row in report["per_day"]["fullmem"]] == [1.0] * 4
    assert report["leakage"]["dropped_exact"] == 0
    assert report["timing"]["encode"]["tokens"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    for piece in (
        "Leakage:",
        "Learning and forgetting",
        "Name tokens",
        "Out of domain",
        "Wall time",
    ):
        assert piece in md
    for f in ("memrate_daily.png", "forgetting.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0


# --- the continual fine-tuning baseline ------------------------------------------------------


def test_continual_finetuning_learns_the_stream_and_leaves_the_frozen_model_alone(enc):
    from memlm.calibrator.constant import ppl
    from memlm.evaluate.finetune import FinetuneConfig, continual_finetune

    rng = np.random.default_rng(2)
    days = [dt.date(2021, 1, 31), dt.date(2021, 2, 1)]
    text = _text(rng, 40)  # every document repeats it: fine-tuning must learn it
    plans = [
        DayPlan(d, [_doc(f"t{i}", text, d) for i in range(3)], [], [_doc("x", text, d)])
        for d in days
    ]
    window = WindowConfig(context=32, stride=16)
    before = [p.detach().clone() for p in enc.model.parameters()]
    bare = ppl(enc.encode_many([enc.tokenize(text)], window)[0].target_logprob.astype(np.float64))
    out, lp = continual_finetune(enc, plans, window, FinetuneConfig(lr=3e-3), resamples=50)
    assert out["test_ppl"] < bare / 2
    assert out["test_ppl"] == pytest.approx(ppl(lp)) and out["test_tokens"] == lp.size
    assert [d["day"] for d in out["per_day"]] == ["2021-01-31", "2021-02-01"]
    n = len(enc.tokenize(text))  # windows of 32 tokens, each predicting all but its first
    per_doc = sum(min(32, n - s) - 1 for s in range(0, n - 1, 32))
    assert all(d["cpu_seconds"] > 0 and d["train_tokens"] == 3 * per_doc for d in out["per_day"])
    assert list(out["forgetting"]) == ["2021-01", "2021-02"]
    # the month's end is the last day: the same model scores the same document
    assert out["forgetting"]["2021-02"]["2021-02"] == pytest.approx(out["per_day"][1]["test_ppl"])
    assert out["forgetting"]["2021-01"]["2021-01"] == pytest.approx(out["per_day"][0]["test_ppl"])
    assert all(torch_equal(a, b) for a, b in zip(before, enc.model.parameters(), strict=True))


def torch_equal(a, b):
    return bool((a == b).all())


def test_continual_finetuning_in_bfloat16_scores_like_the_bare_bfloat16_model():
    """A bfloat16 evaluation trains float32 weights and scores their bfloat16 cast: with a
    zero learning rate that is the evaluation's own bare model, token for token."""
    from memlm.evaluate.finetune import FinetuneConfig, continual_finetune

    enc16 = Encoder.load("tiny-llama", threads=1, precision="bfloat16")
    rng = np.random.default_rng(3)
    d = dt.date(2021, 3, 1)
    text = _text(rng, 40)
    plans = [DayPlan(d, [_doc("t", text, d)], [], [_doc("x", _text(rng, 30), d)])]
    window = WindowConfig(context=32, stride=16)
    bare = enc16.encode_many([enc16.tokenize(plans[0].test[0].text)], window)[0]
    frozen = [p.detach().clone() for p in enc16.model.parameters()]
    still, _ = continual_finetune(enc16, plans, window, FinetuneConfig(lr=0.0), resamples=20)
    lp = bare.target_logprob.astype(np.float64)
    assert still["test_ppl"] == pytest.approx(float(np.exp(-lp.mean())), rel=1e-12)
    assert still["settings"]["scored_in"] == "bfloat16"
    assert still["settings"]["trained_in"] == "float32"
    # with a learning rate the float32 master moves, and so do its bfloat16 scores
    moved, _ = continual_finetune(enc16, plans, window, FinetuneConfig(lr=1e-3), resamples=20)
    assert moved["test_ppl"] != still["test_ppl"]
    assert all(torch_equal(a, b) for a, b in zip(frozen, enc16.model.parameters(), strict=True))


def test_the_finetune_section_shows_its_forgetting_table_out_of_domain_and_plot(tmp_path):
    from memlm.evaluate.markdown import extra_plots, sections

    ft = {
        "settings": {"weights": "full", "optimizer": "AdamW", "lr": 1e-5, "epochs": 1},
        "test_ppl": 25.0,
        "test_ppl_ci95": [24.0, 26.0],
        "cpu_seconds_per_day": 3.5,
        "forgetting": {
            "2021-01": {"2021-01": 20.0, "2021-02": 30.0},
            "2021-02": {"2021-01": 21.0, "2021-02": 28.0},
        },
        "ood": {"wikipedia": 16.5},
    }
    report = {"finetune": ft, "ood": {"bare": {"wikipedia": {"ppl": 15.0}}}}
    md = "\n".join(sections(report))
    assert "test ppl 25.00 (24.00-26.00)" in md
    assert "| 2021-02 | 21.00 | 28.00 |" in md
    assert "wikipedia 16.50 (bare 15.00, +10.00%)" in md
    extra_plots(report, tmp_path)  # no memory policy re-scored: the plot is the baseline's
    assert (tmp_path / "forgetting.png").stat().st_size > 0


def test_top1_under_the_mixture_matches_the_full_distribution(enc):
    from memlm.evaluate.names import TIE, top1_correct
    from memlm.knnlm import KnnParams, neighbour_log_weights

    rng = np.random.default_rng(4)
    o = enc.encode_many([enc.tokenize(_text(rng, 60))], WindowConfig(context=32, stride=16))[0]
    n, k = len(o), 16
    # neighbours: the gold token, the LM's top-1 and a few frequent values, some padding
    pool = np.concatenate([o.targets, o.top_id, rng.integers(0, 50, 20)])
    vals = rng.choice(pool, size=(n, k)).astype(np.int64)
    vals[rng.random((n, k)) < 0.2] = -1
    vals[:3] = -1  # rows without neighbours: the LM alone
    dist = np.sort(rng.gamma(2.0, 5.0, (n, k)), axis=1).astype(np.float32)
    p_lm = np.exp(enc.full_logprobs(o.hidden).astype(np.float64))  # (n, V)
    outcomes = []
    for params in (
        KnnParams(k=16, temperature=2.0, lmbda=0.3),
        KnnParams(k=8, temperature=50.0, lmbda=0.9),
    ):
        v = vals[:, : params.k]
        ids = np.where(v >= 0, 0, -1)
        w = np.exp(neighbour_log_weights(dist[:, : params.k], ids, params.temperature))
        p_knn = np.zeros_like(p_lm)
        for i in range(n):
            np.add.at(p_knn[i], np.maximum(v[i], 0), w[i])
        lam = np.where((v >= 0).any(1), params.lmbda, 0.0)[:, None]
        p = (1 - lam) * p_lm + lam * p_knn
        expected = p[np.arange(n), o.targets] >= p.max(1) * (1 - TIE)
        got = top1_correct(enc, o, np.arange(n), dist, vals, params)
        assert got.tolist() == expected.tolist()
        outcomes += expected.tolist()
    assert set(outcomes) == {True, False}  # the check saw both answers


def test_top1_counts_the_lm_right_when_its_gold_and_top1_log_probs_differ_in_the_last_digits(
    enc,
):
    """A half-precision head reports the top-1 log-prob from its own logits and the gold's
    rescored in float32: for the same token they differ by ~1e-5. At lambda 0 (or with no
    neighbours) the mixture's arg max is the LM's, whatever those digits say."""
    from memlm.evaluate.names import top1_correct
    from memlm.knnlm import KnnParams

    rng = np.random.default_rng(5)
    o = enc.encode_many([enc.tokenize(_text(rng, 80))], WindowConfig(context=32, stride=16))[0]
    n = len(o)
    o.targets[: n // 2] = o.top_id[: n // 2]  # the LM is right on the first half
    o.target_logprob[: n // 2] = o.top_logprob[: n // 2] - 3e-5  # rescored gold: lower
    right = o.top_id == o.targets
    assert right.any() and not right.all()
    vals = np.repeat(o.top_id[:, None], 4, 1).astype(np.int64)
    dist = np.ones((n, 4), np.float32)
    got = top1_correct(enc, o, np.arange(n), dist, vals, KnnParams(k=4, lmbda=0.0))
    assert got.tolist() == right.tolist()
    no_neighbours = np.full((n, 4), -1, np.int64)
    got = top1_correct(enc, o, np.arange(n), dist, no_neighbours, KnnParams(k=4, lmbda=0.5))
    assert got.tolist() == right.tolist()


# --- MemRate with the LM alone ---------------------------------------------------------------


def test_memrate_on_the_lm_alone_is_what_monim_stores_when_the_memory_has_no_weight(
    tmp_path, enc, monkeypatch
):
    """With an ingest lambda of 0 the memory cannot change a decision: each day MoNIM and
    AMT store exactly what the LM alone would. With a weight, the two counts are reported
    side by side; FullMem and RandMem do not search, and have none."""
    from memlm.knnlm import KnnParams

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    base = dict(names=False, forgetting_policies=(), policies=("fullmem", "monim", "monim-amt"))
    base["delta"] = -10.78  # the tiny model's median log-prob: MoNIM stores about half
    cfg = _cfg(**base, ingest=KnnParams(k=4, temperature=1.0, lmbda=0.0))
    still = evaluate(cfg, _stream(), tmp_path / "still", encoder=enc, echo=str)
    for name in ("monim", "monim-amt"):
        rows = still["per_day"][name]
        assert [r["stored_lm_alone"] for r in rows] == [r["stored"] for r in rows]
        r = still["results"][name]
        assert r["memrate_lm_alone"] == pytest.approx(r["memrate"])
    assert 0.2 < still["results"]["monim"]["memrate"] < 0.8
    assert "stored_lm_alone" not in still["per_day"]["fullmem"][0]
    assert "memrate_lm_alone" not in still["results"]["fullmem"]
    cfg = _cfg(**base, ingest=KnnParams(k=4, temperature=1.0, lmbda=0.9))
    heavy = evaluate(cfg, _stream(), tmp_path / "heavy", encoder=enc, echo=str)
    alone = [r["stored_lm_alone"] for r in heavy["per_day"]["monim"]]
    assert alone == [r["stored_lm_alone"] for r in still["per_day"]["monim"]]  # memory-free
    assert alone != [r["stored"] for r in heavy["per_day"]["monim"]]  # the memory mattered
    md = (tmp_path / "heavy" / "report.md").read_text()
    assert "MemRate deciding on the LM alone, as with an empty memory: monim " in md
    assert (tmp_path / "heavy" / "memrate_daily.png").stat().st_size > 0


def test_out_of_domain_with_the_evidence_lambda(tmp_path, enc, monkeypatch):
    """--lambda evidence reports the out-of-domain ppl it serves: the model fitted on all
    dev tokens (the last test day's fit), at the k tuned on dev, for every memory."""
    import memlm.evaluate.harness
    from memlm.calibrator.constant import ppl
    from memlm.calibrator.evidence import EvidenceModel
    from memlm.evaluate.checkpoint import load_arrays
    from memlm.knnlm import interpolate, knn_logprob

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(9)
    ood = {c: [_doc(f"{c}-{i}", _text(rng, 50)) for i in range(2)] for c in ("wikipedia", "kjv")}
    monkeypatch.setattr(memlm.evaluate.harness, "load_ood", lambda *a: ood)
    cfg = _cfg(lambda_mode="evidence", ood_dir="unused")
    report = evaluate(cfg, _stream(), tmp_path / "out", encoder=enc, echo=str)
    for name in ("fullmem", "monim", "randmem"):
        r = report["results"][name]
        last = r["evidence_last_day"]
        model = EvidenceModel.from_json(last)
        for corpus in ("wikipedia", "kjv"):
            a = load_arrays(tmp_path / "out" / "work" / name / "eval" / f"ood-{corpus}.npz")
            d, v = a["distances"][:, : r["k"]], a["values"][:, : r["k"]]
            lam = model.lambdas(d, v, a["qnorm"], last["temperature"], a["context"])
            knn = knn_logprob(
                d, np.where(v >= 0, 0, -1), v, a["gold"][:, None], last["temperature"]
            )
            want = ppl(interpolate(a["target_lm_logprob"], knn[:, 0], lam, v[:, 0] >= 0))
            o = report["ood"][name][corpus]
            assert o["ppl_evidence"] == pytest.approx(want, rel=1e-9)
            assert o["evidence_vs_bare"] == pytest.approx(want / o["bare"] - 1)
            assert o["mean_evidence_lambda"] == pytest.approx(lam[v[:, 0] >= 0].mean())
            assert "ppl_calibrated" not in o
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| policy | corpus | bare ppl | constant lambda | evidence |" in md
    o = report["ood"]["fullmem"]["kjv"]
    assert f"| {o['ppl_evidence']:.2f} ({o['evidence_vs_bare']:+.2%}), mean lambda" in md


def test_the_served_lambda_is_what_each_evenings_build_serves(tmp_path, enc, monkeypatch):
    """--lambda served: each evening the build's own retrain and choose run on the dev tokens
    so far (with their seen view); a day that serves the evidence scores its test tokens with
    that evening's evidence model exactly, a day that serves the combination with the max
    of the evidence's and the calibrator's lambda (never below the evidence's)."""
    import memlm.evaluate.harness
    from memlm.calibrator.evidence import EvidenceModel
    from memlm.evaluate.plan import day_number
    from memlm.knnlm import interpolate, knn_logprob

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(9)
    ood = {c: [_doc(f"{c}-{i}", _text(rng, 50)) for i in range(2)] for c in ("wikipedia", "kjv")}
    monkeypatch.setattr(memlm.evaluate.harness, "load_ood", lambda *a: ood)
    cfg = _cfg(lambda_mode="served", ood_dir="unused", calibrator_min_tokens=1)
    # documents long enough for two 64-token validation blocks a day
    report = evaluate(cfg, _stream(words=120), tmp_path / "out", encoder=enc, echo=str)
    first_day = day_number(dt.date(2021, 1, 30))
    for name in ("fullmem", "monim", "randmem"):
        r = report["results"][name]
        days = r["served_days"]
        assert [d["day"] for d in days] == [first_day + i for i in range(4)]
        for d in days:
            dec = d["decision"]
            assert d["lambda_source"] == ("combined" if dec["serve"] else "evidence")
            assert d["calibrator_trained"] is True  # min tokens 1: every evening trains
            # the first evenings hold fewer than two 64-token validation blocks
            if dec["views"]:
                assert dec["views"]["seen"]["tokens"] == dec["views"]["held-out"]["tokens"] > 0
            else:
                assert dec["reason"] == "no validation tokens"
        assert any(d["decision"]["views"] for d in days)
        assert r["combined_days"] == sum(d["lambda_source"] == "combined" for d in days)
        o = report["ood"][name]["kjv"]
        assert o["served_vs_bare"] == pytest.approx(o["ppl_served"] / o["bare"] - 1)
        assert "mean_served_lambda" in o and "ppl_evidence" not in o
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| policy | corpus | bare ppl | constant lambda | served |" in md
    # the same run with a calibrator that never trains serves the evidence every evening,
    # and scores each day's test tokens with that evening's evidence model exactly (its sum
    # of log-probs, from the test ppl so far); MoNIM decides with what is served, so the
    # minimum is part of a run's identity: resuming with another one is refused
    from memlm.evaluate.checkpoint import load_eval
    from memlm.evaluate.harness import ResumeMismatch

    cfg_ev = replace(cfg, calibrator_min_tokens=10**9)
    with pytest.raises(ResumeMismatch, match="calibrator_min_tokens"):
        evaluate(replace(cfg_ev, resume=True), _stream(words=120), tmp_path / "out", encoder=enc)
    alone = evaluate(cfg_ev, _stream(words=120), tmp_path / "out2", encoder=enc, echo=str)
    for name in ("fullmem", "monim", "randmem"):
        days = alone["results"][name]["served_days"]
        assert [d["lambda_source"] for d in days] == ["evidence"] * 4
        assert days[0]["calibrator_reason"].endswith("fewer than the 1000000000 training needs")
        test = load_eval(tmp_path / "out2" / "work" / name, 4)[1].arrays(cfg.k_max)
        before_n, before_sum = 0, 0.0
        for d, row in zip(days, alone["per_day"][name], strict=True):
            on = test["day"] == d["day"]
            n = before_n + int(on.sum())
            total = -n * math.log(row["test_ppl_so_far"])
            day_sum, before_n, before_sum = total - before_sum, n, total
            model = EvidenceModel.from_json(d["evidence_model"])
            k, t = d["k"], d["temperature"]
            dd, vv = test["distances"][on, :k], test["values"][on, :k]
            lam = model.lambdas(dd, vv, test["qnorm"][on], t, test["context"][on])
            knn = knn_logprob(dd, np.where(vv >= 0, 0, -1), vv, test["gold"][on, None], t)
            lp = interpolate(test["target_lm_logprob"][on], knn[:, 0], lam, vv[:, 0] >= 0)
            assert day_sum == pytest.approx(lp.sum(), rel=1e-6)
        # the evenings that served the combination answered otherwise
        for d_comb, a, b in zip(
            report["results"][name]["served_days"],
            report["per_day"][name],
            alone["per_day"][name],
            strict=True,
        ):
            if d_comb["lambda_source"] == "combined" and (test["day"] == d_comb["day"]).any():
                assert a["test_ppl_so_far"] != b["test_ppl_so_far"]
