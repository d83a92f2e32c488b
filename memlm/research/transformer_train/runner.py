"""``memlm train --arch transformer``: the runner that wires data, model, loop and evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memlm.research.data import HFTokenizerAdapter, make_segments, stream_segments
from memlm.research.transformer_train.checkpoints import latest_checkpoint
from memlm.research.transformer_train.evaluation import encode_segments, memory_logprobs, perplexity
from memlm.research.transformer_train.loop import train
from memlm.research.transformer_train.model import (
    ModelConfig,
    build_model,
    parameter_counts,
    set_threads,
)
from memlm.research.transformer_train.objective import MEMORY_OF, TrainConfig, segment_texts


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
    """Runner for ``memlm train --arch transformer`` (see :class:`memlm.research.TrainRequest`).

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
    from memlm.research.data import encode_corpus, load_encoded_splits, split_documents

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
