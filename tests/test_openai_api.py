"""The OpenAI-compatible API (issue 34): the official ``openai`` client against a live
``memlm up`` (completion, stream, echo + logprobs equal to /score, chat, typed errors), and
in-process: admission exactly as /generate, OpenAI's error body from every layer,
neighbours only for readers, a stream that fails half-way."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from memlm.client import Client
from memlm.encoder import Encoder
from memlm.encoder.loading import bundled_tokenizer_path
from memlm.engine import open_engine
from service.app import create_app
from service.executor import REQUEST, ModelExecutor
from tests.openai_fixtures import INGEST_TOKEN, MODEL, READ_TOKEN, TEXT, LiveServer
from tests.service_helpers import READ, make_settings

# --- the official client against `memlm up` --------------------------------------------------

# One `memlm up` per test process: `make test` (pytest -n 3 --dist loadgroup) runs the
# tests that share it in one process.
LIVE = pytest.mark.xdist_group("memlm_up")


@pytest.fixture(scope="module")
def oa(memlm_up: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{memlm_up.url}/v1", api_key=READ_TOKEN, max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def mc(memlm_up: LiveServer) -> Iterator[Client]:
    with Client(memlm_up.url, token=INGEST_TOKEN, timeout=120) as client:
        yield client


CONTEXT = "The central bank of Ireland"


@LIVE
def test_the_client_lists_the_served_model_and_its_memory(oa: openai.OpenAI, mc: Client) -> None:
    [card] = oa.models.list().data
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "memlm")
    assert card.model_extra == {
        "memlm": {
            "backend": "faiss",
            "entries": mc.stats().entries,
            "index_version": None,
            "max_positions": 1024,
            "chat_template": True,
        }
    }
    assert oa.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4o")


@LIVE
def test_a_completion_is_generates_continuation(oa: openai.OpenAI, mc: Client) -> None:
    r = oa.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=6, temperature=0)
    g = mc.generate(CONTEXT, max_tokens=6)
    assert g.text.startswith(" raised its key")  # the memory's continuation
    [choice] = r.choices
    assert (choice.text, choice.index, choice.finish_reason) == (g.text, 0, "length")
    assert choice.logprobs is None
    assert (r.object, r.model) == ("text_completion", MODEL) and r.id.startswith("cmpl-")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        g.context_tokens,
        6,
        g.context_tokens + 6,
    )


@LIVE
def test_a_stream_adds_up_to_the_whole_answer(oa: openai.OpenAI, memlm_up: LiveServer) -> None:
    ask: dict[str, Any] = {"model": MODEL, "prompt": CONTEXT, "max_tokens": 6, "temperature": 0}
    whole = oa.completions.create(**ask, logprobs=2).choices[0]
    chunks = list(
        oa.completions.create(
            **ask, logprobs=2, stream=True, stream_options={"include_usage": True}
        )
    )
    *parts, usage = chunks
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in parts) == whole.text
    assert [c.choices[0].finish_reason for c in parts] == [None] * (len(parts) - 1) + ["length"]
    assert whole.logprobs is not None
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [x for c in parts for x in getattr(c.choices[0].logprobs, field)]
        assert streamed == getattr(whole.logprobs, field), field
    # the wire format the client hides: `data: <chunk>` events, then `data: [DONE]`
    raw = httpx.post(
        f"{memlm_up.url}/v1/completions",
        json={**ask, "stream": True},
        headers=memlm_up.read(),
        timeout=120,
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == whole.text


@LIVE
def test_echo_logprobs_are_scores_logprobs(oa: openai.OpenAI, mc: Client) -> None:
    text = TEXT[: TEXT.index(" on Tuesday")]
    r = oa.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=3)
    s = mc.score(text)
    [choice] = r.choices
    assert (choice.text, choice.finish_reason) == (text, "length")
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == [None, *s.logprobs]  # exactly: the same code path
    assert lp.tokens[1:] == s.tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.top_logprobs[0] is None
    for token, logprob, top in zip(lp.tokens[1:], s.logprobs, lp.top_logprobs[1:], strict=True):
        # memorised: every token is the most probable one, and reported with its own value
        assert top[token] == logprob == max(top.values()) and len(top) == 3
    extras = choice.model_extra["memlm"]["tokens"]
    assert [t["lm_logprob"] for t in extras] == [None, *s.lm_logprobs]
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(lp.tokens),
        0,
    )


@LIVE
def test_lm_eval_style_request_token_ids_echo_and_one_token(
    oa: openai.OpenAI, mc: Client, memlm_up: LiveServer
) -> None:
    """What lm-evaluation-harness sends for a log-likelihood: token ids, echo, one token."""
    text = TEXT[: TEXT.index(" rate")]
    ids = httpx.post(
        f"{memlm_up.url}/tokenize",
        json={"prompt": text, "add_special_tokens": False},
        headers=memlm_up.read(),
    ).json()["tokens"]
    r = oa.completions.create(
        model=MODEL, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs[: len(ids)] == [None, *mc.score(text).logprobs]
    assert len(lp.tokens) == len(ids) + 1 and r.choices[0].text == text + " rate"
    detok = httpx.post(
        f"{memlm_up.url}/detokenize", json={"tokens": ids}, headers=memlm_up.read()
    ).json()
    assert detok == {"prompt": text}


@LIVE
def test_choices_sample_with_seed_plus_their_index(oa: openai.OpenAI) -> None:
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "seed": 11}
    a = oa.completions.create(**ask, prompt=["The central bank", "Heavy snow"], n=2)
    b = oa.completions.create(**ask, prompt=["The central bank", "Heavy snow"], n=2)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.model_extra["memlm"]["seed"] for c in a.choices] == [11, 12, 11, 12]
    alone = oa.completions.create(**{**ask, "seed": 12}, prompt="Heavy snow")
    assert alone.choices[0].text == a.choices[3].text


@LIVE
def test_chat_is_the_completion_of_the_templated_conversation(
    oa: openai.OpenAI, memlm_up: LiveServer
) -> None:
    from transformers import AutoTokenizer

    messages: list[Any] = [{"role": "user", "content": "What did the central bank raise?"}]
    ask: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    r = oa.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    chunks = list(oa.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    template = AutoTokenizer.from_pretrained(bundled_tokenizer_path()).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    plain = oa.completions.create(model=MODEL, prompt=template, max_tokens=5, temperature=0)
    assert plain.choices[0].text == choice.message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [len(t.top_logprobs) for t in choice.logprobs.content] == [2] * 5


@LIVE
def test_errors_raise_the_clients_typed_exceptions(oa: openai.OpenAI, memlm_up: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        oa.completions.create(model="gpt-3.5-turbo-instruct", prompt="x")
    assert nf.value.body == {
        "message": f"the model `gpt-3.5-turbo-instruct` does not exist; this server serves `{MODEL}`",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert (bad.value.param, bad.value.code) == ("max_tokens", "invalid_request")
    with pytest.raises(openai.BadRequestError) as unknown:
        oa.completions.create(model=MODEL, prompt="x", extra_body={"top_k": 5})
    assert (unknown.value.param, unknown.value.code) == ("top_k", "validation_error")
    assert unknown.value.message.endswith("top_k: Extra inputs are not permitted")
    with pytest.raises(openai.BadRequestError) as penalty:
        oa.completions.create(model=MODEL, prompt="x", presence_penalty=0.5)
    assert penalty.value.param == "presence_penalty"
    wrong = openai.OpenAI(base_url=f"{memlm_up.url}/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        wrong.completions.create(model=MODEL, prompt="x")
    assert auth.value.body == {
        "message": "a valid read bearer token is required",
        "type": "authentication_error",
        "param": None,
        "code": "unauthorized",
    }
    for exc in (nf, bad, unknown, penalty, auth):
        assert isinstance(exc.value, openai.APIStatusError)


# --- in-process: admission, every error layer, neighbours, a failing stream ------------------


@pytest.fixture(scope="module")
def tiny() -> Any:
    return Encoder.load("tiny-llama", threads=1)


def _app(tmp_path: Path, sqlite_url: str, tiny: Any, **over: Any) -> Any:
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama", **over)
    engine = open_engine(settings, encoder=tiny)
    return create_app(settings, engine=engine, run_worker=False, poll=False)


def test_admission_and_its_refusal_are_generates(
    tmp_path: Path, sqlite_url: str, tiny: Any
) -> None:
    """A completion is priced as /generate prices the same prompt and max_tokens: the same
    refusal, with its Retry-After, in OpenAI's body (the client's RateLimitError)."""
    app = _app(tmp_path, sqlite_url, tiny, queue_budget_s=2.0, overload_delay_seconds=0)
    with TestClient(app) as client:
        ex: ModelExecutor = app.state.memlm.executor
        ex.observe("generate", 32, 1.0)
        ex.observe("generate-step", 8, 1.0)  # 0.125 s a token
        gate, entered = threading.Event(), threading.Event()

        def busy() -> None:
            entered.set()
            gate.wait(10)

        client.portal.start_task_soon(lambda: ex.call(busy, wait=True))
        try:
            assert entered.wait(10)
            old = client.post("/generate", json={"context": CONTEXT, "max_tokens": 9})
            new = client.post(
                "/v1/completions", json={"model": MODEL, "prompt": CONTEXT, "max_tokens": 9}
            )
        finally:
            gate.set()
        assert (old.status_code, new.status_code) == (429, 429)
        assert new.headers["Retry-After"] == old.headers["Retry-After"] == "1"
        assert new.json() == {
            "error": {
                "message": old.json()["detail"],
                "type": "rate_limit_error",
                "param": None,
                "code": "overloaded",
            }
        }
        assert "would take about 2.3 s by itself" in old.json()["detail"]


def test_every_layer_answers_openais_error_body(tmp_path: Path, sqlite_url: str, tiny: Any) -> None:
    app = _app(tmp_path, sqlite_url, tiny, max_body_bytes=2000, overload_delay_seconds=0)
    with TestClient(app) as client:
        big = client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 3000})
        assert big.status_code == 413  # BodyGuard, before the app
        assert big.json()["error"]["code"] == "payload_too_large"
        ex: ModelExecutor = app.state.memlm.executor
        ex.observe(REQUEST, 1, 1000.0)  # a request takes 1000 s: a second one has no slot
        ex.enter_request()
        try:
            slot = client.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        finally:
            ex.leave_request(served=False)
        assert slot.status_code == 429 and slot.headers["Retry-After"] == "1000"
        assert slot.json()["error"]["type"] == "rate_limit_error"
        invalid = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "n": 0})
        assert invalid.status_code == 400
        assert invalid.json() == {
            "error": {
                "message": "n: Input should be greater than or equal to 1",
                "type": "invalid_request_error",
                "param": "n",
                "code": "validation_error",
            }
        }
        nowhere = client.get("/v1/embeddings")
        assert nowhere.status_code == 404 and nowhere.json()["error"]["code"] == "not_found"
        # the rest of the API keeps its own body
        assert (
            client.post("/score", json={"text": "a", "n": 0}).json()["error"] == "validation_error"
        )


def test_neighbours_need_read_access(tmp_path: Path, sqlite_url: str, tiny: Any) -> None:
    app = _app(tmp_path, sqlite_url, tiny)
    with TestClient(app) as client:
        engine = app.state.memlm.engine
        engine.process_document(1, TEXT, 19000, policy="fullmem")
        ask = {
            "model": MODEL,
            "prompt": CONTEXT,
            "max_tokens": 2,
            "temperature": 0,
            "neighbour": True,
        }
        anonymous = client.post("/v1/completions", json=ask)
        assert anonymous.status_code == 401
        assert anonymous.json()["error"]["type"] == "authentication_error"
        r = client.post("/v1/completions", json={**ask, "echo": True}, headers=READ)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["memlm"]["tokens"]
        ids = engine.tokenize(CONTEXT)
        # the prompt's tokens were memorised at their positions; so was each continuation
        positions = [t["neighbour"]["position"] if t["neighbour"] else None for t in tokens]
        assert positions == [None, *range(1, len(ids) + 2)]
        assert {t["neighbour"]["document_id"] for t in tokens[1:]} == {1}


def test_a_stream_that_fails_half_way_ends_with_an_error_chunk(
    tmp_path: Path, sqlite_url: str, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(tmp_path, sqlite_url, tiny)
    with TestClient(app) as client:
        engine = app.state.memlm.engine
        start = engine.start_generation_ids

        def failing(ids: list[int], cfg: Any) -> Any:
            gen = start(ids, cfg)
            gen.step = lambda n: (_ for _ in ()).throw(RuntimeError("the disk caught fire"))
            return gen

        monkeypatch.setattr(engine, "start_generation_ids", failing)
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": CONTEXT, "stream": True})
        assert r.status_code == 200
        assert r.text.split("\n\n") == [
            'data: {"error": {"message": "internal server error", "type": "server_error", '
            '"param": null, "code": "internal_error"}}',
            "data: [DONE]",
            "",
        ]
