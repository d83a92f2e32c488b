"""The NN calibrator (lambda per token, MoNIM §3.2 / App. A.3) and the retrieval gate (C.6).

Features of one token, in the paper's three categories (App. A.3):

- distribution of the LM: ``conf`` = max_y p_LM(y), ``entropy`` of p_LM, optionally the
  ``query`` key itself;
- lexical statistics of the stream so far (:class:`memlm.calibrator.lexical.LexicalStats`):
  ``log_freq`` and ``log_succ`` of the last context token (log(1 + count));
- density of the memory: ``knn_dist`` = L2 distances to the top-10 neighbours (the
  square root of the index's squared L2) and ``knn_distinct`` = log of the number of
  distinct values among the top-i neighbours, i = 1..10.

Each feature goes through its own Linear(width, 128) + LeakyReLU layer; the outputs are
concatenated and a 4-layer MLP with dropout 0.2 gives lambda in (0, 1), trained on the
mixture NLL with Adam.  The retrieval gate is the same kind of model, smaller, over the
features known before the search (distribution + lexical): when its lambda is below
theta the search is skipped and the LM answer stands.

The package, one concern a module:

- :mod:`~memlm.calibrator.features`: the features of a token;
- :mod:`~memlm.calibrator.model`: config, network, loss, training set, save / load;
- :mod:`~memlm.calibrator.stream`: training day by day (:class:`StreamCalibrator`) and
  the calibrated evaluation of one policy (:func:`calibrate_stream`);
- :mod:`~memlm.calibrator.heldout_set`: the held-out training set on disk;
- :mod:`~memlm.calibrator.retrain`: what an index build trains, compares and chooses;
- :mod:`~memlm.calibrator.served`: the interpolation served for an index version.
"""

from memlm.calibrator.features import (
    DEFAULT_FEATURES,
    GATE_FEATURES,
    GROUPS,
    PRE_SEARCH_GROUPS,
    TOP_N,
    density_features,
    features_of_groups,
    gold_knn_logprob,
    split_features,
    token_features,
)
from memlm.calibrator.heldout_set import TRAIN_FILE, HeldoutSet
from memlm.calibrator.model import (
    CALIBRATOR_DIR,
    Calibrator,
    CalibratorConfig,
    CalibratorNet,
    TrainingSet,
    gate_config,
    mixture_nll,
    with_prior,
)
from memlm.calibrator.retrain import GATE_DIR
from memlm.calibrator.served import ServedCalibration, ServedInterpolation
from memlm.calibrator.stream import (
    CalibratedResult,
    StreamCalibrator,
    calibrate_stream,
    epochs_for,
    token_rows,
    training_set,
    validation_mask,
    validation_rows,
    with_neighbour,
)

__all__ = [
    "CALIBRATOR_DIR",
    "DEFAULT_FEATURES",
    "GATE_DIR",
    "GATE_FEATURES",
    "GROUPS",
    "PRE_SEARCH_GROUPS",
    "TOP_N",
    "TRAIN_FILE",
    "CalibratedResult",
    "Calibrator",
    "CalibratorConfig",
    "CalibratorNet",
    "HeldoutSet",
    "ServedCalibration",
    "ServedInterpolation",
    "StreamCalibrator",
    "TrainingSet",
    "calibrate_stream",
    "density_features",
    "epochs_for",
    "features_of_groups",
    "gate_config",
    "gold_knn_logprob",
    "mixture_nll",
    "split_features",
    "token_features",
    "token_rows",
    "training_set",
    "validation_mask",
    "validation_rows",
    "with_neighbour",
    "with_prior",
]
