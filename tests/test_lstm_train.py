import datetime as dt
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from memlm.corpus import Document, write_jsonl
from memlm.research.data import EncodedCorpus, bptt_batches
from memlm.research.lstm_models import ShortSpanConfig, ShortSpanLM
from memlm.research.lstm_train import (
    TrainConfig,
    evaluate,
    load_checkpoint,
    masked_loss,
    save_checkpoint,
    train_model,
)

V = 30
ARCH_KW = [
    ("lstm", {}),
    ("attention", {"window": 3}),
    ("kv", {"window": 3}),
    ("kvp", {"window": 3}),
    ("ngram", {"ngram": 2}),
    ("ngram", {"ngram": 4}),
]


def _corpus(lengths: list[int], seed: int = 0) -> EncodedCorpus:
    rng = np.random.default_rng(seed)
    seqs = [np.array([0, *rng.integers(1, V, n), 0]) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    return EncodedCorpus(
        ids=np.concatenate(seqs).astype(np.int32),
        offsets=offsets.astype(np.int64),
        doc_ids=[f"d{i}" for i in range(len(lengths))],
        boundary_id=0,
    )


def _model(arch: str, **kw: int) -> ShortSpanLM:
    torch.manual_seed(0)
    return ShortSpanLM(ShortSpanConfig(arch, V, emb=8, hidden=12, **kw))


@pytest.mark.parametrize(("arch", "kw"), ARCH_KW)
def test_training_steps_decrease_loss_on_a_fixed_batch(arch, kw):
    model = _model(arch, **kw)
    batch = next(bptt_batches(_corpus([15, 9, 22, 6]), batch_size=4, bptt=10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)

    def loss() -> torch.Tensor:
        return masked_loss(model(batch.x, batch.reset).logits, batch.y, batch.mask)

    with torch.no_grad():
        before = float(loss())
    for _ in range(10):
        opt.zero_grad()
        loss().backward()
        opt.step()
    with torch.no_grad():
        after = float(loss())
    assert after < before - 0.3


def test_evaluate_is_exact_perplexity_and_independent_of_batching():
    model = _model("kvp", window=3)
    corpus = _corpus([15, 9, 22, 6, 11])
    a = evaluate(model, corpus, batch_size=2, bptt=4)
    b = evaluate(model, corpus, batch_size=5, bptt=7)
    assert a.tokens == b.tokens == corpus.n_targets == 63 + 5
    assert a.nll == pytest.approx(b.nll, rel=1e-5)
    # reference: each document alone, in one window
    total = 0.0
    with torch.no_grad():
        for i in range(len(corpus)):
            seq = torch.from_numpy(corpus.doc(i).astype(np.int64))
            x, y = seq[:-1].unsqueeze(0), seq[1:]
            reset = torch.zeros_like(x, dtype=torch.bool)
            reset[0, 0] = True
            logits = model(x, reset).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
    assert a.nll == pytest.approx(total / corpus.n_targets, rel=1e-5)
    assert a.ppl == pytest.approx(math.exp(a.nll))
    assert a.attention is not None and len(a.attention) == 3
    assert sum(a.attention) == pytest.approx(1.0, abs=1e-6)
    # full windows only: steps at position >= 3 of each document
    assert a.attention_tokens == sum(len(corpus.doc(i)) - 1 - 3 for i in range(len(corpus)))
    assert evaluate(_model("lstm"), corpus).attention is None


def test_train_model_runs_the_requested_steps_across_epochs():
    model = _model("ngram", ngram=3)
    corpus = _corpus([15, 9, 22, 6])  # 2 rows of bptt 8 -> 4 windows per epoch
    before = evaluate(model, corpus, 2, 8).nll
    res = train_model(
        model, corpus, TrainConfig(steps=10, batch_size=2, bptt=8, lr=1e-2, log_every=5)
    )
    assert res.steps == 10
    assert len(res.losses) == 2
    assert res.tokens > 0
    assert evaluate(model, corpus, 2, 8).nll < before


def test_checkpoint_round_trip(tmp_path: Path):
    model = _model("kv", window=2)
    save_checkpoint(model, tmp_path / "m.pt", {"kind": "word", "words": ["<eos>", "<unk>"]})
    loaded, tok = load_checkpoint(tmp_path / "m.pt")
    assert loaded.cfg == model.cfg
    assert tok == {"kind": "word", "words": ["<eos>", "<unk>"]}
    x = torch.randint(0, V, (2, 5))
    reset = torch.zeros(2, 5, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, reset).logits, model(x, reset).logits)


def test_cli_train_runs_a_small_model(tmp_path: Path):
    from memlm.cli import train_cmd

    words = ["the", "cat", "sat", "on", "mat", "and", "dog", "ran", "to", "park", "in", "2017"]
    rng = np.random.default_rng(0)
    docs = [
        Document(
            id=f"n{i}",
            text=" ".join(rng.choice(words, 60)),
            published_at=dt.date(2017, 3, 1 + i % 3),
            source="s",
        )
        for i in range(40)
    ]
    write_jsonl(docs, tmp_path / "c.jsonl")
    app = typer.Typer()
    train_cmd.register(app)
    app.command("noop")(lambda: None)  # two commands keep typer's sub-command parsing
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "train", "--arch", "kvp", "--corpus", str(tmp_path / "c.jsonl"), "--vocab-size", "20",
            "--emb", "8", "--window", "2", "--steps", "3", "--batch-size", "4", "--bptt", "5",
            "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--set", "budget_hidden=12",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["steps"] == 3
    assert summary["config"]["arch"] == "kvp" and summary["config"]["hidden"] % 3 == 0
    assert summary["dev_tokens"] > 0 and summary["test_tokens"] > 0
    assert math.isfinite(summary["dev_ppl"])
    model, tok = load_checkpoint(out / "model.pt")
    assert tok["kind"] == "word" and model.cfg.vocab_size == 12 + 2  # 12 words incl. N
    bad = CliRunner().invoke(app, ["train", "--arch", "nope", "--out", str(out)])
    assert bad.exit_code != 0
