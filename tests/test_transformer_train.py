"""Transformer LM training: objectives, batching plans, HF checkpoints, exact resume."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.research.data import EncodedCorpus, make_segments, stream_segments
from memlm.research.transformer_train import (
    STATE_FILE,
    ModelConfig,
    TrainConfig,
    batch_loss,
    batch_plan,
    build_model,
    encode_segments,
    memory_logprobs,
    parameter_counts,
    perplexity,
    train,
)
from memlm.research.trime import lm_token_loss, memory_mask

V = 40
TINY = ModelConfig(hidden=16, layers=1, heads=2, ffn=32, max_positions=64)


def _corpus(n_docs: int = 6, seed: int = 0) -> EncodedCorpus:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n_docs):
        # repeated phrases give the memory something to copy
        phrase = rng.integers(1, V, size=5)
        body = np.concatenate([phrase, rng.integers(1, V, size=3 + i), phrase, phrase])
        seqs.append(np.concatenate([[0], body, [0]]).astype(np.int32))
    lengths = np.array([len(s) for s in seqs])
    return EncodedCorpus(
        ids=np.concatenate(seqs),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        doc_ids=[f"d{i}" for i in range(n_docs)],
        boundary_id=0,
    )


def _uneven_corpus() -> EncodedCorpus:
    """Documents of 1 to 29 tokens (2 to 30 pairs): some shorter than one segment of 4."""
    lengths = [7, 1, 29, 3, 12, 2, 18, 5, 1, 22, 9, 4]
    seqs = [
        np.array([0, *range(100 * (i + 1), 100 * (i + 1) + n), 0]) for i, n in enumerate(lengths)
    ]
    return EncodedCorpus(
        ids=np.concatenate(seqs).astype(np.int32),
        offsets=np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int64),
        doc_ids=[f"d{i}" for i in range(len(lengths))],
        boundary_id=0,
    )


def test_trime_long_batches_are_full_and_memory_stays_in_its_document() -> None:
    corpus = _uneven_corpus()  # 125 pairs
    B, L, m = 4, 4, 2
    segs = stream_segments(corpus, L, rows_multiple=B)
    assert len(segs) == 28  # 31 rows of 4, rounded down to a multiple of B
    epoch = len(segs) // B
    cfg = TrainConfig(
        objective="trime-long", seg_len=L, batch_segments=B, long_m=m, steps=2 * epoch
    )
    plan = batch_plan(segs, cfg)
    assert plan == batch_plan(segs, cfg) and len(plan) == 2 * epoch
    for e in range(2):  # each epoch covers every segment exactly once
        rows = sorted(r for batch in plan[e * epoch : (e + 1) * epoch] for r in batch)
        assert rows == list(range(len(segs)))
    assert plan[:epoch] != plan[epoch:]  # reshuffled every epoch
    cross_segment, several_docs = 0, 0
    for rows in plan:
        assert len(rows) == B and int(segs.valid[rows].sum()) == B * L
        # whole groups of m consecutive segments of the stream
        assert rows[1] == rows[0] + 1 and rows[3] == rows[2] + 1 and rows[0] % m == 0
        doc, pos = torch.from_numpy(segs.doc[rows]), torch.from_numpy(segs.pos[rows])
        vis = memory_mask(doc, pos, "long")
        d, p = doc.reshape(-1), pos.reshape(-1)
        want = (d.view(-1, 1) == d.view(1, -1)) & (p.view(1, -1) < p.view(-1, 1))
        assert torch.equal(vis, want)  # exactly the earlier pairs of the same document
        row = torch.arange(B * L) // L
        cross_segment += int((vis & (row.view(-1, 1) != row.view(1, -1))).sum())
        several_docs += int(len(set(d.tolist())) > 1)
    assert cross_segment > 0 and several_docs > 0  # the masks above were not vacuous


def test_every_objective_gets_full_batches() -> None:
    segs = stream_segments(_uneven_corpus(), 4, rows_multiple=4)
    texts = [" ".join(f"w{t % 7}" for t in segs.x[i]) for i in range(len(segs))]
    for objective in ("vanilla", "trime", "trime-ext"):
        cfg = TrainConfig(objective=objective, seg_len=4, batch_segments=4, steps=7)  # type: ignore[arg-type]
        plan = batch_plan(segs, cfg, texts)
        assert [len(rows) for rows in plan] == [4] * 7
        assert sorted(r for rows in plan for r in rows) == list(range(len(segs)))
        assert plan == batch_plan(segs, cfg, texts)
    ext_cfg = TrainConfig(objective="trime-ext", seg_len=4, batch_segments=4, steps=3)
    with pytest.raises(ValueError):
        batch_plan(segs, ext_cfg)  # BM25 batching needs the texts
    assert batch_plan(segs, replace(ext_cfg, bm25=False)) != batch_plan(segs, ext_cfg, texts)
    with pytest.raises(ValueError):
        TrainConfig(objective="trime-long", batch_segments=6, long_m=4)


def test_first_updates_use_the_plain_loss() -> None:
    segs = make_segments(_corpus(), 8)
    model = build_model(TINY, V, 0, seed=0)
    cfg = TrainConfig(objective="trime", seg_len=8, batch_segments=4, steps=20, vanilla_frac=0.05)
    rows = [0, 1, 2, 3]
    plain, _ = batch_loss(model, segs, rows, cfg, step=0)
    trime, _ = batch_loss(model, segs, rows, cfg, step=1)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(segs.x[rows])).logits.reshape(32, V)
    y = torch.from_numpy(segs.y[rows]).reshape(-1)
    valid = torch.from_numpy(segs.valid[rows]).reshape(-1)
    want = lm_token_loss(logits, y, valid).sum() / valid.sum()
    assert plain.item() == pytest.approx(want.item(), abs=1e-6)
    assert trime.item() != pytest.approx(plain.item(), abs=1e-4)


@pytest.mark.parametrize("objective", ["vanilla", "trime", "trime-long", "trime-ext"])
def test_single_step_decreases_loss_on_a_fixed_batch(objective: str) -> None:
    segs = stream_segments(_corpus(), 8)  # rows end one document and start the next
    cfg = TrainConfig(
        objective=objective,  # type: ignore[arg-type]
        seg_len=8,
        batch_segments=4,
        steps=10,
        vanilla_frac=0.0,
        p_drop_local=0.0,
    )
    model = build_model(TINY, V, 0, seed=1)
    rows = [0, 1, 2, 3]
    # 0.1: one small step; at 0.5 the trime-ext loss (memory over the whole batch) overshoots
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, _ = batch_loss(model, segs, rows, cfg, step=5)
    opt.zero_grad()
    before.backward()
    opt.step()
    after, _ = batch_loss(model, segs, rows, cfg, step=5)
    assert after.item() < before.item()


def test_hf_checkpoint_and_exact_resume(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    segs = make_segments(_corpus(), 8)
    cfg = TrainConfig(
        objective="trime", seg_len=8, batch_segments=2, steps=6, save_every=2, lr=1e-2
    )
    full = build_model(TINY, V, 0, seed=2)
    r = train(full, segs, cfg, tmp_path / "full", progress=False)
    assert r.steps_done == 6 and r.resumed_from == 0 and len(r.history) == 6
    # saved at 2, 4, 6; the two latest are kept
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == [
        "step-4",
        "step-6",
    ]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "model")
    x = torch.from_numpy(segs.x[:2])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, full.eval()(input_ids=x).logits)

    part = build_model(TINY, V, 0, seed=2)
    r1 = train(part, segs, cfg, tmp_path / "part", progress=False, stop_after=3)
    assert r1.steps_done == 3 and not (tmp_path / "part" / "model").exists()
    fresh = build_model(TINY, V, 0, seed=99)  # weights come from the checkpoint
    r2 = train(fresh, segs, cfg, tmp_path / "part", progress=False)
    assert r2.resumed_from == 3 and r2.steps_done == 6
    for (n, a), b in zip(full.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n
    assert [h["loss"] for h in r2.history] == pytest.approx([h["loss"] for h in r.history])


def test_parameter_counts_and_memory_eval() -> None:
    model = build_model(TINY, V, 0, seed=3)
    counts = parameter_counts(model)
    assert counts["embedding"] == V * 16
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    segs = make_segments(_corpus(), 8)
    out = encode_segments(model, segs)
    assert len(out.targets) == int(segs.valid.sum())
    bare = memory_logprobs(out, None, 1.0, 8)
    lm = out.gold_logit - out.lse
    assert torch.allclose(bare, lm, atol=1e-6)
    local = memory_logprobs(out, 0, 1.0, 8)
    first_of_segment = torch.from_numpy(out.pos == out.seg_start)
    assert torch.allclose(local[first_of_segment], lm[first_of_segment], atol=1e-6)
    long = memory_logprobs(out, 2, 1.0, 8)
    first_of_doc = torch.from_numpy(out.pos == 0)
    assert torch.allclose(long[first_of_doc], lm[first_of_doc], atol=1e-6)
    later = torch.from_numpy(out.seg_start > 0) & first_of_segment
    assert bool(later.any()) and not torch.allclose(long[later], lm[later], atol=1e-4)
    assert perplexity(torch.log(torch.tensor([0.5, 0.125]))) == pytest.approx(4.0)
    # over stream rows, a document that starts inside a row starts its own segment there
    stream = encode_segments(model, stream_segments(_corpus(), 8))
    assert stream.doc.tolist()[:24] == [0] * 19 + [1] * 5
    assert stream.pos.tolist()[16:24] == [16, 17, 18, 0, 1, 2, 3, 4]
    assert stream.seg_start.tolist()[16:24] == [16, 16, 16, 0, 0, 0, 0, 0]


def test_read_text_documents(tmp_path: Path) -> None:
    from memlm.research.transformer_train import read_text_documents

    txt = tmp_path / "a.txt"
    txt.write_text("first doc\nline two\n\n\nsecond doc\n")
    assert [d.text for d in read_text_documents(txt)] == ["first doc\nline two", "second doc"]
    js = tmp_path / "a.jsonl"
    js.write_text('{"text": "x y"}\n\n{"text": "z", "id": 3}\n')
    assert [d.text for d in read_text_documents(js)] == ["x y", "z"]


@pytest.mark.slow
def test_cli_runner_continues_training_an_hf_model(tmp_path: Path) -> None:
    """`memlm train --arch transformer --init-from tiny-llama --data FILE.jsonl` end to end."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memlm.research import TrainRequest
    from memlm.research.transformer_train import run

    rng = np.random.default_rng(0)
    words = ["market", "storm", "minister", "goal", "rain", "shares", "vote", "match"]
    lines = [json.dumps({"text": " ".join(rng.choice(words, size=60).tolist())}) for _ in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines))
    req = TrainRequest(
        arch="transformer",
        out=tmp_path / "run",
        objective="trime-ext",
        steps=4,
        batch_size=4,
        bptt=16,
        lr=1e-3,
        clip=1.0,
        threads=1,
        cache_dir=tmp_path / "cache",
        extra={"init_from": "tiny-llama", "data": str(data), "save_every": "2"},
    )
    summary = run(req)
    assert summary["steps"] == 4 and summary["objective"] == "trime-ext"
    assert np.isfinite(summary["dev_ppl"]) and np.isfinite(summary["test_ppl_memory"])
    folder = tmp_path / "run" / "model"
    AutoModelForCausalLM.from_pretrained(folder)
    assert len(AutoTokenizer.from_pretrained(folder)) == 49152
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-2",
        "step-4",
    ]


