"""The TRIME training objective and its in-batch memory masks."""

from __future__ import annotations

import math

import pytest
import torch

from memlm.research.trime import LseAndGold, lm_token_loss, memory_mask, trime_token_loss


def _batch(n: int = 6, v: int = 5, d: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    keys = torch.randn(n, d, generator=g, dtype=torch.float64)
    return logits, targets, keys


def _rows(doc: list[list[int]], pos: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(doc), torch.tensor(pos)


def test_empty_memory_equals_vanilla_loss() -> None:
    logits, targets, keys = _batch()
    none = torch.zeros(6, 6, dtype=torch.bool)
    assert torch.allclose(
        trime_token_loss(logits, targets, keys, none), lm_token_loss(logits, targets), atol=1e-12
    )
    # the first token of every segment has an empty local memory
    vis = memory_mask(*_rows([[0, 0], [1, 1], [2, 2]], [[0, 1], [0, 1], [0, 1]]), "local")
    got = trime_token_loss(logits, targets, keys, vis)
    want = lm_token_loss(logits, targets)
    assert torch.allclose(got[[0, 2, 4]], want[[0, 2, 4]], atol=1e-12)
    assert not torch.allclose(got[[1, 3, 5]], want[[1, 3, 5]], atol=1e-6)


def test_loss_matches_brute_force() -> None:
    logits, targets, keys = _batch(seed=3)
    targets[:] = torch.tensor([1, 1, 2, 1, 2, 0])
    vis = torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) < 0.5
    valid = torch.tensor([True, True, False, True, True, True])
    got = trime_token_loss(logits, targets, keys, vis, valid, tau=0.5)
    for i in range(6):
        if not valid[i]:
            assert got[i].item() == 0.0
            continue
        num = math.exp(logits[i, targets[i]].item())
        den = float(torch.exp(logits[i]).sum())
        for j in range(6):
            if vis[i, j] and valid[j]:
                e = math.exp(float(keys[i] @ keys[j]) / math.sqrt(4) / 0.5)
                den += e
                num += e if targets[j] == targets[i] else 0.0
        assert got[i].item() == pytest.approx(-math.log(num / den), abs=1e-12)


def test_memory_masks_with_two_documents_in_a_row() -> None:
    # a stream cut into rows of 2: doc 7 holds pairs 0-2, doc 9 pairs 0-2; row 1 holds both
    doc, pos = _rows([[7, 7], [7, 9], [9, 9]], [[0, 1], [2, 0], [1, 2]])
    local = memory_mask(doc, pos, "local").int().tolist()
    assert local == [
        [0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],  # the first pair of doc 9 does not see doc 7 in its row
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0],
    ]
    long = memory_mask(doc, pos, "long").int().tolist()
    # every earlier pair of the same document, in this row or an earlier one; never doc 7
    assert long == [
        [0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
    ]
    ext = memory_mask(doc, pos, "ext").int().tolist()
    assert ext == [
        [0, 0, 1, 1, 1, 1],
        [1, 0, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 1],
        [1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
    ]
    ext_drop = memory_mask(doc, pos, "ext", drop_local=True).int().tolist()
    assert ext_drop[1] == [0, 0, 1, 1, 1, 1] and ext_drop[5] == [1, 1, 1, 1, 0, 0]
    # padding (doc -1) is nobody's memory and has none
    pad = memory_mask(*_rows([[4, -1], [4, -1]], [[0, -1], [1, -1]]), "long").int().tolist()
    assert pad == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError):
        memory_mask(doc, pos, "global")  # type: ignore[arg-type]


def test_gradients_reach_memory_representations() -> None:
    logits, targets, keys = _batch(seed=5)
    targets[:] = torch.tensor([3, 3, 3, 3, 3, 3])
    keys.requires_grad_(True)
    vis = memory_mask(*_rows([[0, 0], [0, 0], [1, 1]], [[0, 1], [2, 3], [0, 1]]), "long")
    # loss of position 3 only (second token of the second segment of document 0)
    trime_token_loss(logits, targets, keys, vis)[3].backward()
    assert keys.grad is not None
    g = keys.grad.abs().sum(1)
    # positions 0, 1 (earlier segment) and 2 (local) are its memory; 4, 5 another document
    assert bool((g[:4] > 0).all()) and g[4:].tolist() == [0.0, 0.0]
    assert bool(torch.isfinite(keys.grad).all())


def test_gradients_finite_with_rows_without_memory() -> None:
    logits, targets, keys = _batch(seed=6)
    keys.requires_grad_(True)
    logits.requires_grad_(True)
    vis = memory_mask(*_rows([[0, 0], [1, 1], [2, 2]], [[0, 1], [0, 1], [0, 1]]), "local")
    trime_token_loss(logits, targets, keys, vis).sum().backward()
    assert keys.grad is not None and logits.grad is not None
    assert bool(torch.isfinite(keys.grad).all()) and bool(torch.isfinite(logits.grad).all())


def test_lse_and_gold_values_and_gradients_match_autograd() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 8, 3, 3, 5])
    lse, gold = LseAndGold.apply(logits, targets)
    assert torch.allclose(lse, torch.logsumexp(logits, 1), atol=1e-12)
    assert torch.equal(gold, logits.gather(1, targets.view(-1, 1)).squeeze(1))
    assert torch.autograd.gradcheck(lambda x: LseAndGold.apply(x, targets), (logits,))
