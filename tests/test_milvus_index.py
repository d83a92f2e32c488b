"""Which index a Milvus memory builds (memlm.memory.milvus_index): the rule by size and
by the URL's ``index`` option, the Milvus index of each kind and back, the search
parameters. No server needed (tests/test_memory_milvus.py builds each kind on one)."""

from __future__ import annotations

import pytest

from memlm.index import FLAT_THRESHOLD, IndexParams
from memlm.memory.milvus_index import (
    DEFAULT_KIND,
    IVF_NPROBE,
    describe,
    from_index,
    milvus_index,
    params_for,
    search_param,
)
from memlm.memory.url import parse_memory_url

DIM = 576
SEGMENT = 222_000  # rows of one 512 MB segment at d=576


def test_flat_below_the_threshold_whatever_the_choice() -> None:
    for choice in ("auto", "hnsw", "ivf_flat", "ivf_sq8", "ivf_pq"):
        assert params_for(FLAT_THRESHOLD - 1, DIM, SEGMENT, choice).kind == "flat"
    assert params_for(10**6, DIM, SEGMENT, "flat").kind == "flat"


@pytest.mark.parametrize(
    ("choice", "kind"),
    [
        ("auto", DEFAULT_KIND),
        ("hnsw", "hnsw"),
        ("ivf_flat", "ivfflat"),
        ("ivf_sq8", "ivfsq8"),
        ("ivf_pq", "ivfpq"),
    ],
)
def test_the_url_chooses_the_kind_above_the_threshold(choice: str, kind: str) -> None:
    p = params_for(10**6, DIM, SEGMENT, choice)
    assert p.kind == kind
    if kind.startswith("ivf"):
        # the lists are sized to one segment (Milvus indexes segments one by one), so a
        # growing memory keeps its index once it fills a segment
        assert p.nlist == IndexParams.for_size(SEGMENT, DIM).nlist
        assert params_for(5 * 10**6, DIM, SEGMENT, choice) == p


def test_each_kind_round_trips_through_the_milvus_index() -> None:
    for choice in ("hnsw", "ivf_flat", "ivf_sq8", "ivf_pq"):
        p = params_for(300_000, DIM, SEGMENT, choice)
        index = milvus_index(p)
        assert index["metric_type"] == "L2"
        back = from_index(index["index_type"], index["params"])
        assert milvus_index(back) == index
        assert back.kind == p.kind and back.nprobe == p.nprobe
    assert milvus_index(IndexParams.exact())["index_type"] == "FLAT"
    assert from_index(None, {}).kind == "flat"
    assert from_index("DISKANN", {}).kind == "flat"  # not ours: searched without params


def test_search_parameters() -> None:
    hnsw = params_for(10**6, DIM, SEGMENT, "hnsw")
    assert search_param(hnsw, 64)["params"] == {"ef": hnsw.ef}
    # Milvus refuses an ef below the candidates asked for
    assert search_param(hnsw, 1024)["params"] == {"ef": 1024}
    sq8 = params_for(10**6, DIM, SEGMENT, "ivf_sq8")
    assert search_param(sq8, 64)["params"] == {"nprobe": IVF_NPROBE}
    assert search_param(IndexParams.exact(), 64)["params"] == {}
    assert describe(hnsw).startswith("HNSW M16")
    assert describe(sq8) == f"IVF_SQ8 {sq8.nlist}/{IVF_NPROBE}"


def test_exact_distances_only_where_the_float32_keys_are_searched() -> None:
    kinds = {
        k: params_for(10**6, DIM, SEGMENT, k).exact_distances
        for k in ("hnsw", "ivf_flat", "ivf_sq8", "ivf_pq")
    }
    assert kinds == {"hnsw": True, "ivf_flat": True, "ivf_sq8": False, "ivf_pq": False}
    assert IndexParams.exact().exact_distances


def test_the_url_option() -> None:
    assert parse_memory_url("milvus://h/c").index == "auto"  # type: ignore[union-attr]
    assert parse_memory_url("milvus://h/c?index=ivf_sq8").index == "ivf_sq8"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="index must be one of"):
        parse_memory_url("milvus://h/c?index=annoy")


def test_the_faiss_memory_refuses_a_milvus_kind(tmp_path) -> None:
    import numpy as np

    from memlm.memory import open_faiss

    mem = open_faiss(tmp_path, 8)
    mem.append(np.ones((4, 8)), np.arange(4), np.zeros(4), np.arange(4), np.zeros(4))
    with pytest.raises(ValueError, match="faiss memory builds"):
        mem.build(IndexParams(kind="hnsw", nlist=1, m=1, nprobe=1, train_size=0))
    with pytest.raises(ValueError, match="kind must be one of"):
        IndexParams(kind="annoy")  # type: ignore[arg-type]


def test_the_url_sets_the_search_parameters() -> None:
    from memlm.memory.milvus_index import searched

    url = parse_memory_url("milvus://h/c?ef=300&nprobe=8")
    assert url is not None and (url.ef, url.nprobe) == (300, 8)
    hnsw = params_for(10**6, DIM, SEGMENT, "hnsw")
    assert searched(hnsw, url.ef, url.nprobe).ef == 300
    ivf = params_for(10**6, DIM, SEGMENT, "ivf_flat")
    assert searched(ivf, url.ef, url.nprobe).nprobe == 8
    assert searched(IndexParams.exact(), 300, 8) == IndexParams.exact()  # nothing to set
    assert searched(hnsw, None, None) == hnsw
    for bad in ("ef=0", "nprobe=-1", "ef=many"):
        with pytest.raises(ValueError, match="memory URL"):
            parse_memory_url(f"milvus://h/c?{bad}")


def test_a_reranked_search_is_split_under_the_reply_limit() -> None:
    from memlm.memory.milvus_reads import HIT_BYTES, REPLY_BYTES, SEARCH_BATCH, search_batch

    # 1,024 candidates with their d=576 keys: 2.4 MB a query, 14 queries a call
    assert search_batch(1024, 576) == REPLY_BYTES // (1024 * (4 * 576 + HIT_BYTES)) == 14
    assert search_batch(64, 0) == SEARCH_BATCH  # without keys the batch limit binds
    assert search_batch(16384, 576) == 1  # one query even when it alone is over the limit
