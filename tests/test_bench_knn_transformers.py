"""benchmarks/bench_knn_transformers.py: the tokens and windows both sides score (no timing).

The peer (neulab/knn-transformers) is never part of this repository: the one test that
imports it runs where ``MEMLM_KNNT_DIR`` names a checkout holding its ``knnlm.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import faiss
import numpy as np
import pytest

from memlm.encoder import WindowConfig


def _load() -> ModuleType:
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(
        "bench_knnt", folder / "bench_knn_transformers.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_knnt"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_split_tokens_gives_exact_counts() -> None:
    docs = [list(range(10)), [1], list(range(7)), list(range(20)), list(range(5))]
    memory, evaluation = bench.split_tokens(docs, 12, 8)
    assert memory == [list(range(10)), list(range(4))]  # 9 + 3 targets, the second cut
    assert evaluation == [list(range(9))]  # the next document, cut at 8 targets
    with pytest.raises(ValueError, match="fewer than"):
        bench.split_tokens(docs, 30, 30)


@pytest.mark.parametrize("n", [2, 9, 10, 11, 23])
def test_labelled_windows_score_every_target_once_as_memlm_does(n: int) -> None:
    window = WindowConfig(context=6, stride=3)
    ids = list(range(100, 100 + n))
    windows = bench.labelled_windows(ids, window)
    assert len(windows) == len(window.windows(n))
    scored = []
    for (inputs, labels), (begin, end, first) in zip(windows, window.windows(n), strict=True):
        assert inputs == ids[begin:end]
        # a causal LM scores label j from inputs[:j]: target position begin + j
        for j, lab in enumerate(labels):
            if lab != -100:
                assert lab == ids[begin + j]
                assert begin + j >= first
                scored.append(begin + j)
        assert labels[0] == -100  # nothing predicts a window's first token
    assert scored == list(range(1, n))


def test_peer_sees_the_flat_index_search_unchanged(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((200, 8)).astype(np.float32)
    flat = faiss.IndexFlatL2(8)
    flat.add(keys)
    path = tmp_path / "flat.index"
    faiss.write_index(flat, str(path))
    seen = bench._FaissForPeer().read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR)
    seen.nprobe = 32  # what the peer does to an IVF index: no effect here
    seen.make_direct_map()
    d, i = seen.search(keys[:5], 3)
    d0, i0 = flat.search(keys[:5], 3)
    assert np.array_equal(i, i0) and np.array_equal(d, d0)
    assert i[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert bench._FaissForPeer().IndexFlatL2 is faiss.IndexFlatL2


def test_load_peer_adds_llama_keys() -> None:
    folder = os.environ.get("MEMLM_KNNT_DIR")
    if not folder or not (Path(folder) / "knnlm.py").exists():
        pytest.skip(
            "MEMLM_KNNT_DIR does not name a neulab/knn-transformers checkout (its knnlm.py "
            "is read from there, never copied into this repository)"
        )
    peer = bench.load_peer(Path(folder))
    layer, captured_input = peer.KNNWrapper.model_layer_to_capture["llama"][
        peer.KEY_TYPE.last_ffn_input
    ]
    assert captured_input is True
    assert isinstance(peer.faiss, bench._FaissForPeer)
