"""Scoring a text token by token under the LM and the augmented model."""

from __future__ import annotations

import math

import numpy as np

from memlm.engine.core import EngineCore
from memlm.engine.results import ScoreResult
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
        pol = self._policy(policy)
        served = self.served  # the same interpolation scores the text and decides would_store
        ids, out = self._encode(text, pol.needs_key_ce)
        scores, lam, (dist, eids, vals) = self._scores(out, served)
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
        knn = knn_logprob(dist, eids, vals, out.targets[:, None], served.params.temperature)[:, 0]
        aug = interpolate(base, knn, lam, valid)
        if not pol.needs_augmented and pol.needs_key_ce:
            scores = TokenScores(scores.target_logprob, scores.max_logprob, out.key_ce)
        store = pol.decide(scores)
        lm = out.target_logprob.astype(np.float64)
        return ScoreResult(
            tokens=self.encoder.token_strings(out.targets.tolist()),
            lm_logprobs=lm.tolist(),
            logprobs=aug.astype(np.float64).tolist(),
            lm_ppl=perplexity(lm),
            ppl=perplexity(aug),
            would_store=store.astype(bool).tolist(),
            trime_logprobs=None if trime is None else trime.tolist(),
            trime_ppl=None if trime is None else perplexity(trime),
        )
