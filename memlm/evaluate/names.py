"""Name tokens: what the memory knows that the frozen model does not.

A name token is the first token of a capitalised word that does not begin a sentence:
the people, places and organisations of the news.  Detection works on the token ids of a
document with the tokenizer's decoded pieces, so test tokens and ingested documents use
exactly the same rule.  A name is "seen" by the memory when its word occurred as a name
in a document ingested on or before the evening its test document is scored; which names
the model met in pre-training cannot be known, so "seen in the stream" is the split.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from memlm.knnlm import KnnParams, has_neighbours, neighbour_log_weights

_SENTENCE_END = ".!?:"
_OPENERS = "\"'“‘([«"
# "Mr. Trump": a full stop after these does not end the sentence
_ABBREV = {"mr", "mrs", "ms", "dr", "st", "sen", "rep", "gov", "gen", "lt", "col", "prof", "jr"}
_WORD = re.compile(r"[^\W\d_][\w'’.-]*")
_CONTEXT = 8
TIE = 1e-6  # relative: float32 log-probabilities of one token agree to about 1e-7  # decoded pieces looked back at to find the previous character


def pieces_of(tokenizer: Any, vocab_size: int) -> list[str]:
    """The decoded text of every token id (what each id adds to a decoded text)."""
    return [tokenizer.decode([i]) for i in range(vocab_size)]


def _sentence_initial(before: str) -> bool:
    tail = before.rstrip(" \t")
    if not tail or tail.endswith("\n"):
        return True
    tail = tail.rstrip(_OPENERS).rstrip()
    if not tail or tail.endswith("\n"):
        return True
    if tail[-1] not in _SENTENCE_END:
        return False
    if tail[-1] == ".":  # an abbreviation or an initial ("J. K.") does not end a sentence
        last = re.findall(r"(\w+)\.$", tail)
        if last and (last[0].lower() in _ABBREV or (len(last[0]) == 1 and last[0].isupper())):
            return False
    return True


def name_words(ids: Sequence[int], pieces: Sequence[str]) -> dict[int, str]:
    """{position: word} for every name token of a document's token ids."""
    out: dict[int, str] = {}
    for p in range(1, len(ids)):
        piece = pieces[ids[p]]
        prev = pieces[ids[p - 1]]
        starts = piece[:1].isspace() or prev[-1:].isspace() or prev[-1:] in _OPENERS
        s = piece.lstrip()
        if not starts or not s[:1].isupper() or not s[:1].isalpha():
            continue
        before = "".join(pieces[i] for i in ids[max(0, p - _CONTEXT) : p])
        if piece[:1].isspace():
            before += piece[: len(piece) - len(s)]
        if _sentence_initial(before):
            continue
        # the whole word: this piece and the pieces that continue it
        text = s
        q = p + 1
        while q < len(ids) and q < p + 10 and not pieces[ids[q]][:1].isspace():
            text += pieces[ids[q]]
            q += 1
        m = _WORD.match(text)
        word = m.group(0).rstrip(".'’-") if m else s
        if word in ("I", "I'm", "I've", "I'll", "I'd"):
            continue
        out[p] = word
    return out


def top1_correct(
    encoder: Any, o: Any, rows: np.ndarray, dist: np.ndarray, vals: np.ndarray, params: KnnParams
) -> np.ndarray:
    """Whether the gold token is the augmented model's arg max (ties count), for ``rows``.

    The arg max is the LM's top-1 or a neighbour value (knnlm.augmented_scores); p_kNN of
    each value is summed once per (row, value) with one bincount, O(n k log k), where
    scoring every candidate against every neighbour would be O(n k^2) (minutes at k=1024).
    """
    k = min(params.k, vals.shape[1])
    d, v = dist[:, :k], vals[:, :k]
    n = len(v)
    ids = np.where(v >= 0, 0, -1)
    w = np.exp(neighbour_log_weights(d, ids, params.temperature))  # (n, k), 0 on padding
    key = np.arange(n, dtype=np.int64)[:, None] * encoder.vocab_size + np.maximum(v, 0)
    _, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(n, k)
    knn_slot = np.bincount(inv.ravel(), weights=w.ravel())[inv]  # p_kNN(value of the slot)
    gold, top = o.targets[rows], o.top_id[rows]
    knn_gold = (w * (v == gold[:, None])).sum(1)
    knn_top = (w * (v == top[:, None])).sum(1)
    lam = np.where(has_neighbours(ids), params.lmbda, 0.0)[:, None]
    value_lm = np.exp(encoder.logprobs_for(o.hidden[rows], o.lse[rows], np.maximum(v, 0)))
    lam1 = lam[:, 0]
    p_top = (1 - lam1) * np.exp(o.top_logprob[rows].astype(np.float64)) + lam1 * knn_top
    p_gold = (1 - lam1) * np.exp(o.target_logprob[rows].astype(np.float64)) + lam1 * knn_gold
    # When the LM is right, gold and top-1 are one token and get one probability: a
    # half-precision head's top-1 log-prob and its float32-rescored gold log-prob differ by
    # up to ~3e-5, which the tie tolerance would count as a loss (full57: 36.7% -> 20.8%
    # top-1 at lambda 0 before this)
    p_top = np.where(gold == top, p_gold, p_top)
    p_slot = np.where(v >= 0, (1 - lam) * value_lm + lam * knn_slot, -np.inf)
    # the gold and top-1 slots take the encoder's own log-probabilities: the head product
    # of logprobs_for differs from them in the last float32 bits, enough to unseat a tie
    p_slot = np.where(v == gold[:, None], p_gold[:, None], p_slot)
    p_slot = np.where(v == top[:, None], p_top[:, None], p_slot)
    best = np.maximum(p_top, p_slot.max(1) if k else p_top)
    return p_gold >= best * (1 - TIE)


def summarise(
    logprobs: dict[str, np.ndarray], correct: dict[str, np.ndarray], masks: dict[str, np.ndarray]
) -> dict[str, dict[str, Any]]:
    """{subset: {system: {tokens, ppl, top1}}} for the name-token subsets."""
    out: dict[str, dict[str, Any]] = {}
    for subset, mask in masks.items():
        out[subset] = {}
        for name, lp in logprobs.items():
            n = int(mask.sum())
            out[subset][name] = {
                "tokens": n,
                "ppl": float(np.exp(-lp[mask].mean())) if n else None,
                "top1": float(correct[name][mask].mean()) if n else None,
            }
    return out
