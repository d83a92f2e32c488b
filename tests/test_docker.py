"""docker-compose.yml and the Dockerfiles agree with the settings (Docker cannot run here)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from memlm.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
MEMLM_SERVICES = ("migrate", "api", "worker", "scheduler")
# Variables read from the environment outside the settings object, and by whom.
READ_ELSEWHERE = {"MEMLM_CACHE_DIR": ROOT / "memlm" / "encoder" / "loading.py"}


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _interpolate(value: object) -> str:
    """Compose's ${VAR:-default} and ${VAR:?error} with nothing set: default or a secret."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        assert op in ("-", "?"), f"${{{name}}} has neither a default nor an error message"
        return arg if op == "-" else f"test-secret-{name.lower()}"

    return re.sub(r"\$\{(\w+):([-?])([^}]*)\}", one, str(value))


def _dockerfile_env(name: str) -> set[str]:
    text = (ROOT / name).read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith("ENV ")]
    return {m for line in lines for m in re.findall(r"\b(MEMLM_\w+)=", line)}


def test_every_memlm_variable_they_set_is_read() -> None:
    fields = {f"MEMLM_{name.upper()}" for name in Settings.model_fields}
    compose = _compose()["services"]
    names = {k for s in MEMLM_SERVICES for k in compose[s]["environment"]}
    names |= _dockerfile_env("Dockerfile") | _dockerfile_env("Dockerfile.gpu")
    assert names >= {"MEMLM_DATABASE_URL", "MEMLM_DATA_DIR", "MEMLM_CACHE_DIR"}
    for name in sorted(names - fields):
        assert name in READ_ELSEWHERE, f"{name} is neither a setting nor read elsewhere"
        assert f'"{name}"' in READ_ELSEWHERE[name].read_text(), name


@pytest.mark.parametrize("service", MEMLM_SERVICES)
def test_each_service_environment_makes_valid_production_settings(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("MEMLM_")]:
        monkeypatch.delenv(name)
    env = _compose()["services"][service]["environment"]
    for name, value in env.items():
        monkeypatch.setenv(name, _interpolate(value))
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert (s.env, s.data_dir, s.rebuild_cron) == ("production", Path("/data"), "0 3 * * *")
    password = "test-secret-postgres_password"
    assert s.db_url == f"postgresql+psycopg://memlm:{password}@postgres:5432/memlm"
    assert s.ingest_token.get_secret_value() == "test-secret-memlm_ingest_token"
    assert s.read_tokens()[0] == "test-secret-memlm_read_token"
    assert s.reads_protected  # /predict and /score need a token in production
    assert s.embedded_worker is (service != "api")


def test_every_secret_must_be_set() -> None:
    """No secret has a default: compose stops with the message unless it is set."""
    services = _compose()["services"]
    env = {
        k: v for s in (*MEMLM_SERVICES, "postgres") for k, v in services[s]["environment"].items()
    }
    text = (ROOT / "docker-compose.yml").read_text()
    secrets = ("POSTGRES_PASSWORD", "MEMLM_INGEST_TOKEN", "MEMLM_ADMIN_TOKEN", "MEMLM_READ_TOKEN")
    for name in secrets:
        assert f"${{{name}:?set {name}}}" in text, name
        assert f"${{{name}:-" not in text, f"{name} has a default"
    assert env["POSTGRES_PASSWORD"] == "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    assert "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}@" in env["MEMLM_DATABASE_URL"]
    assert "MEMLM_PROTECT_READ" not in env  # production's default: reads need a token


def test_migrations_run_before_api_worker_and_scheduler() -> None:
    services = _compose()["services"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("api", "worker", "scheduler"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"}
        }


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_images_install_the_package_itself_with_its_migrations(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", text, flags=re.M))
    assert copied == {"memlm", "service", "workers", "migrations"}
    assert "COPY setup.py ./" in text  # it maps migrations/ into the package
    # Not editable: the image runs what the wheel ships (tests/test_packaging.py).
    assert "RUN pip install . " in text and "pip install -e" not in text
    assert 'ENTRYPOINT ["memlm"]' in text
