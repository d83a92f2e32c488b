"""Transformer LM training: objectives, batching plans, HF checkpoints, exact resume."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.train.data import EncodedCorpus
from memlm.train.transformer_train import (
    ModelConfig,
    TrainConfig,
    batch_loss,
    batch_plan,
    build_model,
    encode_segments,
    make_segments,
    memory_logprobs,
    parameter_counts,
    perplexity,
    train,
)
from memlm.train.trime import lm_token_loss

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


def test_make_segments_covers_every_pair_once() -> None:
    corpus = _corpus()
    segs = make_segments(corpus, 8)
    assert int(segs.valid.sum()) == corpus.n_targets
    for i in range(len(corpus)):
        rows = np.flatnonzero(segs.doc == i)
        assert segs.order[rows].tolist() == list(range(len(rows)))
        x = np.concatenate([segs.x[r][segs.valid[r]] for r in rows])
        y = np.concatenate([segs.y[r][segs.valid[r]] for r in rows])
        assert x.tolist() == corpus.doc(i)[:-1].tolist()
        assert y.tolist() == corpus.doc(i)[1:].tolist()


def test_plans() -> None:
    segs = make_segments(_corpus(), 4)
    long_cfg = TrainConfig(objective="trime-long", seg_len=4, batch_segments=4, long_m=2, steps=9)
    plan = batch_plan(segs, long_cfg)
    assert len(plan) == 9 and plan == batch_plan(segs, long_cfg)
    n_pairs = 0
    for rows in plan:
        assert len(rows) <= 4
        for d in set(segs.doc[rows].tolist()):
            orders = [int(segs.order[r]) for r in rows if segs.doc[r] == d]
            # one group of m = 2 consecutive segments (a single one at a document's end)
            assert orders[0] % 2 == 0 and orders == list(range(orders[0], orders[0] + len(orders)))
            n_pairs += len(orders) == 2
    assert n_pairs > 0
    n_groups = sum(-(-int((segs.doc == d).sum()) // 2) for d in set(segs.doc.tolist()))
    epoch = batch_plan(segs, replace(long_cfg, steps=-(-n_groups // 2)))
    assert sorted(r for rows in epoch for r in rows) == list(range(len(segs)))
    texts = [" ".join(f"w{t}" for t in segs.x[i]) for i in range(len(segs))]
    ext_cfg = TrainConfig(objective="trime-ext", seg_len=4, batch_segments=4, steps=3)
    assert batch_plan(segs, ext_cfg, texts) == batch_plan(segs, ext_cfg, texts)
    with pytest.raises(ValueError):
        batch_plan(segs, ext_cfg)
    rand = batch_plan(segs, replace(ext_cfg, bm25=False))
    assert [len(r) for r in rand] == [4, 4, 4]


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
    segs = make_segments(_corpus(), 8)
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
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
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


def test_read_text_documents(tmp_path: Path) -> None:
    from memlm.train.transformer_train import read_text_documents

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

    from memlm.train import TrainRequest
    from memlm.train.transformer_train import run

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
