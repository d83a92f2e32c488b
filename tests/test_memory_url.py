"""MEMLM_MEMORY_URL: the contract other tools set (no server needed)."""

from __future__ import annotations

import pytest

from memlm.memory import parse_memory_url
from memlm.settings import Settings


@pytest.mark.parametrize("url", [None, "", "faiss", " faiss "])
def test_faiss_is_the_default(url: str | None) -> None:
    assert parse_memory_url(url) is None


def test_milvus_url_parts() -> None:
    u = parse_memory_url("milvus://milvus.internal:19531/news_memory")
    assert u is not None
    assert (u.host, u.port, u.collection) == ("milvus.internal", 19531, "news_memory")
    assert (u.consistency, u.rerank, u.timeout, u.seal) == ("Session", False, 60.0, 20_000)
    assert str(u) == "milvus://milvus.internal:19531/news_memory"
    d = parse_memory_url("milvus://h/c?consistency=Strong&rerank=1&timeout=5&seal=0")
    assert d is not None and (d.port, d.consistency, d.rerank, d.timeout, d.seal) == (
        19530,
        "Strong",
        True,
        5.0,
        0,
    )


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgres://h/c", "must be 'faiss'"),
        ("milvus:///c", "no host"),
        ("milvus://h:notaport/c", "bad port"),
        ("milvus://h:19530/", "collection name"),
        ("milvus://h/1abc", "collection name"),
        ("milvus://h/a-b", "collection name"),
        ("milvus://h/c?colour=red", "unknown options"),
        ("milvus://h/c?consistency=strong", "consistency"),
        ("milvus://h/c?rerank=yes", "rerank"),
        ("milvus://h/c?timeout=-1", "timeout"),
        ("milvus://h/c?seal=-1", "seal"),
        ("milvus://h/c?seal=many", "seal"),
    ],
)
def test_bad_urls_are_refused_by_name(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_memory_url(url)


def test_settings_validate_the_memory_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMLM_MEMORY_URL", "milvus://localhost:19530/memlm")
    assert Settings().memory_url == "milvus://localhost:19530/memlm"
    monkeypatch.setenv("MEMLM_MEMORY_URL", "milvus://localhost/bad-name")
    with pytest.raises(ValueError, match="collection name"):
        Settings()
