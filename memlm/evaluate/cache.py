"""Per-document LM outputs cached on disk, so comparing policies never re-encodes."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import numpy as np

from memlm.encoder import Encoder, TokenOutputs, WindowConfig, cache_dir


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
        self.encoded_tokens = 0  # tokens encoded by this process (not found in the cache)
        self.encode_seconds = 0.0

    def _path(self, ids: Sequence[int]) -> Path:
        h = hashlib.sha1(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()[:20]
        return self.root / f"{h}.npz"

    def get_many(self, texts: Sequence[str], progress: bool = False) -> list[TokenOutputs]:
        ids = [self.encoder.tokenize(t) for t in texts]
        out: dict[int, TokenOutputs] = {}
        missing = []
        for i, doc_ids in enumerate(ids):
            p = self._path(doc_ids)
            if p.exists():
                with np.load(p) as z:
                    arrays = {f.name: z[f.name] for f in fields(TokenOutputs) if f.name in z}
                if arrays["keys"].dtype != np.float32:  # not written by this version
                    missing.append(i)
                    continue
                pos = arrays["positions"]
                arrays["prev_tokens"] = np.asarray(doc_ids, np.int64)[pos - 1]
                out[i] = TokenOutputs(**arrays)
            else:
                missing.append(i)
        if missing:
            t0 = time.perf_counter()
            enc = self.encoder.encode_many(
                [ids[i] for i in missing], self.window, progress=progress
            )
            self.encode_seconds += time.perf_counter() - t0
            for i, o in zip(missing, enc, strict=True):
                self.encoded_tokens += len(o)
                p = self._path(ids[i])
                tmp = p.with_suffix(".tmp.npz")
                arrays = {f.name: getattr(o, f.name) for f in fields(TokenOutputs)}
                del arrays["prev_tokens"]  # derived from the token ids on load
                arrays["keys"] = o.keys.astype(np.float32)  # queries in float32, as served
                np.savez(tmp, **arrays)
                tmp.replace(p)
                o.keys = arrays["keys"]  # same values as a reload
                out[i] = o
        return [out[i] for i in range(len(texts))]
