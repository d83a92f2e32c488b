"""Training: the shared data pipeline (:mod:`memlm.research.data`) and the LMs trained on it.

:class:`TrainRequest` is what ``memlm train`` hands to an architecture's runner (see
``RUNNERS`` in :mod:`memlm.cli.train_cmd`); it is kept here, free of heavy imports, so that
runners do not depend on the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TrainRequest:
    """Options common to every architecture; ``extra`` holds ``--set key=value`` pairs."""

    arch: str
    out: Path
    objective: str = "vanilla"
    corpus: str = "news"
    tokenizer: str = "word"  # "word" (fixed vocabulary, numbers -> N) or "subword" (SmolLM2)
    vocab_size: int = 10_000
    seed: int = 0
    hidden: int | None = None  # None: derived from the parameter budget, where supported
    emb: int = 64
    window: int = 5
    ngram: int = 4
    steps: int = 1000
    max_minutes: float | None = None
    batch_size: int = 64
    bptt: int = 20
    lr: float = 1e-3
    clip: float = 5.0
    max_train_tokens: int | None = None
    max_eval_tokens: int | None = None
    threads: int | None = None
    cache_dir: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)


# Options whose good value depends on the architecture; ``memlm train`` fills what the
# command line leaves out from here.  The recurrent models of the short-attention study
# use the paper's settings (§4.1); the Transformer those of the TRIME experiment
# (docs/trime.md: 8 segments of 128 subword tokens a step, lr 2e-3, clip 1).
TRAIN_DEFAULTS: dict[str, dict[str, object]] = {
    "recurrent": {"batch_size": 64, "bptt": 20, "lr": 1e-3, "clip": 5.0, "tokenizer": "word"},
    "transformer": {
        "batch_size": 8,
        "bptt": 128,
        "lr": 2e-3,
        "clip": 1.0,
        "tokenizer": "subword",
    },
}


def train_defaults(arch: str, *, continuing: bool = False) -> dict[str, object]:
    """The defaults of ``memlm train --arch ARCH`` for the architecture-dependent options.

    ``continuing``: a pretrained model is trained further (``--init-from``), so the rate is
    a fine-tuning one (5e-5), not the from-scratch 2e-3 that would wreck its weights.
    """
    out = dict(TRAIN_DEFAULTS["transformer" if arch == "transformer" else "recurrent"])
    if continuing:
        out["lr"] = 5e-5
    return out
