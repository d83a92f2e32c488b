"""schemathesis against the in-process app: every operation, with the tokens, bounded and
derandomised examples, valid and invalid; no 5xx and every answer as the OpenAPI says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis  # a dev extra: pip install -e '.[dev]'
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from schemathesis.generation import GenerationMode

from service.app import create_app
from tests.test_api import Env, _env

# Examples per operation and mode: 15 operations x 2 modes x 25 take ~30 s here (docs/service.md).
EXAMPLES = 25
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
]
# The admin token opens every route (it is accepted for ingest too).
AUTH = {"Authorization": "Bearer admin-secret-for-tests"}


def _schema() -> Any:
    """The OpenAPI of an app that is never started (building it opens nothing)."""
    from tests.service_helpers import make_settings

    app = create_app(make_settings(Path("unused"), "sqlite://"), run_worker=False, poll=False)
    return schemathesis.openapi.from_dict(app.openapi())


SCHEMA = _schema()
# The OpenAI-compatible API and the tokenizer endpoints speak token ids, which the fake
# engine (words) has none of: test_api_contract fuzzes them against the tiny model.
TOKEN_IDS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")
OPERATIONS = [
    (op.path, op.method.upper())
    for op in (result.ok() for result in SCHEMA.get_all_operations())
    if not op.path.startswith(TOKEN_IDS)
]
# Invalid requests exist only where there is something to get wrong (a body or a path id).
TAKES_INPUT = {
    (path, method.upper())
    for path, ops in SCHEMA.raw_schema["paths"].items()
    for method, op in ops.items()
    if ("requestBody" in op or op.get("parameters")) and not path.startswith(TOKEN_IDS)
}
CASES = [
    pytest.param(path, method, mode, id=f"{mode.value}-{method} {path}")
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    for path, method in OPERATIONS
    if mode is GenerationMode.POSITIVE or (path, method) in TAKES_INPUT
]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fuzz_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    yield from _env(tmp_path, url)


def _httpx_kwargs(case: Any) -> dict[str, Any]:
    """schemathesis prepares requests-style keyword arguments; TestClient is httpx."""
    kw = dict(case.as_transport_kwargs(base_url="http://testserver", headers=AUTH))
    kw.pop("cookies", None)  # never generated here (no cookie parameters)
    if "data" in kw:
        kw["content"] = kw.pop("data")
    return kw


def test_the_schema_lists_every_operation() -> None:
    assert len(OPERATIONS) == 16  # 14 + GET /admin/stats/history (dashboard) + POST /generate
    assert len(TAKES_INPUT) == 10 and len(CASES) == 26


@pytest.mark.parametrize(("path", "method", "mode"), CASES)
def test_fuzzed_requests_get_no_5xx_and_conform(
    fuzz_env: Env, path: str, method: str, mode: GenerationMode
) -> None:
    client = fuzz_env.client
    operation = SCHEMA[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,  # the same examples on every run: CI stays reproducible
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = client.request(**_httpx_kwargs(case))
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    run()
    assert statuses and max(statuses) < 500, statuses