def test_resume_accepts_operational_changes_only(tmp_path: Path) -> None:
    segs = stream_segments(_corpus(), 8)
    cfg = TrainConfig(objective="vanilla", seg_len=8, batch_segments=2, steps=4, save_every=2)
    train(build_model(TINY, V, 0, seed=4), segs, cfg, tmp_path, progress=False, stop_after=2)
    with pytest.raises(ValueError, match=r"another configuration \(lr\)"):
        train(build_model(TINY, V, 0), segs, replace(cfg, lr=1e-3), tmp_path, progress=False)
    other = replace(cfg, save_every=3, keep_checkpoints=1, threads=1)
    r = train(build_model(TINY, V, 0), segs, other, tmp_path, progress=False)
    assert (r.resumed_from, r.steps_done) == (2, 4)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-4"]
    # starting over deletes them, so that a stale step-4 never outranks the new step-2
    short = replace(cfg, steps=2)
    r = train(build_model(TINY, V, 0), segs, short, tmp_path, progress=False, resume=False)
    assert (r.resumed_from, r.steps_done) == (0, 2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-2"]


class _Payload:
    """Any pickled object that is not plain data: weights_only refuses to build it."""

    ran = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_Payload.mark, ())

    @staticmethod
    def mark() -> None:
        _Payload.ran = True


