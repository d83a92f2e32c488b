"""Training and evaluation of the short-attention-span LMs (section 4.1 of Daniluk et al.).

Adam (lr 0.001), mini-batches of 64 rows, gradient-norm clipping at 5, truncated BPTT of
20 steps, the recurrent state (and the attention memory) zeroed where a document starts;
initialisation is in :class:`memlm.research.lstm_models.ShortSpanLM`.  ``run`` is the
``memlm train --arch lstm|attention|kv|kvp|ngram`` runner.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from memlm.research import TrainRequest
from memlm.research.data import EncodedCorpus, WordTokenizer, bptt_batches, load_encoded_splits
from memlm.research.lstm_models import (
    ShortSpanConfig,
    ShortSpanLM,
    count_parameters,
    hidden_for_budget,
)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    max_minutes: float | None = None  # stop early on wall time (same time for every model)
    batch_size: int = 64  # paper, section 4.1
    bptt: int = 20  # paper: 20 steps of unrolling
    lr: float = 1e-3  # paper: Adam, initial learning rate 0.001
    clip: float = 5.0  # paper: gradient norm clipped at 5
    seed: int = 0
    log_every: int = 100


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens: int
    losses: list[float] = field(default_factory=list)  # mean train loss per log interval


@dataclass
class EvalResult:
    nll: float  # mean negative log likelihood per target (nats)
    tokens: int
    attention: list[float] | None  # mean weight per window slot, oldest first; full windows only
    attention_tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def set_threads(threads: int | None) -> None:
    """torch threads from the argument, else ``$MEMLM_THREADS``, else torch's default."""
    n = threads if threads is not None else int(os.environ.get("MEMLM_THREADS", "0") or 0)
    if n > 0:
        torch.set_num_threads(n)


