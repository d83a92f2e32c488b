import math

import numpy as np
import pytest

from memlm.knnlm import (
    KnnParams,
    augmented_scores,
    has_neighbours,
    interpolate,
    knn_logprob,
    neighbour_log_weights,
)


def test_knn_distribution_matches_hand_computation():
    d = np.array([[1.0, 2.0, 4.0]])
    ids = np.array([[0, 1, 2]])
    vals = np.array([[7, 9, 7]])
    t = 2.0
    w = np.exp(-np.array([1.0, 2.0, 4.0]) / t)
    expect7 = (w[0] + w[2]) / w.sum()
    expect9 = w[1] / w.sum()
    got = np.exp(knn_logprob(d, ids, vals, np.array([[7, 9, 3]]), t))[0]
    assert got == pytest.approx([expect7, expect9, 0.0])


def test_padding_is_ignored_and_empty_rows_fall_back_to_lm():
    d = np.array([[1.0, np.inf], [np.inf, np.inf]])
    ids = np.array([[5, -1], [-1, -1]])
    vals = np.array([[3, -1], [-1, -1]])
    lw = neighbour_log_weights(d, ids, 1.0)
    assert lw[0, 0] == 0.0 and lw[0, 1] == -np.inf
    assert np.all(lw[1] == -np.inf)
    assert has_neighbours(ids).tolist() == [True, False]
    knn = knn_logprob(d, ids, vals, np.array([[3], [3]]), 1.0)[:, 0]
    lm = np.log(np.array([0.2, 0.2]))
    mixed = interpolate(lm, knn, 0.25, has_neighbours(ids))
    assert mixed[0] == pytest.approx(math.log(0.75 * 0.2 + 0.25 * 1.0))
    assert mixed[1] == pytest.approx(math.log(0.2))  # no neighbour: the plain LM


def test_interpolate_per_row_lambda():
    lm = np.log(np.array([0.5, 0.1]))
    knn = np.array([-np.inf, 0.0])
    got = np.exp(interpolate(lm, knn, np.array([0.5, 0.2]), np.array([True, True])))
    assert got == pytest.approx([0.25, 0.8 * 0.1 + 0.2])


def test_augmented_scores_target_and_max():
    # LM: p(gold=1)=0.1, top-1 is token 2 with 0.6; neighbours all carry token 1.
    params = KnnParams(k=2, temperature=1.0, lmbda=0.5)
    out = augmented_scores(
        target_lm_logprob=np.log([0.1]),
        top_lm_logprob=np.log([0.6]),
        top_id=np.array([2]),
        targets=np.array([1]),
        distances=np.array([[0.0, 0.0]]),
        ids=np.array([[0, 1]]),
        values=np.array([[1, 1]]),
        value_lm_logprob=np.log([[0.1, 0.1]]),
        params=params,
    )
    assert out.target_logprob[0] == pytest.approx(math.log(0.5 * 0.1 + 0.5))
    # token 1: 0.55 beats token 2: 0.5 * 0.6 = 0.3
    assert out.max_logprob[0] == pytest.approx(math.log(0.55))


def test_params_validation():
    with pytest.raises(ValueError):
        KnnParams(k=0)
    with pytest.raises(ValueError):
        KnnParams(temperature=0)
    with pytest.raises(ValueError):
        KnnParams(lmbda=1.5)


def test_knn_logprob_in_row_blocks_is_bit_identical_to_one_block(monkeypatch):
    """The (rows, m, k) comparison is built a block of rows at a time (a document at
    k = 1,024 would need gigabytes in one piece); each row alone, so no bit changes."""
    import memlm.knnlm.mixture as mixture

    rng = np.random.default_rng(3)
    n, k, m = 37, 16, 18
    dist = np.sort(rng.random((n, k)).astype(np.float32) * 5, axis=1)
    ids = np.where(rng.random((n, k)) < 0.1, -1, rng.integers(0, 1000, (n, k)))
    vals = np.where(ids >= 0, rng.integers(0, 6, (n, k)), -1)
    tokens = rng.integers(0, 6, (n, m))
    temps = rng.random(n) * 3 + 0.5
    whole = mixture.knn_logprob(dist, ids, vals, tokens, temps)
    monkeypatch.setattr(mixture, "_MATCH_ELEMENTS", m * k * 5)  # 5 rows a block
    np.testing.assert_array_equal(mixture.knn_logprob(dist, ids, vals, tokens, temps), whole)
    monkeypatch.setattr(mixture, "_MATCH_ELEMENTS", 1)  # one row a block
    np.testing.assert_array_equal(mixture.knn_logprob(dist, ids, vals, tokens, temps), whole)
    assert mixture.knn_logprob(dist[:0], ids[:0], vals[:0], tokens[:0], 1.0).shape == (0, m)


@pytest.mark.parametrize("seed", range(6))
def test_knn_logprob_summed_by_value_equals_the_comparison(seed, monkeypatch):
    """Many candidates of many neighbours take the sorted path; it gives what the
    candidate-by-neighbour comparison gives (padding, repeated values, absent tokens,
    one temperature per row)."""
    from memlm.knnlm import mixture

    rng = np.random.default_rng(seed)
    n, k, m = 7, 200, 50
    dist = np.sort(rng.random((n, k)) * 10, axis=1)
    vals = rng.integers(0, 30, (n, k))
    ids = np.arange(n * k).reshape(n, k)
    ids[:, -rng.integers(0, 20) or k :] = -1  # padding at the end of each row
    vals[ids < 0] = -1
    tokens = rng.integers(-1, 40, (n, m))
    temps = rng.random(n) + 0.5
    assert m * k > mixture._DENSE_MATCH
    fast = mixture.knn_logprob(dist, ids, vals, tokens, temps)
    monkeypatch.setattr(mixture, "_DENSE_MATCH", 1 << 40)  # the comparison
    dense = mixture.knn_logprob(dist, ids, vals, tokens, temps)
    np.testing.assert_allclose(fast, dense, rtol=1e-12, atol=0)
    assert (np.isneginf(fast) == np.isneginf(dense)).all()
