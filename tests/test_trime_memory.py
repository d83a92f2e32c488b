"""TRIME inference memory: Eq. 6 (memory in the softmax), Eq. 8 (memory only), Eq. 9."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from memlm.knnlm.trime import (
    document_gold_logprobs,
    interpolate,
    l2_scores,
    masked_scores,
    memory_gold_logprob,
    scaled_dot_scores,
    trime_gold_logprob,
    trime_log_probs,
    window_mask,
)


def test_eq6_hand_example() -> None:
    # V = 2, logits 0 and 0; one memory entry with score log 2 and next token 1.
    # P(1) = (e^0 + 2) / (e^0 + e^0 + 2) = 3/4.
    logits = torch.zeros(1, 2, dtype=torch.float64)
    scores = torch.tensor([[math.log(2.0)]], dtype=torch.float64)
    values = torch.tensor([1])
    gold = torch.tensor([1])
    lp = trime_gold_logprob(logits[:, 1], torch.logsumexp(logits, 1), scores, values, gold)
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-12)
    full = trime_log_probs(logits, scores, values).exp()
    assert full.tolist()[0] == pytest.approx([0.25, 0.75], abs=1e-12)


def test_empty_memory_is_the_lm() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    gold = torch.randint(0, 11, (5,), generator=g)
    lm = torch.log_softmax(logits, 1).gather(1, gold.view(-1, 1)).squeeze(1)
    lse = torch.logsumexp(logits, 1)
    none = torch.empty(5, 0, dtype=torch.float64)
    assert torch.allclose(
        trime_gold_logprob(
            logits.gather(1, gold.view(-1, 1)).squeeze(1),
            lse,
            none,
            torch.empty(0, dtype=torch.long),
            gold,
        ),
        lm,
        atol=1e-12,
    )
    hidden = masked_scores(
        torch.randn(5, 3, generator=g, dtype=torch.float64), torch.zeros(5, 3, dtype=torch.bool)
    )
    values = torch.tensor([1, 2, 3])
    gl = logits.gather(1, gold.view(-1, 1)).squeeze(1)
    assert torch.allclose(trime_gold_logprob(gl, lse, hidden, values, gold), lm, atol=1e-12)
    assert torch.allclose(
        trime_log_probs(logits, hidden, values), torch.log_softmax(logits, 1), atol=1e-12
    )


def test_gold_logprob_matches_full_distribution_and_brute_force() -> None:
    g = torch.Generator().manual_seed(1)
    t, v, m = 4, 7, 9
    logits = torch.randn(t, v, generator=g, dtype=torch.float64)
    scores = torch.randn(t, m, generator=g, dtype=torch.float64)
    scores[0, 3] = float("-inf")
    values = torch.randint(0, v, (m,), generator=g)
    gold = torch.tensor([values[0].item(), 6, values[2].item(), 0])
    lp = trime_gold_logprob(
        logits.gather(1, gold.view(-1, 1)).squeeze(1),
        torch.logsumexp(logits, 1),
        scores,
        values,
        gold,
    )
    full = trime_log_probs(logits, scores, values)
    assert torch.allclose(full.exp().sum(1), torch.ones(t, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(lp, full.gather(1, gold.view(-1, 1)).squeeze(1), atol=1e-12)
    for i in range(t):
        mass = [math.exp(logits[i, w].item()) for w in range(v)]
        for j in range(m):
            mass[int(values[j])] += math.exp(scores[i, j].item())
        assert lp[i].item() == pytest.approx(math.log(mass[int(gold[i])] / sum(mass)), abs=1e-12)


def test_scores_and_mask() -> None:
    q = torch.tensor([[1.0, 2.0, 0.0, 2.0]])
    k = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # (1 + 2 + 0 + 2) / sqrt(4) / tau
    assert scaled_dot_scores(q, k, tau=0.5).tolist() == [[5.0, 0.0]]
    assert l2_scores(torch.tensor([4.0]), 2.0).tolist() == [-2.0]
    vis = window_mask(torch.tensor([0, 2, 5]), torch.arange(6), torch.tensor([0, 1, 3]))
    assert vis.int().tolist() == [
        [0, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0],
    ]


def test_memory_only_distribution_and_interpolation() -> None:
    scores = torch.tensor(
        [[0.0, math.log(3.0)], [float("-inf"), float("-inf")]], dtype=torch.float64
    )
    values = torch.tensor([[5, 7], [5, 7]])
    lp, has = memory_gold_logprob(scores, values, torch.tensor([7, 7]))
    assert has.tolist() == [True, False]
    assert lp[0].item() == pytest.approx(math.log(0.75), abs=1e-12)
    assert lp[1].item() == float("-inf")
    model = torch.log(torch.tensor([0.5, 0.2], dtype=torch.float64))
    mixed = interpolate(model, lp, 0.25, has)
    assert mixed[0].item() == pytest.approx(math.log(0.75 * 0.5 + 0.25 * 0.75), abs=1e-12)
    assert mixed[1].item() == pytest.approx(math.log(0.2), abs=1e-12)
    assert torch.equal(interpolate(model, lp, 0.0, has), model)


def _brute_document(keys, targets, gold_logit, lse, window_start, long_span, tau, extra=None):
    n, d = keys.shape
    out = []
    for i in range(n):
        num = math.exp(gold_logit[i].item())
        den = math.exp(lse[i].item())
        for j in range(max(0, int(window_start[i]) - long_span), i):
            e = math.exp(float(keys[i] @ keys[j]) / math.sqrt(d) / tau)
            den += e
            if targets[j] == targets[i]:
                num += e
        if extra is not None:
            for s, v in zip(extra[0][i].tolist(), extra[1][i].tolist(), strict=True):
                den += math.exp(s)
                if v == targets[i]:
                    num += math.exp(s)
        out.append(math.log(num / den))
    return out


@pytest.mark.parametrize("long_span", [0, 3, 100])
def test_document_gold_logprobs_brute_force(long_span: int) -> None:
    g = torch.Generator().manual_seed(2)
    n, d, v = 13, 4, 3
    keys = torch.randn(n, d, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64)
    gold_logit = logits.gather(1, targets.view(-1, 1)).squeeze(1)
    lse = torch.logsumexp(logits, 1)
    # windows of 5 tokens with stride 5: positions 0-4 start at 0, 5-9 at 5, 10-12 at 10
    window_start = (torch.arange(n) // 5) * 5
    extra = (torch.randn(n, 2, generator=g, dtype=torch.float64), torch.randint(0, v, (n, 2)))
    for ex in (None, extra):
        got = document_gold_logprobs(
            keys,
            targets,
            gold_logit,
            lse,
            window_start,
            long_span,
            0.7,
            chunk=4,
            extra_scores=None if ex is None else ex[0],
            extra_values=None if ex is None else ex[1],
        )
        want = _brute_document(keys, targets, gold_logit, lse, window_start, long_span, 0.7, ex)
        assert got.tolist() == pytest.approx(want, abs=1e-10)
    # the first position of the document has no memory at all: exactly the LM
    got0 = document_gold_logprobs(keys, targets, gold_logit, lse, window_start, long_span, 0.7)
    assert got0[0].item() == pytest.approx((gold_logit[0] - lse[0]).item(), abs=1e-12)


def test_cached_doc_logprobs_follow_the_scoring_windows() -> None:
    from memlm.knnlm.trime import cached_doc_logprobs, window_begins

    g = torch.Generator().manual_seed(4)
    n_tok, d, v = 12, 3, 4  # a document of 12 tokens: targets at positions 1..11
    positions = np.arange(1, n_tok)
    windows = [(0, 6, 1), (3, 9, 6), (6, 12, 9)]  # context 6, stride 3
    assert window_begins(positions, windows).tolist() == [0] * 5 + [3] * 3 + [6] * 3
    keys = torch.randn(len(positions), d, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (len(positions),), generator=g)
    logits = torch.randn(len(positions), v, generator=g, dtype=torch.float64)
    lse = torch.logsumexp(logits, 1)
    lp = logits.gather(1, targets.view(-1, 1)).squeeze(1) - lse
    got = cached_doc_logprobs(
        keys.numpy(), targets.numpy(), lp.numpy(), lse.numpy(), positions, windows, 0, [1.0, 2.0]
    )
    assert got.shape == (11, 2)
    for c, tau in enumerate([1.0, 2.0]):
        for i, t in enumerate(positions.tolist()):
            begin = window_begins(positions[i : i + 1], windows)[0]
            num = math.exp(lp[i].item())
            den = 1.0
            for j, p in enumerate(positions.tolist()):
                if begin < p < t:
                    e = math.exp(float(keys[i] @ keys[j]) / math.sqrt(d) / tau - lse[i].item())
                    den += e
                    num += e if targets[j] == targets[i] else 0.0
            assert got[i, c] == pytest.approx(math.log(num / den), abs=1e-6)  # float32 keys
    # long-term memory reaches back before the window; the first target has none at all
    longer = cached_doc_logprobs(
        keys.numpy(), targets.numpy(), lp.numpy(), lse.numpy(), positions, windows, 6, [1.0]
    )
    assert longer[0, 0] == pytest.approx(lp[0].item(), abs=1e-12)
    assert not np.allclose(longer[5:, 0], got[5:, 0])
