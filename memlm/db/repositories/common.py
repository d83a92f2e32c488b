"""What the repositories share: the clock and the content hash of a text."""

from __future__ import annotations

import datetime as dt
import hashlib


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
