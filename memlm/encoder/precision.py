"""The precision the encoder's transformer runs in (``MEMLM_PRECISION``), chosen by measuring.

``float32`` is the reference. ``bfloat16`` / ``float16`` cast the transformer's weights;
``int8`` is torch's dynamic quantisation of its Linear layers (weights int8, activations
quantised per batch; a CPU kernel). Whatever the transformer runs in, the encoder returns
float32 keys and hidden states, and the logits, log-sum-exp, log-softmax, entropy and
the kNN interpolation are float32 (memlm.encoder.core). The LM head's product runs in
float32 too, except under bfloat16 / float16, where it runs in that dtype with each token's
largest logits recomputed in float32 (memlm.encoder.head, ``HALF_HEAD``).

``auto`` (the service's default) probes once per processor kind and model
(:func:`auto_precision`): it times the model's own matmul shapes in every candidate
precision, interleaved, and measures each candidate's perplexity on a fixed bundled text
(``probe_text.txt``, about 2k tokens, written for this project). It picks the fastest
candidate whose perplexity is within 0.5% of float32's and that beats float32's time by at
least 10% (a tie is not worth any loss of accuracy). Processors of one machine kind differ
(DATA.md: bf16 2.3x float32 on one, 3.5x slower on another), so nothing is assumed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlm.encoder.device import candidate_precisions, processor_id
from memlm.encoder.loading import EncoderError, cache_dir
from memlm.locks import FileLock

log = logging.getLogger("memlm.encoder")

PRECISIONS = ("float32", "bfloat16", "float16", "int8")
SETTING_PATTERN = r"^(auto|float32|bfloat16|float16|int8)$"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Precisions whose LM head product runs in their own dtype, the largest logits rescored in
# float32 (memlm.encoder.head); the others run the head in float32.
HALF_HEAD = ("bfloat16", "float16")
PPL_TOLERANCE = 0.005  # a candidate's perplexity may differ from float32's by 0.5% at most
MIN_SPEEDUP = 1.10  # ... and must be this much faster: within timing noise, keep float32
PROBE_ROWS = 512  # tokens per timed matmul: one 512-token window, the encoder's unit
# Interleaved rounds; the best time of each shape is kept. On a shared machine single
# calls vary 10x (measured at load 16 on 2 cores), so the minimum needs several samples.
PROBE_REPEATS = 5
PROBE_TEXT = Path(__file__).with_name("probe_text.txt")
PROBE_TOKENS = 2048


def check_precision(precision: str, device: torch.device) -> str:
    """A concrete precision usable on ``device``; raises EncoderError otherwise."""
    if precision not in PRECISIONS:
        raise EncoderError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "int8" and device.type != "cpu":
        raise EncoderError("precision int8 (dynamic quantisation) runs on the CPU only")
    return precision


def quantise_int8(module: nn.Module) -> nn.Module:
    """torch's dynamic int8 quantisation of every nn.Linear under ``module`` (in place)."""
    with warnings.catch_warnings():
        # torch.ao.quantization announces its move to torchao (and its quantised tensors'
        # deprecation); the kernels are still torch's own, and work
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantiz", category=UserWarning)
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)


def cast_model(model: Any, precision: str) -> Any:
    """The HF causal LM with its transformer in ``precision`` (in place; returns it)."""
    if precision == "int8":
        if not any(isinstance(m, nn.Linear) for m in model.base_model.modules()):
            raise EncoderError(
                f"{type(model).__name__} has no nn.Linear layers (GPT-2 uses Conv1D): "
                "int8 dynamic quantisation would change nothing"
            )
        quantise_int8(model.base_model)
        return model
    return model.to(DTYPES[precision])


# --- timing ---------------------------------------------------------------------------------


def matmul_shapes(model: Any) -> Counter[tuple[int, int]]:
    """(in, out) of every weight matmul of the transformer, with how often it runs."""
    shapes: Counter[tuple[int, int]] = Counter()
    for m in model.base_model.modules():
        if isinstance(m, nn.Linear):
            shapes[(m.in_features, m.out_features)] += 1
        elif type(m).__name__ == "Conv1D":  # GPT-2's transposed Linear, weight (in, out)
            shapes[(int(m.weight.shape[0]), int(m.weight.shape[1]))] += 1
    return shapes


