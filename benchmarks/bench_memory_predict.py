"""``Engine.predict`` over a filled memory against the bare forward (bench_memory_backends).

The bundled SmolLM2-135M reads 128-token contexts of late news articles (after the ones
whose keys fill the memory); each round calls the bare forward (tokenise, forward, LM
head at the last position) and ``Engine.predict`` (the same plus the memory search, the
kNN distribution and the interpolation) once, so load changes hit both alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

_ENCODER: Any = None


def _contexts(enc: Any, n: int) -> list[str]:
    from memlm.corpus import load_news

    docs = load_news()[-n:]
    out = []
    for d in docs:
        ids = enc.tokenize(d.text)
        if len(ids) >= 128:
            out.append(enc.tokenizer.decode(ids[:128]))
    return out


def predict_rows(name: str, memory: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """p50 ms of the bare forward and of ``Engine.predict`` over ``memory``."""
    global _ENCODER
    from memlm.encoder import Encoder
    from memlm.engine import Engine

    if _ENCODER is None:
        _ENCODER = Encoder.load(threads=1)
    enc = _ENCODER
    if name == "faiss":
        engine = Engine(memory.root.parent, enc, readonly=True)
    else:
        engine = Engine(Path(tempfile.mkdtemp()), enc, readonly=True, memory_url=str(memory.url))
    ctxs = _contexts(enc, 60)

    def bare(c: str) -> None:
        ids = enc.tokenize(c)
        with torch.inference_mode():
            _, hidden, _ = enc.start([ids])
            torch.log_softmax(enc.logits(hidden[0, -1:]), dim=-1)

    paths = {"bare forward": bare, "Engine.predict": lambda c: engine.predict(c, top_n=10)}
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(args.predict_rounds + 3):
        c = ctxs[r % len(ctxs)]
        for p, fn in paths.items():
            t0 = time.perf_counter()
            fn(c)
            if r >= 3:  # warm-up rounds
                times[p].append(time.perf_counter() - t0)
    p50 = {p: 1000 * statistics.median(t) for p, t in times.items()}
    return [
        {
            "backend": name,
            "bare forward p50 ms": p50["bare forward"],
            "predict p50 ms": p50["Engine.predict"],
            "predict / bare": p50["Engine.predict"] / p50["bare forward"],
            "rounds": args.predict_rounds,
        }
    ]
