"""The OpenAPI contract is as tight as the server (issue 31, defect 7).

schemathesis with every check (``st run --checks all``) against a live ``memlm serve``
in production mode (reads need a token) on PostgreSQL, and the cases it found, each
checked exactly in-process.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from memlm.api import SPACE
from memlm.engine.generation import GenerateConfig, choose
from memlm.engine.score import perplexity
from memlm.knnlm.policy import POLICY_PARAMS
from tests.processes import ROOT, free_port, memlm_env
from tests.service_helpers import ADMIN, INGEST, doc
from tests.test_api import Env
from tests.test_api import env as env  # the fixture

# Production refuses short or default secrets (memlm/settings.py).
TOKENS = {
    "MEMLM_INGEST_TOKEN": "ingest-token-for-the-contract-test-0001",
    "MEMLM_ADMIN_TOKEN": "admin-token-for-the-contract-test-00002",
    "MEMLM_READ_TOKEN": "read-token-for-the-contract-test-000003",
}
# Limits small enough that the token limits no schema can state never bind: SmolLM2's
# byte-level BPE gives at most 4 tokens per character, so 128 characters are at most 512
# tokens: under MEMLM_MAX_SCORE_TOKENS (2048) and, with the 128 generated tokens at most,
# under the tiny model's 1024 positions. They also keep the boundary cases small: a
# /v1/completions samples by default (temperature 1), and a top_p below 1 sorts the 49k
# probabilities at every step (19 ms a token on the tiny model, quiet 2-core machine), so
# 256 tokens came near the 10 s response-time limit of `--checks all` on a loaded one.
LIMITS = {
    "MEMLM_MAX_GENERATE_TOKENS": "128",
    "MEMLM_MAX_CONTEXT_CHARS": "128",
    "MEMLM_MAX_TEXT_CHARS": "2000",
    "MEMLM_MAX_DOCUMENTS_PER_REQUEST": "16",
}
# 413 refuses too: a body over a limit the schema states (maxLength, maxItems) gets it.
# /score refuses a text of one token ("the text must hold at least two tokens", 422
# invalid_input): tokens are not characters, so no JSON Schema can say it.
# The coverage phase sends every boundary of every optional field: for the two completion
# routes that is ~400 valid requests each generating its tokens (minutes on 2 busy cores,
# more than the rest of the run); they get its invalid cases, and valid ones from the
# examples and fuzzing phases.
# The OpenAI-compatible API refuses (400, OpenAI's status for any refused request) what
# only the model knows or no JSON Schema states: a token id past the vocabulary, a prompt
# whose tokens with max_tokens exceed the model's positions, prompts x n x max_tokens over
# MEMLM_MAX_GENERATE_TOKENS (a product); /detokenize (422) ids past the vocabulary.
ST_CONFIG = """\
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422",
  "428", "429", "5xx"]

[[operations]]
include-name = "POST /score"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404",
  "409", "429", "5xx", "422"]

[[operations]]
include-name = "POST /v1/completions"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404",
  "409", "429", "5xx", "400"]
phases.coverage.generation.mode = "negative"

[[operations]]
include-name = "POST /v1/chat/completions"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404",
  "409", "429", "5xx", "400"]
phases.coverage.generation.mode = "negative"

[[operations]]
include-name = "POST /detokenize"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404",
  "409", "429", "5xx", "422"]
"""
# Examples per operation in the fuzzing phase (schemathesis' default is 100); the
# coverage and stateful phases add their own. Seeded: the same requests on every run.
MAX_EXAMPLES = 30


@pytest.fixture
def live_server(tmp_path: Path, pg_url: str) -> Iterator[str]:
    """``memlm serve`` in production mode on PostgreSQL with the tiny random Llama."""
    port = free_port()
    env = memlm_env(
        **TOKENS,
        **LIMITS,
        MEMLM_ENV="production",
        MEMLM_DATABASE_URL=pg_url,
        MEMLM_DATA_DIR=str(tmp_path / "data"),
        MEMLM_DEVICE="cpu",
        MEMLM_PRECISION="float32",
        MEMLM_EMBEDDED_WORKER="true",  # it creates the datastore the API opens
    )
    env.pop("MEMLM_PROTECT_READ", None)  # production's default: reads need a token
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "memlm serve not ready in 180 s"
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        # production: an anonymous read is refused, so the fuzz's auth checks bite
        anonymous = httpx.post(f"{base}/predict", json={"context": "a"}, timeout=30)
        assert anonymous.status_code == 401
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.postgres
@pytest.mark.slow
def test_live_server_conforms_to_its_openapi_with_every_check(
    live_server: str, tmp_path: Path
) -> None:
    """`st run --checks all`: no 5xx, no schema-violating request accepted, no valid one
    refused, every answer and header as the OpenAPI says (about 1,000 requests, ~1 min)."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(ST_CONFIG)
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{live_server}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"Authorization: Bearer {TOKENS['MEMLM_ADMIN_TOKEN']}",
        "--seed",
        "1",
        "--max-examples",
        str(MAX_EXAMPLES),
        # a 256-token /generate on the tiny model takes a second on a quiet machine; on a
        # loaded 2-core one over 60 s was seen (reported as ST112): a hang is still caught
        "--request-timeout",
        "240",
        "--output-truncate",
        "false",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    print(out[-1200:])  # the summary, shown with -s
    assert run.returncode == 0, out[-20000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated is not None and int(generated[1]) >= 500, out[-3000:]
    assert "Tested: 23" in out, out[-3000:]  # every operation


# --- what the fuzz found, each exactly (in-process: the fake engine, SQLite) ------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("OPTIONS", "/admin/policy", "GET, PUT"),
        ("DELETE", "/admin/policy", "GET, PUT"),
        ("GET", "/admin/documents/1", "DELETE"),
        ("PUT", "/ingest", "POST"),
    ],
)
def test_a_405_allows_every_method_of_the_path(
    env: Env, method: str, path: str, allow: str
) -> None:
    """Starlette named only the first matching route's methods: `Allow: GET` on PUT's path."""
    r = env.client.request(method, path, headers=ADMIN)
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    assert r.json() == {"error": "method_not_allowed", "detail": "Method Not Allowed"}


