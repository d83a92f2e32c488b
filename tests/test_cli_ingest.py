"""`memlm ingest FILE|DIR` against a real server (uvicorn in a thread, the exact fake
engine): batches, duplicates, corpus-export ids, bad lines refused before sending."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from memlm.cli import app as cli
from memlm.corpus import Document, write_jsonl
from service.app import create_app
from tests.fakes import FakeEngine
from tests.service_helpers import make_settings, serve
from tests.test_api import by_name

runner = CliRunner(env={"COLUMNS": "500", "NO_COLOR": "1"})
TOKEN = "ingest-secret-for-tests"


def _lines(path: Path, docs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_ingest_a_file_and_a_folder(tmp_path: Path, sqlite_url: str) -> None:
    settings = make_settings(tmp_path, sqlite_url)
    engine = FakeEngine()
    app = create_app(settings, engine=engine, policy_factory=by_name, run_worker=False, poll=False)
    one = _lines(
        tmp_path / "a.jsonl",
        [
            {"text": f"story {i} of the day", "published_at": "2017-02-07", "source": "s",
             "external_id": f"e{i}"}
            for i in range(5)
        ],
    )  # fmt: skip
    folder = tmp_path / "more"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(  # the format of `memlm corpus export`: "id" becomes external_id
        [Document("n1", "a new story", dt.date(2017, 2, 8), "t")],
        folder / "sub" / "b.jsonl",
    )
    _lines(folder / "c.jsonl", [{"text": "story 0 of the day", "published_at": "2017-02-07",
                                 "source": "s", "external_id": "e0"}])  # fmt: skip
    with serve(app) as url:
        args = ["--url", url, "--token", TOKEN, "--batch-size", "2"]
        r = runner.invoke(cli, ["ingest", str(one), *args])
        assert r.exit_code == 0, r.output
        assert "5 documents sent to" in r.output and "5 new, 0 already there" in r.output
        assert "5/5" in r.output  # the progress bar's last state
        r = runner.invoke(cli, ["ingest", str(folder), *args])
        assert r.exit_code == 0, r.output
        assert "2 documents sent" in r.output and "1 new, 1 already there" in r.output
        with app.state.memlm.sessions() as s:
            from memlm.db.repositories import DocumentRepository

            doc = DocumentRepository(s).get(6)
            assert (doc.external_id, doc.source) == ("n1", "t")
        r = runner.invoke(cli, ["ingest", str(one), "--url", url, "--token", "wrong"])
        assert r.exit_code == 1 and "401 unauthorized" in r.output


def test_bad_lines_are_refused_before_anything_is_sent(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"text": "fine", "published_at": "2017-02-07", "source": "s"}\n'
        '{"text": "", "published_at": "2017-02-07", "source": "s"}\n'
    )
    # no server at this URL: the command must stop before it tries one
    r = runner.invoke(cli, ["ingest", str(bad), "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 2
    assert "bad.jsonl:2: text:" in " ".join(r.output.split())
    r = runner.invoke(cli, ["ingest", str(tmp_path / "none.jsonl")])
    assert r.exit_code == 2 and "no such file or folder" in " ".join(r.output.split())
