"""Whole-word suggestions: the most probable next words, not just the next token.

A word is a first token followed by zero or more *continuation* tokens (tokens that
glue onto the previous one: no leading space, starting with a letter or digit) and
ended by any other token. Its probability under a next-token model p is

    P(w) = p(t_1 | c) * p(t_2 | c t_1) * ... * p(t_m | c t_1..t_{m-1}) * p(end | c t_1..t_m)

with p(end | .) the mass of the non-continuation tokens. Several tokenisations of the
same string are different paths to one word, so their probabilities add up.

The search is a beam search over prefixes: a prefix's probability bounds every word it
can still become, so prefixes that fall below the n-th finished word are dropped, and at
most ``beam`` prefixes per context are extended, for at most ``max_tokens`` tokens.
Everything model-specific sits behind ``step``; the same code scores the LM, the memory
and their interpolation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WordConfig:
    """Search limits: cost grows with beam x max_tokens forwards of one token each."""

    beam: int = 16  # at most this many prefixes per context (2 per word asked for)
    max_tokens: int = 4  # BPE news words are 1-3 tokens; longer ones are rare suggestions

    def __post_init__(self) -> None:
        if self.beam < 1 or self.max_tokens < 1:
            raise ValueError("beam and max_tokens must be >= 1")


@dataclass(frozen=True)
class Distributions:
    """Next-token distributions of R rows: the final one and its two parts, each (R, V)."""

    prob: np.ndarray  # what the suggestions are ranked by (the interpolation)
    lm_prob: np.ndarray  # the bare LM
    knn_prob: np.ndarray  # the memory alone


@dataclass(frozen=True)
class WordSuggestion:
    word: str  # the decoded tokens (a leading space marks a new word)
    token_ids: tuple[int, ...]  # the most probable tokenisation
    tokens: tuple[str, ...]  # ... and its tokens as strings
    prob: float
    lm_prob: float
    knn_prob: float


# step(parents, tokens): row j of the next step continues row parents[j] of the previous
# one (the contexts at the first step) with token tokens[j]; returns its distributions.
StepFn = Callable[[np.ndarray, np.ndarray], Distributions]


def continuation_mask(token_strings: Sequence[str]) -> np.ndarray:
    """(V,) bool: tokens that continue the word before them instead of ending it."""
    out = np.zeros(len(token_strings), bool)
    for i, s in enumerate(token_strings):
        if not s or s[0].isspace():
            continue
        c = s[0]
        # U+FFFD: a byte of a multi-byte letter, decoded alone; an apostrophe with letters
        # after it is part of the word ("Trump's", "don't")
        out[i] = c.isalnum() or c == "\ufffd" or (c in "'\u2019" and s[1:2].isalpha())
    return out


@dataclass
class _Prefix:
    context: int
    tokens: tuple[int, ...]
    prob: float
    lm_prob: float
    knn_prob: float


def complete_words(
    first: Distributions,
    step: StepFn,
    continues: np.ndarray,
    decode: Callable[[Sequence[int]], str],
    n: int,
    cfg: WordConfig | None = None,
) -> list[list[WordSuggestion]]:
    """The n most probable whole words after each context, most probable first.

    ``first`` holds the distributions of the first token after each of the B contexts;
    ``continues`` is :func:`continuation_mask` of the vocabulary.
    """
    cfg = cfg or WordConfig()
    n_ctx, vocab = first.prob.shape
    assert continues.shape == (vocab,) and n >= 1
    # Each prefix is a row of the next forward (a 16-row step costs about 0.4 of a
    # 128-token context's forward here); twice the words asked for leaves room for
    # prefixes that do not end well without paying for 16 when 3 words are wanted.
    beam = min(cfg.beam, max(2 * n, 4))
    ends = ~continues
    done: list[dict[tuple[int, ...], tuple[float, float, float]]] = [{} for _ in range(n_ctx)]
    prefixes = [
        _Prefix(
            r, (int(t),), *(float(d[r, t]) for d in (first.prob, first.lm_prob, first.knn_prob))
        )
        for r in range(n_ctx)
        for t in _top(first.prob[r], beam)
        if first.prob[r, t] > 0
    ]
    parents = np.array([p.context for p in prefixes], np.int64)
    for depth in range(cfg.max_tokens):
        if not prefixes:
            break
        d = step(parents, np.array([p.tokens[-1] for p in prefixes], np.int64))
        end_mass = [x[:, ends].sum(axis=1) for x in (d.prob, d.lm_prob, d.knn_prob)]
        for j, p in enumerate(prefixes):
            done[p.context][p.tokens] = (
                p.prob * float(end_mass[0][j]),
                p.lm_prob * float(end_mass[1][j]),
                p.knn_prob * float(end_mass[2][j]),
            )
        if depth + 1 == cfg.max_tokens:
            break
        prefixes, parents = _extend(prefixes, d, continues, done, n, beam)
    return [_merge(done[r], decode, n) for r in range(n_ctx)]


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of a row, largest first (ties: smaller index)."""
    k = min(k, len(row))
    part = np.argpartition(-row, k - 1)[:k]
    return part[np.lexsort((part, -row[part]))]


def _extend(
    prefixes: list[_Prefix],
    d: Distributions,
    continues: np.ndarray,
    done: list[dict[tuple[int, ...], tuple[float, float, float]]],
    n: int,
    beam: int,
) -> tuple[list[_Prefix], np.ndarray]:
    """The next prefixes: the best ``beam`` continuations per context that can still win."""
    cont_ids = np.flatnonzero(continues)
    by_context: dict[int, list[tuple[float, int, int]]] = {}
    for j, p in enumerate(prefixes):
        scores = p.prob * d.prob[j, cont_ids]
        for c in _top(scores, beam):
            if scores[c] > 0:
                by_context.setdefault(p.context, []).append((float(scores[c]), j, int(cont_ids[c])))
    out: list[_Prefix] = []
    parents: list[int] = []
    for ctx, cands in sorted(by_context.items()):
        finished = sorted((v[0] for v in done[ctx].values()), reverse=True)
        # a prefix's probability bounds every word it can become
        bound = finished[n - 1] if len(finished) >= n else 0.0
        cands.sort(key=lambda x: (-x[0], x[1], x[2]))
        for score, j, t in cands[:beam]:
            if score <= bound:
                break
            p = prefixes[j]
            out.append(
                _Prefix(
                    ctx,
                    p.tokens + (t,),
                    score,
                    p.lm_prob * float(d.lm_prob[j, t]),
                    p.knn_prob * float(d.knn_prob[j, t]),
                )
            )
            parents.append(j)
    return out, np.array(parents, np.int64)


def _merge(
    done: dict[tuple[int, ...], tuple[float, float, float]],
    decode: Callable[[Sequence[int]], str],
    n: int,
) -> list[WordSuggestion]:
    """Sum the tokenisations of each string; keep the n most probable words."""
    words: dict[str, list[float]] = {}
    best: dict[str, tuple[float, tuple[int, ...]]] = {}
    for tokens, probs in done.items():
        w = decode(tokens)
        acc = words.setdefault(w, [0.0, 0.0, 0.0])
        for i in range(3):
            acc[i] += probs[i]
        if w not in best or probs[0] > best[w][0]:
            best[w] = (probs[0], tokens)
    ranked = sorted(words.items(), key=lambda kv: (-kv[1][0], kv[0]))[:n]
    return [
        WordSuggestion(w, best[w][1], tuple(decode([t]) for t in best[w][1]), p[0], p[1], p[2])
        for w, p in ranked
    ]
