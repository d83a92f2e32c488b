"""Pack training segments into batches by BM25 similarity (TRIME App. B, Algorithm 1).

Start from a random segment; repeatedly move to the most similar segment (top-k BM25
neighbours of the current one, k = 20 as in the paper) that is not used yet, or to a
random unused segment when none of the k is left; cut the chain into batches of B. Lexical
neighbours in one batch stand in for the nearest neighbours the external memory will
return at test time (§4.3). Scoring is bm25s (a maintained library), not home-made.
"""

from __future__ import annotations

from collections.abc import Sequence

import bm25s
import numpy as np


def bm25_neighbours(texts: Sequence[str], k: int = 20) -> list[list[int]]:
    """For each text, up to k other texts by decreasing BM25 score (score > 0 only)."""
    n = len(texts)
    if n == 0:
        return []
    tokens = bm25s.tokenize(list(texts), stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    # +1: a segment is its own best match; fewer when the corpus (or its vocabulary) is tiny
    kk = min(k + 1, n)
    docs, scores = retriever.retrieve(tokens, k=kk, show_progress=False, n_threads=1)
    out: list[list[int]] = []
    for i in range(n):
        keep = [int(j) for j, s in zip(docs[i], scores[i], strict=True) if s > 0 and int(j) != i]
        out.append(keep[:k])
    return out


def greedy_chain(neighbours: Sequence[Sequence[int]], seed: int = 0) -> list[int]:
    """Algorithm 1's order: follow the best unused neighbour, else restart at random."""
    n = len(neighbours)
    rng = np.random.default_rng(seed)
    restart = rng.permutation(n)  # the random_sample(S) draws, in order
    used = np.zeros(n, dtype=bool)
    order: list[int] = []
    ptr = 0
    cur: int | None = None
    while len(order) < n:
        if cur is None:
            while used[restart[ptr]]:
                ptr += 1
            cur = int(restart[ptr])
        order.append(cur)
        used[cur] = True
        nxt = None
        for j in neighbours[cur]:
            if not used[j]:
                nxt = j
                break
        cur = nxt
    return order


def bm25_batches(
    texts: Sequence[str], batch_size: int, k: int = 20, seed: int = 0
) -> list[list[int]]:
    """Batches of segment indices packed by BM25 similarity (the last may be shorter)."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    order = greedy_chain(bm25_neighbours(texts, k), seed)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def random_batches(n: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """The "without BM25 batching" ablation: a seeded random partition into batches."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    order = [int(i) for i in np.random.default_rng(seed).permutation(n)]
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]
