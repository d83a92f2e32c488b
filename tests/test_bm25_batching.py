"""BM25 packing (TRIME Algorithm 1) on a toy corpus with known topics."""

from __future__ import annotations

import numpy as np

from memlm.research.bm25_batching import bm25_batches, bm25_neighbours, greedy_chain, random_batches

TOPICS = {
    "football": [
        "striker goal keeper penalty",
        "goal striker league match",
        "penalty keeper match referee",
        "league referee striker goal",
    ],
    "weather": [
        "storm rain flood forecast",
        "forecast temperature rain snow",
        "snow storm temperature cold",
        "flood rain cold forecast",
    ],
    "markets": [
        "stocks shares investors dollar",
        "dollar bonds yields investors",
        "shares bonds stocks trading",
        "yields trading dollar shares",
    ],
}


def _corpus(seed: int) -> tuple[list[str], list[str]]:
    items = [(t, s) for t, segs in TOPICS.items() for s in segs]
    perm = np.random.default_rng(seed).permutation(len(items))
    return [items[i][1] for i in perm], [items[i][0] for i in perm]


def test_packing_groups_similar_segments() -> None:
    for seed in range(5):
        texts, topics = _corpus(seed)
        batches = bm25_batches(texts, batch_size=4, seed=seed)
        assert sorted(i for b in batches for i in b) == list(range(12))
        # topics share no word: every batch is exactly one topic
        assert sorted(len({topics[i] for i in b}) for b in batches) == [1, 1, 1]
        shuffled = random_batches(12, 4, seed=seed)
        assert sorted(i for b in shuffled for i in b) == list(range(12))


def test_neighbours_are_ranked_by_bm25() -> None:
    texts = ["apple banana cherry", "apple banana grape", "apple kiwi lemon", "zebra yak"]
    nb = bm25_neighbours(texts, k=20)
    assert nb[0] == [1, 2]  # two shared words beat one; "zebra yak" shares none
    assert nb[3] == []


def test_greedy_chain_follows_best_unused_neighbour() -> None:
    neighbours = [[2, 1], [0], [1, 0], []]
    starts = set()
    for seed in range(8):
        order = greedy_chain(neighbours, seed=seed)
        assert sorted(order) == [0, 1, 2, 3]
        starts.add(order[0])
        for pos, (a, b) in enumerate(zip(order, order[1:], strict=False)):
            unused = [j for j in neighbours[a] if j not in order[: pos + 1]]
            if unused:  # otherwise Algorithm 1 restarts at a random unused segment
                assert b == unused[0]
    assert len(starts) > 1  # the start is a seeded random draw
    assert greedy_chain(neighbours, seed=3) == greedy_chain(neighbours, seed=3)
