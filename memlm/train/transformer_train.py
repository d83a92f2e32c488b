"""Train a causal Transformer LM with the vanilla or the TRIME objective.

Objectives (Zhong et al. 2022, Table 1):

- ``vanilla``: cross-entropy (Eq. 1), segments batched at random;
- ``trime`` (TrimeLM): Eq. 5 with local memory, segments batched at random;
- ``trime-long`` (TrimeLM_long): m consecutive segments of a document in one batch,
  memory across them, gradients flowing into the memory representations;
- ``trime-ext`` (TrimeLM_ext): segments packed by BM25 similarity (App. B), memory over
  the whole batch, local memory dropped for a batch with probability p = 0.9.

The first 5% of the updates of every TRIME objective use the plain LM loss (§5.2).
Models are small ``LlamaConfig`` models built from scratch with the SmolLM2 tokenizer,
or any HF causal LM to continue training. Checkpoints are HF folders (model + tokenizer,
loadable with ``AutoModelForCausalLM.from_pretrained``) plus ``trainer_state.pt``
(optimizer, schedule, step, RNG) so a run resumes exactly where it stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from memlm.encoder import last_mlp
from memlm.train.bm25_batching import bm25_neighbours, greedy_chain, random_batches
from memlm.train.data import (
    Segments,
    consecutive_batches,
    make_segments,
    stream_segments,
)
from memlm.train.trime import MemoryKind, lm_token_loss, memory_mask, trime_token_loss

log = logging.getLogger(__name__)

Objective = Literal["vanilla", "trime", "trime-long", "trime-ext"]
OBJECTIVES: tuple[Objective, ...] = ("vanilla", "trime", "trime-long", "trime-ext")
MEMORY_OF: dict[str, MemoryKind | None] = {
    "vanilla": None,
    "trime": "local",
    "trime-long": "long",
    "trime-ext": "ext",
}
STATE_FILE = "trainer_state.pt"


def set_threads(threads: int | None = None) -> int:
    """torch threads: the argument, else $MEMLM_THREADS, else 1 (the machine is shared)."""
    n = threads or int(os.environ.get("MEMLM_THREADS", "1"))
    torch.set_num_threads(n)
    return n


# --- model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """A small Llama for CPU training; the 49,152-row tied embedding dominates its size."""

    hidden: int = 128  # 6.3M embedding parameters at 128; the LM head is most of the FLOPs
    layers: int = 4
    heads: int = 4  # head dim 32
    ffn: int = 512  # 4x hidden, as the paper's 7M model (hidden 128, FFN 512)
    max_positions: int = 1024
    tie_embeddings: bool = True  # halves the parameters at this vocabulary size


def build_model(cfg: ModelConfig, vocab_size: int, boundary_id: int, seed: int = 0) -> nn.Module:
    """A randomly initialised LlamaForCausalLM (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=boundary_id,
        eos_token_id=boundary_id,
        pad_token_id=boundary_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(conf)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total (tied weights once), embedding, and non-embedding parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()  # type: ignore[operator]
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


@contextmanager
def capture_keys(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the input of the last MLP (with its graph) during forwards in the block."""
    store: list[torch.Tensor] = []

    def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        store.append(args[0])

    handle = last_mlp(model).register_forward_pre_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


def forward_with_keys(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids -> logits (B, T, V) and keys (B, T, d)."""
    with capture_keys(model) as store:
        logits = model(input_ids=x).logits
    assert len(store) == 1
    return logits.float(), store[0].float()


# --- segments and batches -------------------------------------------------------------------


def segment_texts(segs: Segments, decode: Callable[[Sequence[int]], str]) -> list[str]:
    """Decoded text of every segment (the BM25 corpus)."""
    return [decode([int(t) for t in segs.x[i][segs.valid[i]]]) for i in range(len(segs))]


def batch_plan(
    segs: Segments,
    cfg: TrainConfig,
    texts: Sequence[str] | None = None,
) -> list[list[int]]:
    """Segment rows of every step, epoch after epoch, deterministic in ``cfg.seed``.

    Every epoch uses each row once. Over :func:`stream_segments` rows cut to a multiple
    of ``cfg.batch_segments``, every batch of every objective holds exactly B full rows.
    """
    plan: list[list[int]] = []
    neighbours: list[list[int]] | None = None
    if cfg.objective == "trime-ext" and cfg.bm25:
        if texts is None:
            raise ValueError("BM25 batching needs the segment texts")
        neighbours = bm25_neighbours(texts, cfg.bm25_k)
    epoch = 0
    while len(plan) < cfg.steps:
        seed = cfg.seed * 1000 + epoch
        if cfg.objective == "trime-long":
            batches = consecutive_batches(len(segs), cfg.batch_segments, cfg.long_m, seed)
        elif neighbours is not None:
            order = greedy_chain(neighbours, seed)
            b = cfg.batch_segments
            batches = [order[i : i + b] for i in range(0, len(order), b)]
        else:
            batches = random_batches(len(segs), cfg.batch_segments, seed)
        plan.extend(batches)
        epoch += 1
    return plan[: cfg.steps]


# --- training -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the reason for each default beside it."""

    objective: Objective = "vanilla"
    seg_len: int = 128  # L: attention span of training and evaluation
    batch_segments: int = 8  # B: 1,024 tokens a step and a 1,024-entry in-batch memory
    long_m: int = 4  # m: consecutive segments per document for trime-long
    steps: int = 300
    lr: float = 2e-3  # small models from scratch take a large rate
    min_lr_frac: float = 0.1  # cosine decay to 10% of lr
    warmup_frac: float = 0.05  # linear lr warm-up
    weight_decay: float = 0.01
    clip: float = 1.0
    vanilla_frac: float = 0.05  # §5.2: first 5% of updates with the plain LM loss
    p_drop_local: float = 0.9  # §4.3 / App. H: trime-ext drops local memory this often
    bm25: bool = True  # trime-ext: False is the "without BM25 batching" ablation
    bm25_k: int = 20  # App. B: top-20 neighbours per segment
    tau: float = 1.0  # training uses the plain scaled dot product
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2  # older step-N folders are deleted (each holds Adam's 2x state)
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, not {self.objective!r}")
        if self.steps < 1 or self.batch_segments < 1 or self.seg_len < 2 or self.long_m < 1:
            raise ValueError("steps, batch_segments, long_m must be >= 1 and seg_len >= 2")
        if not 0 <= self.p_drop_local <= 1 or not 0 <= self.vanilla_frac <= 1:
            raise ValueError("p_drop_local and vanilla_frac must lie in [0, 1]")
        if self.objective == "trime-long" and self.batch_segments % self.long_m:
            raise ValueError(
                f"trime-long needs batch_segments ({self.batch_segments}) to be a multiple "
                f"of long_m ({self.long_m}): a batch holds whole groups of m segments"
            )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac``."""
    warm = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def drop_local_at(step: int, cfg: TrainConfig) -> bool:
    """The per-batch coin of §4.3, seeded by (seed, step) so that a resumed run agrees."""
    rng = np.random.default_rng([cfg.seed, step, 17])
    return bool(rng.random() < cfg.p_drop_local)


def batch_loss(
    model: nn.Module, segs: Segments, rows: Sequence[int], cfg: TrainConfig, step: int
) -> tuple[torch.Tensor, int]:
    """Mean loss of one batch (TRIME or plain, per objective and step) and its token count."""
    idx = np.asarray(rows)
    x = torch.from_numpy(segs.x[idx])  # (B, L)
    y = torch.from_numpy(segs.y[idx]).reshape(-1)  # (N,)
    valid = torch.from_numpy(segs.valid[idx]).reshape(-1)  # (N,)
    logits, keys = forward_with_keys(model, x)
    logits = logits.reshape(y.shape[0], -1)  # (N, V)
    kind = MEMORY_OF[cfg.objective]
    plain = kind is None or step < round(cfg.vanilla_frac * cfg.steps)
    if plain:
        per_tok = lm_token_loss(logits, y, valid)
    else:
        assert kind is not None
        vis = memory_mask(
            torch.from_numpy(segs.doc[idx]),
            torch.from_numpy(segs.pos[idx]),
            kind,
            drop_local=kind == "ext" and drop_local_at(step, cfg),
        )
        per_tok = trime_token_loss(logits, y, keys.reshape(y.shape[0], -1), vis, valid, cfg.tau)
    n = int(valid.sum())
    return per_tok.sum() / max(n, 1), n


# Fields that do not change the weights a run ends with: a run may resume with other values.
OPERATIONAL_FIELDS = ("save_every", "keep_checkpoints", "threads")


def _resume_key(config: dict[str, Any]) -> dict[str, Any]:
    """A run's configuration (``asdict(TrainConfig)``) without the operational fields."""
    return {k: v for k, v in config.items() if k not in OPERATIONAL_FIELDS}


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """An HF tokenizer (``save_pretrained``) or memlm's word vocabulary (``save``)."""
    if tokenizer is None:
        return
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    else:
        tokenizer.save(folder / "word_tokenizer.json")


def _save_checkpoint(
    folder: Path,
    model: nn.Module,
    tokenizer: Any,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    cfg: TrainConfig,
    history: list[dict[str, float]],
) -> None:
    """Write an HF folder + trainer state to a temp dir, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        model.save_pretrained(tmp)  # type: ignore[operator]
        _save_tokenizer(tokenizer, tmp)
        torch.save(
            {
                "step": step,
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "config": asdict(cfg),
                "history": history,
            },
            tmp / STATE_FILE,
        )
        if folder.exists():
            old = folder.with_name(f".{folder.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoint folders under ``out_dir/checkpoints``, by increasing step."""
    root = out_dir / "checkpoints"
    found = [p for p in root.glob("step-*") if (p / STATE_FILE).exists()] if root.exists() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _prune_checkpoints(out_dir: Path, keep: int) -> None:
    for old in _checkpoints(out_dir)[: -max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint folder with the highest step under ``out_dir/checkpoints``."""
    found = _checkpoints(out_dir)
    return found[-1] if found else None


@dataclass
class TrainResult:
    steps_done: int
    resumed_from: int
    seconds: float
    tokens: int
    history: list[dict[str, float]] = field(default_factory=list)


def train(
    model: nn.Module,
    segs: Segments,
    cfg: TrainConfig,
    out_dir: Path,
    *,
    tokenizer: Any = None,
    texts: Sequence[str] | None = None,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
    max_seconds: float | None = None,
) -> TrainResult:
    """Train in place; checkpoint every ``save_every`` steps and at the end; resume if asked.

    ``stop_after`` ends the loop early after that many steps and checkpoints there (a time
    limit, or an interruption in tests): a second call with ``resume`` finishes the run.
    ``max_seconds`` does the same after that much wall time. ``resume=False`` starts over
    and deletes the checkpoints already under ``out_dir``.
    """
    from tqdm import tqdm

    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    plan = batch_plan(segs, cfg, texts)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    start, history = 0, []
    if not resume:  # start over: older checkpoints would otherwise outrank the new ones
        for old in _checkpoints(out_dir):
            log.warning("resume=False: deleting %s", old)
            shutil.rmtree(old)
    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        from safetensors.torch import load_file

        # weights_only: a checkpoint folder is data, never code to run (plain dicts, lists,
        # numbers and tensors are all that _save_checkpoint writes)
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
        saved, wanted = _resume_key(state["config"]), _resume_key(asdict(cfg))
        if saved != wanted:
            diff = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
            raise ValueError(f"{ckpt} was written with another configuration ({', '.join(diff)})")
        weights = load_file(str(ckpt / "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:  # a tied lm_head is not stored
            raise ValueError(f"{ckpt}: missing {missing}, unexpected {unexpected}")
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start, history = int(state["step"]), list(state["history"])
        log.info("resumed from %s at step %d", ckpt, start)
    model.train()
    t0, tokens = time.time(), 0
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(
        range(start, end), initial=start, total=cfg.steps, disable=not progress, desc=cfg.objective
    )
    for step in bar:
        loss, n = batch_loss(model, segs, plan[step], cfg, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        sched.step()
        tokens += n
        value = float(loss.detach())
        history.append({"step": step + 1, "loss": value, "lr": float(sched.get_last_lr()[0])})
        bar.set_postfix(loss=f"{value:.3f}")
        done = step + 1
        if max_seconds is not None and time.time() - t0 > max_seconds and done < end:
            end = done
        if done % cfg.save_every == 0 or done == end:
            _save_checkpoint(
                out_dir / "checkpoints" / f"step-{done}",
                model,
                tokenizer,
                opt,
                sched,
                done,
                cfg,
                history,
            )
            _prune_checkpoints(out_dir, cfg.keep_checkpoints)
        if done == end:
            break
    if end == cfg.steps:
        _save_final(out_dir, model, tokenizer, cfg, history)
    return TrainResult(
        steps_done=end, resumed_from=start, seconds=time.time() - t0, tokens=tokens, history=history
    )


def _save_final(
    out_dir: Path,
    model: nn.Module,
    tokenizer: Any,
    cfg: TrainConfig,
    history: list[dict[str, float]],
) -> None:
    """``out_dir/model``: HF folder + tokenizer + ``memlm_train.json``, renamed into place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".model-"))
    try:
        model.save_pretrained(tmp)  # type: ignore[operator]
        _save_tokenizer(tokenizer, tmp)
        meta = {"train_config": asdict(cfg), "final_loss": history[-1]["loss"] if history else None}
        (tmp / "memlm_train.json").write_text(json.dumps(meta, indent=2))
        final = out_dir / "model"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- evaluation of trained models -----------------------------------------------------------


@dataclass
class SegmentOutputs:
    """Per position of an evaluated corpus, documents in order."""

    keys: torch.Tensor  # (N, d)
    targets: torch.Tensor  # (N,)
    gold_logit: torch.Tensor  # (N,)
    lse: torch.Tensor  # (N,)
    doc: np.ndarray  # (N,) document index
    pos: np.ndarray  # (N,) position of the input within its document
    seg_start: np.ndarray  # (N,) document position where the position's segment starts


@torch.inference_mode()
def encode_segments(model: nn.Module, segs: Segments, batch: int = 16) -> SegmentOutputs:
    """Run the model over non-overlapping segments; keep what the memory needs per token."""
    model.eval()
    keys, gold, lse, tgt = [], [], [], []
    for a in range(0, len(segs), batch):
        x = torch.from_numpy(segs.x[a : a + batch])
        y = torch.from_numpy(segs.y[a : a + batch])
        logits, k = forward_with_keys(model, x)
        v = torch.from_numpy(segs.valid[a : a + batch])
        keys.append(k[v])
        gold.append(logits.gather(2, y.unsqueeze(-1)).squeeze(-1)[v])
        lse.append(torch.logsumexp(logits, dim=-1)[v])
        tgt.append(y[v])
    valid = segs.valid
    # a position's segment starts where its document's run in the row starts
    t = np.arange(segs.seg_len)[None, :]
    run_start = valid & ((t == 0) | (segs.doc != np.roll(segs.doc, 1, axis=1)))
    first = np.maximum.accumulate(np.where(run_start, t, 0), axis=1)
    seg_start = np.take_along_axis(segs.pos, first, axis=1)[valid]
    doc, pos = segs.doc[valid], segs.pos[valid]
    return SegmentOutputs(
        keys=torch.cat(keys),
        targets=torch.cat(tgt),
        gold_logit=torch.cat(gold),
        lse=torch.cat(lse),
        doc=doc,
        pos=pos,
        seg_start=seg_start,
    )


def memory_logprobs(
    out: SegmentOutputs,
    long_segments: int | None,
    tau: float,
    seg_len: int,
    extra_scores: torch.Tensor | None = None,
    extra_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """log P(target) per position with TRIME memory (Eq. 6), document by document.

    long_segments None: no local/long memory (only ``extra`` entries, if any); 0: local
    memory (earlier tokens of the same segment); S > 0: plus the S previous segments of
    the same document. ``extra_*`` (N, K): retrieved external entries joining Eq. 6.
    """
    from memlm.trime_memory import document_gold_logprobs, trime_gold_logprob

    if long_segments is None:
        k = 0 if extra_scores is None else extra_scores.shape[1]
        scores = torch.empty(len(out.targets), 0) if extra_scores is None else extra_scores
        values = (
            torch.empty(len(out.targets), k, dtype=torch.long)
            if extra_values is None
            else extra_values
        )
        return trime_gold_logprob(out.gold_logit, out.lse, scores, values, out.targets)
    res = torch.empty_like(out.lse)
    bounds = np.flatnonzero(np.diff(out.doc)) + 1
    for a, b in zip(
        np.concatenate([[0], bounds]), np.concatenate([bounds, [len(out.doc)]]), strict=True
    ):
        # inputs are contiguous within a document, so the document slice index is pos - pos[a]
        start = torch.from_numpy(out.seg_start[a:b] - out.pos[a]).long()
        res[a:b] = document_gold_logprobs(
            out.keys[a:b],
            out.targets[a:b],
            out.gold_logit[a:b],
            out.lse[a:b],
            start,
            long_segments * seg_len,
            tau,
            extra_scores=None if extra_scores is None else extra_scores[a:b],
            extra_values=None if extra_values is None else extra_values[a:b],
        )
    return res


def perplexity(logprobs: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood."""
    return float(torch.exp(-logprobs.double().mean()))


# --- `memlm train --arch transformer` -------------------------------------------------------


class HFTokenizerAdapter:
    """An HF tokenizer seen through :class:`memlm.train.data.Tokenizer` (for ``--data``)."""

    def __init__(self, tok: Any, name: str) -> None:
        self.tok = tok
        self.name = name
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id
        if eos is None:
            raise ValueError(f"{name}: the tokenizer has neither an EOS nor a BOS token")
        self._boundary = int(eos)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def boundary_id(self) -> int:
        return self._boundary

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tok.decode(list(ids))
        return text


def read_text_documents(path: Path) -> list[Any]:
    """Documents of a ``.jsonl`` file (field ``text``) or a ``.txt`` file (blank-line blocks)."""
    import datetime as dt

    from memlm.corpus import Document

    day = dt.date(1970, 1, 1)  # dates do not matter for training
    texts: list[str] = []
    if path.suffix == ".jsonl":
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(str(json.loads(line)["text"]))
    else:
        blocks = path.read_text(encoding="utf-8").split("\n\n")
        texts = [b.strip() for b in blocks if b.strip()]
    if not texts:
        raise ValueError(f"{path}: no documents")
    return [
        Document(id=f"{i:08d}", text=t, published_at=day, source=path.name)
        for i, t in enumerate(texts)
    ]


def _opt(extra: dict[str, str], key: str, default: Any) -> Any:
    if key not in extra:
        return default
    raw = extra[key]
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes")
    return type(default)(raw) if default is not None else raw


def run(req: Any) -> dict[str, Any]:
    """Runner for ``memlm train --arch transformer`` (see :class:`memlm.train.TrainRequest`).

    ``--objective`` vanilla | trime | trime-long | trime-ext; ``--bptt`` is the segment
    length L and ``--batch-size`` the segments per batch B (every batch holds B full rows
    of the document stream). ``--set`` keys: ``init_from`` (HF id or folder, or
    ``smollm2-135m``: continue training it, with its own tokenizer), ``data`` (a .txt or
    .jsonl file instead of ``--corpus``), ``layers``, ``heads``, ``ffn``, ``long_m``,
    ``p_drop_local``, ``bm25`` (false: random batching), ``vanilla_frac``, ``save_every``,
    ``keep_checkpoints``, ``resume`` (default true; false starts over), ``tau``
    (evaluation).
    """
    from memlm.corpus import load_corpus
    from memlm.train.data import encode_corpus, load_encoded_splits, split_documents

    ex = dict(req.extra)
    set_threads(req.threads)
    out = Path(req.out)
    init_from = _opt(ex, "init_from", None)
    data = _opt(ex, "data", None)
    docs = None if data is None else read_text_documents(Path(data))
    tokenizer: Any
    if init_from is not None:
        from memlm.encoder import Encoder

        enc = Encoder.load(str(init_from), threads=req.threads)
        model, hf_tok = enc.model, enc.tokenizer
        for p in model.parameters():
            p.requires_grad_(True)
        # the model's own tokenizer, over --data or else --corpus
        tokenizer = HFTokenizerAdapter(hf_tok, f"hf-{Path(str(init_from)).name}")
        splits = split_documents(load_corpus(req.corpus) if docs is None else docs, seed=req.seed)
        train_c, dev_c, test_c = (
            encode_corpus(d, tokenizer, req.cache_dir)
            for d in (splits.train, splits.dev, splits.test)
        )
    else:
        enc_splits = load_encoded_splits(
            corpus=req.corpus,
            tokenizer=req.tokenizer,
            vocab_size=req.vocab_size,
            seed=req.seed,
            cache_dir=req.cache_dir,
            docs=docs,
        )
        train_c, dev_c, test_c = enc_splits.train, enc_splits.dev, enc_splits.test
        tokenizer = enc_splits.tokenizer
        mcfg = ModelConfig(
            hidden=req.hidden or 128,
            layers=_opt(ex, "layers", 4),
            heads=_opt(ex, "heads", 4),
            ffn=_opt(ex, "ffn", 4 * (req.hidden or 128)),
            max_positions=max(1024, req.bptt),
        )
        model = build_model(mcfg, tokenizer.vocab_size, tokenizer.boundary_id, req.seed)
        hf_tok = None
        if req.tokenizer == "subword":
            from transformers import AutoTokenizer

            from memlm.encoder import bundled_tokenizer_path

            hf_tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    decode = tokenizer.decode
    if req.max_train_tokens:
        train_c = train_c.truncate_tokens(req.max_train_tokens)
    if req.max_eval_tokens:
        dev_c, test_c = (c.truncate_tokens(req.max_eval_tokens) for c in (dev_c, test_c))
    cfg = TrainConfig(
        objective=req.objective,
        seg_len=req.bptt,
        batch_segments=req.batch_size,
        long_m=_opt(ex, "long_m", 4),
        steps=req.steps,
        lr=req.lr,
        clip=req.clip,
        vanilla_frac=_opt(ex, "vanilla_frac", 0.05),
        p_drop_local=_opt(ex, "p_drop_local", 0.9),
        bm25=_opt(ex, "bm25", True),
        seed=req.seed,
        save_every=_opt(ex, "save_every", 100),
        keep_checkpoints=_opt(ex, "keep_checkpoints", 2),
        threads=req.threads,
    )
    segs = stream_segments(train_c, cfg.seg_len, rows_multiple=cfg.batch_segments)
    texts = segment_texts(segs, decode) if cfg.objective == "trime-ext" and cfg.bm25 else None
    result = train(
        model,
        segs,
        cfg,
        out,
        tokenizer=hf_tok if hf_tok is not None else tokenizer,  # word vocabularies too
        texts=texts,
        resume=_opt(ex, "resume", True),
        max_seconds=None if req.max_minutes is None else 60 * req.max_minutes,
    )
    complete = result.steps_done == cfg.steps
    last = latest_checkpoint(out)
    summary: dict[str, Any] = {
        "arch": "transformer",
        "objective": cfg.objective,
        "parameters": parameter_counts(model),
        "complete": complete,  # False: stopped by --max-minutes; run again to resume
        "steps": result.steps_done,
        "resumed_from": result.resumed_from,
        "train_seconds": round(result.seconds, 1),
        "train_tokens": result.tokens,
        "final_loss": result.history[-1]["loss"] if result.history else None,
        "model_dir": str(out / "model" if complete or last is None else last),
    }
    tau = _opt(ex, "tau", 1.0)
    kind = MEMORY_OF[cfg.objective]
    long_s = {None: None, "local": 0, "long": cfg.long_m, "ext": 0}[kind]
    for name, corpus in (("dev", dev_c), ("test", test_c)):
        o = encode_segments(model, make_segments(corpus, cfg.seg_len))
        summary[f"{name}_ppl"] = perplexity(o.gold_logit - o.lse)
        if long_s is not None:
            summary[f"{name}_ppl_memory"] = perplexity(memory_logprobs(o, long_s, tau, cfg.seg_len))
    return summary
