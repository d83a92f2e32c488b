"""Per-document LM outputs cached on disk, so comparing policies never re-encodes."""

from __future__ import annotations

import hashlib
import os
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from memlm.encoder import Encoder, TokenOutputs, WindowConfig, cache_dir

# Documents encoded between two writes: small enough that an interrupted encode loses
# under a minute of work on a CPU, large enough to batch windows of similar length.
CHUNK_DOCS = 16


def _scored(doc_ids: Sequence[int]) -> int:
    """How many targets a document of these token ids scores: each token after the first."""
    return max(len(doc_ids) - 1, 0)


def _header(zf: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """(shape, fortran order, dtype) of one array of an ``.npz``, without reading it."""
    with zf.open(f"{name}.npy") as f:
        major, _ = np.lib.format.read_magic(f)
        if major == 1:
            return np.lib.format.read_array_header_1_0(f)
        return np.lib.format.read_array_header_2_0(f)


class TokenCache:
    """Per-document encoder outputs on disk, keyed by model, window and token ids.

    Keys are kept in float32, as the encoder returns them: held-out tokens query the
    memory with the same float32 keys the service queries with (the datastore stores
    float16 keys either way).  Caches written before that held float16 keys; the
    ``-k32`` directory suffix keeps the two from ever mixing.
    """

    def __init__(self, encoder: Encoder, window: WindowConfig, root: Path | None = None):
        self.encoder, self.window = encoder, window
        slug = encoder.name.replace("/", "_")
        if encoder.precision != "float32":  # another key space: never share float32's cache
            slug += f"-{encoder.precision}"
        if encoder.head_weight_half is not None:
            # the half head's log-sum-exp holds the float32 gold logit (earlier caches summed
            # its half-precision rounding); int8 keeps the float32 head and its caches
            slug += "-g"
        self.root = (
            root or cache_dir() / "encoded"
        ) / f"{slug}-c{window.context}-s{window.stride}-k32"
        self.root.mkdir(parents=True, exist_ok=True)
        # Read-only roots searched after ``root``: e.g. a key-CE cache (the same outputs
        # plus key_ce) serves a run that does not need key_ce.
        self.also: list[Path] = []
        self.chunk_docs = CHUNK_DOCS
        self.encoded_tokens = 0  # tokens encoded by this process (not found in the cache)
        self.encode_seconds = 0.0
        # Follow another process's encode (``--encode-shard`` beside the run) instead of
        # encoding: wait up to ``follow`` seconds for each missing document to appear.
        self.follow: float | None = None
        self.poll_seconds = 0.5
        self.wait_seconds = 0.0  # time spent waiting for those documents

    def _path(self, ids: Sequence[int]) -> Path:
        h = hashlib.sha1(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()[:20]
        return self.root / f"{h}.npz"

    def _find(self, ids: Sequence[int]) -> Path | None:
        """The cached file of these token ids, in ``root`` or else in ``also``."""
        p = self._path(ids)
        for root in (self.root, *self.also):
            if (root / p.name).exists():
                return root / p.name
        return None

    def get_many(self, texts: Sequence[str], progress: bool = False) -> list[TokenOutputs]:
        ids = [self.encoder.tokenize(t) for t in texts]
        out: dict[int, TokenOutputs] = {}
        missing = []
        for i, doc_ids in enumerate(ids):
            o = self._load(doc_ids)
            if o is None:
                missing.append(i)
            else:
                out[i] = o
        if self.follow is not None:
            for i in missing:
                out[i] = self._await(ids[i], self.follow)
        else:
            for i, o in self._encode(ids, missing, progress):
                out[i] = o
        return [out[i] for i in range(len(texts))]

    def _load(self, doc_ids: Sequence[int]) -> TokenOutputs | None:
        """The cached outputs of these token ids, or None if none written by this version."""
        p = self._find(doc_ids)
        if p is None:
            return None
        with np.load(p) as z:
            arrays = {f.name: z[f.name] for f in fields(TokenOutputs) if f.name in z}
        if arrays["keys"].dtype != np.float32:  # not written by this version
            return None
        pos = arrays["positions"]
        arrays["prev_tokens"] = np.asarray(doc_ids, np.int64)[pos - 1]
        return TokenOutputs(**arrays)

    def _await(self, doc_ids: Sequence[int], timeout: float) -> TokenOutputs:
        """Wait for another process to write this document (files appear atomically)."""
        t0 = time.perf_counter()
        try:
            while (o := self._load(doc_ids)) is None:
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(
                        f"--follow-encode: a document of {len(doc_ids)} tokens did not appear "
                        f"in {self.root} within {timeout:.0f} s; is an --encode-shard process "
                        "with the same settings running?"
                    )
                time.sleep(self.poll_seconds)
            return o
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def lengths(self, texts: Sequence[str], progress: bool = False) -> list[int]:
        """Each text's scored-token count, encoding what the cache lacks on the way.

        Holds at most one chunk of outputs: a whole stream's keys do not fit in memory
        (2.65M tokens x 576 x 4 bytes), and freed small arrays are not given back to the
        system, so loading them all once left each run at 12 GB resident.
        """
        ids = [self.encoder.tokenize(t) for t in texts]
        out: dict[int, int] = {}
        missing = []
        for i, doc_ids in enumerate(ids):
            p = self._find(doc_ids)
            if p is not None:
                with zipfile.ZipFile(p) as zf:  # array headers only, no data
                    if _header(zf, "keys")[2] == np.float32:
                        out[i] = int(_header(zf, "targets")[0][0])
                        continue
            missing.append(i)
        if self.follow is not None:  # another process encodes: each scores n - 1 targets
            out.update((i, _scored(ids[i])) for i in missing)
            return [out[i] for i in range(len(texts))]
        for i, o in self._encode(ids, missing, progress):
            out[i] = len(o)
        return [out[i] for i in range(len(texts))]

    def _encode(
        self, ids: Sequence[Sequence[int]], missing: Sequence[int], progress: bool
    ) -> Iterator[tuple[int, TokenOutputs]]:
        """Encode ``ids[i]`` for each ``i`` in ``missing``, yielding each after it is stored.

        Chunks of documents, each written before the next is encoded: an interrupted encode
        keeps what it finished, and a later call (or another process sharing the cache)
        finds it. Each chunk first looks again for documents that another process wrote
        since ``missing`` was computed, so encode processes started at different times do
        not repeat each other's work.
        """
        bar = None
        if progress and missing:
            from tqdm import tqdm

            total = sum(_scored(ids[i]) for i in missing)
            bar = tqdm(total=total, unit="tok", desc="encode", smoothing=0.05)
        try:
            for c in range(0, len(missing), self.chunk_docs):
                part = []
                for i in missing[c : c + self.chunk_docs]:
                    if (done := self._load(ids[i])) is None:
                        part.append(i)
                        continue
                    if bar is not None:  # written by another process meanwhile
                        bar.update(_scored(ids[i]))
                    yield i, done
                if not part:
                    continue
                t0 = time.perf_counter()
                enc = self.encoder.encode_many([ids[i] for i in part], self.window)
                self.encode_seconds += time.perf_counter() - t0
                for i, o in zip(part, enc, strict=True):
                    self.encoded_tokens += len(o)
                    yield i, self._write(ids[i], o)
                if bar is not None:
                    bar.update(sum(len(o) for o in enc))
        finally:
            if bar is not None:
                bar.close()

    def _write(self, doc_ids: Sequence[int], o: TokenOutputs) -> TokenOutputs:
        """Store one document's outputs atomically (a temporary file per process)."""
        p = self._path(doc_ids)
        tmp = p.with_suffix(f".{os.getpid()}.tmp.npz")
        arrays = {f.name: getattr(o, f.name) for f in fields(TokenOutputs)}
        del arrays["prev_tokens"]  # derived from the token ids on load
        arrays["keys"] = o.keys.astype(np.float32)  # queries in float32, as served
        np.savez(tmp, **arrays)
        tmp.replace(p)
        o.keys = arrays["keys"]  # same values as a reload
        return o
