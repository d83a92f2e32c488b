"""memlm's kNN-LM beside neulab/knn-transformers' ``knnlm.py`` on the same tokens, k, T, lambda.

The peer is read and run from a checkout outside this repository (``--peer-dir``, the
folder holding its ``knnlm.py``); nothing of it is copied here. Both sides:

- build a memory of exactly ``--memory-tokens`` entries (20,000) from the first bundled
  news articles (the last one cut), scored with the same windows (``WindowConfig()``:
  512 tokens, stride 256, every target once with >= 256 tokens of left context), keys
  = the input of the last decoder layer's MLP, values = the next token;
- search it exactly and score the next ``--eval-tokens`` tokens of the following articles
  with the same windows: p(y) = (1 - lambda) p_LM(y) + lambda p_kNN(y), p_kNN from
  softmax(-d / T) over the k nearest (d squared L2).

memlm: the fp16 keys of ``Encoder.encode_ids`` in a faiss memory built with the
service's parameters for its size (exact FLAT under 50k entries), scored by
``Engine.score_ids`` (the ``/score`` path, constant k, T, lambda, no calibrator), at
bfloat16 (the default precision here) and float32; beside it memlm's bare forward
(``Encoder.encode_ids`` of the same documents).
Peer: ``KNNSaver`` writes its fp16 keys and values while the model runs the memory
windows (labels -100 before each window's first scored target), an exact
``IndexFlatL2`` over those keys replaces the IVF-PQ its ``build_index`` makes, and
``KNNWrapper`` (``knn_gpu=False``, keys and values in RAM) scores the evaluation windows;
its perplexity is ``exp`` of the mean of the Hugging Face loss, as its ``run_clm.py``
reports it. Beside it the same HF model without the wrapper. float32: the peer's faiss
search takes float32 queries.

The memories are built first; then every path (each side's kNN-LM and bare forward) reads
each evaluation document in turn, the order rotated by document, so that the load of a
shared machine reaches all paths alike. One process: the peer's import of
``faiss.contrib.torch_utils`` wraps faiss's search for memlm too (a type check per call).

Run-time adaptations of the peer, none of which changes what it computes: its table of
layers gains ``llama`` (``model.model.layers[-1].mlp``, input captured: the key memlm
uses); the index its ``faiss.read_index`` returns is the flat one wrapped so that setting
``nprobe`` and ``make_direct_map()`` (which faiss refuses on a flat index) do nothing;
``recompute_dists`` is off, so nothing reconstructs.

    MEMLM_THREADS=1 PYTHONPATH=. nice -n 5 python benchmarks/bench_knn_transformers.py \\
        --peer-dir /work/knnt
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import load_average, markdown_table  # noqa: E402

from memlm.encoder import WindowConfig  # noqa: E402

DAY = 17000  # any day number: the memory has one


def split_tokens(
    docs: list[list[int]], memory_tokens: int, eval_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The memory documents (exactly ``memory_tokens`` targets: the last one cut) and the
    evaluation documents after them (whole, until ``eval_tokens`` targets, the last cut)."""
    out: list[list[list[int]]] = [[], []]
    want = [memory_tokens, eval_tokens]
    part = 0
    for ids in docs:
        if len(ids) < 2:
            continue
        have = sum(len(d) - 1 for d in out[part])
        take = min(len(ids), want[part] - have + 1)
        if take >= 2:
            out[part].append(ids[:take])
        if have + take - 1 >= want[part]:
            part += 1
            if part == 2:
                return out[0], out[1]
    raise ValueError(f"the documents hold fewer than {memory_tokens} + {eval_tokens} targets")


