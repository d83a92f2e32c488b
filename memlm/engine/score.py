"""Scoring a text token by token under the LM and the augmented model."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from memlm.encoder import TokenOutputs
from memlm.encoder.head import BLOCK_ROWS
from memlm.engine.core import EngineCore
from memlm.engine.results import Neighbour, ScoreResult
from memlm.knnlm import MemoryOptions, has_neighbours, interpolate, knn_logprob
from memlm.knnlm.policy import Policy, TokenScores
from memlm.knnlm.trime import cached_doc_logprobs

# exp(709.78) is the largest float64: a mean log-probability below -MAX_LOG_PPL (a sharp
# memory with a small tau puts ~0 on the target) overflowed math.exp into a 500.
MAX_LOG_PPL = math.log(np.finfo(np.float64).max)


def perplexity(logprobs: np.ndarray) -> float:
    """exp(-mean log p), saturated at the largest float (JSON has no infinity)."""
    return math.exp(min(-float(np.mean(logprobs)), MAX_LOG_PPL))


class ScoreMixin(EngineCore):
    """``score``: per-token log-probabilities and what the policy would store."""

    def score(
        self,
        text: str,
        *,
        policy: Policy | str | None = None,
        memory: MemoryOptions | None = None,
    ) -> ScoreResult:
        """Per-token log-probabilities under the LM and the augmented model.

        With ``memory`` the text's own earlier tokens join the LM softmax first (TRIME
        Eq. 6, over the same windows the encoder scores); the datastore is interpolated
        on top of that (App. A, Eq. 9).
        """
        return self.score_ids(self.encoder.tokenize(text), policy=policy, memory=memory)

    def score_ids(
        self,
        ids: Sequence[int],
        *,
        policy: Policy | str | None = None,
        memory: MemoryOptions | None = None,
        top: int = 0,
        nearest: bool = False,
    ) -> ScoreResult:
        """``score`` of a text given as token ids (the OpenAI API's echo reads it).

        ``top``: also the ``top`` most probable tokens of the augmented distribution at
        every scored position (without ``memory``); ``nearest``: the nearest entry of
        each token's search, with its provenance.
        """
        if top and memory is not None and memory.active:
            raise ValueError("top tokens are computed for the datastore's interpolation only")
        pol = self._policy(policy)
        served = self.served  # the same interpolation scores the text and decides would_store
        out = self._encode_ids(list(ids), pol.needs_key_ce)
        scores, lam, temps, (dist, eids, vals) = self._scores(out, served, self.rerank_depth)
        base = out.target_logprob.astype(np.float64)
        trime = None
        if memory is not None and memory.active:
            trime = cached_doc_logprobs(
                out.keys,
                out.targets,
                out.target_logprob,
                out.lse,
                out.positions,
                self.window.windows(len(ids)),
                long_tokens=memory.long_segments * self.window.context,
                taus=[memory.tau],
            )[:, 0]
            base = trime
        # lambda per token from the calibrator, else the constant; tokens the gate skips
        # (lambda 0) or with no neighbour keep the base distribution
        valid = has_neighbours(eids)
        knn = knn_logprob(dist, eids, vals, out.targets[:, None], temps)[:, 0]
        aug = interpolate(base, knn, lam, valid)
        if not pol.needs_augmented and pol.needs_key_ce:
            scores = TokenScores(scores.target_logprob, scores.max_logprob, out.key_ce)
        store = pol.decide(scores)
        lm = out.target_logprob.astype(np.float64)
        tops = None
        if top:
            tops = self._top_tokens(out, (dist, eids, vals), lam, temps, aug, top)
        found = None
        if nearest:
            found = self._nearest_all(eids, vals, dist)
        return ScoreResult(
            tokens=self.encoder.token_strings(out.targets.tolist()),
            lm_logprobs=lm.tolist(),
            logprobs=aug.astype(np.float64).tolist(),
            lm_ppl=perplexity(lm),
            ppl=perplexity(aug),
            would_store=store.astype(bool).tolist(),
            trime_logprobs=None if trime is None else trime.tolist(),
            trime_ppl=None if trime is None else perplexity(trime),
            knn_logprobs=knn.tolist(),
            lambdas=np.where(valid, lam, 0.0).astype(np.float64).tolist(),
            top=tops,
            nearest=found,
        )

    def _top_tokens(
        self,
        out: TokenOutputs,
        search: tuple[np.ndarray, np.ndarray, np.ndarray],
        lam: np.ndarray,
        temps: np.ndarray,
        aug: np.ndarray,
        top: int,
    ) -> list[list[tuple[int, str, float]]]:
        """The ``top`` most probable tokens of (1 - lambda) p_LM + lambda p_kNN at each
        scored position, most probable first: (id, decoded alone, log-probability).

        Exact without the (n, V) mixture: a token outside the LM's ``top`` and outside the
        neighbour values has the mass (1 - lambda) p_LM of a token below all of the LM's
        ``top``, so the mixture's ``top`` lie among those candidates (as
        ``memlm.knnlm.augmented_scores`` finds the top-1). The scored token keeps the
        log-probability ``score`` gives it, so a caller comparing the two sees equality
        exactly where the scored token is the most probable.
        """
        dist, eids, vals = search
        n = len(out)
        if top == 1:  # the encoder kept each position's LM argmax
            lm_top = out.top_id[:, None]
        else:
            lm_top = np.empty((n, top), np.int64)
            for s in range(0, n, BLOCK_ROWS):
                h = torch.from_numpy(np.ascontiguousarray(out.hidden[s : s + BLOCK_ROWS]))
                logits = self.encoder.logits(h)  # (b, V): the LM's order is its logits'
                lm_top[s : s + BLOCK_ROWS] = torch.topk(logits, top, dim=1).indices.numpy()
        cand = np.concatenate([out.targets[:, None], lm_top, vals.astype(np.int64)], axis=1)
        cand_lm = self.encoder.logprobs_for(out.hidden, out.lse, cand).astype(np.float64)
        knn = knn_logprob(dist, eids, vals, cand, temps)
        cand_aug = interpolate(cand_lm, knn, lam, has_neighbours(eids))  # (n, 1 + top + k)
        cand_aug = np.where(cand == out.targets[:, None], aug[:, None], cand_aug)
        cand_aug[cand < 0] = -np.inf  # padding neighbours are no tokens
        order = np.argsort(-cand_aug, axis=1, kind="stable")
        rows: list[dict[int, float]] = []
        for r in range(n):
            seen: dict[int, float] = {}
            for c in order[r]:
                tok = int(cand[r, c])
                if tok >= 0 and tok not in seen:
                    seen[tok] = float(cand_aug[r, c])
                    if len(seen) == top:
                        break
            rows.append(seen)
        names = iter(self.encoder.token_strings([t for seen in rows for t in seen]))
        return [[(t, next(names), lp) for t, lp in seen.items()] for seen in rows]

    def _nearest_all(
        self, eids: np.ndarray, vals: np.ndarray, dist: np.ndarray
    ) -> list[Neighbour | None]:
        """Each row's nearest neighbour with its provenance (None where the search found
        none): one provenance lookup for all rows."""
        hit = np.flatnonzero(eids[:, 0] >= 0)
        found: list[Neighbour | None] = [None] * len(eids)
        if not len(hit):
            return found
        docs, pos, days = self.memory.provenance(eids[hit, 0])
        toks = self.encoder.token_strings(vals[hit, 0].tolist())
        for j, r in enumerate(hit):
            found[r] = Neighbour(
                int(eids[r, 0]),
                int(docs[j]),
                int(pos[j]),
                toks[j],
                int(vals[r, 0]),
                float(dist[r, 0]),
                int(days[j]),
            )
        return found
