"""memlm.encoder.head: the half-precision LM head against the float32 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.encoder import Encoder, WindowConfig
from memlm.encoder.head import gold_logits, half_head_logits, logit_statistics, top_k_indices
from memlm.encoder.precision import HALF_HEAD, head_precision

V, H, N = 4096, 64, 96
DOCS = [list(np.random.default_rng(s).integers(5, 2000, size=200)) for s in range(2)]


def _head(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, ...]:
    """A head whose logits spread like an LM's (max about 20, a peaked top), and inputs
    exact in ``dtype`` (the transformer's output)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g) * 0.6
    h = (torch.randn(N, H, generator=g) * 0.6).to(dtype).float()
    b = torch.randn(V, generator=g) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    return w, h, b, y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_half_head_statistics_match_the_float32_head(dtype, bias):
    w, h, b, y = _head(dtype, bias)
    ref = h @ w.T + (0 if b is None else b)  # (N, V) float32
    assert 10 < float(ref.max(-1).values.mean()) < 40  # LM-like logits: rounding matters
    ref_top_logit, ref_top = ref.max(-1)
    want = logit_statistics(ref.clone(), ref.gather(1, y[:, None])[:, 0], ref_top_logit)

    logits, top, top_logit = half_head_logits(h, w, b, w.to(dtype), k=16)
    got = logit_statistics(logits, gold_logits(h, w, b, y), top_logit)

    assert logits.dtype == torch.float32 and got["lse"].dtype == torch.float32
    assert torch.equal(top, ref_top)
    torch.testing.assert_close(top_logit, ref_top_logit, rtol=0, atol=1e-4)  # rescored
    torch.testing.assert_close(gold_logits(h, w, b, y), ref.gather(1, y[:, None])[:, 0])
    for name in ("lse", "tlp", "toplp", "ent"):
        err = (got[name] - want[name]).abs()
        # the rounded tail moves these by 3e-4 nats on average at entropy 4.2-4.6 nats
        # (the bfloat16 transformer of SmolLM2 moves them by 3e-2)
        assert float(err.mean()) < 1e-3 and float(err.max()) < 5e-3, (name, err.max())
    # a bare half-precision product (no rescoring) is much further off
    bare = F_linear_half(h, w, b, dtype)
    bare_lse = torch.logsumexp(bare, -1)
    assert (bare_lse - want["lse"]).abs().mean() > 5 * (got["lse"] - want["lse"]).abs().mean()


def F_linear_half(h, w, b, dtype):  # noqa: N802 - the product under test, without rescoring
    out = (h.to(dtype) @ w.to(dtype).T).float()
    return out if b is None else out + b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gold_logit_is_exact_in_the_log_sum_exp_too(dtype):
    """A gold token outside the rescored top-k: its float32 logit replaces the rounded one
    in the row, so the log-sum-exp and the gold log-prob's numerator agree."""
    w, h, b, _ = _head(dtype, True)
    ref = h @ w.T + b
    y = ref.argmin(-1)  # never among the largest
    logits, _, top_logit = half_head_logits(h, w, b, w.to(dtype), y, k=16)
    exact_gold = gold_logits(h, w, b, y)
    assert torch.equal(logits.gather(1, y[:, None])[:, 0], exact_gold)
    rounded, _, _ = half_head_logits(h, w, b, w.to(dtype), k=16)
    assert not torch.equal(rounded.gather(1, y[:, None])[:, 0], exact_gold)  # it did move
    stats = logit_statistics(logits.clone(), exact_gold, top_logit)
    torch.testing.assert_close(stats["lse"], torch.logsumexp(logits, -1))
    torch.testing.assert_close(stats["tlp"], exact_gold - torch.logsumexp(logits, -1))


def test_rescoring_all_logits_is_the_float32_head():
    w, h, b, y = _head(torch.bfloat16, True)
    logits, top, _ = half_head_logits(h, w, b, w.bfloat16(), k=V)
    torch.testing.assert_close(logits, h @ w.T + b, rtol=0, atol=1e-4)


def test_bfloat16_encoder_uses_the_half_head_and_matches_the_float32_head():
    enc = Encoder.load("tiny-llama", threads=1, precision="bfloat16")
    assert enc.head_weight_half is not None and enc.head_weight_half.dtype == torch.bfloat16
    window = WindowConfig(context=64, stride=32)
    half = enc.encode_many(DOCS, window)
    enc.head_weight_half = None  # the float32 head, same transformer
    full = enc.encode_many(DOCS, window)
    for a, b in zip(half, full, strict=True):
        np.testing.assert_array_equal(a.top_id, b.top_id)
        np.testing.assert_array_equal(a.keys, b.keys)
        for name in ("lse", "target_logprob", "top_logprob", "entropy"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), atol=1e-3)


def test_float32_and_int8_keep_the_float32_head():
    assert Encoder.load("tiny-llama", threads=1).head_weight_half is None
    assert [head_precision(p) for p in ("float32", "bfloat16", "float16", "int8")] == [
        "float32",
        "bfloat16",
        "float16",
        "float32",
    ]
    assert set(HALF_HEAD) == {"bfloat16", "float16"}


@pytest.mark.parametrize("v", [4096, 4100, 40])  # grouped, V not a multiple of 16, tiny V
def test_top_k_indices_are_torch_topk(v):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, v, generator=g)
    group = slice(3, None, v // 16)  # one strided group of top_k_indices (16 columns)
    x[0, group] = 9.0 + torch.arange(len(x[0, group])) / v  # all of row 0's top in it
    for k in (1, 5, 16):
        got = top_k_indices(x, k).sort(-1).values
        assert torch.equal(got, torch.topk(x, k, dim=-1).indices.sort(-1).values), k
