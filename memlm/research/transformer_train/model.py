"""The small Llama trained from scratch, and the keys (input of the last MLP) it yields."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from memlm.encoder import last_mlp


def set_threads(threads: int | None = None) -> int:
    """torch threads: the argument, else $MEMLM_THREADS, else 1 (the machine is shared)."""
    n = threads or int(os.environ.get("MEMLM_THREADS", "1"))
    torch.set_num_threads(n)
    return n


@dataclass(frozen=True)
class ModelConfig:
    """A small Llama for CPU training; the 49,152-row tied embedding dominates its size."""

    hidden: int = 128  # 6.3M embedding parameters at 128; the LM head is most of the FLOPs
    layers: int = 4
    heads: int = 4  # head dim 32
    ffn: int = 512  # 4x hidden, as the paper's 7M model (hidden 128, FFN 512)
    max_positions: int = 1024
    tie_embeddings: bool = True  # halves the parameters at this vocabulary size


def build_model(cfg: ModelConfig, vocab_size: int, boundary_id: int, seed: int = 0) -> nn.Module:
    """A randomly initialised LlamaForCausalLM (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=boundary_id,
        eos_token_id=boundary_id,
        pad_token_id=boundary_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(conf)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total (tied weights once), embedding, and non-embedding parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()  # type: ignore[operator]
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


@contextmanager
def capture_keys(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the input of the last MLP (with its graph) during forwards in the block."""
    store: list[torch.Tensor] = []

    def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        store.append(args[0])

    handle = last_mlp(model).register_forward_pre_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


def forward_with_keys(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids -> logits (B, T, V) and keys (B, T, d)."""
    with capture_keys(model) as store:
        logits = model(input_ids=x).logits
    assert len(store) == 1
    return logits.float(), store[0].float()
