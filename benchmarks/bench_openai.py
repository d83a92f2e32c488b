"""The overhead of the OpenAI-compatible API against memlm's own routes, same work, one run.

Builds a memory from real news with the real engine (MoNIM, then an index build), serves
the app over a local socket, and times, round by round with the rows interleaved (so a
change of the machine's load hits every row), one request at a time:

  - generation: ``POST /generate`` against ``POST /v1/completions`` with the same
    context (the first ``--context`` tokens of a later article, not in memory), greedy,
    ``--tokens`` tokens at most; whole JSON answers and server-sent event streams;
  - scoring: ``POST /score`` against ``POST /v1/completions`` with ``echo``,
    ``max_tokens: 0`` and ``logprobs: 1`` (a log-likelihood as evaluation tools ask for
    it) of the same text; and lm-evaluation-harness's own request (token ids, echo,
    ``max_tokens: 1``, ``logprobs: 1``: a score and a one-token generation) against
    ``/score`` followed by a one-token ``/generate``, the same work in memlm's routes.

Prints tokens per second (generated, or scored) and the /v1 row's overhead against the
memlm row it does the same work as, and the load average.

    python benchmarks/bench_openai.py --memory-docs 6 --tokens 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import interleaved, load_average, markdown_table, memorise, open_served_engine, serving


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--memory-docs", type=int, default=6, help="news articles memorised")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    ap.add_argument("--context", type=int, default=128, help="context tokens (and scored text)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each row once)")
    args = ap.parse_args()

    import httpx
    import torch

    from memlm.corpus import load_news
    from service.app import create_app

    load_before = load_average()
    news = load_news()
    settings, engine, _ = open_served_engine(
        "bench-openai",
        model=args.model,
        threads=args.threads,
        max_generate_tokens=max(256, args.tokens),
        # one request at a time: a stream's request slot may still be held for the moment
        # after its last event, which a tight budget answers with 429; admission is not
        # what is measured here
        queue_budget_s=600,
    )
    build_s = memorise(engine, settings, news[: args.memory_docs])
    stats = engine.stats()
    contexts: list[list[int]] = []
    for d in news[args.memory_docs :]:
        ids = engine.tokenize(d.text)
        if len(ids) >= args.context:
            contexts.append(ids[: args.context])
        if len(contexts) == args.rounds + 1:
            break
    current: list[list[int]] = []
    texts = iter(range(10**9))

    def next_round() -> None:
        current[:] = [contexts[next(texts) % len(contexts)]]

    n, model = args.tokens, settings.model
    done: dict[str, list[int]] = {}  # tokens generated or scored by each call
    cpu: dict[str, list[float]] = {}

    def row(name: str, fn: Callable[[], int]) -> Callable[[], None]:
        """``fn`` (returns its tokens) recording its tokens and the process's CPU seconds
        (the server runs in this process: on a shared machine wall time is mostly waiting
        for a core; CPU time is the work)."""
        done[name], cpu[name] = [], []

        def run() -> None:
            t = time.process_time()
            done[name].append(fn())
            cpu[name].append(time.process_time() - t)

        return run

    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with serving(app) as base, httpx.Client(base_url=base, timeout=600) as client:

        def text() -> str:
            return engine.detokenize(current[0])

        def post(path: str, body: dict[str, Any]) -> Any:
            r = client.post(path, json=body)
            r.raise_for_status()
            return r.json()

        def stream(path: str, body: dict[str, Any]) -> list[str]:
            """The lines of a server-sent event stream, read to its end."""
            with client.stream("POST", path, json={**body, "stream": True}) as r:
                r.raise_for_status()
                return list(r.iter_lines())

        def generate_stream() -> int:
            lines = stream("/generate", {**gen, "context": text()})
            return sum(line == "event: token" for line in lines)

        def v1_stream() -> int:
            body = {**v1, "prompt": text(), "stream_options": {"include_usage": True}}
            lines = stream("/v1/completions", body)
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            return int(chunks[-1]["usage"]["completion_tokens"])  # the usage chunk is last

        gen = {"max_tokens": n}
        v1 = {"model": model, "max_tokens": n, "temperature": 0}

        def generate() -> int:
            return int(post("/generate", {**gen, "context": text()})["generated_tokens"])

        def completion() -> int:
            return int(
                post("/v1/completions", {**v1, "prompt": text()})["usage"]["completion_tokens"]
            )

        def score() -> int:  # the text's tokens: the first is read, not scored
            return len(post("/score", {"text": text()})["logprobs"]) + 1

        def echo() -> int:
            body = {"model": model, "prompt": text(), "max_tokens": 0, "echo": True, "logprobs": 1}
            return int(post("/v1/completions", body)["usage"]["prompt_tokens"])

        def score_and_one() -> int:
            post("/generate", {"context": text(), "max_tokens": 1})
            return score()

        def lm_eval() -> int:
            body = {"model": model, "prompt": [current[0]], "max_tokens": 1, "echo": True,
                    "logprobs": 1, "temperature": 0, "seed": 1234}  # fmt: skip
            return int(post("/v1/completions", body)["usage"]["prompt_tokens"])

        paths = {
            "/generate": row("/generate", generate),
            "/v1/completions": row("/v1/completions", completion),
            "/generate stream": row("/generate stream", generate_stream),
            "/v1/completions stream": row("/v1/completions stream", v1_stream),
            "/score": row("/score", score),
            "/v1/completions echo": row("/v1/completions echo", echo),
            # lm-evaluation-harness's request, and the same work in memlm's own two requests
            "/score + /generate 1": row("/score + /generate 1", score_and_one),
            "/v1/completions lm-eval": row("/v1/completions lm-eval", lm_eval),
        }
        times = interleaved(paths, args.rounds, warmup=1, before_round=next_round)

    print(f"model {args.model}, threads {args.threads}, torch {torch.__version__}")
    print(
        f"memory: {args.memory_docs} news articles, {stats['entries']} entries (MoNIM), "
        f"index version {stats['index_version']} ({build_s:.0f} s to build)"
    )
    print(
        f"{args.rounds} rounds after one warm-up round, each a {args.context}-token context "
        f"and up to {n} new tokens (greedy), the rows interleaved, one request at a time"
    )
    print(f"load average before: {load_before}; after: {load_average()}")
    print()
    pairs = {
        "/v1/completions": "/generate",
        "/v1/completions stream": "/generate stream",
        "/v1/completions echo": "/score",
        "/v1/completions lm-eval": "/score + /generate 1",
    }
    rates = {
        name: statistics.median(k / s for k, s in zip(done[name][1:], secs, strict=True))
        for name, secs in times.items()
    }
    cpu_rates = {
        name: statistics.median(k / s for k, s in zip(done[name][1:], cpu[name][1:], strict=True))
        for name in times
    }
    generated = {"/generate", "/v1/completions", "/generate stream", "/v1/completions stream"}
    rows = []
    for name in times:
        ref = pairs.get(name)
        rows.append(
            (
                name,
                "generated" if name in generated else "read (scored)",
                rates[name],
                cpu_rates[name],
                "" if ref is None else f"{100 * (rates[ref] / rates[name] - 1):+.1f}%",
                "" if ref is None else f"{100 * (cpu_rates[ref] / cpu_rates[name] - 1):+.1f}%",
                ref or "",
            )
        )
    header = ["route", "tokens", "tokens/s (wall)", "tokens per CPU second", "overhead (wall)",
              "overhead (CPU)", "against"]  # fmt: skip
    print(markdown_table(header, rows, digits=1))
    print(
        "(medians over the rounds; overhead: how much longer the /v1 request takes than the "
        "memlm row that does the same work; CPU: the process's CPU seconds, server included)"
    )


if __name__ == "__main__":
    main()