def masked_loss(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the real targets of a (B, T, V) window."""
    return F.cross_entropy(logits[mask], y[mask])


def train_model(
    model: ShortSpanLM,
    corpus: EncodedCorpus,
    cfg: TrainConfig,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train in place for ``cfg.steps`` windows (or ``max_minutes``), cycling over epochs."""
    torch.manual_seed(cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train()
    start = time.perf_counter()
    step, tokens, epoch = 0, 0, 0
    interval: list[float] = []
    result = TrainResult(0, 0.0, 0)
    deadline = None if cfg.max_minutes is None else start + 60 * cfg.max_minutes
    while step < cfg.steps:
        state = None
        for batch in bptt_batches(corpus, cfg.batch_size, cfg.bptt, shuffle_seed=cfg.seed + epoch):
            if not batch.mask.any():
                continue
            out = model(batch.x, batch.reset, None if batch.first else state)
            loss = masked_loss(out.logits, batch.y, batch.mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            state = out.state.detach()
            step += 1
            tokens += int(batch.mask.sum())
            interval.append(loss.item())
            if step % cfg.log_every == 0 or step == cfg.steps:
                result.losses.append(sum(interval) / len(interval))
                if log is not None:
                    mean = result.losses[-1]
                    log(f"step {step} loss {mean:.3f} ppl {math.exp(mean):.1f}")
                interval = []
            if step >= cfg.steps or (deadline is not None and time.perf_counter() > deadline):
                break
        else:
            epoch += 1
            continue
        break
    result.steps, result.tokens = step, tokens
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def evaluate(
    model: ShortSpanLM, corpus: EncodedCorpus, batch_size: int = 64, bptt: int = 20
) -> EvalResult:
    """Perplexity over whole documents (state carried across windows, reset per document).

    For attentive models also the mean attention weight per window slot, over the steps
    whose window lies entirely in the current document (as in Figure 3 of the paper).
    """
    model.eval()
    nll, n = 0.0, 0
    L = model.cfg.window
    attn_sum = torch.zeros(L, dtype=torch.float64)
    attn_n = 0
    state = None
    for batch in bptt_batches(corpus, batch_size, bptt):
        out = model(batch.x, batch.reset, None if batch.first else state)
        state = out.state
        if not batch.mask.any():
            continue
        nll += float(F.cross_entropy(out.logits[batch.mask], batch.y[batch.mask], reduction="sum"))
        n += int(batch.mask.sum())
        if out.attention is not None:
            full = batch.mask & (out.pos >= L)
            attn_sum += out.attention[full].sum(0).double()
            attn_n += int(full.sum())
    model.train()
    attentive = model.cfg.arch in ("attention", "kv", "kvp")
    attention = (attn_sum / max(attn_n, 1)).tolist() if attentive else None
    return EvalResult(nll / max(n, 1), n, attention, attn_n)


# --- checkpoints ----------------------------------------------------------------------------


def save_checkpoint(model: ShortSpanLM, path: Path, tokenizer: dict[str, object]) -> None:
    """Model weights, config and the tokenizer description, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(
        {"config": asdict(model.cfg), "state_dict": model.state_dict(), "tokenizer": tokenizer}, tmp
    )
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> tuple[ShortSpanLM, dict[str, object]]:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    model = ShortSpanLM(ShortSpanConfig(**obj["config"]))
    model.load_state_dict(obj["state_dict"])
    model.eval()
    return model, obj["tokenizer"]


# --- the CLI runner -------------------------------------------------------------------------


def model_config(req: TrainRequest, vocab_size: int) -> ShortSpanConfig:
    """The model of a request; without ``--hidden``, sized to the LSTM budget.

    The budget is theta_M (all parameters but the input embedding) of the baseline LSTM
    with hidden size ``--set budget_hidden=K`` (default 100), as the paper matches theta_M.
    """
    fields = {"emb": req.emb, "window": req.window, "ngram": req.ngram}
    if req.hidden is not None:
        return ShortSpanConfig(req.arch, vocab_size, hidden=req.hidden, **fields)
    base = ShortSpanConfig(
        "lstm", vocab_size, hidden=int(req.extra.get("budget_hidden", 100)), emb=req.emb
    )
    hidden = hidden_for_budget(count_parameters(base), req.arch, vocab_size, **fields)
    return ShortSpanConfig(req.arch, vocab_size, hidden=hidden, **fields)


def run(req: TrainRequest) -> dict[str, object]:
    """Train one model of a request, evaluate dev and test, save checkpoint + metrics."""
    set_threads(req.threads)
    torch.manual_seed(req.seed)
    data = load_encoded_splits(
        req.corpus, req.tokenizer, req.vocab_size, seed=0, cache_dir=req.cache_dir
    )
    train, dev, test = data.train, data.dev, data.test
    if req.max_train_tokens is not None:
        train = train.truncate_tokens(req.max_train_tokens)
    if req.max_eval_tokens is not None:
        dev, test = (
            dev.truncate_tokens(req.max_eval_tokens),
            test.truncate_tokens(req.max_eval_tokens),
        )
    cfg = model_config(req, data.tokenizer.vocab_size)
    model = ShortSpanLM(cfg)
    tcfg = TrainConfig(
        steps=req.steps,
        max_minutes=req.max_minutes,
        batch_size=req.batch_size,
        bptt=req.bptt,
        lr=req.lr,
        clip=req.clip,
        seed=req.seed,
    )
    result = train_model(model, train, tcfg, log=lambda s: print(s, flush=True))
    ev_dev = evaluate(model, dev, req.batch_size, req.bptt)
    ev_test = evaluate(model, test, req.batch_size, req.bptt)
    tok: dict[str, object]
    if isinstance(data.tokenizer, WordTokenizer):
        tok = {"kind": "word", "words": data.tokenizer.words, "lowercase": data.tokenizer.lowercase}
    else:
        tok = {"kind": "subword", "name": data.tokenizer.name}
    save_checkpoint(model, req.out / "model.pt", tok)
    summary: dict[str, object] = {
        "config": asdict(cfg),
        "train": asdict(tcfg),
        "params_no_embedding": count_parameters(cfg),
        "params_total": count_parameters(cfg, include_embedding=True),
        "steps": result.steps,
        "train_tokens": result.tokens,
        "train_seconds": round(result.seconds, 1),
        "dev_ppl": round(ev_dev.ppl, 2),
        "test_ppl": round(ev_test.ppl, 2),
        "dev_tokens": ev_dev.tokens,
        "test_tokens": ev_test.tokens,
        "test_attention": ev_test.attention,
        "checkpoint": str(req.out / "model.pt"),
    }
    (req.out / "metrics.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary
