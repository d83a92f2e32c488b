"""A datastore records the precision its keys were made with and never mixes key spaces;
the engine, the worker and the API follow MEMLM_PRECISION / MEMLM_DEVICE and report them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from memlm.datastore import MANIFEST, Datastore, DatastoreError, KeyPrecisionMismatch
from memlm.encoder import Encoder
from memlm.engine import Engine
from service.app import create_app
from tests.service_helpers import ADMIN, make_settings
from workers.engine import open_engine

D = 8


def _append(ds: Datastore, n: int = 3) -> None:
    rng = np.random.default_rng(0)
    ds.append(
        rng.standard_normal((n, D)).astype(np.float32),
        np.arange(n, dtype=np.int32),
        doc_ids=np.zeros(n, np.int64),
        positions=np.arange(n, dtype=np.int32),
        days=np.zeros(n, np.int32),
    )


def test_the_manifest_records_the_key_precision(tmp_path: Path):
    with Datastore.open(tmp_path / "ds", D, key_precision="bfloat16") as ds:
        _append(ds)
        assert ds.key_precision == "bfloat16"
    raw = json.loads((tmp_path / "ds" / MANIFEST).read_text())
    assert raw["key_precision"] == "bfloat16"  # kept by every later commit
    assert Datastore.stored_key_precision(tmp_path / "ds") == "bfloat16"
    assert Datastore.stored_key_precision(tmp_path / "none") is None
    with Datastore.open(tmp_path / "ds", D, key_precision="bfloat16") as ds:
        assert len(ds) == 3
    with Datastore.open(tmp_path / "ds", D) as ds:  # no precision named: no check (tools)
        assert ds.key_precision == "bfloat16"


@pytest.mark.parametrize("readonly", [False, True])
def test_another_precision_is_refused_with_the_way_out(tmp_path: Path, readonly: bool):
    with Datastore.open(tmp_path / "ds", D, key_precision="bfloat16") as ds:
        _append(ds)
    with pytest.raises(KeyPrecisionMismatch) as err:
        Datastore.open(tmp_path / "ds", D, key_precision="float32", readonly=readonly)
    msg = str(err.value)
    assert "made with the encoder in bfloat16" in msg and "runs in float32" in msg
    assert "MEMLM_PRECISION=bfloat16" in msg and "ingest the documents again" in msg
    assert isinstance(err.value, DatastoreError)
    # the refusal changed nothing, and the writer lock was released
    with Datastore.open(tmp_path / "ds", D, key_precision="bfloat16") as ds:
        assert len(ds) == 3


def test_a_store_from_before_the_field_holds_float32_keys(tmp_path: Path):
    with Datastore.open(tmp_path / "ds", D) as ds:
        _append(ds)
    path = tmp_path / "ds" / MANIFEST
    raw = json.loads(path.read_text())
    del raw["key_precision"]
    path.write_text(json.dumps(raw))
    with Datastore.open(tmp_path / "ds", D, key_precision="float32") as ds:
        assert ds.key_precision == "float32"
    with pytest.raises(KeyPrecisionMismatch):
        Datastore.open(tmp_path / "ds", D, key_precision="int8")


# --- the engine ---------------------------------------------------------------------------


def test_engine_auto_follows_the_store_and_explicit_mismatch_is_refused(tmp_path: Path):
    eng = Engine.open(tmp_path, model="tiny-llama", threads=1, precision="bfloat16")
    eng.process_document(1, "The harbour wall was finished in October.", 0, policy="fullmem")
    assert eng.stats()["precision"] == "bfloat16" and eng.stats()["device"] == "cpu"
    eng.close()
    with pytest.raises(KeyPrecisionMismatch, match="MEMLM_PRECISION=bfloat16"):
        Engine.open(tmp_path, model="tiny-llama", threads=1, precision="float32")
    # auto keeps the store's precision, without probing
    again = Engine.open(tmp_path, model="tiny-llama", threads=1, precision="auto")
    assert again.encoder.precision == "bfloat16" and again.encoder.probe is None
    again.close()


# --- the service --------------------------------------------------------------------------


def test_readyz_and_stats_report_device_and_precision(tmp_path: Path, sqlite_url: str):
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama", precision="bfloat16")
    engine: Any = open_engine(settings)
    assert isinstance(engine.encoder, Encoder) and engine.encoder.precision == "bfloat16"
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        ready = client.get("/readyz").json()
        assert (ready["device"], ready["precision"]) == ("cpu", "bfloat16")
        stats = client.get("/admin/stats", headers=ADMIN).json()
        assert (stats["device"], stats["precision"]) == ("cpu", "bfloat16")
