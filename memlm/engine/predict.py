"""Next-token prediction: ``predict`` (top-N tokens, neighbours, whole words, TRIME memory)."""

from __future__ import annotations

import numpy as np
import torch

from memlm.calibrator import ServedInterpolation
from memlm.encoder import Decoding
from memlm.engine.core import EngineCore
from memlm.engine.errors import EngineInputError
from memlm.engine.results import ContextFit, Neighbour, Prediction, Suggestion, _NextToken
from memlm.knnlm import MemoryOptions, has_neighbours
from memlm.knnlm.trime import scaled_dot_scores, trime_log_probs
from memlm.knnlm.words import Distributions, WordSuggestion, complete_words


class PredictMixin(EngineCore):
    """Next tokens under (1 - lambda) p_LM + lambda p_kNN, batched."""

    def predict_span(self, long_segments: int = 0) -> int:
        """Tokens at the end of a context that ``predict`` reads.

        Its window, less room for the word search's extra positions if the model is
        short, plus ``long_segments`` windows of TRIME long-term memory before it.
        """
        span = min(self.window.context, self.encoder.max_positions - self.words.max_tokens)
        return span + long_segments * self.window.context

    def fit_context(self, context: str, *, long_segments: int = 0) -> ContextFit:
        """``context`` cut at a token boundary to what ``predict`` reads (for the API)."""
        spans = self.encoder.char_offsets(context)
        keep = self.predict_span(long_segments)
        if len(spans) <= keep:
            return ContextFit(context, len(spans), len(spans))
        return ContextFit(context[spans[-keep][0] :], keep, len(spans))

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` (what a request costs the model thread)."""
        return len(self.encoder.tokenize(text))

    def predict(
        self,
        context: str,
        *,
        top_n: int = 10,
        neighbours: int = 0,
        words: int = 0,
        memory: MemoryOptions | None = None,
    ) -> Prediction:
        """Top-N next tokens under (1 - lambda) p_LM + lambda p_kNN, with neighbours."""
        return self.predict_batch(
            [context], top_n=top_n, neighbours=neighbours, words=words, memory=memory
        )[0]

    @torch.inference_mode()
    def predict_batch(
        self,
        contexts: list[str],
        *,
        top_n: int = 10,
        neighbours: int = 0,
        words: int = 0,
        memory: MemoryOptions | None = None,
    ) -> list[Prediction]:
        """``predict`` for several contexts: one LM forward and one search for all of them.

        ``words`` > 0 adds that many whole-word suggestions (memlm.knnlm.words), continuing the
        same forward's attention cache; ``memory`` adds TRIME local / long-term memory
        (earlier tokens of the context) to the LM softmax before the datastore's share.
        """
        id_lists = [self.encoder.tokenize(c) for c in contexts]
        if any(not ids for ids in id_lists):
            raise EngineInputError("the context is empty after tokenisation")
        trime = memory if memory is not None and memory.active else None
        span = self.predict_span()
        windows = [ids[-span:] for ids in id_lists]
        keys_all, hidden_all, decoding = self.encoder.start(windows, cache=words > 0)
        rows, last = torch.arange(len(windows)), torch.tensor([len(w) - 1 for w in windows])
        keys, hidden = keys_all[rows, last], hidden_all[rows, last]  # (B, d), (B, h)
        mems = None
        if trime is not None:
            mems = [
                self._context_memory(ids, keys_all[r, : len(w) - 1], w, trime)
                for r, (ids, w) in enumerate(zip(id_lists, windows, strict=True))
            ]
        prev = np.array([w[-1] for w in windows])
        served = self.served  # one interpolation for the whole call (words included)
        nxt = self._next_token(
            keys,
            hidden,
            prev,
            k=max(served.params.k, neighbours),
            lookup=neighbours > 0,
            mems=mems,
            tau=trime.tau if trime else 1.0,
            served=served,
            context=np.array([len(w) for w in windows]),
        )
        word_lists: list[list[WordSuggestion]] = [[] for _ in contexts]
        if words:
            assert decoding is not None
            word_lists = self._complete_words(nxt, decoding, keys, mems, trime, words, served)
        out = []
        for r, ids in enumerate(id_lists):
            best = np.argsort(-nxt.prob[r])[:top_n]
            strings = self.encoder.token_strings(best.tolist())
            sugg = [
                Suggestion(
                    s,
                    int(t),
                    float(nxt.prob[r, t]),
                    float(nxt.lm[r, t]),
                    float(nxt.knn[r, t]),
                    None if nxt.trime is None else float(nxt.trime[r, t]),
                )
                for s, t in zip(strings, best, strict=True)
            ]
            found = self._neighbours(nxt.eids[r], nxt.vals[r], nxt.dist[r], neighbours)
            out.append(
                Prediction(
                    sugg, float(nxt.lam[r]), found, len(ids), word_lists[r], self.served_version
                )
            )
        return out

    def _next_token(
        self,
        keys: torch.Tensor,
        hidden: torch.Tensor,
        prev: np.ndarray,
        *,
        k: int,
        lookup: bool = False,
        mems: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        tau: float = 1.0,
        served: ServedInterpolation | None = None,
        context: np.ndarray | None = None,
    ) -> _NextToken:
        """Next-token distributions of R rows from their keys (R, d) and head inputs (R, h).

        The retrieval gate may skip a row's search (it then keeps the LM answer); ``lookup``
        searches every row anyway, for the neighbours the caller asked for.  ``context``:
        (R,) tokens of context before each row's next token (None: long contexts).
        """
        served = served or self.served  # the caller's, read once for its whole call
        logits = self.encoder.logits(hidden)  # (R, V)
        logp = torch.log_softmax(logits, dim=-1).numpy()
        lm = np.exp(logp)
        top, ent = logp.max(axis=1), -(lm * logp).sum(axis=1)
        search = served.gate_mask(top, ent, prev).astype(bool)  # (R,)
        looked_up = search | lookup
        n = len(prev)
        dist = np.full((n, k), np.inf, np.float32)
        eids = np.full((n, k), -1, np.int64)
        vals = np.full((n, k), -1, np.int32)
        if looked_up.any():
            dist[looked_up], eids[looked_up], vals[looked_up] = self.memory.search(
                keys[looked_up].float().numpy(), k, depth=self.rerank_depth
            )
        kk = served.params.k
        qnorm = (keys.float() ** 2).sum(dim=1).numpy()  # (R,) the evidence's distance scale
        lam, temps = served.token_mix(top, ent, prev, dist[:, :kk], vals[:, :kk], qnorm, context)
        valid = search & has_neighbours(eids[:, :kk])
        lam = np.where(valid, lam, 0.0)
        knn = np.zeros_like(lm)
        for r in np.flatnonzero(valid):
            d, v = dist[r, :kk], vals[r, :kk]
            ok = v >= 0
            w = np.exp(-(d[ok] - d[ok].min()) / temps[r])
            np.add.at(knn[r], v[ok], w / w.sum())
        trime = None
        if mems is not None:  # TRIME Eq. 6: the memory joins the LM softmax
            trime = np.concatenate(
                [
                    trime_log_probs(
                        logits[r : r + 1], scaled_dot_scores(keys[r : r + 1], mk, tau), mv
                    )
                    .exp()
                    .numpy()
                    for r, (mk, mv) in enumerate(mems)
                ]
            )
        base = lm if trime is None else trime
        prob = (1 - lam)[:, None] * base + lam[:, None] * knn
        return _NextToken(prob, lm, knn, trime, lam, dist, eids, vals)

    def _context_memory(
        self, ids: list[int], window_keys: torch.Tensor, window: list[int], memory: MemoryOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TRIME memory of a context's next token: keys (M, d) and next tokens (M,).

        Local: every earlier position of the window (key of ``window[:j+1]`` -> the token
        after it). Long-term: the ``long_segments`` windows' worth of positions before it,
        keyed as the encoder keys documents (each by the window that scores it).
        """
        keys = window_keys  # (L - 1, d)
        values = torch.tensor(window[1:], dtype=torch.long)
        begin = len(ids) - len(window)  # document position of the window's first token
        if memory.long_segments and begin > 0:
            out = self.encoder.encode_ids(ids[: begin + 1], self.window)  # targets 1..begin
            keep = out.positions >= begin + 1 - memory.long_segments * self.window.context
            keys = torch.cat([torch.from_numpy(out.keys[keep]), keys])
            values = torch.cat([torch.from_numpy(out.targets[keep]), values])
        return keys, values

    def _complete_words(
        self,
        first: _NextToken,
        decoding: Decoding,
        keys: torch.Tensor,
        mems: list[tuple[torch.Tensor, torch.Tensor]] | None,
        memory: MemoryOptions | None,
        n: int,
        served: ServedInterpolation,
    ) -> list[list[WordSuggestion]]:
        """Whole words after each context: a beam search that extends the attention cache."""
        # Per row: the context it continues, its query key, and (TRIME) the entries its
        # own generated tokens added to the local memory.
        row_ctx = np.arange(len(first.prob))
        row_keys = keys
        row_new: list[list[tuple[torch.Tensor, int]]] = [[] for _ in row_ctx]

        def step(parents: np.ndarray, tokens: np.ndarray) -> Distributions:
            nonlocal row_ctx, row_keys, row_new
            new = [
                row_new[p] + [(row_keys[p], int(t))] for p, t in zip(parents, tokens, strict=True)
            ]
            ctx = row_ctx[parents]
            k, h = self.encoder.extend(decoding, parents, tokens)
            rows_mem = None
            if mems is not None:
                rows_mem = [
                    (
                        torch.cat([mems[c][0], torch.stack([e[0] for e in extra])]),
                        torch.cat([mems[c][1], torch.tensor([e[1] for e in extra])]),
                    )
                    for c, extra in zip(ctx, new, strict=True)
                ]
            d = self._next_token(
                k,
                h,
                tokens,
                k=served.params.k,
                mems=rows_mem,
                tau=memory.tau if memory else 1.0,
                served=served,
            )
            row_ctx, row_keys, row_new = ctx, k, new
            return Distributions(d.prob, d.lm, d.knn)

        return complete_words(
            Distributions(first.prob, first.lm, first.knn),
            step,
            self.encoder.continues_word,
            self.encoder.tokenizer.decode,
            n,
            self.words,
        )

    def _neighbours(
        self, eids: np.ndarray, vals: np.ndarray, dist: np.ndarray, n: int
    ) -> list[Neighbour]:
        """Provenance of the first n neighbours of one query."""
        sel = eids[:n]
        sel = sel[sel >= 0]
        if not n or not len(sel):
            return []
        docs, pos, days = self.memory.provenance(sel)
        toks = self.encoder.token_strings(vals[: len(sel)].tolist())
        return [
            Neighbour(int(e), int(dd), int(p), tok, int(v), float(di), int(dy))
            for e, dd, p, tok, v, di, dy in zip(
                sel, docs, pos, toks, vals[: len(sel)], dist[: len(sel)], days, strict=True
            )
        ]