def test_resume_loads_plain_data_only(tmp_path: Path) -> None:
    segs = stream_segments(_corpus(), 8)
    cfg = TrainConfig(objective="vanilla", seg_len=8, batch_segments=2, steps=4, save_every=2)
    train(build_model(TINY, V, 0, seed=4), segs, cfg, tmp_path, progress=False, stop_after=2)
    [ckpt] = (tmp_path / "checkpoints").iterdir()
    state = torch.load(ckpt / STATE_FILE, weights_only=True)  # what train writes loads so
    state["history"].append(_Payload())
    torch.save(state, ckpt / STATE_FILE)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        train(build_model(TINY, V, 0), segs, cfg, tmp_path, progress=False)
    assert not _Payload.ran


def test_cli_runner_trains_from_scratch_on_a_text_file(tmp_path: Path) -> None:
    """`memlm train --arch transformer --tokenizer word --data FILE.txt`: no --init-from."""
    from memlm.research import TrainRequest
    from memlm.research.data import WordTokenizer
    from memlm.research.transformer_train import run

    rng = np.random.default_rng(1)
    words = ["market", "storm", "minister", "goal", "rain", "shares", "vote", "match"]
    data = tmp_path / "d.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(words, size=50)) for _ in range(40)))
    req = TrainRequest(
        arch="transformer",
        out=tmp_path / "run",
        objective="trime-long",
        tokenizer="word",
        vocab_size=20,
        hidden=16,
        steps=3,
        batch_size=4,
        bptt=8,
        threads=1,
        cache_dir=tmp_path / "cache",
        extra={"data": str(data), "layers": "1", "heads": "2", "long_m": "2"},
    )
    summary = run(req)
    assert summary["complete"] is True and summary["steps"] == 3
    assert summary["train_tokens"] == 3 * 4 * 8  # full batches
    tok = WordTokenizer.load(tmp_path / "run" / "model" / "word_tokenizer.json")
    assert tok.words[:2] == ["<eos>", "<unk>"] and sorted(tok.words[2:]) == sorted(words)
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "word_tokenizer.json").exists()
    assert np.isfinite(summary["test_ppl_memory"])


