"""Memorising a document: encode, score against the served memory, apply the policy,
append durably (and roll back an uncommitted tail)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from memlm.calibrator import TOP_N
from memlm.encoder import TokenOutputs
from memlm.engine.core import EngineCore
from memlm.engine.results import IngestResult, PreparedDocument
from memlm.knnlm.policy import Policy, TokenScores
from memlm.memory import SimulatedCrash

log = logging.getLogger(__name__)


class IngestMixin(EngineCore):
    """The data flow's write side: ``process_document`` = ``prepare`` + ``store``."""

    def encode_ahead(self, text: str, *, policy: Policy | str | None = None) -> None:
        """Start encoding the document the caller prepares next, on a thread of its own,
        so that its forward overlaps the search and the decision of the current one (the
        encode reads no memory: the result is the same). One slot: a later call replaces
        an earlier one that was not taken."""
        key = (text, self._policy(policy).needs_key_ce)
        with self._ahead_lock:
            if self._ahead is not None and self._ahead[0] == key:
                return
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="encode-ahead")
            self._ahead = (key, self._ahead_pool.submit(self._encode, *key))

    def _encoded(self, text: str, key_ce: bool) -> tuple[list[int], TokenOutputs]:
        """The token ids and outputs of ``text``: encode_ahead's if it started this one.
        Another text's encode stays in the slot (a second worker of this engine started it
        for the document it prepares next)."""
        with self._ahead_lock:
            ahead = self._ahead
            if ahead is not None and ahead[0] == (text, key_ce):
                self._ahead = None
            else:
                ahead = None
        if ahead is not None:
            return ahead[1].result()  # what encoding here would give, or raise
        return self._encode(text, key_ce)

    # --- the data flow ---------------------------------------------------------------------

    def process_document(
        self,
        doc_id: int,
        text: str,
        day: int,
        *,
        policy: Policy | str | None = None,
        crash_at: str | None = None,
    ) -> IngestResult:
        """Encode, score against the memory served now, apply the policy, append durably."""
        return self.store_document(
            self.prepare_document(doc_id, text, day, policy=policy), crash_at=crash_at
        )

    def prepare_document(
        self,
        doc_id: int,
        text: str,
        day: int,
        *,
        policy: Policy | str | None = None,
        next_text: str | None = None,
    ) -> PreparedDocument:
        """Everything before the append, without the write lock: encode, score every token
        against the memory served now (other writers' entries included), apply the policy.

        ``next_text``: the document the caller prepares next. Its encode starts (on a
        thread of its own, :meth:`encode_ahead`) as soon as this document's outputs are in
        hand, so the model's forward of the next document runs beside this one's search,
        decision, append and commit; a prepare of that text takes the result.

        A sampled document's held-out tokens are recorded for the calibrator here (they
        were scored against the memory before its own entries join it).
        """
        self._check_writer()
        if self.shared:  # what other writers appended, and an index another one built
            self.sync()
            self.reload_index()
        pol = self._policy(policy)
        served = self.served  # MoNIM asks the model served now (read once)
        token_ids, out = self._encoded(text, pol.needs_key_ce)
        if next_text is not None:  # not before: two encodes would share the cores
            self.encode_ahead(next_text, policy=pol)
        search: tuple[np.ndarray, np.ndarray] | None = None
        usage = None
        if pol.needs_augmented:
            scores, _, _, (dist, ids, vals) = self._scores(out, served, self.ingest_rerank_depth)
            # the held-out records tune what is served: they reuse only a served-depth search
            search = (dist, vals) if self.ingest_rerank_depth == self.rerank_depth else None
            # usage: the search MoNIM needs anyway, counted when the document is stored
            usage = (ids, vals, out.targets)
        else:
            nan = np.full(len(out), np.nan)
            scores = TokenScores(nan, nan, out.key_ce)
        scores = replace(scores, doc_id=doc_id)  # RandMem's mask is the document's own
        store = pol.decide(scores)
        self._record_heldout(doc_id, day, out, search, store)
        spans = self.char_spans(text)
        ok = len(spans) == len(token_ids)
        if not ok:  # offsets of another tokenisation would mark the wrong characters
            log.warning("document %d: %d spans for %d tokens", doc_id, len(spans), len(token_ids))
        return PreparedDocument(
            doc_id, day, token_ids, out, store, spans if ok else None, usage=usage
        )

    def store_document(
        self, prep: PreparedDocument, *, crash_at: str | None = None
    ) -> IngestResult:
        """Append a prepared document's entries durably and make them searchable.

        A caller that must commit its own bookkeeping atomically with the append (the
        ingest worker) calls this inside ``exclusive()`` and commits before leaving it.
        """
        self._check_writer()
        out, mask, doc_id = prep.outputs, prep.store, prep.doc_id
        n = int(mask.sum())
        with self.exclusive(), self._write_lock:
            # Counted once, even when processed again (the lexical statistics and the
            # memory's usage alike: a document retried after a failed put, or processed
            # again after a crash, counts nothing twice); before the put, so that the put
            # is the last write here: a full disk then fails the document with nothing
            # stored, and no rollback (itself a write) is needed.
            if self.calibration.observe(prep.token_ids, doc_id) and prep.usage is not None:
                self.usage.add(*prep.usage)
            span = self.memory.put_document(
                doc_id, out.keys[mask], out.targets[mask], out.positions[mask], prep.day
            )
            # after the put: the ids are its own (an id used again takes the new value)
            ids = self.memory.entry_ids(doc_id, out.positions[mask], span)
            self.entry_lm.add(ids, out.target_logprob[mask])
        if crash_at == "after_append":
            raise SimulatedCrash("engine: crash after the append, before the caller commits")
        if span is None:  # ids found by document (Milvus): no range to record
            return IngestResult(len(out), n, None, None)
        return IngestResult(len(out), n, span.start, span.stop)

    def _record_heldout(
        self,
        doc_id: int,
        day: int,
        out: TokenOutputs,
        search: tuple[np.ndarray, np.ndarray] | None,
        store: np.ndarray,
    ) -> None:
        """Record the document's held-out tokens for the calibrator if it is sampled.

        ``search``: the policy's (distances, values) against the memory served now, reused
        when it holds enough neighbours; FullMem and RandMem do not search, so a sampled
        document costs them one search here.  ``store``: the policy's decision; the seen
        view adds the entries it is about to append to that search (exactly, with the
        float16 keys the datastore will hold).
        """
        self.calibration.refresh_lexical()
        if not self.heldout.cfg.enabled or self.calibration.lexical.counted(doc_id):
            return  # counted before: processed again after a crash, its record stands
        docs, day_tokens = self.calibration.training_index()
        budget = self.heldout.budget(doc_id, day, docs, day_tokens)
        if budget <= 0:
            return
        rows = self.heldout.rows(doc_id, len(out), budget)
        # every k the build may tune (and the served one), and the 10 density features
        width = max(self.grid.k_max, self.knn.k, TOP_N)
        if search is not None and search[0].shape[1] >= width:
            dist, vals = search[0][rows, :width], search[1][rows, :width]
        else:
            dist, _, vals = self.memory.search(out.keys[rows], width, depth=self.rerank_depth)
        n = len(rows)
        queries = out.keys[rows].astype(np.float32)
        seen_d, seen_v = seen_view(
            queries, dist, vals, out.keys[store].astype(np.float16), out.targets[store]
        )
        self.heldout.record(
            doc_id,
            day,
            {
                "target_lm_logprob": out.target_logprob[rows].astype(np.float32),
                "distances": dist.astype(np.float32),  # (n, width) squared L2
                "values": vals.astype(np.int32),  # (n, width), -1 pads
                "gold": out.targets[rows].astype(np.int64),
                "top_logprob": out.top_logprob[rows].astype(np.float32),
                "entropy": out.entropy[rows].astype(np.float32),
                # the statistics before this document is counted (observe() comes later)
                "lexical": self.calibration.lexical.features(out.prev_tokens[rows]),
                "day": np.full(n, day, np.int32),
                "doc": np.full(n, doc_id, np.int64),
                "qnorm": (queries.astype(np.float64) ** 2).sum(axis=1).astype(np.float32),
                "context": out.positions[rows].astype(np.float32),  # tokens before each
                "seen_distances": seen_d,
                "seen_values": seen_v,
            },
        )


