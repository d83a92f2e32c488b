"""Choosing the served constant: the grid's exact argmin on held-out rows, the default
while too few rows have a neighbour, a one-point grid served as given, the record files."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from memlm.calibrator.constant import (
    SERVED_DEFAULT,
    SERVED_GRID,
    TuneGrid,
    choose_constant,
    load_choice,
    ppl,
    save_choice,
    token_logprobs,
)
from memlm.knnlm import KnnParams


def heldout_rows(n: int, seed: int, width: int = 64, useful: float = 0.6) -> dict[str, np.ndarray]:
    """Synthetic held-out records: a share of tokens whose near neighbours hold the gold."""
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 50, n)
    dist = np.sort(rng.uniform(1.0, 30.0, (n, width)), axis=1).astype(np.float32)
    vals = rng.integers(0, 50, (n, width)).astype(np.int32)
    hit = rng.random(n) < useful
    for j in range(0, 24, 3):  # some of the first neighbours carry the gold token
        vals[hit, j] = gold[hit]
    vals[:5, :] = -1  # a few tokens met an empty memory
    dist[:5, :] = np.inf
    return {
        "target_lm_logprob": rng.uniform(-9.0, -0.1, n),
        "distances": dist,
        "values": vals,
        "gold": gold,
        "day": np.zeros(n, np.int32),
    }


def test_the_choice_is_the_exact_argmin_of_the_grid() -> None:
    rows = heldout_rows(3000, seed=1)
    grid = TuneGrid(ks=(8, 16, 64), temperatures=(1.0, 4.0, 16.0), lambdas=(0.0, 0.1, 0.3, 0.6))
    choice = choose_constant(rows, grid, SERVED_DEFAULT, min_tokens=100)
    scores = {
        (k, t, lam): ppl(token_logprobs(rows, KnnParams(k=k, temperature=t, lmbda=lam)))
        for k, t, lam in itertools.product(grid.ks, grid.temperatures, grid.lambdas)
    }
    best = min(scores, key=lambda key: scores[key])
    assert (choice.params.k, choice.params.temperature, choice.params.lmbda) == best
    assert choice.source == "tuned" and choice.ppl == scores[best]
    assert (choice.tokens, choice.tokens_with_neighbours) == (3000, 2995)
    assert choice.bare_ppl == ppl(rows["target_lm_logprob"])
    assert choice.params.lmbda > 0  # the useful memory is used


def test_a_memory_that_only_hurts_gives_lambda_zero() -> None:
    rows = heldout_rows(2000, seed=2, useful=0.0)
    rows["values"][rows["values"] == rows["gold"][:, None]] = -1  # never the gold token
    rows["values"][5:, 0] = (rows["gold"][5:] + 1) % 50
    choice = choose_constant(rows, SERVED_GRID, SERVED_DEFAULT, min_tokens=100)
    assert choice.source == "tuned"
    assert choice.params == KnnParams(k=16, temperature=1.0, lmbda=0.0)  # first of the ties
    assert choice.ppl == pytest.approx(choice.bare_ppl, rel=1e-12)


def test_too_few_tokens_with_neighbours_keep_the_default() -> None:
    rows = heldout_rows(300, seed=3)
    choice = choose_constant(rows, SERVED_GRID, SERVED_DEFAULT, min_tokens=296)
    assert choice.source == "default" and choice.params == SERVED_DEFAULT
    assert choice.tokens_with_neighbours == 295
    assert choice.ppl == ppl(token_logprobs(rows, SERVED_DEFAULT))
    empty = choose_constant({}, SERVED_GRID, SERVED_DEFAULT)
    assert (empty.source, empty.tokens, empty.ppl) == ("default", 0, None)


def test_a_grid_of_one_point_is_served_as_given() -> None:
    rows = heldout_rows(50, seed=4)
    grid = SERVED_GRID.fixed(k=32, temperature=3.0, lmbda=0.4)
    assert (grid.ks, grid.temperatures, grid.lambdas) == ((32,), (3.0,), (0.4,))
    choice = choose_constant(rows, grid, SERVED_DEFAULT)
    assert choice.source == "fixed"
    assert choice.params == KnnParams(k=32, temperature=3.0, lmbda=0.4)
    partly = SERVED_GRID.fixed(lmbda=0.1)
    assert (partly.ks, partly.lambdas) == (SERVED_GRID.ks, (0.1,))


def test_lambda_zero_is_in_the_served_grid_and_bad_grids_are_refused() -> None:
    assert 0.0 in SERVED_GRID.lambdas
    with pytest.raises(ValueError, match="lambda must be in"):
        TuneGrid(lambdas=(0.0, 1.5))
    with pytest.raises(ValueError, match="at least one value"):
        TuneGrid(ks=())


def test_choice_files_beside_versions(tmp_path: Path) -> None:
    assert load_choice(tmp_path, 3) is None
    save_choice(tmp_path, 2, {"k": 16})
    save_choice(tmp_path, 5, {"k": 32})
    assert load_choice(tmp_path, 4) == (2, {"k": 16})
    assert load_choice(tmp_path, 5) == (5, {"k": 32})
    assert load_choice(tmp_path, 1) is None and load_choice(tmp_path, None) is None
    assert not list(tmp_path.rglob(".tmp-*"))
