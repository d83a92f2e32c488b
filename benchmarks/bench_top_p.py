"""top-p's nucleus from the most probable tokens first against a sort of the whole
vocabulary, on SmolLM2-135M's real next-token distributions over a news article.

    PYTHONPATH=. python benchmarks/bench_top_p.py --doc 5 --tokens 400 --every 4

Prints, per top_p, how often the 256 most probable tokens already hold top_p's mass and
the time a step of each path takes; every step's kept tokens are checked equal.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _common import load_average, markdown_table

from memlm.corpus import load_corpus
from memlm.encoder import Encoder
from memlm.engine.generation import NUCLEUS_PREFIX, nucleus


def full_sort(q: np.ndarray, top_p: float) -> np.ndarray:
    """The code before: a stable sort of every token."""
    order = np.argsort(-q, kind="stable")
    return order[np.cumsum(q[order]) - q[order] < top_p]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doc", type=int, default=5, help="which article of the bundled news")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--every", type=int, default=4, help="every Nth position is a step")
    ap.add_argument("--top-p", default="0.8,0.9,0.95")
    args = ap.parse_args()
    torch.set_num_threads(1)
    enc = Encoder.load("smollm2-135m", threads=1, precision="float32")
    ids = enc.tokenize(load_corpus("news")[args.doc].text)[: args.tokens]
    with torch.no_grad():
        logits = enc.model(torch.tensor([ids])).logits[0].float()
    probs = torch.softmax(logits, -1).numpy().astype(np.float64)[:: args.every]
    print(f"load average before: {load_average()}")
    rows = []
    for top_p in (float(x) for x in args.top_p.split(",")):
        enough = 0
        secs = {"full": 0.0, "nucleus": 0.0}
        for q in probs:
            q = q / q.sum()
            enough += np.sort(q)[::-1][:NUCLEUS_PREFIX].sum() >= top_p + 1e-9
            t = time.perf_counter()
            a = full_sort(q, top_p)
            secs["full"] += time.perf_counter() - t
            t = time.perf_counter()
            b = nucleus(q, top_p)
            secs["nucleus"] += time.perf_counter() - t
            assert np.array_equal(a, b), "the nucleus differs from the full sort's"
        n = len(probs)
        rows.append(
            (
                f"{top_p:g}",
                f"{enough}/{n}",
                f"{secs['full'] / n * 1e3:.2f}",
                f"{secs['nucleus'] / n * 1e3:.2f}",
                f"{secs['full'] / secs['nucleus']:.2f}x",
            )
        )
    print(
        markdown_table(
            ["top_p", "steps the prefix holds", "full sort ms", "nucleus ms", "speed-up"], rows
        )
    )


if __name__ == "__main__":
    main()
