"""`memlm eval` with every key rounded to float16 after the cache (what the float16 cache
of earlier versions did to the queries), to measure what the query precision changes.

    MEMLM_THREADS=1 python benchmarks/eval_float16_queries.py --start 2017-02-13 --days 5 \\
        --max-docs-per-day 20 --out runs/slice20-f16 --policies monim,randmem

Any `memlm eval` option works; compare with the same command run by `memlm eval`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

import memlm.evaluate as ev
from memlm.cli import app
from memlm.encoder import TokenOutputs

_get_many = ev.TokenCache.get_many


def _float16_keys(
    self: ev.TokenCache, texts: Sequence[str], progress: bool = False
) -> list[TokenOutputs]:
    outs = _get_many(self, texts, progress)
    for o in outs:
        o.keys = o.keys.astype(np.float16).astype(np.float32)
    return outs


if __name__ == "__main__":
    ev.TokenCache.get_many = _float16_keys  # type: ignore[method-assign]
    sys.argv = ["memlm", "eval", *sys.argv[1:]]
    app()
