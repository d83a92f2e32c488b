"""Where the encoded corpora are cached, and the atomic writes of their files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def default_cache_dir() -> Path:
    """``$MEMLM_CACHE_DIR`` or ``~/.cache/memlm/train``."""
    env = os.environ.get("MEMLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "memlm" / "train"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)
