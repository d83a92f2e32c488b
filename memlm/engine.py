"""The engine facade: one object that the service and the workers drive.

It owns the encoder, the datastore and the served memory index of one data directory,
and offers the operations of the data flow in DESIGN.md: memorise a document with a
policy, predict the next token, score a text, rebuild the index, forget a document.
No database and no HTTP here; the caller commits its own bookkeeping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.calibrator import TOP_N, ServedCalibration, ServedInterpolation
from memlm.datastore import Compaction, Datastore, SimulatedCrash
from memlm.encoder import BUNDLED_MODEL, Decoding, Encoder, TokenOutputs, WindowConfig
from memlm.generate import GenerateConfig, Generation
from memlm.heldout import PENDING_DIR, HeldOutConfig, HeldOutRecorder
from memlm.index import (
    BuildInfo,
    IndexParams,
    MemoryIndex,
    build_index,
    list_versions,
    newest_recorded,
    prune,
    remove_orphan_versions,
)
from memlm.interpolation import MIN_TUNE_TOKENS, SERVED_DEFAULT, SERVED_GRID, TuneGrid
from memlm.knnlm import KnnParams, MemoryOptions, has_neighbours, interpolate, knn_logprob
from memlm.locks import FileLock, LockBusy
from memlm.policy import Policy, TokenScores, make_policy, token_scores
from memlm.trime_memory import (
    cached_doc_logprobs,
    scaled_dot_scores,
    trime_log_probs,
)
from memlm.words import Distributions, WordConfig, WordSuggestion, complete_words

__all__ = ["Engine", "MemoryOptions", "make_policy"]

log = logging.getLogger(__name__)

ENGINE_CRASH_POINTS = ("after_append",)  # entries durable, caller not yet told
BUILD_LOCK = "build.lock"  # one index build (and training-set write) at a time


class EngineInputError(ValueError):
    """The text given to the engine cannot be used (empty after tokenisation...)."""


@dataclass(frozen=True)
class IngestResult:
    tokens_seen: int
    tokens_stored: int
    first_entry: int  # datastore ids [first_entry, end_entry) hold this document's entries
    end_entry: int


@dataclass(frozen=True)
class PreparedDocument:
    """A document encoded, scored and decided on, ready to append (``Engine.store_document``)."""

    doc_id: int
    day: int
    token_ids: list[int]
    outputs: TokenOutputs
    store: np.ndarray  # (n,) bool: the policy's decision per scored token
    # (len(token_ids), 2) character span of every token: stored beside the document so that
    # a neighbour's snippet is a slice of its text, not a re-tokenisation (service/provenance)
    char_spans: np.ndarray | None = None


@dataclass(frozen=True)
class RebuildInfo(BuildInfo):
    """A new index version, what the calibrator training at that build did, and the
    interpolation it serves (``interpolation.json``: constant chosen, calibrator or not)."""

    calibrator: dict[str, Any] = field(default_factory=dict)
    # what the compaction before the build removed (rows of forgotten documents)
    compaction: dict[str, int] = field(default_factory=dict)
    interpolation: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Suggestion:
    token: str
    token_id: int
    prob: float
    lm_prob: float
    knn_prob: float
    trime_prob: float | None = None  # LM + local / long-term memory (TRIME Eq. 6), if asked


@dataclass(frozen=True)
class Neighbour:
    entry_id: int
    doc_id: int
    position: int  # token position of the value in its document
    token: str
    token_id: int
    distance: float  # squared L2
    day: int = 0


@dataclass(frozen=True)
class Prediction:
    suggestions: list[Suggestion]
    lam: float
    neighbours: list[Neighbour]
    context_tokens: int = 0
    words: list[WordSuggestion] = field(default_factory=list)
    index_version: int | None = None  # the built index version searched (None: fresh only)


@dataclass(frozen=True)
class _NextToken:
    """Next-token distributions of R rows, each (R, V), and the search behind them."""

    prob: np.ndarray  # (1 - lambda) * base + lambda * knn, base = trime if given else lm
    lm: np.ndarray
    knn: np.ndarray
    trime: np.ndarray | None
    lam: np.ndarray  # (R,) 0 where the gate skipped the search or nothing was found
    dist: np.ndarray  # (R, k)
    eids: np.ndarray
    vals: np.ndarray


@dataclass(frozen=True)
class ScoreResult:
    tokens: list[str]  # the scored tokens (every token but the first)
    lm_logprobs: list[float]
    logprobs: list[float]
    lm_ppl: float
    ppl: float
    would_store: list[bool]
    trime_logprobs: list[float] | None = None  # LM + local / long-term memory, if asked
    trime_ppl: float | None = None


@dataclass(frozen=True)
class ContextFit:
    """The end of a context that ``predict`` reads (``Engine.fit_context``)."""

    text: str  # the context from the first token read on (all of it when it fits)
    tokens: int  # tokens of ``text``
    total: int  # tokens of the whole context


class Engine:
    """Encoder + datastore + memory index of one data directory."""

    def __init__(
        self,
        data_dir: Path,
        encoder: Encoder,
        *,
        knn: KnnParams | None = None,
        policy: Policy | None = None,
        window: WindowConfig | None = None,
        gate_theta: float = 0.0,
        heldout: HeldOutConfig | None = None,
        readonly: bool = False,
        shared: bool = False,
        grid: TuneGrid | None = SERVED_GRID,
        tune_min_tokens: int = MIN_TUNE_TOKENS,
    ):
        """``knn``: the constant served until a build chooses one (default: the measured
        ``SERVED_DEFAULT``); ``grid``: what every build tunes on the held-out tokens (None:
        serve ``knn`` always); ``tune_min_tokens``: held-out tokens with a neighbour needed
        to tune."""
        self.data_dir = Path(data_dir)
        self.readonly = readonly  # another process (the worker) writes; sync() follows it
        self.shared = shared  # one of several writer processes; they take turns to append
        self.encoder = encoder
        default = knn or SERVED_DEFAULT
        self.grid = (
            grid
            if grid is not None
            else TuneGrid((default.k,), (default.temperature,), (default.lmbda,))
        )
        self.tune_min_tokens = tune_min_tokens
        self.policy = policy or make_policy("monim")
        self.window = window or WindowConfig()
        self.words = WordConfig()
        self.datastore = Datastore.open(
            self.data_dir / "datastore",
            dim=None if readonly else encoder.dim,
            readonly=readonly,
            shared=shared,
        )
        self.index = MemoryIndex(self.datastore, self.data_dir / "index")
        self._write_lock = threading.Lock()  # one appender per process
        self._build_lock = threading.RLock()  # building(): this process's holder
        self._build_file = FileLock(self.data_dir / BUILD_LOCK)  # ... and across processes
        self._building = 0
        # The served interpolation (constant k, T, lambda or the calibrator) of the served
        # index version; every call reads ``self.calibration.served`` once.
        self.calibration = ServedCalibration(
            self.data_dir, encoder.vocab_size, theta=gate_theta, shared=shared, default=default
        )
        self.calibration.load_for(self.data_dir / "index", self.index.version)
        # held-out tokens recorded while ingesting, for the calibrator of the next build
        self.heldout = HeldOutRecorder(self.data_dir / PENDING_DIR, heldout or HeldOutConfig())

    @classmethod
    def open(
        cls,
        data_dir: Path,
        *,
        model: str = BUNDLED_MODEL,
        knn: KnnParams | None = None,
        policy: str | Policy = "monim",
        delta: float | None = None,
        rate: float = 0.5,
        threads: int | None = None,
        encoder: Encoder | None = None,
        window: WindowConfig | None = None,
        gate_theta: float = 0.0,
        heldout: HeldOutConfig | None = None,
        readonly: bool = False,
        shared: bool = False,
        grid: TuneGrid | None = SERVED_GRID,
        tune_min_tokens: int = MIN_TUNE_TOKENS,
    ) -> Engine:
        """Load the model (or use ``encoder``) and open the memory under ``data_dir``."""
        enc = encoder or Encoder.load(model, threads=threads)
        pol = make_policy(policy, delta=delta, rate=rate) if isinstance(policy, str) else policy
        return cls(
            Path(data_dir),
            enc,
            knn=knn,
            policy=pol,
            window=window,
            gate_theta=gate_theta,
            heldout=heldout,
            readonly=readonly,
            shared=shared,
            grid=grid,
            tune_min_tokens=tune_min_tokens,
        )

    @property
    def knn(self) -> KnnParams:
        """The constant served now (k and T of p_kNN; lambda unless the calibrator is)."""
        return self.calibration.served.params

    @property
    def served(self) -> ServedInterpolation:
        """The interpolation served now; a call reads it once and uses it throughout."""
        return self.calibration.served

    def _policy(self, policy: Policy | str | None) -> Policy:
        if policy is None:
            return self.policy
        return make_policy(policy) if isinstance(policy, str) else policy

    # --- memory lookups --------------------------------------------------------------------

    def _scores(
        self, out: TokenOutputs, served: ServedInterpolation
    ) -> tuple[TokenScores, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The augmented model's scores under the served interpolation, the lambda of each
        token (0 where the gate skips the search) and the search behind them (k columns).

        The same model answers /score and decides what MoNIM stores (DESIGN.md).
        """
        k = served.params.k
        # the calibrator's density features describe the top 10 neighbours
        width = max(k, TOP_N) if served.lambda_source == "calibrator" else k
        dist, ids, vals = self.index.search_values(out.keys, width)
        lam = served.lambdas(out.top_logprob, out.entropy, out.prev_tokens, dist, vals)
        dist, ids, vals = dist[:, :k], ids[:, :k], vals[:, :k]
        scores = token_scores(self.encoder, out, dist, vals, served.params, lmbda=lam)
        return scores, lam, (dist, ids, vals)

    def _encode(self, text: str, key_ce: bool = False) -> tuple[list[int], TokenOutputs]:
        ids = self.encoder.tokenize(text)
        if len(ids) < 2:
            raise EngineInputError("the text must hold at least two tokens")
        return ids, self.encoder.encode_ids(ids, self.window, key_ce=key_ce)

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
        self, doc_id: int, text: str, day: int, *, policy: Policy | str | None = None
    ) -> PreparedDocument:
        """Everything before the append, without the write lock: encode, score every token
        against the memory served now (other writers' entries included), apply the policy.

        A sampled document's held-out tokens are recorded for the calibrator here (they
        were scored against the memory before its own entries join it).
        """
        self._check_writer()
        if self.shared:  # what other writers appended, and an index another one built
            self.sync()
            self.reload_index()
        pol = self._policy(policy)
        served = self.served  # MoNIM asks the model served now (read once)
        token_ids, out = self._encode(text, pol.needs_key_ce)
        search: tuple[np.ndarray, np.ndarray] | None = None
        if pol.needs_augmented:
            scores, _, (dist, _, vals) = self._scores(out, served)
            search = (dist, vals)
        else:
            nan = np.full(len(out), np.nan)
            scores = TokenScores(nan, nan, out.key_ce)
        self._record_heldout(doc_id, day, out, search)
        scores = replace(scores, doc_id=doc_id)  # RandMem's mask is the document's own
        spans = self.char_spans(text)
        ok = len(spans) == len(token_ids)
        if not ok:  # offsets of another tokenisation would mark the wrong characters
            log.warning("document %d: %d spans for %d tokens", doc_id, len(spans), len(token_ids))
        return PreparedDocument(
            doc_id, day, token_ids, out, pol.decide(scores), spans if ok else None
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
            first = len(self.datastore)
            if n:
                self.datastore.append(
                    out.keys[mask].astype(np.float16),
                    out.targets[mask].astype(np.int32),
                    np.full(n, doc_id, np.int64),
                    out.positions[mask],
                    np.full(n, prep.day, np.int32),
                )
                self.index.refresh()
            end = len(self.datastore)
            self.calibration.observe(prep.token_ids, doc_id)  # once, even when processed again
        if crash_at == "after_append":
            raise SimulatedCrash("engine: crash after the append, before the caller commits")
        return IngestResult(len(out), n, first, end)

    @contextlib.contextmanager
    def building(self, timeout: float | None = None) -> Iterator[None]:
        """The data directory's build lock for the block (reentrant in this process).

        One index build at a time across processes; a worker holds it from claiming a
        build request to recording it, so a build marked running always has a live builder.
        ``timeout``: raise ``LockBusy`` after waiting that long (0: do not wait).
        """
        if not self._build_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise LockBusy("another thread of this process is building")
        try:
            if self._building == 0:
                self._build_file.acquire(timeout)
            self._building += 1
        except BaseException:
            self._build_lock.release()
            raise
        try:
            yield
        finally:
            self._building -= 1
            if self._building == 0:
                self._build_file.release()
            self._build_lock.release()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The datastore's write lock for the block, with the memory up to date inside.

        A shared writer (``Engine.open(shared=True)``: several ingest processes on one
        data directory) sees every entry the others committed before it appends.
        """
        self._check_writer()
        with self.datastore.exclusive():
            if self.shared:
                self.index.refresh()
            yield

    def _record_heldout(
        self,
        doc_id: int,
        day: int,
        out: TokenOutputs,
        search: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        """Record the document's held-out tokens for the calibrator if it is sampled.

        ``search``: the policy's (distances, values) against the memory served now, reused
        when it holds enough neighbours; FullMem and RandMem do not search, so a sampled
        document costs them one search here.
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
            dist, _, vals = self.index.search_values(out.keys[rows], width)
        n = len(rows)
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
            },
        )

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

    @property
    def generation_positions(self) -> int:
        """Context plus generated tokens that a continuation may hold (the model's positions)."""
        return self.encoder.max_positions

    def start_generation(self, context: str, cfg: GenerateConfig) -> Generation:
        """Read ``context`` and return the continuation to step (``memlm.generate``)."""
        ids = self.encoder.tokenize(context)
        if not ids:
            raise EngineInputError("the context is empty after tokenisation")
        if len(ids) + cfg.max_tokens > self.generation_positions:
            raise EngineInputError(
                f"the context has {len(ids)} tokens; with max_tokens {cfg.max_tokens} that "
                f"exceeds the model's {self.generation_positions} positions"
            )
        return Generation.start(self, ids, cfg)

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

        ``words`` > 0 adds that many whole-word suggestions (memlm.words), continuing the
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
                    sugg, float(nxt.lam[r]), found, len(ids), word_lists[r], self.index.version
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
    ) -> _NextToken:
        """Next-token distributions of R rows from their keys (R, d) and head inputs (R, h).

        The retrieval gate may skip a row's search (it then keeps the LM answer); ``lookup``
        searches every row anyway, for the neighbours the caller asked for.
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
            dist[looked_up], eids[looked_up], vals[looked_up] = self.index.search_values(
                keys[looked_up].float().numpy(), k
            )
        kk, temperature = served.params.k, served.params.temperature
        cal = served.calibrated(top, ent, prev, dist[:, :kk], vals[:, :kk])
        valid = search & has_neighbours(eids[:, :kk])
        lam = np.where(valid, cal if cal is not None else served.params.lmbda, 0.0)
        knn = np.zeros_like(lm)
        for r in np.flatnonzero(valid):
            d, v = dist[r, :kk], vals[r, :kk]
            ok = v >= 0
            w = np.exp(-(d[ok] - d[ok].min()) / temperature)
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
        docs, pos, days = self.datastore.provenance(sel)
        toks = self.encoder.token_strings(vals[: len(sel)].tolist())
        return [
            Neighbour(int(e), int(dd), int(p), tok, int(v), float(di), int(dy))
            for e, dd, p, tok, v, di, dy in zip(
                sel, docs, pos, toks, vals[: len(sel)], dist[: len(sel)], days, strict=True
            )
        ]

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
            lm_ppl=math.exp(-float(lm.mean())),
            ppl=math.exp(-float(np.mean(aug))),
            would_store=store.astype(bool).tolist(),
            trime_logprobs=None if trime is None else trime.tolist(),
            trime_ppl=None if trime is None else math.exp(-float(trime.mean())),
        )

    def char_spans(self, text: str) -> np.ndarray:
        """(n, 2) int64: the character span of every token of ``text`` (its positions)."""
        return np.asarray(self.encoder.char_offsets(text), dtype=np.int64).reshape(-1, 2)

    # --- maintenance ---------------------------------------------------------------------------

    def rebuild(
        self, *, crash_at: str | None = None, params: IndexParams | None = None
    ) -> RebuildInfo:
        """Build a new index version, choose its interpolation on the held-out tokens (the
        constant tuned on them, or the calibrator trained on them if it beats that constant
        on the same validation tokens), serve both.

        One build at a time per data directory, across processes (``build.lock``).
        """
        self._check_writer()
        with self.building():
            self.sync()
            compaction = self.compact()
            info = build_index(
                self.datastore, self.data_dir / "index", params, crash_at=crash_at, progress=False
            )
            # ingest goes on during a build (workers.builder): the statistics are saved
            # between two documents, never half-way through one's update
            with self.exclusive(), self._write_lock:
                self.calibration.snapshot(self.data_dir / "index", info.version)
            report, interpolation = self._calibrate_for(info.version)
            # After the calibrator of the new version is saved (or carried forward): older
            # versions that hold a forgotten document's keys go now, whatever their age.
            if self.datastore.num_deleted_documents:  # (a failed training carried none)
                self.calibration._carry_forward(self.data_dir / "index", info.version)
            prune(
                self.data_dir / "index",
                keep=3,
                deleted_documents=self.datastore.num_deleted_documents,
            )
        self.reload_index()
        return RebuildInfo(
            **{f.name: getattr(info, f.name) for f in fields(info)},
            calibrator=report,
            compaction=dataclasses.asdict(compaction),
            interpolation=interpolation,
        )

    def compact(self, *, crash_at: str | None = None) -> Compaction:
        """Remove forgotten documents' rows from the datastore files (``Datastore.compact``).

        Runs under the build lock (the nightly build calls it first) and the datastore's
        write lock; the served memory then re-reads the rewritten segments. Ids do not
        change, so the index versions, the fresh index and the database stay valid.
        """
        self._check_writer()
        with self.building(), self.exclusive(), self._write_lock:
            done = self.datastore.compact(crash_at=crash_at)
            self.index.refresh()
        if done.rows_removed:
            log.info(
                "compaction: %d rows of forgotten documents removed from %d segments, "
                "%d bytes reclaimed",
                done.rows_removed,
                done.segments,
                done.bytes_reclaimed,
            )
        return done

    def _calibrate_for(self, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Merge the pending held-out tokens, tune the constant on them, train the
        calibrator of ``version`` with its k and T, record which of the two it serves.

        Returns (calibrator report, interpolation record).  A failure leaves the version
        without ``interpolation.json``: it serves the newest older choice.
        """
        cfg = self.heldout.cfg
        index_root = self.data_dir / "index"
        report: dict[str, Any] = {"trained": False, "reason": "calibrator training is off"}
        try:
            if cfg.enabled:
                pending = self.heldout.pending()
                merged = self.calibration.add_heldout(
                    self.heldout.load(pending.paths), version, max_tokens=cfg.max_tokens
                )
                # Deleted only once the merge is durable; a crash in between merges them
                # again, and add_heldout drops the rows of documents it already holds.
                self.heldout.remove(pending.paths)
            choice = self.calibration.choose_constant(self.grid, min_tokens=self.tune_min_tokens)
            if cfg.enabled:
                report = self.calibration.retrain(
                    choice.params, index_root, version, min_tokens=cfg.min_tokens
                )
                report = {"merged_tokens": merged, **report}
            record = self.calibration.choose(choice, self.grid, index_root, version)
        except Exception:  # the index is built and good: serve it with the older choice
            log.exception("choosing the interpolation of index version %d failed", version)
            reason = "training failed (details in the worker log)"
            return {"trained": False, "reason": reason}, {"error": reason}
        log.info("calibrator for index version %d: %s", version, report)
        log.info("interpolation for index version %d: %s", version, record)
        return report, record

    def train_calibrator(self, texts: list[str], day: int) -> dict[str, Any]:
        """Add held-out documents of ``day`` to the calibrator's set, retrain, serve it.

        The calibrator and the gate are saved beside the served index version; processes
        serving that version pick them up on their next ``reload_index``.
        """
        self._check_writer()
        version = self.index.version
        if version is None:
            raise EngineInputError("build an index before training the calibrator")
        outs = [self._encode(t)[1] for t in texts]
        o = TokenOutputs.concat(outs)
        dist, _, vals = self.index.search_values(o.keys, max(self.knn.k, TOP_N))
        split: dict[str, np.ndarray] = {
            "target_lm_logprob": o.target_logprob.astype(np.float64),
            "distances": dist,
            "values": vals,
            "day": np.full(len(o), day, np.int32),
            # negative: not stream documents (those have ids >= 0 and are merged once)
            "doc": np.concatenate([np.full(len(x), -1 - i, np.int64) for i, x in enumerate(outs)]),
            "gold": o.targets,
            "top_logprob": o.top_logprob,
            "entropy": o.entropy,
            "lexical": self.calibration.lexical.features(o.prev_tokens),
        }
        index_root = self.data_dir / "index"
        with self.building():  # the training set and the version's files have the build lock
            # k and T of the constant chosen now; the calibrator's lambda competes with it
            choice = self.calibration.choose_constant(self.grid, min_tokens=self.tune_min_tokens)
            report = self.calibration.train(split, choice.params, index_root, version)
            choice = self.calibration.choose_constant(self.grid, min_tokens=self.tune_min_tokens)
            record = self.calibration.choose(choice, self.grid, index_root, version)
        self.calibration.load_for(index_root, version)
        return {**report, "interpolation": record}

    def sync(self) -> int:
        """Make entries other processes appended searchable (read-only and shared engines)."""
        return self.index.refresh() if self.readonly or self.shared else 0

    def _check_writer(self) -> None:
        if self.readonly:
            raise RuntimeError("this engine opened the memory read-only; the worker writes")

    def reload_index(self) -> bool:
        """Serve the newest built version (and its calibrator) if another process built one."""
        changed = self.index.reload()
        self.calibration.load_for(self.data_dir / "index", self.index.version)
        return changed

    def reconcile_index(self, recorded: Collection[int], *, delete: bool = False) -> list[int]:
        """Serve only index versions the database recorded: the newest of them on disk.

        A version directory no record names (a build killed before its record) is an
        orphan; ``delete`` (a writer, which takes the build lock) also removes orphans and
        points CURRENT back. Returns the orphan versions found, ascending.
        """
        root = self.data_dir / "index"
        if delete:
            self._check_writer()
            with self.building(timeout=0):
                orphans = remove_orphan_versions(root, recorded)
        else:
            orphans = [v for v in list_versions(root) if v not in set(recorded)]
        want = newest_recorded(root, recorded)
        if self.index.version != want:
            self.index.serve(want)
            self.calibration.load_for(root, self.index.version)
        return orphans

    def forget_document(
        self, doc_id: int, text: str | None = None, *, entries: range | None = None
    ) -> int:
        """Hide every entry of a document from search and from later builds.

        Its held-out tokens leave the calibrator's pending records and training set too.
        With its ``text`` its tokens also leave the lexical statistics (once: a retry
        after a crash takes nothing out twice); the snapshot beside the index version
        served now keeps them until the next build, which compacts the datastore (the
        keys leave the disk) and deletes every older index version (see ``rebuild``).
        ``entries``: the id range the database recorded for it, so that only that range
        of the datastore is read (``Datastore.delete_document``).
        """
        self._check_writer()
        ids = None if text is None else self.encoder.tokenize(text)
        with self.exclusive(), self._write_lock:
            hidden = self.datastore.delete_document(doc_id, entries=entries)
            if ids is not None:
                self.calibration.forget(ids, doc_id)
        self.heldout.drop_document(doc_id)
        with self.building():  # the training set has the builder's lock
            self.calibration.drop_document(doc_id)
        return hidden

    def hide_documents(self, doc_ids: list[int]) -> int:
        """Stop serving these documents' entries now, before the writer deletes them (a
        forget requested, not yet applied); see ``MemoryIndex.hide_documents``."""
        return self.index.hide_documents(doc_ids)

    def truncate_datastore(self, n: int) -> None:
        """Roll back entries with ids >= n (their documents were never committed)."""
        self._check_writer()
        with self.exclusive(), self._write_lock:
            self.datastore.truncate(n)
            self.index.refresh()

    def _index_ram_bytes(self, idx: dict[str, Any]) -> int:
        """Vectors the served index holds in RAM: float32 for exact parts, codes for PQ."""
        info = self.index._state.info
        fresh = int(idx["fresh_entries"]) * (4 * self.encoder.dim + 8)
        built = int(idx["built_entries"])
        if info is None or info.params.kind == "flat":
            return fresh + built * (4 * self.encoder.dim + 8)
        return fresh + built * (info.params.m + 8)

    def stats(self) -> dict[str, Any]:
        ds = self.datastore.stats()
        idx = self.index.stats()
        index_bytes = (
            sum(f.stat().st_size for f in (self.data_dir / "index").rglob("*") if f.is_file())
            if (self.data_dir / "index").exists()
            else 0
        )
        return {
            "entries": ds["live_entries"],
            "datastore_entries": ds["entries"],
            "datastore_rows": ds["rows"],
            "deleted_documents": ds["deleted_documents"],
            "bytes_reclaimed": ds["bytes_reclaimed"],
            "bytes_on_disk": ds["bytes_on_disk"] + index_bytes,
            "bytes_in_ram": self._index_ram_bytes(idx),
            "index_version": self.index.version,
            "index": idx,
            "model": self.encoder.name,
            "policy": self.policy.name,
            "knn": {"k": self.knn.k, "temperature": self.knn.temperature, "lambda": self.knn.lmbda},
            "interpolation": self.served.to_json(),
            "calibrator": self._calibrator_stats(),
        }

    def _calibrator_stats(self) -> dict[str, Any]:
        """The calibrator beside the served version (the index version it lives beside), its
        training, and whether it sets lambda (``active``: it beat the constant)."""
        served = self.served
        cal = served.calibrator
        meta = cal.meta if cal is not None else {}
        return {
            "active": served.lambda_source == "calibrator",
            "index_version": served.calibrator_version,
            "trained_for": meta.get("index_version"),
            "train_tokens": meta.get("train_tokens"),
            "val_tokens": meta.get("val_tokens"),
            "gate": served.gate is not None,
            "gate_theta": served.theta,
            "training": self.heldout.cfg.enabled,
            "pending_tokens": self.heldout.pending().tokens,
        }
