"""memlm.encoder.attention: the matmul attention of half-precision CPU encoders."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from memlm.encoder import Encoder, WindowConfig
from memlm.encoder.attention import MAX_KEYS, NAME, matmul_attention, use_matmul_attention

DOCS = [list(np.random.default_rng(s).integers(5, 2000, size=n)) for s, n in ((0, 300), (1, 90))]


def _qkv(b: int, h: int, kv: int, t: int, s: int, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, h, t, d, generator=g),
        torch.randn(b, kv, s, d, generator=g),
        torch.randn(b, kv, s, d, generator=g),
    )


def _reference(q, k, v, allowed):  # SDPA with the key/value heads repeated: (B, T, H, d)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)


def test_matmul_attention_is_sdpa_with_grouped_heads_and_padding():
    q, k, v = _qkv(b=2, h=6, kv=2, t=7, s=7)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril().repeat(2, 1, 1, 1)  # (B, 1, T, S)
    allowed[1, :, :, 5:] = False  # row 1 is right-padded after 5 tokens
    allowed[1, :, 5:, 0] = True  # (its padded queries see something: no empty row)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, weights = matmul_attention(nn.Module().eval(), q, k, v, additive, scaling=16**-0.5)
    assert weights is None and out.shape == (2, 7, 6, 16)
    torch.testing.assert_close(out, _reference(q, k, v, allowed), rtol=1e-5, atol=1e-5)


def test_single_queries_and_long_contexts_go_to_sdpa():
    module = nn.Module().eval()
    module.num_key_value_groups = 3  # read by transformers' SDPA for grouped heads
    for t, s in ((1, 9), (MAX_KEYS + 1, MAX_KEYS + 1)):
        q, k, v = _qkv(b=1, h=6, kv=2, t=t, s=s)
        allowed = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None]
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out, _ = matmul_attention(module, q, k, v, additive, scaling=16**-0.5)
        torch.testing.assert_close(out, _reference(q, k, v, allowed), rtol=1e-5, atol=1e-5)


def test_half_precision_cpu_encoders_use_it_and_float32_keeps_sdpa():
    assert Encoder.load("tiny-llama", threads=1).model.config._attn_implementation == "sdpa"
    enc = Encoder.load("tiny-llama", threads=1, precision="bfloat16")
    assert enc.model.config._attn_implementation == NAME
    # GPT-2 has no grouped heads but dispatches the same way
    assert (
        Encoder.load("tiny-gpt2", threads=1, precision="bfloat16").model.config._attn_implementation
        == NAME
    )


def test_encoder_outputs_match_sdpa_in_float32():
    """Same model, same batches (padded windows, cached decoding): float32 leaves only the
    matmul attention's rounding between the two."""
    sdpa = Encoder.load("tiny-llama", threads=1)
    mm = Encoder.load("tiny-llama", threads=1)
    assert use_matmul_attention(mm.model)
    window = WindowConfig(context=64, stride=32, batch_size=4)
    for a, b in zip(sdpa.encode_many(DOCS, window), mm.encode_many(DOCS, window), strict=True):
        np.testing.assert_allclose(a.keys, b.keys, atol=1e-5)
        np.testing.assert_allclose(a.target_logprob, b.target_logprob, atol=1e-5)
    ctx = [DOCS[0][:20], DOCS[1][:13]]
    (_, _, s1), (_, _, s2) = sdpa.start(ctx, cache=True), mm.start(ctx, cache=True)
    parents, tokens = np.array([1, 0, 0]), np.array([5, 6, 7])
    _, h1 = sdpa.extend(s1, parents, tokens)
    _, h2 = mm.extend(s2, parents, tokens)
    torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
