"""Train a causal Transformer LM with the vanilla or the TRIME objective.

Objectives (Zhong et al. 2022, Table 1):

- ``vanilla``: cross-entropy (Eq. 1), segments batched at random;
- ``trime`` (TrimeLM): Eq. 5 with local memory, segments batched at random;
- ``trime-long`` (TrimeLM_long): m consecutive segments of a document in one batch,
  memory across them, gradients flowing into the memory representations;
- ``trime-ext`` (TrimeLM_ext): segments packed by BM25 similarity (App. B), memory over
  the whole batch, local memory dropped for a batch with probability p = 0.9.

The first 5% of the updates of every TRIME objective use the plain LM loss (§5.2).
Models are small ``LlamaConfig`` models built from scratch with the SmolLM2 tokenizer,
or any HF causal LM to continue training. Checkpoints are HF folders (model + tokenizer,
loadable with ``AutoModelForCausalLM.from_pretrained``) plus ``trainer_state.pt``
(optimizer, schedule, step, RNG) so a run resumes exactly where it stopped.

The package, one concern a module: :mod:`~.model` (the Llama and its keys),
:mod:`~.objective` (config, batches, the loss of a batch), :mod:`~.checkpoints`,
:mod:`~.loop` (:func:`train`), :mod:`~.evaluation` (TRIME-memory perplexities) and
:mod:`~.runner` (``memlm train --arch transformer``).
"""

from memlm.research.transformer_train.checkpoints import (
    OPERATIONAL_FIELDS,
    STATE_FILE,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    saved_checkpoints,
)
from memlm.research.transformer_train.evaluation import (
    SegmentOutputs,
    encode_segments,
    memory_logprobs,
    perplexity,
)
from memlm.research.transformer_train.loop import TrainResult, train
from memlm.research.transformer_train.model import (
    ModelConfig,
    build_model,
    capture_keys,
    forward_with_keys,
    parameter_counts,
    set_threads,
)
from memlm.research.transformer_train.objective import (
    MEMORY_OF,
    OBJECTIVES,
    Objective,
    TrainConfig,
    batch_loss,
    batch_plan,
    drop_local_at,
    lr_factor,
    segment_texts,
)
from memlm.research.transformer_train.runner import HFTokenizerAdapter, read_text_documents, run

__all__ = [
    "MEMORY_OF",
    "OBJECTIVES",
    "OPERATIONAL_FIELDS",
    "STATE_FILE",
    "HFTokenizerAdapter",
    "ModelConfig",
    "Objective",
    "SegmentOutputs",
    "TrainConfig",
    "TrainResult",
    "batch_loss",
    "batch_plan",
    "build_model",
    "capture_keys",
    "drop_local_at",
    "encode_segments",
    "forward_with_keys",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_factor",
    "memory_logprobs",
    "parameter_counts",
    "perplexity",
    "read_text_documents",
    "run",
    "save_checkpoint",
    "saved_checkpoints",
    "segment_texts",
    "set_threads",
    "train",
]
