"""The engine's state and what every operation shares: opening the memory of a data
directory, the served interpolation, the scores of a text, the build and write locks, and
serving the newest index version."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from memlm.calibrator import ServedCalibration, ServedInterpolation
from memlm.calibrator.constant import MIN_TUNE_TOKENS, SERVED_DEFAULT, SERVED_GRID, TuneGrid
from memlm.calibrator.heldout import PENDING_DIR, HeldOutConfig, HeldOutRecorder
from memlm.encoder import Encoder, TokenOutputs, WindowConfig
from memlm.engine.errors import EngineInputError
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import Policy, TokenScores, make_policy
from memlm.knnlm.words import WordConfig
from memlm.locks import FileLock, LockBusy, ProcessLock
from memlm.memory import Committed, MemoryBackend, Neighbours, Recovered, open_memory
from memlm.memory.consolidation import ConsolidationConfig
from memlm.memory.entry_lm import EntryLM
from memlm.memory.pointers import PointerConfig, PointerSearch
from memlm.memory.usage import Usage

ENGINE_CRASH_POINTS = ("after_append",)  # entries durable, caller not yet told
BUILD_LOCK = "build.lock"  # one index build (and training-set write) at a time


class EngineCore:
    """The encoder and the memory (``MemoryBackend``) of one data directory, with the
    served interpolation (``Engine`` adds the operations: memlm.engine.ingest, .predict,
    .score, .build, .forget, .stats)."""

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
        memory_url: str | None = None,
        evidence: bool = False,
        consolidation: ConsolidationConfig | None = None,
        rerank_depth: int | None = None,
        ingest_rerank_depth: int | None = None,
        pointers: PointerConfig | None = None,
        build_lock: ProcessLock | None = None,
    ):
        """``knn``: the constant served until a build chooses one (default: the measured
        ``SERVED_DEFAULT``); ``grid``: what every build tunes on the held-out tokens (None:
        serve ``knn`` always); ``tune_min_tokens``: held-out tokens with a neighbour needed
        to tune; ``evidence``: lambda per token from the retrieval evidence
        (memlm.calibrator.evidence; the service turns it on unless the settings fix
        lambda), not the constant ``knn``'s lambda; never with a grid that fixes lambda.
        ``memory_url``: ``MEMLM_MEMORY_URL`` (None or "faiss": the files under
        ``data_dir``; ``milvus://host:port/collection``: a Milvus collection).
        ``consolidation``: what each build re-tests and the memory budget it keeps
        (memlm.memory.consolidation; default: off).
        ``rerank_depth``: candidates every search of this engine re-ranks exactly (None:
        the memory's default, 1,024 at the served k <= 64; ``MEMLM_RERANK_DEPTH``).
        ``ingest_rerank_depth``: the same for the policy's decision while ingesting only
        (None: ``rerank_depth``; ``MEMLM_INGEST_RERANK_DEPTH``); held-out records keep
        the served depth, since they tune what /predict and /score serve.
        ``pointers``: /score and the policy's decision follow RetoMaton's pointers and
        search only where they fail (memlm.memory.pointers; ``MEMLM_POINTERS``; off by
        default)."""
        self.data_dir = Path(data_dir)
        if not readonly:  # the engine's own files live here on every backend (on
            # Milvus nothing else makes it before the first build)
            self.data_dir.mkdir(parents=True, exist_ok=True)
        for name, depth in (
            ("rerank_depth", rerank_depth),
            ("ingest_rerank_depth", ingest_rerank_depth),
        ):
            if depth is not None and depth < 1:
                raise ValueError(f"{name} must be >= 1, got {depth}")
        self.rerank_depth = rerank_depth
        self.ingest_rerank_depth = (
            rerank_depth if ingest_rerank_depth is None else ingest_rerank_depth
        )
        self.pointers = pointers
        # by (k, depth): each learns its own threshold
        self._follow: dict[tuple[int, int | None], PointerSearch] = {}
        # encode_ahead's one slot: ((text, key_ce), the encode running on its own thread)
        self._ahead: tuple[tuple[str, bool], Future[tuple[list[int], TokenOutputs]]] | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ahead_lock = threading.Lock()
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
        # the one place that knows which memory serves: nothing below asks
        self.memory: MemoryBackend = open_memory(
            memory_url,
            self.data_dir,
            encoder.dim,
            readonly=readonly,
            shared=shared,
            # refused when the store's keys were made in another precision (never mixed)
            key_precision=encoder.precision,
            threads=encoder.threads,  # the model's and the searches' (MEMLM_THREADS)
        )
        self._write_lock = threading.Lock()  # one appender per process
        self._build_lock = threading.RLock()  # building(): this process's holder
        # ... and across processes: those of this data directory, or (``build_lock``) every
        # process that shares the memory (a Milvus collection served to several data
        # directories: one build, one cleanup of its generations at a time)
        self._build_file = build_lock or FileLock(self.data_dir / BUILD_LOCK)
        self._building = 0
        # The served interpolation (constant k, T, lambda or the calibrator) of the served
        # index version; every call reads ``self.calibration.served`` once.
        evidence = evidence and len(self.grid.lambdas) > 1
        self.calibration = ServedCalibration(
            self.data_dir,
            encoder.vocab_size,
            theta=gate_theta,
            shared=shared,
            default=default,
            evidence=evidence,
        )
        self.calibration.load_for(self.memory.root, self.served_version)
        self.consolidation = consolidation or ConsolidationConfig()
        # retrievals and hits per block of entries, counted from MoNIM's searches
        self.usage = Usage.load(self.memory.root)
        # log p_LM of each stored entry's value: the spread budget's order within a day
        # and the exact re-test of consolidation (memlm.memory.entry_lm)
        self.entry_lm = EntryLM.load(self.memory.root)
        # held-out tokens recorded while ingesting, for the calibrator of the next build
        self.heldout = HeldOutRecorder(self.data_dir / PENDING_DIR, heldout or HeldOutConfig())

    @property
    def served_version(self) -> int | None:
        """The memory's built version served (None before the first build)."""
        return self.memory.served_version

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
        self, out: TokenOutputs, served: ServedInterpolation, depth: int | None
    ) -> tuple[TokenScores, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The augmented model's scores under the served interpolation, the lambda and the
        kNN temperature of each token (lambda 0 where the gate skips the search) and the
        search behind them (k columns, ``depth`` candidates re-ranked).

        The same model answers /score and decides what MoNIM stores (docs/calibrator.md).
        """
        return served.scores(
            self.encoder, out, lambda width: self._search_document(out, width, depth)
        )

    def _search_document(self, out: TokenOutputs, k: int, depth: int | None) -> Neighbours:
        """The k neighbours of a document's tokens: one search, or the pointers first."""
        if self.pointers is None:
            return self.memory.search(out.keys, k, depth=depth)
        ps = self._follow.get((k, depth))
        if ps is None:
            ps = self._follow.setdefault(
                (k, depth),
                PointerSearch(
                    lambda q, kk: self.memory.search(q, kk, depth=depth),
                    self.memory.successors,
                    k,
                    self.pointers,
                ),
            )
        dist, ids, vals, _ = ps.document(out.keys, out.targets)
        return Neighbours(dist, ids, vals)

    def _encode(self, text: str, key_ce: bool = False) -> tuple[list[int], TokenOutputs]:
        ids = self.encoder.tokenize(text)
        return ids, self._encode_ids(ids, key_ce)

    def _encode_ids(self, ids: list[int], key_ce: bool = False) -> TokenOutputs:
        if len(ids) < 2:
            raise EngineInputError("the text must hold at least two tokens")
        return self.encoder.encode_ids(ids, self.window, key_ce=key_ce)

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
        """The memory's writer block (``MemoryBackend.writer``), with the memory up to date
        inside: a shared writer (``Engine.open(shared=True)``: several ingest processes on
        one data directory) sees every entry the others committed before it writes."""
        self._check_writer()
        with self.memory.writer():
            yield

    def char_spans(self, text: str) -> np.ndarray:
        """(n, 2) int64: the character span of every token of ``text`` (its positions)."""
        return np.asarray(self.encoder.char_offsets(text), dtype=np.int64).reshape(-1, 2)

    def sync(self) -> int:
        """Make entries other processes wrote searchable (read-only and shared engines)."""
        return self.memory.refresh() if self.readonly or self.shared else 0

    def close(self) -> None:
        """Let go of the memory (its files, or its server connection) and of the thread
        that encodes ahead."""
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True, cancel_futures=True)
        self.memory.close()

    def _check_writer(self) -> None:
        if self.readonly:
            raise RuntimeError("this engine opened the memory read-only; the worker writes")

    def reload_index(self) -> bool:
        """Serve the newest built version (and its interpolation) if another process
        built one; returns whether the served version changed."""
        changed = self.memory.reload()
        self.calibration.load_for(self.memory.root, self.memory.served_version)
        return changed

    def memory_unavailable(self) -> str | None:
        """Why the memory cannot answer a search now, or None (``MemoryBackend.unavailable``)."""
        return self.memory.unavailable()

    # --- what the database committed -------------------------------------------------------

    def rollback(self, committed: Committed, document: int | None = None) -> int:
        """Take out the entries of tries the database did not commit
        (``MemoryBackend.rollback``); returns how many left."""
        self._check_writer()
        with self.exclusive(), self._write_lock:
            return self.memory.rollback(committed, document)

    def recover(self, committed: Committed) -> Recovered:
        """At a writer's start: the memory holds exactly the committed documents' entries
        afterwards (``MemoryBackend.recover``; raises ``MemoryBehind``)."""
        self._check_writer()
        with self.exclusive(), self._write_lock:
            return self.memory.recover(committed)
