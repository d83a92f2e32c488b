"""--follow-encode: the policies run while --encode-shard fills the cache beside them."""

from __future__ import annotations

import json
import threading

import pytest
from test_evaluate_stream import _cfg, _numbers, _stream

from memlm.encoder import Encoder
from memlm.evaluate import evaluate
from memlm.evaluate.cache import TokenCache


@pytest.fixture(scope="module")
def enc():
    return Encoder.load("tiny-llama", threads=1)


def test_a_run_following_an_encode_gets_the_numbers_of_a_run_that_encoded(
    tmp_path, enc, monkeypatch
):
    docs = _stream()
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "own"))
    whole = evaluate(_cfg(), docs, tmp_path / "whole", encoder=enc, echo=str)

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "shared"))
    said: list[str] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def encode() -> None:  # another process in real life: its own encoder
        try:
            started.wait(30)
            other = Encoder.load("tiny-llama", threads=1)
            shard = _cfg(encode_shard=(0, 1))
            evaluate(shard, docs, tmp_path / "enc", encoder=other, echo=said.append)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=encode)
    t.start()
    try:
        # the encode starts only once the run is waiting for its first document
        orig = enc.tokenize

        def tokenize(text):  # a spy: the run tokenizes, then waits
            started.set()
            return orig(text)

        monkeypatch.setattr(enc, "tokenize", tokenize)
        followed = evaluate(_cfg(follow_encode=60.0), docs, tmp_path / "run", encoder=enc, echo=str)
    finally:
        t.join(60)
    assert not errors, errors
    assert any("encoded" in s for s in said)
    assert followed["settings"]["encoded_tokens_this_run"] == 0  # the shard encoded it all
    assert followed["timing"]["encode"]["wait_seconds"] > 0  # it did wait for the shard
    waited = sum(followed["timing"][p]["encode_wait_seconds"] for p in ("fullmem", "monim"))
    assert waited > 0
    assert list(followed["results"]) == list(whole["results"])  # bare first, as always
    assert _numbers(followed) == _numbers(whole)


def test_following_an_encode_that_is_not_running_fails_clearly(tmp_path, enc, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(TimeoutError, match="--follow-encode.*--encode-shard"):
        evaluate(_cfg(follow_encode=0.3), _stream(days=1), tmp_path / "run", encoder=enc, echo=str)


def test_the_encode_writes_every_test_set_first_then_the_stream_day_by_day(
    tmp_path, enc, monkeypatch
):
    # A run following the encode re-scores every month's test set at the first month's end
    # (forgetting), so the test sets must not wait for the encode's last day.
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    written: list[tuple[int, ...]] = []
    orig = TokenCache._write

    def spy(self, doc_ids, o):
        written.append(tuple(doc_ids))
        return orig(self, doc_ids, o)

    monkeypatch.setattr(TokenCache, "_write", spy)
    docs = _stream()
    evaluate(_cfg(encode_shard=(0, 1)), docs, tmp_path / "enc", encoder=enc, echo=str)
    plan = json.loads((tmp_path / "enc" / "split.json").read_text())
    by_id = {d.id: tuple(enc.tokenize(d.text)) for d in docs}
    test_ids = {by_id[i] for i in plan["test"]}
    assert test_ids and set(written[: len(test_ids)]) == test_ids
    memory = [by_id[i] for i in plan["memory"]]
    assert [w for w in written if w in set(memory)] == memory  # the stream in order
