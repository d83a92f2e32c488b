"""Where `memlm eval --lambda evidence` gains or loses against the constant lambda, by the
relative distance s to the nearest neighbour (memlm/calibrator/evidence.py).

Reads the checkpointed held-out search of a finished run (its ``work/`` directory, kept
by ``memlm eval`` without ``--keep-stores``) and prints one table per policy:

    python benchmarks/evidence_by_distance.py runs/slice20-evidence --days 5 \
        --k 1024 --temperature 2 --lmbda 0.05

--k/--temperature/--lmbda: the constant tuned on dev (the run's report.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from memlm.calibrator.constant import SERVED_GRID, ppl, token_logprobs
from memlm.calibrator.evidence import features, stream
from memlm.evaluate.checkpoint import load_eval
from memlm.knnlm import KnnParams

EDGES = (0.0, 0.1, 0.2, 0.3, 0.35, 0.4, 0.45, 0.5, 10.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--days", type=int, required=True)
    ap.add_argument("--policies", default="fullmem,monim")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--lmbda", type=float, default=0.05)
    a = ap.parse_args()
    params = KnnParams(k=a.k, temperature=a.temperature, lmbda=a.lmbda)
    temps = tuple(sorted({*SERVED_GRID.temperatures, a.temperature}))
    for pol in a.policies.split(","):
        dev_t, test_t = load_eval(a.run / "work" / pol, a.days)
        dev, test = dev_t.arrays(a.k), test_t.arrays(a.k)
        dev.pop("trime")
        test.pop("trime")
        const = token_logprobs(test, params)
        ev, lam, days = stream(dev, test, a.k, temps)
        d, v = test["distances"][:, : a.k], test["values"][:, : a.k]
        s, _ = features(d, v, test["qnorm"], days[-1]["temperature"])
        lm = test["target_lm_logprob"]
        print(
            f"{pol}: test ppl bare {ppl(lm):.2f}, constant {ppl(const):.2f}, "
            f"evidence {ppl(ev):.2f} ({len(lm)} tokens)\n"
        )
        print("| s | tokens | mean evidence lambda | NLL constant - bare | NLL evidence - bare |")
        print("|---|---:|---:|---:|---:|")
        for lo, hi in zip(EDGES, EDGES[1:], strict=False):
            m = (s >= lo) & (s < hi)
            if m.any():
                print(
                    f"| {lo:g}-{hi:g} | {int(m.sum())} | {lam[m].mean():.4f} "
                    f"| {np.sum(lm[m] - const[m]):+.1f} | {np.sum(lm[m] - ev[m]):+.1f} |"
                )
        print()


if __name__ == "__main__":
    main()