def seen_view(
    queries: np.ndarray,
    dist: np.ndarray,
    vals: np.ndarray,
    own_keys: np.ndarray,
    own_values: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The search results once a document's own entries join the memory: its stored
    (float16) keys searched exactly and merged with the memory's results by distance.

    queries (n, d) float32; dist, vals (n, K) the search before the append; own_keys (m, d),
    own_values (m,).  Returns (n, K) float32 distances and int32 values, as the search would.
    """
    width = dist.shape[1]
    if not len(own_keys):
        return dist.astype(np.float32), vals.astype(np.int32)
    own = own_keys.astype(np.float32)
    d_own = (
        (queries**2).sum(axis=1)[:, None] - 2.0 * queries @ own.T + (own**2).sum(axis=1)[None, :]
    )  # (n, m) squared L2
    d_own = np.maximum(d_own, 0.0)
    all_d = np.concatenate([dist.astype(np.float32), d_own.astype(np.float32)], axis=1)
    all_v = np.concatenate([vals.astype(np.int32), np.broadcast_to(own_values, d_own.shape)], 1)
    all_d = np.where(all_v >= 0, all_d, np.inf)
    order = np.argsort(all_d, axis=1, kind="stable")[:, :width]
    return np.take_along_axis(all_d, order, 1), np.take_along_axis(all_v, order, 1).astype(np.int32)
