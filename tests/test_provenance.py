"""Neighbours' provenance reads only what it shows: a card and a window of text per snippet,
never a whole document (except one without stored spans), on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.models import Document
from memlm.db.repositories import DocumentRepository, NewDocument, SpanRepository
from memlm.db.repositories.provenance import WINDOWS_PER_QUERY
from service.provenance import SpanCache, provenance, snippet, snippet_of, snippet_window
from tests.fakes import Neighbour


def whole_text_snippet(text: str, start: int, end: int, width: int = 240) -> str:
    """The snippet as it was cut from the whole text before windows were read."""
    lo, hi = max(0, start - width // 2), min(len(text), end + width // 2)
    if lo > 0:
        space = text.find(" ", lo, start)
        lo = space + 1 if space != -1 else lo
    if hi < len(text):
        space = text.rfind(" ", end, hi)
        hi = space if space != -1 else hi
    head = ("…" if lo > 0 else "") + text[lo:start]
    tail = text[end:hi] + ("…" if hi < len(text) else "")
    return f"{head}[[{text[start:end]}]]{tail}".replace("\n", " ")


def test_a_snippet_from_its_window_is_the_snippet_from_the_whole_text() -> None:
    rng = random.Random(0)
    alphabet = "ab cdé\nfg  hï "
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 700)))
        start = rng.randrange(len(text))
        end = min(len(text), start + rng.randrange(0, 6))
        lo, hi = snippet_window(start, end)
        want = whole_text_snippet(text, start, end)
        assert snippet_of(text[lo:hi], lo, start, end) == want
        assert snippet(text, start, end) == want


def _spans(text: str) -> np.ndarray:
    return np.array([[m.start(), m.end()] for m in re.finditer(r"\S+", text)], dtype=np.int32)


LONG = " ".join(f"w{i}" for i in range(20_000))  # 128,889 characters, 20,000 tokens


@pytest.fixture(params=["sqlite", "postgres"])
def db(
    request: pytest.FixtureRequest, make_sessions: Callable[[str], sessionmaker[Session]]
) -> Iterator[tuple[sessionmaker[Session], list[str]]]:
    """Sessions over a migrated database, and the SQL statements they run (captured)."""
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    sessions = make_sessions(url)
    statements: list[str] = []

    def capture(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement.lower())

    engine = sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", capture)
    yield sessions, statements
    event.remove(engine, "before_cursor_execute", capture)


def _add(sessions: sessionmaker[Session], text: str, title: str, *, spans: bool = True) -> int:
    with sessions.begin() as s:
        [acc] = DocumentRepository(s).add_many(
            [NewDocument(text, dt.date(2017, 2, 7), "test", title=title)]
        )
        if spans:
            SpanRepository(s).put(acc.id, _spans(text))
        return acc.id


def _neighbours(doc_id: int, positions: list[int]) -> list[Neighbour]:
    return [Neighbour(7, doc_id, p, f"w{p}", 0, 0.5) for p in positions]


def _whole_text_reads(statements: list[str]) -> list[str]:
    """Statements that select the text column itself (not a substr window of it)."""
    return [s for s in statements if re.search(r"(?<!substr\()documents\.text\b", s)]


def test_provenance_reads_a_window_of_text_per_snippet_never_the_document(
    db: tuple[sessionmaker[Session], list[str]],
) -> None:
    sessions, statements = db
    doc_id = _add(sessions, LONG, "Long")
    spans = _spans(LONG)
    positions = [0, 1, 9_999, 19_999, 20_000]  # the last: no such token
    cache = SpanCache(char_spans=None)
    statements.clear()
    out = provenance(sessions, _neighbours(doc_id, positions), cache)
    assert [n.snippet for n in out] == [
        *(whole_text_snippet(LONG, int(spans[p][0]), int(spans[p][1])) for p in positions[:4]),
        None,
    ]
    assert [(n.title, n.source, n.published_at) for n in out] == [
        ("Long", "test", dt.date(2017, 2, 7))
    ] * 5
    assert _whole_text_reads(statements) == []
    assert sum("substr(documents.text" in s for s in statements) == 1  # one query, 4 windows
    # A snippet is a window of about 240 characters of the 128,889.
    assert max(len(n.snippet or "") for n in out) <= 240 + len("[[]]…") + 2


def test_no_text_is_read_for_a_document_being_forgotten(
    db: tuple[sessionmaker[Session], list[str]],
) -> None:
    sessions, statements = db
    doc_id = _add(sessions, LONG, "Long")
    with sessions.begin() as s:
        row = s.get(Document, doc_id)
        assert row is not None
        row.status = "forgetting"
    cache = SpanCache(char_spans=None)
    cache.put(doc_id, _spans(LONG))
    statements.clear()
    [n] = provenance(sessions, _neighbours(doc_id, [3]), cache)
    assert (n.title, n.snippet, n.document_id) == (None, None, doc_id)
    assert [s for s in statements if "documents.text" in s] == []
    assert cache.cached(doc_id) is None  # its spans leave the cache too


def test_only_a_document_without_stored_spans_is_read_whole_once(
    db: tuple[sessionmaker[Session], list[str]],
) -> None:
    sessions, statements = db
    old = _add(sessions, "the cat sat on the mat", "Old", spans=False)
    new = _add(sessions, LONG, "New")
    tokenised: list[str] = []

    def char_spans(text: str) -> np.ndarray:
        tokenised.append(text)
        return _spans(text)

    cache = SpanCache(char_spans)
    for _ in range(2):
        statements.clear()
        out = provenance(sessions, [*_neighbours(old, [1, 5]), *_neighbours(new, [2])], cache)
        assert [n.snippet for n in out] == [
            "the [[cat]] sat on the mat",
            "the cat sat on the [[mat]]",
            whole_text_snippet(LONG, 6, 8),  # "w2"
        ]
    assert tokenised == ["the cat sat on the mat"]  # once: its spans are cached since
    assert len(_whole_text_reads(statements)) == 0  # the second call read windows only


def test_many_windows_are_read_in_bounded_statements(
    db: tuple[sessionmaker[Session], list[str]],
) -> None:
    sessions, statements = db
    doc_id = _add(sessions, LONG, "Long")
    positions = list(range(0, 20_000, 40))  # 500 neighbours
    statements.clear()
    out = provenance(sessions, _neighbours(doc_id, positions), SpanCache(char_spans=None))
    spans = _spans(LONG)
    assert [n.snippet for n in out] == [
        whole_text_snippet(LONG, int(spans[p][0]), int(spans[p][1])) for p in positions
    ]
    windows = [s for s in statements if "substr(documents.text" in s]
    assert len(windows) == -(-500 // WINDOWS_PER_QUERY) == 3
    assert _whole_text_reads(statements) == []