def _timed_op(
    precision: str, n_in: int, n_out: int, rows: int, device: torch.device
) -> Callable[[], Any]:
    """A (rows, n_in) x (n_in, n_out) product as the encoder would run it in ``precision``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=gen)
    lin = nn.Linear(n_in, n_out, bias=False)
    if precision == "int8":
        qlin = quantise_int8(nn.Sequential(lin))
        return lambda: qlin(x)
    dtype = DTYPES[precision]
    xd, w = x.to(device, dtype), lin.weight.detach().to(device, dtype)
    return lambda: torch.nn.functional.linear(xd, w)


@torch.inference_mode()
def time_matmuls(
    shapes: Counter[tuple[int, int]],
    precisions: Sequence[str],
    device: torch.device,
    rows: int = PROBE_ROWS,
    repeats: int = PROBE_REPEATS,
    head_shapes: Counter[tuple[int, int]] | None = None,
) -> dict[str, float]:
    """Seconds per ``rows`` tokens of the weight matmuls in each precision (best of
    ``repeats`` rounds, precisions interleaved so that a busy spell hits all of them).

    ``head_shapes`` (the LM head) run as the encoder runs them: in the candidate's dtype
    for ``HALF_HEAD`` precisions, in float32 for the others; added to every candidate, so
    that a speed-up is the whole forward's. (The half head's float32 rescoring of a few
    logits per token is not timed: a top-k pass, small beside the product.)
    """
    head = head_shapes or Counter()
    ops = {p: {s: _timed_op(p, *s, rows, device) for s in shapes} for p in precisions}
    for p in {head_precision(p) for p in precisions}:
        ops[f"head {p}"] = {s: _timed_op(p, *s, rows, device) for s in head}
    best = {p: dict.fromkeys(ops[p], math.inf) for p in ops}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for group in ops.values():  # warm-up: first calls pick kernels and fault pages in
        for op in group.values():
            op()
    for _ in range(repeats):
        for p, group in ops.items():
            for s, op in group.items():
                sync()
                t = time.perf_counter()
                op()
                sync()
                best[p][s] = min(best[p][s], time.perf_counter() - t)
    return {
        p: sum(best[f"head {head_precision(p)}"][s] * n for s, n in head.items())
        + sum(best[p][s] * n for s, n in shapes.items())
        for p in precisions
    }


def head_precision(precision: str) -> str:
    """The precision the LM head's product runs in under ``precision`` (memlm.encoder.head)."""
    return precision if precision in HALF_HEAD else "float32"


def head_shape(model: Any) -> Counter[tuple[int, int]]:
    """The LM head's (in, out) (its precision: :func:`head_precision`)."""
    w = model.get_output_embeddings().weight
    return Counter({(int(w.shape[1]), int(w.shape[0])): 1})


