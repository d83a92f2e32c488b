"""Every scored token is predicted from its own context (issue: windows vs one full forward).

The oracle is a separate, unpadded forward of the same model over exactly the tokens a
target's window holds before it. ``stride == context`` used to be accepted and predicted
each later window's first target from the window's last position (or padding); it must
now be refused, and every stride the config accepts must satisfy the property.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memlm.encoder import Encoder, WindowConfig, last_mlp


@given(n=st.integers(0, 300), context=st.integers(2, 64), data=st.data())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_windows_score_each_target_once_from_its_own_window(n, context, data):
    stride = data.draw(st.integers(1, context - 1), label="stride")
    w = WindowConfig(context=context, stride=stride)
    scored: list[int] = []
    for begin, end, first in w.windows(n):
        assert 0 <= begin < first < end <= n and end - begin <= context
        for t in range(first, end):
            # the window holds t - 1, and all the left context the settings promise
            assert begin <= t - 1
            assert t - begin >= min(t, context - stride)
        scored += range(first, end)
    assert scored == list(range(1, n))


@pytest.mark.parametrize("context", [2, 3, 64, 512])
def test_stride_equal_to_context_is_refused_naming_the_largest_legal_stride(context):
    with pytest.raises(ValueError, match=f"largest legal stride for context {context} is "):
        WindowConfig(context=context, stride=context)
    assert WindowConfig(context=context, stride=context - 1).min_context == 1


class _Oracle:
    """Unpadded single forwards of one model, with a key hook of the test's own."""

    def __init__(self, enc: Encoder):
        self.enc = enc

    @torch.inference_mode()
    def __call__(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """keys (len, d) and log-softmax rows (len, V) of one forward over ``ids``."""
        got: list[torch.Tensor] = []
        handle = last_mlp(self.enc.model).register_forward_pre_hook(
            lambda _m, args: got.append(args[0])
        )
        try:
            logits = self.enc.model(torch.tensor([ids])).logits[0]
        finally:
            handle.remove()
        return got[0][0].numpy(), torch.log_softmax(logits, -1).numpy()


def _check(enc: Encoder, docs: list[list[int]], window: WindowConfig, rng: random.Random) -> None:
    oracle = _Oracle(enc)
    outs = enc.encode_many(docs, window)
    for doc, out in zip(docs, outs, strict=True):
        n = len(doc)
        assert out.positions.tolist() == list(range(1, n))  # every target once, in order
        row_of = {int(p): i for i, p in enumerate(out.positions)}
        wins = window.windows(n)
        literal = rng.randrange(len(wins)) if wins else -1
        for w_i, (begin, end, first) in enumerate(wins):
            # by causality the window's own forward gives, at offset t-1-begin, the
            # forward over exactly doc[begin:t]
            keys, logp = oracle(doc[begin:end])
            rows = [row_of[t] for t in range(first, end)]
            offs = [t - 1 - begin for t in range(first, end)]
            np.testing.assert_allclose(out.keys[rows], keys[offs], atol=1e-4, rtol=1e-4)
            gold = logp[offs, doc[first:end]]
            np.testing.assert_allclose(out.target_logprob[rows], gold, atol=1e-4, rtol=1e-4)
            if w_i != literal:
                continue
            # and literally, for one target per document: a forward that ends at t - 1
            t = rng.randrange(first, end)
            k_t, lp_t = oracle(doc[begin:t])
            np.testing.assert_allclose(out.keys[row_of[t]], k_t[-1], atol=1e-4, rtol=1e-4)
            assert out.target_logprob[row_of[t]] == pytest.approx(lp_t[-1, doc[t]], abs=1e-4)


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def enc(request):
    return Encoder.load(request.param, threads=1)


@pytest.mark.parametrize("case", range(6))
def test_every_legal_stride_matches_unpadded_forwards(enc, case):
    """Random documents (2-300 tokens), random context (2-64), strides up to context.

    Several documents share padded batches. A stride the config accepts must give keys
    and log-probabilities equal to the oracle's; stride == context must be refused.
    Every stride for contexts up to 24; past that (the cost grows as the sum of n/stride)
    the strides at both ends, the middle and four random ones.
    """
    rng = random.Random(1000 * case + (enc.name == "tiny-llama"))
    context = rng.choice([2, 3, rng.randint(4, 16), rng.randint(17, 64)])
    docs = [
        [rng.randrange(5, 2000) for _ in range(rng.choice([2, 3, rng.randint(4, 300)]))]
        for _ in range(rng.randint(1, 3))
    ]
    strides = set(range(1, context + 1))
    if context > 24:
        strides = {1, 2, 3, context // 2, context - 2, context - 1, context}
        strides |= set(rng.sample(range(4, context - 2), 4))
    for stride in sorted(strides):
        try:
            window = WindowConfig(context=context, stride=stride, batch_size=rng.randint(1, 4))
        except ValueError:
            assert stride == context
            continue
        _check(enc, docs, window, rng)


def test_measured_case_context_64_stride_64(enc):
    """The reported case: a 150-token document, context 64, stride 64.

    Refused with the largest legal stride named. At that stride (63) targets 1-63 equal
    the full forward, and target 64 is scored by the window that begins at 63, from
    exactly token 63 (the context - stride = 1 token that stride promises), never from
    the previous window's last position or from padding.
    """
    with pytest.raises(ValueError, match="largest legal stride for context 64 is 63"):
        WindowConfig(context=64, stride=64)
    ids = [int(x) for x in np.random.RandomState(0).randint(5, 2000, 150)]
    window = WindowConfig(context=64, stride=63)
    assert window.windows(150) == [(0, 64, 1), (63, 127, 64), (126, 150, 127)]
    out = enc.encode_ids(ids, window)
    keys, logp = _Oracle(enc)(ids[:64])  # the full forward over positions 0-63
    np.testing.assert_allclose(out.keys[:63], keys[:63], atol=1e-4, rtol=1e-4)
    assert out.positions[63] == 64
    k64, lp64 = _Oracle(enc)(ids[63:64])
    np.testing.assert_allclose(out.keys[63], k64[0], atol=1e-4, rtol=1e-4)
    assert out.target_logprob[63] == pytest.approx(lp64[0, ids[64]], abs=1e-4)