def test_cli_defaults_depend_on_the_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    """`memlm train --arch transformer` gets the Transformer's settings, not the LSTM's."""
    import sys
    import types

    import typer
    from typer.testing import CliRunner

    from memlm.cli import train_cmd

    seen: list[object] = []
    fake = types.ModuleType("fake_runner")
    fake.run = lambda req: seen.append(req) or {"ok": True}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_runner", fake)
    monkeypatch.setattr(
        train_cmd, "RUNNERS", {"transformer": "fake_runner:run", "lstm": "fake_runner:run"}
    )
    app = typer.Typer()
    train_cmd.register(app)
    app.command("noop")(lambda: None)
    for args in (
        ["--arch", "transformer", "--init-from", "smollm2-135m"],
        ["--arch", "transformer"],
        ["--arch", "lstm"],
        ["--arch", "transformer", "--bptt", "64", "--tokenizer", "word"],
    ):
        result = CliRunner().invoke(app, ["train", *args])
        assert result.exit_code == 0, result.output
    tuned, t, r, given = seen
    pick = ("batch_size", "bptt", "lr", "clip", "tokenizer")
    assert tuned.lr == 5e-5 and tuned.extra["init_from"] == "smollm2-135m"
    assert [getattr(t, k) for k in pick] == [8, 128, 2e-3, 1.0, "subword"]
    assert [getattr(r, k) for k in pick] == [64, 20, 1e-3, 5.0, "word"]
    assert [getattr(given, k) for k in pick] == [8, 64, 2e-3, 1.0, "word"]
