"""The kNN-LM: what the memory's neighbours make of the next-token distribution.

One package for the maths that turns neighbours into probabilities and decisions:

- :mod:`~memlm.knnlm.mixture`: p_kNN from the neighbours and its interpolation with the LM
  (re-exported here: ``from memlm.knnlm import KnnParams, augmented_scores``);
- :mod:`~memlm.knnlm.policy`: the memorisation policies (FullMem, RandMem, MoNIM, AMT) that
  decide what is stored;
- :mod:`~memlm.knnlm.words`: whole-word suggestions from token distributions;
- :mod:`~memlm.knnlm.trime`: TRIME's local and long-term memory at inference.

How lambda is chosen per token lives in :mod:`memlm.calibrator`; where the neighbours come
from, in :mod:`memlm.memory`. NumPy only at import (trime imports torch).
"""

from memlm.knnlm.mixture import (
    DEFAULT_TAU,
    AugmentedScores,
    KnnParams,
    MemoryOptions,
    augmented_scores,
    has_neighbours,
    interpolate,
    knn_logprob,
    neighbour_log_weights,
)

__all__ = [
    "AugmentedScores",
    "DEFAULT_TAU",
    "KnnParams",
    "MemoryOptions",
    "augmented_scores",
    "has_neighbours",
    "interpolate",
    "knn_logprob",
    "neighbour_log_weights",
]
