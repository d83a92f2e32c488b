import datetime as dt
import json

import pytest

from memlm.corpus import (
    CorpusError,
    Document,
    by_day,
    load_news,
    normalise_text,
    read_jsonl,
    write_jsonl,
)


def test_normalise_drops_lost_bytes_and_fixes_mojibake():
    assert normalise_text("Sinn F\ufffd\ufffdin won") == "Sinn Fin won"
    assert normalise_text("caf\u00c3\u00a9  au\u00a0lait") == "café au lait"
    assert normalise_text("a\n\n\n\nb") == "a\n\nb"


def test_jsonl_round_trip(tmp_path):
    docs = [
        Document("b", "second text", dt.date(2020, 1, 2), "x", "T2"),
        Document("a", "first text", dt.date(2020, 1, 1), "y", "T1", {"url": "u"}),
    ]
    path = tmp_path / "s.jsonl"
    assert write_jsonl(docs, path) == 2
    back = read_jsonl(path)
    assert [d.id for d in back] == ["a", "b"]  # sorted by date
    assert back[0] == docs[1]


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"id": 1, "text": "t", "published_at": "2020-01-01"}) + "\n{not json\n"
    )
    with pytest.raises(CorpusError, match="bad.jsonl:2"):
        read_jsonl(path)
    path.write_text(json.dumps({"id": 1, "text": "t", "published_at": "yesterday"}) + "\n")
    with pytest.raises(CorpusError, match=":1"):
        read_jsonl(path)


def test_by_day_groups_in_order():
    d1, d2 = dt.date(2020, 1, 1), dt.date(2020, 1, 2)
    docs = [Document(str(i), "t", d, "s") for i, d in enumerate([d1, d1, d2])]
    assert [(d, len(b)) for d, b in by_day(docs)] == [(d1, 2), (d2, 1)]


def test_bundled_news():
    docs = load_news()
    assert len(docs) == 3744  # 3,824 rows less 80 with under 200 characters of text
    assert len({d.published_at for d in docs}) == 57
    assert all("\ufffd" not in d.text for d in docs)
    assert docs == sorted(docs, key=lambda d: (d.published_at, d.id))
    assert docs[-1].published_at == dt.date(2017, 3, 30)