@torch.inference_mode()
def matmul_peak(precision: str, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """Peak GFLOP/s (GOP/s for int8) of an n x n x n product in ``precision``."""
    op = _timed_op(precision, n, n, n, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    op()
    best = math.inf
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        op()
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


# --- the decision ---------------------------------------------------------------------------


@dataclass
class ProbeResult:
    """What the probe measured and chose; cached as JSON."""

    precision: str
    seconds: dict[str, float]  # weight-matmul time per PROBE_ROWS tokens, per candidate
    ppl: dict[str, float]  # perplexity on the probe text, for the candidates checked
    rejected: dict[str, str] = field(default_factory=dict)  # why each other candidate lost
    key: dict[str, Any] = field(default_factory=dict)  # what the cache entry is valid for
    created: str = ""

    def summary(self) -> str:
        speed = ", ".join(
            f"{p} {self.seconds['float32'] / s:.2f}x" for p, s in self.seconds.items() if s > 0
        )
        why = "; ".join(f"{p}: {r}" for p, r in self.rejected.items())
        return f"{self.precision} (matmul speed vs float32: {speed}){'; ' + why if why else ''}"


def choose_precision(
    seconds: dict[str, float],
    ppl_of: Callable[[str], float],
    tolerance: float = PPL_TOLERANCE,
    min_speedup: float = MIN_SPEEDUP,
) -> ProbeResult:
    """The fastest candidate within ``tolerance`` of float32's perplexity, else float32.

    ``seconds`` must hold "float32". Candidates are checked fastest first, and only those
    faster than float32 by ``min_speedup``: the quality check is the expensive part.
    ``ppl_of`` may raise (a precision the model cannot run in): that candidate is rejected.
    """
    ref = ppl_of("float32")
    if not math.isfinite(ref):
        raise EncoderError(f"float32 perplexity on the probe text is {ref}")
    base = seconds["float32"]
    out = ProbeResult("float32", dict(seconds), {"float32": ref})
    for p in sorted((p for p in seconds if p != "float32"), key=lambda p: seconds[p]):
        if out.precision != "float32":
            out.rejected[p] = f"slower than {out.precision}"
            continue
        speedup = base / seconds[p] if seconds[p] > 0 else math.inf
        if speedup < min_speedup:
            out.rejected[p] = f"matmuls {speedup:.2f}x float32 (< {min_speedup}x)"
            continue
        try:
            q = ppl_of(p)
        except Exception as exc:  # noqa: BLE001 - any failure only removes the candidate
            out.rejected[p] = f"failed: {type(exc).__name__}: {exc}"
            continue
        out.ppl[p] = q
        delta = (q - ref) / ref
        if not math.isfinite(q) or abs(delta) > tolerance:
            out.rejected[p] = f"ppl {q:.3f} vs {ref:.3f} ({delta:+.2%}, limit {tolerance:.1%})"
            continue
        out.precision = p
    return out


def probe_text_ids(tokenize: Callable[[str], list[int]]) -> list[int]:
    """The probe text's first PROBE_TOKENS tokens."""
    return tokenize(PROBE_TEXT.read_text(encoding="utf-8"))[:PROBE_TOKENS]


def probe_key(model: Any, name: str, device: torch.device, threads: int) -> dict[str, Any]:
    """What a cached choice is valid for: processor kind, model, threads, torch."""
    config = model.config.to_json_string(use_diff=False) if hasattr(model, "config") else ""
    return {
        "processor": processor_id(device),
        "model": name,
        "model_config": hashlib.sha1(config.encode()).hexdigest()[:12],
        "threads": threads,
        "torch": torch.__version__,
        "tolerance": PPL_TOLERANCE,
    }


def auto_precision(
    model: Any,
    name: str,
    device: torch.device,
    threads: int,
    ppl_of: Callable[[str], float],
    *,
    timer: Callable[..., dict[str, float]] | None = None,
    root: Path | None = None,
) -> ProbeResult:
    """The cached choice for this processor and model, or a fresh probe (then cached).

    ``ppl_of(precision)`` is the perplexity of the model run in that precision on the
    probe text; ``timer`` replaces :func:`time_matmuls` (tests inject timings).
    """
    key = probe_key(model, name, device, threads)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = root or cache_dir() / "precision"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.json"
    # one probe at a time: the API and a worker starting together share the first's result
    with FileLock(folder / f".{digest}.lock"):
        cached = _read_cached(path, key)
        if cached is not None:
            log.info("precision %s for %s on %s (cached in %s)", cached.precision, name,
                     key["processor"], path)  # fmt: skip
            return cached
        candidates = candidate_precisions(device)
        shapes = matmul_shapes(model)
        if "int8" in candidates and not any(
            isinstance(m, nn.Linear) for m in model.base_model.modules()
        ):
            candidates.remove("int8")  # nothing to quantise (GPT-2's Conv1D)
        seconds = (timer or time_matmuls)(shapes, candidates, device, head_shapes=head_shape(model))
        result = choose_precision(seconds, ppl_of)
        result.key = key
        result.created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(result), indent=1), encoding="utf-8")
        os.replace(tmp, path)
    log.info("precision probe for %s on %s: %s (cached in %s)", name, key["processor"],
             result.summary(), path)  # fmt: skip
    return result


def _read_cached(path: Path, key: dict[str, Any]) -> ProbeResult | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        result = ProbeResult(**raw)
    except (OSError, ValueError, TypeError):
        return None  # missing or unreadable: probe again
    if result.key != key or result.precision not in PRECISIONS:
        return None
    return result
