"""Which constant (k, T, lambda) to serve before any held-out token exists.

Streams a slice of the bundled news with FullMem and MoNIM (MoNIM scoring with the served
interpolation, as the service does) and scores every held-out token (dev and test: nothing
is tuned here) against the memory of its evening, for a few candidate constants; prints,
per candidate, the perplexity over all held-out tokens and the worst day's ratio to the
bare LM.  The service's default must not hurt on any day (memlm/calibrator/constant.py).

    MEMLM_THREADS=1 python benchmarks/served_defaults.py --start 2017-02-13 --days 5 \\
        --max-docs-per-day 20
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import tempfile
from pathlib import Path

import numpy as np
from _common import markdown_table

from memlm.calibrator.constant import ppl, token_logprobs
from memlm.corpus import load_corpus
from memlm.encoder import Encoder, WindowConfig
from memlm.evaluate import TokenCache, plan_stream, run_policy
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import make_policy

CANDIDATES = [
    KnnParams(k=k, temperature=t, lmbda=lam)
    for k, t, lam in itertools.product(
        (16, 64), (1.0, 2.0, 5.0), (0.005, 0.01, 0.02, 0.05, 0.1, 0.25)
    )
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", default="2017-02-13")
    ap.add_argument("--days", type=int, default=5)
    ap.add_argument("--max-docs-per-day", type=int, default=20)
    args = ap.parse_args()
    enc = Encoder.load("smollm2-135m")
    plans = plan_stream(
        load_corpus("news"),
        days=args.days,
        start=dt.date.fromisoformat(args.start),
        max_docs_per_day=args.max_docs_per_day,
    )
    cache = TokenCache(enc, WindowConfig())
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("fullmem", "monim"):
            run = run_policy(
                make_policy(name), plans, cache, Path(tmp) / name, ingest_params=None, k_max=64
            )
            held = {k: np.concatenate([run.dev[k], run.test[k]]) for k in run.dev}
            days = sorted(set(held["day"].tolist()))
            bare = held["target_lm_logprob"]
            print(
                f"\n{name}: {run.entries} entries, {len(bare)} held-out tokens, "
                f"bare ppl {ppl(bare):.2f}"
            )
            table = []
            for p in CANDIDATES:
                lp = token_logprobs(held, p)
                worst = max(ppl(lp[held["day"] == d]) / ppl(bare[held["day"] == d]) for d in days)
                table.append(
                    (
                        p.k,
                        f"{p.temperature:g}",
                        f"{p.lmbda:g}",
                        f"{ppl(lp):.2f}",
                        f"{ppl(lp) / ppl(bare) - 1:+.1%}",
                        f"{worst - 1:+.1%}",
                    )
                )
            header = ["k", "T", "lambda", "ppl", "vs bare", "worst day vs bare"]
            print(markdown_table(header, table, align="rrrrrr"))


if __name__ == "__main__":
    main()
