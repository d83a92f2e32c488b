"""Attention for a half-precision transformer on the CPU: two batched matmuls, not SDPA.

torch's CPU SDPA kernel (``_scaled_dot_product_flash_attention_for_cpu``) gains nothing
from bfloat16: a 512-token SmolLM2 window spends about 8 ms per layer in it in float32 and
in bfloat16 alike (1 thread, avx512_bf16), while bfloat16 matmuls run 2.3x faster than
float32's. Written as matmuls, the same attention runs in about 6 ms per layer: Q K^T and
P V are bfloat16 GEMMs, and grouped-query heads share their key/value head without the
copies of ``repeat_kv``: the query heads of one group are stacked into one (G T, d) matrix.
The softmax runs in float32 (as transformers' eager attention does). The scores are
materialised, (B, H, T, S) float32, so this runs only up to ``MAX_KEYS`` keys; longer
contexts, single-token decoding steps, and anything unusual (a paged cache, a position
bias, soft-capping) go to transformers' SDPA.

Registered with transformers as ``NAME`` (:func:`use_matmul_attention`), with
transformers' eager (additive) mask.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "memlm_matmul"
MAX_KEYS = 1024  # scores of one 512-token window: 9 heads x 512 x 512 x 4 B = 9 MB


def matmul_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, T, d), key and value
    (B, KV, S, d), an additive mask (B or 1, 1, T, S) or None; returns (B, T, H, d)."""
    b, h, t, d = query.shape
    kv, s = key.shape[1], key.shape[2]
    simple = (
        query.device.type == "cpu"
        and t > 1
        and s <= MAX_KEYS
        and h % kv == 0
        and (attention_mask is not None and attention_mask.is_floating_point())
        and (dropout == 0.0 or not module.training)
        and kwargs.get("cache") is None  # transformers passes only a paged cache here
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if not simple:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    assert attention_mask is not None
    g = h // kv  # query heads per key/value head; head i uses key/value head i // g
    scale = d**-0.5 if scaling is None else scaling
    q = (query * scale).reshape(b, kv, g * t, d)
    scores = torch.matmul(q, key.transpose(2, 3)).view(b, h, t, s)  # (B, H, T, S)
    scores += attention_mask.to(scores.dtype)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(p.view(b, kv, g * t, s), value)  # (B, KV, G T, d)
    return out.view(b, h, t, d).transpose(1, 2).contiguous(), None


def use_matmul_attention(model: Any) -> bool:
    """Switch ``model`` (a transformers model on SDPA) to :func:`matmul_attention`;
    False where the model does not dispatch through transformers' attention interface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, matmul_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, NotImplementedError):
        model.set_attn_implementation("sdpa")
        return False
    return True