def labelled_windows(ids: list[int], window: WindowConfig) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per window: labels -100 where a target is not this window's to
    score, so that a Hugging Face causal LM scores each target once, as memlm does."""
    out = []
    for begin, end, first in window.windows(len(ids)):
        inputs = ids[begin:end]
        labels = [t if begin + j >= first else -100 for j, t in enumerate(inputs)]
        out.append((inputs, labels))
    return out


# --- memlm --------------------------------------------------------------------------------


@dataclass
class Side:
    """One implementation at one precision: its memory built, and its two ways to read a
    document: ``knn`` (summed log-prob of the scored targets, their count) and ``bare``."""

    name: str
    entries: int
    index: str
    save_tps: float  # tokens/s of building the memory (forwards + writes)
    knn: Callable[[list[int]], tuple[float, int]]
    bare: Callable[[list[int]], object]


def memlm_side(
    precision: str, memory: list[list[int]], args: argparse.Namespace, workdir: Path
) -> Side:
    from memlm.encoder import Encoder
    from memlm.engine import Engine
    from memlm.index import IndexParams
    from memlm.knnlm import KnnParams
    from memlm.memory import open_memory

    enc = Encoder.load(threads=args.threads, precision=precision)
    window = WindowConfig()
    enc.encode_ids(memory[0][:256], window)  # warm-up: the first forward allocates
    data = workdir / f"memlm-{precision}"
    mem = open_memory(None, data, enc.dim, key_precision=enc.precision)
    t0 = time.perf_counter()
    with mem.writer():
        for doc, ids in enumerate(memory):
            o = enc.encode_ids(ids, window)
            mem.put_document(doc, o.keys, o.targets, o.positions, DAY)
    save_s = time.perf_counter() - t0
    n = mem.count()
    params = IndexParams.for_size(n, enc.dim)
    mem.build(params)
    mem.close()
    knn = KnnParams(k=args.k, temperature=args.temperature, lmbda=args.lmbda)
    eng = Engine.open(data, encoder=enc, knn=knn, grid=None, policy="fullmem")
    eng.reload_index()

    def score(ids: list[int]) -> tuple[float, int]:
        res = eng.score_ids(ids)
        assert set(res.lambdas) == {args.lmbda}, "a constant lambda on every token"
        return float(np.sum(res.logprobs)), len(res.logprobs)

    return Side(
        f"memlm {precision}",
        n,
        params.kind,
        sum(len(d) - 1 for d in memory) / save_s,
        score,
        lambda ids: enc.encode_ids(ids, window),
    )


# --- the peer ------------------------------------------------------------------------------


def load_peer(peer_dir: Path) -> ModuleType:
    """The peer's ``knnlm`` module, imported from its checkout, with ``llama`` keys."""
    path = peer_dir / "knnlm.py"
    if not path.exists():
        raise SystemExit(f"{path}: not found (fetch neulab/knn-transformers there)")
    spec = importlib.util.spec_from_file_location("knnlm_peer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # The same key as memlm's: the input of the last decoder layer's MLP (after its norm).
    layers = mod.KNNWrapper.model_layer_to_capture
    layers.setdefault(
        "llama", {mod.KEY_TYPE.last_ffn_input: (lambda m: m.base_model.layers[-1].mlp, True)}
    )
    mod.faiss = _FaissForPeer()
    return mod


class _ExactAsIVF:
    """The flat index as the peer handles an IVF one: it sets ``nprobe`` and asks for a
    direct map (for ``reconstruct``, which a flat index does without); search unchanged."""

    def __init__(self, index: Any) -> None:
        self.index = index
        self.nprobe = 0

    def make_direct_map(self) -> None:
        pass

    def search(self, x: Any, k: int) -> Any:
        return self.index.search(x, k)


class _FaissForPeer:
    """``faiss`` as the peer's module sees it: ``read_index`` wraps what it reads."""

    def __getattr__(self, name: str) -> Any:
        return getattr(faiss, name)

    @staticmethod
    def read_index(path: str, flags: int = 0) -> _ExactAsIVF:
        return _ExactAsIVF(faiss.read_index(path, flags))


def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    from memlm.encoder import BUNDLED_MODEL, cache_dir

    folder = cache_dir() / "models" / BUNDLED_MODEL  # converted by Encoder.load
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _nll(model: Any, windows: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    """Summed loss and scored targets of ``windows`` (the HF mean loss times its count)."""
    total, count = 0.0, 0
    for inputs, labels in windows:
        lab = torch.tensor([labels])
        out = model(input_ids=torch.tensor([inputs]), labels=lab)
        n = int((lab[:, 1:] != -100).sum())
        total += float(out.loss) * n
        count += n
    return total, count


@torch.inference_mode()
def peer_side(memory: list[list[int]], args: argparse.Namespace, workdir: Path) -> list[Side]:
    """The peer's kNN-LM (and the same HF model without it), its memory saved and indexed."""
    peer = load_peer(args.peer_dir)
    window = WindowConfig()
    size = sum(len(d) - 1 for d in memory)
    dim = 576
    folder = workdir / "peer"
    model = hf_model()
    _nll(model, labelled_windows(memory[0][:256], window))  # warm-up
    saver = peer.KNNSaver(dstore_size=size, dstore_dir=str(folder), dimension=dim)
    saver.break_into(model)
    t0 = time.perf_counter()
    for ids in memory:
        _nll(model, labelled_windows(ids, window))
    save_s = time.perf_counter() - t0
    saver.break_out()
    assert saver.dstore_idx == size, (saver.dstore_idx, size)
    keys = np.asarray(saver.dstore_keys, dtype=np.float32)
    flat = faiss.IndexFlatL2(dim)  # exact, where its build_index makes IVF-PQ
    flat.add(keys)
    faiss.write_index(flat, peer.get_index_path(str(folder), "llama", size, dim))
    del saver, keys

    wrapper = peer.KNNWrapper(
        dstore_size=size,
        dstore_dir=str(folder),
        dimension=dim,
        knn_sim_func=peer.DIST.l2,
        knn_gpu=False,
        move_dstore_to_mem=True,
        k=args.k,
        lmbda=args.lmbda,
        knn_temp=args.temperature,
    )
    wrapper.break_into(model)
    bare = hf_model()

    @torch.inference_mode()
    def score(m: Any, ids: list[int]) -> tuple[float, int]:
        nll, n = _nll(m, labelled_windows(ids, window))
        return -nll, n

    return [
        Side(
            "knn-transformers float32",
            size,
            "flat",
            size / save_s,
            lambda ids: score(model, ids),
            lambda ids: score(bare, ids),
        ),
    ]


def evaluate(sides: list[Side], evaluation: list[list[int]]) -> list[dict[str, Any]]:
    """Every side's kNN-LM and bare forward on each document in turn, the order rotated
    document by document, so that a change of the machine's load reaches all alike."""
    paths = [(i, kind) for i in range(len(sides)) for kind in ("knn", "bare")]
    seconds = {p: 0.0 for p in paths}
    logprob = [0.0] * len(sides)
    tokens = [0] * len(sides)
    for j, ids in enumerate(evaluation):
        r = j % len(paths)
        for i, kind in paths[r:] + paths[:r]:
            t0 = time.perf_counter()
            if kind == "knn":
                lp, n = sides[i].knn(ids)
                logprob[i] += lp
                tokens[i] += n
            else:
                sides[i].bare(ids)
            seconds[(i, kind)] += time.perf_counter() - t0
    return [
        {
            "side": s.name,
            "entries": s.entries,
            "index": s.index,
            "save tok/s": s.save_tps,
            "ppl": math.exp(-logprob[i] / tokens[i]),
            "tokens": tokens[i],
            "kNN-LM tok/s": tokens[i] / seconds[(i, "knn")],
            "bare tok/s": tokens[i] / seconds[(i, "bare")],
        }
        for i, s in enumerate(sides)
    ]


# --- the table -----------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    peer = next((r for r in rows if r["side"].startswith("knn-transformers")), None)
    body = []
    for r in rows:
        vs_peer = f"{r['kNN-LM tok/s'] / peer['kNN-LM tok/s']:.2f}x" if peer else "-"
        body.append(
            [
                r["side"],
                f"{r['entries']:,} {r['index']}",
                f"{r['save tok/s']:,.0f}",
                f"{r['ppl']:.4f}",
                f"{r['kNN-LM tok/s']:,.0f}",
                f"{r['bare tok/s']:,.0f}",
                f"{r['kNN-LM tok/s'] / r['bare tok/s']:.2f}x",
                vs_peer,
            ]
        )
    header = [
        "implementation",
        "memory",
        "save tok/s",
        "kNN-LM ppl",
        "kNN-LM tok/s",
        "own bare fwd tok/s",
        "kNN-LM / bare",
        "vs peer",
    ]
    return markdown_table(header, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peer-dir", type=Path, default=None, help="knn-transformers checkout")
    ap.add_argument("--memory-tokens", type=int, default=20_000)
    ap.add_argument("--eval-tokens", type=int, default=3_000)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=5.0)
    ap.add_argument("--lmbda", type=float, default=0.25)
    ap.add_argument("--precisions", default="bfloat16,float32", help="memlm's")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", "1")))
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from memlm.corpus import load_news
    from memlm.encoder import bundled_tokenizer_path

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    docs = [tok(d.text, add_special_tokens=False)["input_ids"] for d in load_news()[:200]]
    memory, evaluation = split_tokens(docs, args.memory_tokens, args.eval_tokens)
    print(
        f"# memory {len(memory)} articles, evaluation {len(evaluation)} articles; "
        f"k {args.k}, T {args.temperature}, lambda {args.lmbda}; threads {args.threads}; "
        f"torch {torch.__version__}, faiss {faiss.__version__}; load {load_average()}",
        flush=True,
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="knnt-"))
    sides = []
    for precision in args.precisions.split(","):
        sides.append(memlm_side(precision, memory, args, workdir))
        print(
            f"# {sides[-1].name}: memory saved, {sides[-1].save_tps:.0f} tok/s; load {load_average()}"
        )
    if args.peer_dir is None:
        print("# no --peer-dir: the peer's rows are not measured")
    else:
        sides.extend(peer_side(memory, args, workdir))
        print(
            f"# {sides[-1].name}: memory saved, {sides[-1].save_tps:.0f} tok/s; load {load_average()}"
        )
    print(f"# evaluating, every path on each document in turn; load {load_average()}", flush=True)
    rows = evaluate(sides, evaluation)
    print()
    print(table(rows))
    print(f"\nload after: {load_average()}")


if __name__ == "__main__":
    main()