@pytest.mark.parametrize(
    ("path", "body", "detail"),
    [
        ("/admin/rebuild", {"retrain": 0}, "retrain: Input should be a valid boolean"),
        ("/admin/rebuild", {"retrain": "true"}, "retrain: Input should be a valid boolean"),
        ("/admin/rebuild", {"key": 7}, "key: Input should be a valid string"),
        (
            "/ingest",
            {"documents": [doc("ok", day=0)]},  # type: ignore[arg-type]
            "documents.0.published_at: Input should be a valid date",
        ),
        (
            "/ingest",
            {"documents": [doc("ok", day="2017-02-07T10:00:00")]},  # no offset: not RFC 3339
            "documents.0.published_at: Value error, published_at '2017-02-07T10:00:00' is not",
        ),
        (
            "/ingest",
            {"documents": [doc("ok", day="20170207")]},  # Python's fromisoformat took it
            "documents.0.published_at: Value error, published_at '20170207' is not",
        ),
        ("/predict", {"context": "a", "top_n": "5"}, "top_n: Input should be a valid integer"),
        ("/predict", {"context": "a", "top_n": True}, "top_n: Input should be a valid integer"),
        ("/predict", {"context": "a", "top_n": 2.5}, "top_n: Input should be a valid integer"),
        (
            "/predict",
            {"context": "a", "local_memory": 1},
            "local_memory: Input should be a valid boolean",
        ),
        (
            "/predict",
            {"context": "a", "local_memory": True, "tau": 1e-9},
            "tau: Input should be greater than or equal to 0.001",
        ),
        ("/score", {"text": "a b", "tau": "1"}, "tau: Input should be a valid number"),
        ("/generate", {"context": "a", "stream": 0}, "stream: Input should be a valid boolean"),
        ("/generate", {"context": "a", "seed": -1}, "seed: Input should be greater than or equal"),
    ],
)
def test_lax_values_are_refused(env: Env, path: str, body: dict[str, Any], detail: str) -> None:
    """The schema says boolean, integer, string, date: 0, "5", 7 and a timestamp are not."""
    r = env.client.post(path, headers=ADMIN, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "validation_error"
    assert r.json()["detail"].startswith(detail), r.json()


def test_a_whole_float_is_an_integer_and_a_datetime_with_offset_a_date(env: Env) -> None:
    """JSON Schema counts 5.0 as an integer: strict mode must not refuse it."""
    r = env.client.post("/predict", json={"context": "a", "top_n": 2.0})
    assert r.status_code == 200 and len(r.json()["suggestions"]) == 2
    body = {"policy": "randmem", "params": {"rate": 1, "seed": 7.0}}
    r = env.client.put("/admin/policy", headers=ADMIN, json=body)
    assert r.status_code == 200 and r.json()["params"] == {"rate": 1, "seed": 7}
    r = env.client.post(
        "/ingest", headers=INGEST, json={"documents": [doc("ok", day="2017-02-07t23:10:00+05:00")]}
    )
    doc_id = r.json()["documents"][0]["id"]
    got = env.client.get(f"/documents/{doc_id}", headers=INGEST).json()
    assert got["published_at"] == "2017-02-07"  # the date as written, whatever the offset


def test_the_openapi_states_what_put_policy_takes(env: Env) -> None:
    """One body per policy: the params rules check_policy enforces, in the schema."""
    spec = env.client.get("/openapi.json").json()
    body = spec["paths"]["/admin/policy"]["put"]["requestBody"]["content"]["application/json"]
    ref = "#/components/schemas/"
    assert body["schema"]["oneOf"] == [
        {"$ref": f"{ref}FullMemIn"},
        {"$ref": f"{ref}RandMemIn"},
        {"$ref": f"{ref}MonimIn"},
    ]
    assert body["schema"]["discriminator"] == {
        "propertyName": "policy",
        "mapping": {
            "fullmem": f"{ref}FullMemIn",
            "randmem": f"{ref}RandMemIn",
            "monim": f"{ref}MonimIn",
            "monim-amt": f"{ref}MonimIn",
            "monim-kl": f"{ref}MonimIn",
        },
    }
    schemas = spec["components"]["schemas"]
    for name in ("FullMemIn", "RandMemIn"):
        assert schemas[name]["properties"]["delta"]["type"] == "null"
    for name in ("FullMemIn", "MonimIn"):
        assert schemas[name]["properties"]["params"] == {"$ref": f"{ref}NoParams"}
    assert schemas["NoParams"]["properties"] == {}
    assert schemas["NoParams"]["additionalProperties"] is False
    params = schemas["RandMemParams"]
    assert params["additionalProperties"] is False
    # the same names and bounds as memlm.knnlm.policy; exact integers (FastAPI wrote 2**63 - 1
    # as the float 9.223372036854776e18, i.e. 2**63, which the server refuses)
    assert {
        k: (v["type"], v["minimum"], v["maximum"]) for k, v in params["properties"].items()
    } == {
        k: ("number" if kind is float else "integer", lo, hi)
        for k, (kind, lo, hi) in POLICY_PARAMS["randmem"].items()
    }
    assert type(params["properties"]["seed"]["maximum"]) is int


def test_the_openapi_states_the_settings_limits_and_cross_field_rules(env: Env) -> None:
    spec = env.client.get("/openapi.json").json()
    s = spec["components"]["schemas"]
    settings = env.client.app.state.memlm.settings  # type: ignore[attr-defined]
    assert s["GenerateRequest"]["properties"]["max_tokens"]["maximum"] == 256
    assert settings.max_generate_tokens == 256
    assert s["GenerateRequest"]["properties"]["seed"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 2**63 - 1,
    }
    assert s["PredictRequest"]["properties"]["neighbours"]["maximum"] == settings.max_neighbours
    for model, prop in (("PredictRequest", "context"), ("GenerateRequest", "context")):
        assert s[model]["properties"][prop]["maxLength"] == settings.max_context_chars
    assert s["ScoreRequest"]["properties"]["text"]["maxLength"] == settings.max_context_chars
    assert s["DocumentIn"]["properties"]["text"]["maxLength"] == settings.max_text_chars
    docs = s["IngestRequest"]["properties"]["documents"]
    assert docs["maxItems"] == settings.max_documents_per_request
    # tau only with a memory on (the server's _tau_needs_memory)
    for model in ("PredictRequest", "ScoreRequest"):
        assert s[model]["anyOf"] == [
            {"properties": {"tau": {"type": "null"}}},
            {"properties": {"local_memory": {"const": True}}, "required": ["local_memory"]},
            {"properties": {"long_memory": {"minimum": 1}}, "required": ["long_memory"]},
        ]
    published = s["DocumentIn"]["properties"]["published_at"]["anyOf"]
    assert published == [
        {"type": "string", "format": "date"},
        {"type": "string", "format": "date-time"},
    ]
    assert s["DocumentIn"]["properties"]["metadata"]["propertyNames"] == {"pattern": r"^[^\x00]*$"}
    for prop in ("source", "title"):
        assert s["DocumentIn"]["properties"][prop]["pattern"] == r"^[^\x00]*$"


def test_the_text_pattern_spells_pythons_white_space() -> None:
    """`text` must hold a character str.strip() keeps; ECMA's \\s is another set."""
    space = re.compile(f"[{SPACE}]")
    assert [c for c in range(sys.maxunicode + 1) if chr(c).isspace()] == [
        c for c in range(sys.maxunicode + 1) if space.fullmatch(chr(c))
    ]


def test_a_perplexity_past_float64_saturates() -> None:
    """A tau of 0.001 put ~0 on every target: math.exp overflowed into a 500 on /score."""
    assert perplexity(np.array([-1e4, -2e4])) == pytest.approx(np.finfo(np.float64).max)
    assert perplexity(np.array([-1.0, -3.0])) == pytest.approx(np.exp(2.0))


def test_a_tiny_temperature_samples_the_argmax() -> None:
    """A temperature of 5e-324 made every log p / T -inf and the distribution NaN: a 500."""
    prob = np.array([0.2, 0.5, 0.3])
    for t in (5e-324, 1e-300):
        cfg = GenerateConfig(temperature=t)
        assert [choose(prob, cfg, np.random.default_rng(s)) for s in range(5)] == [1] * 5
