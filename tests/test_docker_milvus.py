"""docker-compose.yml's `milvus` profile (Docker cannot run here: the file is checked)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from memlm.memory import parse_memory_url
from memlm.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ("etcd", "minio", "milvus")


def _services() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data["services"]


def test_profile_has_the_official_images_of_the_tested_version() -> None:
    s = _services()
    assert s["milvus"]["image"] == "milvusdb/milvus:v2.3.5"  # == the tests' milvus==2.3.5
    assert s["etcd"]["image"].startswith("quay.io/coreos/etcd:v3.5")
    assert s["minio"]["image"].startswith("minio/minio:RELEASE.")
    for name in PROFILE:
        assert s[name]["profiles"] == ["milvus"], name
        assert "healthcheck" in s[name], name
    assert s["milvus"]["environment"] == {
        "ETCD_ENDPOINTS": "etcd:2379",
        "MINIO_ADDRESS": "minio:9000",
    }
    assert s["milvus"]["depends_on"] == {
        "etcd": {"condition": "service_healthy"},
        "minio": {"condition": "service_healthy"},
    }
    # only Milvus's gRPC port leaves the compose network
    assert "ports" not in s["etcd"] and "ports" not in s["minio"]
    assert s["milvus"]["ports"] == ["19530:19530"]
    # the memlm services run without the profile too (faiss by default)
    for name in ("migrate", "api", "worker", "scheduler"):
        assert "profiles" not in s[name]


@pytest.mark.parametrize(
    ("value", "backend"),
    [(None, None), ("milvus://milvus:19530/memlm", "milvus://milvus:19530/memlm")],
)
def test_memlm_services_take_the_memory_url(
    value: str | None, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEMLM_MEMORY_URL=milvus://milvus:19530/<collection> with the profile; faiss without."""
    for name in [n for n in os.environ if n.startswith("MEMLM_")]:
        monkeypatch.delenv(name)
    env = _services()["worker"]["environment"]
    raw = env["MEMLM_MEMORY_URL"]
    assert raw == "${MEMLM_MEMORY_URL:-faiss}"
    monkeypatch.setenv("MEMLM_MEMORY_URL", value or "faiss")
    url = parse_memory_url(Settings(_env_file=None).memory_url)  # type: ignore[call-arg]
    assert (None if url is None else str(url)) == backend
    if url is not None:
        assert url.host in _services()  # the compose service name resolves inside it
