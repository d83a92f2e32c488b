"""The memory budget through the service: settings -> worker build -> build record,
/admin/stats (issue 35)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.service_helpers import ADMIN, INGEST, doc, make_settings
from tests.test_api_engine import OTHER, TEXT, _env

BUDGET = 40


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


@pytest.mark.parametrize("criterion", ["age", "spread"])
def test_the_build_keeps_the_budget_and_says_what_it_retired(
    tmp_path: Path, sqlite_url: str, tiny: Any, criterion: str
) -> None:
    settings = make_settings(
        tmp_path,
        sqlite_url,
        model="tiny-llama",
        knn_lambda=0.25,
        consolidate_sample=64,
        memory_budget_entries=BUDGET,
        budget_criterion=criterion,
    )
    for env in _env(settings, tiny):
        c = env.client
        texts = [TEXT, OTHER, TEXT + " It said so again.", OTHER + " More snow fell."]
        c.post("/ingest", headers=INGEST, json={"documents": [doc(t) for t in texts]})
        assert env.drain() == 4
        stored = env.engine.memory.count()
        assert stored > BUDGET
        build = c.post("/admin/rebuild", headers=ADMIN).json()
        assert env.drain() == 1
        env.sync()
        build = c.get(f"/admin/builds/{build['id']}", headers=ADMIN).json()
        cons = build["consolidation"]
        assert build["status"] == "done" and build["entries"] == env.engine.memory.count()
        assert build["entries"] <= BUDGET and cons["budget"] == BUDGET
        assert cons["criterion"] == criterion and cons["examined"] == min(64, stored)
        assert cons["recent"] == (0.0 if criterion == "spread" else None)
        retired = cons["retired"]["test"] + cons["retired"]["budget"]
        assert retired == stored - build["entries"] and cons["retired"]["budget"] > 0
        stats = c.get("/admin/stats", headers=ADMIN).json()
        assert stats["entries"] == build["entries"]
        assert stats["consolidation"]["budget"] == BUDGET
        assert stats["consolidation"]["recent"] == cons["recent"]
        assert stats["consolidation"]["last"]["retired"] == cons["retired"]
        assert stats["consolidation"]["usage"]["retrievals"] > 0
        lm = stats["consolidation"]["entry_lm"]
        assert lm["entries"] == build["entries"] and lm["bytes"] == 10 * lm["entries"]
