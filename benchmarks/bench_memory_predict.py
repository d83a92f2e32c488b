"""``/predict`` over a filled memory against the bare forward (bench_memory_backends).

The memory a ``bench_memory_backends`` run filled (the faiss files under a data
directory, or a Milvus collection) is served as the service serves it: the engine that
``memlm serve`` opens read-only from ``Settings`` (``data_dir``, resp. ``memory_url``),
inside ``service.app.create_app`` behind a real uvicorn (``_common.serving``). The
bundled SmolLM2-135M reads 128-token contexts of late news articles (after the ones whose
keys fill the memory). Each round, on the same context, calls in turn:

- ``bare``: tokenise, forward, LM head and log-softmax at the last position;
- ``engine``: ``Engine.predict`` (the same plus the memory search, the kNN distribution
  and the interpolation), in this process;
- ``http``: ``POST /predict`` (``top_n=10``) to the served app: the engine's call plus
  JSON, the request queue and the model executor's thread.

so a change in the machine's load hits the three alike (``_common.interleaved``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import interleaved, open_served_engine, serving, stats_ms

CONTEXT_TOKENS = 128
WARMUP_ROUNDS = 3


def contexts(enc: Any, n: int) -> list[str]:
    """Up to ``n`` contexts of ``CONTEXT_TOKENS`` tokens: the first tokens of the last
    ``n`` news articles long enough (decoded back to text, as a client sends them)."""
    from memlm.corpus import load_news

    out = []
    for d in load_news()[-n:]:
        ids = enc.tokenize(d.text)
        if len(ids) >= CONTEXT_TOKENS:
            out.append(enc.tokenizer.decode(ids[:CONTEXT_TOKENS]))
    if not out:
        raise SystemExit(f"no news article of {CONTEXT_TOKENS} tokens for the contexts")
    return out


def predict_rows(
    name: str, where: Path | str, rounds: int, *, label: str = ""
) -> list[dict[str, Any]]:
    """p50/p99 ms of the bare forward, ``Engine.predict`` and HTTP ``/predict`` served over
    the memory at ``where`` (faiss: the data directory whose ``memory/`` the writer filled;
    milvus: the ``milvus://`` URL), ``rounds`` interleaved rounds after the warm-up."""
    import httpx
    import torch

    from service.app import create_app

    if name == "faiss":
        from bench_scale import record_builds  # the API serves recorded builds only

        settings, engine, _ = open_served_engine("bench-mem", writer=False, data_dir=Path(where))
        record_builds(settings.db_url, settings.datastore_dir / "index")
    else:
        settings, engine, _ = open_served_engine("bench-mem", writer=False, memory_url=str(where))
    enc = engine.encoder
    ctxs = contexts(enc, 60)
    current = [ctxs[0]]
    turn = iter(range(1 << 30))

    def next_context() -> None:
        current[0] = ctxs[next(turn) % len(ctxs)]

    def bare() -> None:
        with torch.inference_mode():
            _, hidden, _ = enc.start([enc.tokenize(current[0])])  # (1, T, d)
            torch.log_softmax(enc.logits(hidden[0, -1:]), dim=-1)  # (1, V)

    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with serving(app) as base, httpx.Client(base_url=base, timeout=120) as client:

        def http() -> None:
            r = client.post("/predict", json={"context": current[0], "top_n": 10})
            r.raise_for_status()

        paths = {
            "bare": bare,
            "engine": lambda: engine.predict(current[0], top_n=10),
            "http": http,
        }
        times = interleaved(paths, rounds, warmup=WARMUP_ROUNDS, before_round=next_context)
    served = engine.memory.count()  # what the predictions searched
    engine.memory.close()
    st = {p: stats_ms(s) for p, s in times.items()}
    row: dict[str, Any] = {"backend": name, "index": label}
    for p in paths:
        row[f"{p} p50 ms"] = st[p]["p50"]
        row[f"{p} p99 ms"] = st[p]["p99"]
    row["engine/bare p50"] = st["engine"]["p50"] / st["bare"]["p50"]
    row["http/bare p50"] = st["http"]["p50"] / st["bare"]["p50"]
    row["rounds"] = rounds
    row["served entries"] = served
    return [row]
