"""MEMLM_PRECISION: the probe's decision, its cache, and what each precision does to keys."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pytest
import torch

from memlm.encoder import Encoder, EncoderError, WindowConfig, choose_precision
from memlm.encoder import precision as prec
from memlm.encoder.precision import auto_precision, matmul_shapes, probe_text_ids

PPL = {"float32": 20.0, "bfloat16": 20.04, "int8": 20.3}  # bf16 +0.2%, int8 +1.5%


def ppl_from(table: dict[str, float], calls: list[str] | None = None):
    def ppl_of(p: str) -> float:
        if calls is not None:
            calls.append(p)
        return table[p]

    return ppl_of


# --- the decision, with injected timings --------------------------------------------------


def test_fast_bf16_is_chosen():
    calls: list[str] = []
    r = choose_precision({"float32": 1.0, "bfloat16": 0.45, "int8": 0.5}, ppl_from(PPL, calls))
    assert r.precision == "bfloat16"
    assert calls == ["float32", "bfloat16"]  # int8, slower, never needs its quality check
    assert r.rejected == {"int8": "slower than bfloat16"}


def test_slow_bf16_keeps_float32():
    calls: list[str] = []
    r = choose_precision({"float32": 1.0, "bfloat16": 3.5}, ppl_from(PPL, calls))
    assert r.precision == "float32"
    assert calls == ["float32"]
    assert r.rejected["bfloat16"].startswith("matmuls 0.29x float32")


def test_a_tie_keeps_float32():
    # 5% faster is within timing noise on a shared machine: not worth any accuracy
    r = choose_precision({"float32": 1.0, "bfloat16": 0.95}, ppl_from(PPL))
    assert r.precision == "float32"


def test_quality_failure_keeps_float32():
    bad = {"float32": 20.0, "bfloat16": 20.2}  # +1.0% > 0.5%
    r = choose_precision({"float32": 1.0, "bfloat16": 0.4}, ppl_from(bad))
    assert r.precision == "float32"
    assert "+1.00%" in r.rejected["bfloat16"]
    assert r.ppl == {"float32": 20.0, "bfloat16": 20.2}


def test_quality_failure_falls_to_the_next_fastest():
    r = choose_precision(
        {"float32": 1.0, "int8": 0.4, "bfloat16": 0.5}, ppl_from(PPL)
    )  # int8 fastest but +1.5%: bf16 next
    assert r.precision == "bfloat16"
    assert r.rejected["int8"].startswith("ppl 20.300")


def test_a_candidate_that_fails_to_run_is_rejected():
    def ppl_of(p: str) -> float:
        if p == "int8":
            raise RuntimeError("no quantized engine")
        return PPL[p]

    r = choose_precision({"float32": 1.0, "int8": 0.3}, ppl_of)
    assert r.precision == "float32"
    assert r.rejected["int8"] == "failed: RuntimeError: no quantized engine"


def test_nan_perplexity_is_a_quality_failure():
    r = choose_precision(
        {"float32": 1.0, "float16": 0.3}, ppl_from({"float32": 20.0, "float16": float("nan")})
    )
    assert r.precision == "float32"


# --- the cache --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Encoder:
    return Encoder.load("tiny-llama", threads=1)


def _timer(seconds: dict[str, float], calls: list[str]):
    def timer(shapes: Counter, precisions, device, head_shapes) -> dict[str, float]:
        calls.append("timer")
        assert head_shapes == Counter({(32, 49152): 1})  # the head
        assert set(precisions) == {"float32", "bfloat16", "int8"}  # the CPU's candidates
        assert shapes == matmul_shapes_of_tiny_llama()
        return {p: seconds[p] for p in precisions}

    return timer


def matmul_shapes_of_tiny_llama() -> Counter:
    # hidden 32, FFN 64, 4 heads / 2 KV heads of 8: q, o (32->32), k, v (32->16), gate, up
    # (32->64), down (64->32), in each of the 2 layers
    return Counter({(32, 32): 4, (32, 16): 4, (32, 64): 4, (64, 32): 2})


def test_matmul_shapes(tiny):
    assert matmul_shapes(tiny.model) == matmul_shapes_of_tiny_llama()


def test_the_choice_is_cached_per_processor_and_model(tiny, tmp_path, monkeypatch, caplog):
    calls: list[str] = []
    timer = _timer({"float32": 1.0, "bfloat16": 0.4, "int8": 0.7}, calls)
    cpu = torch.device("cpu")
    args = (tiny.model, "tiny-llama", cpu, 1)
    with caplog.at_level(logging.INFO, logger="memlm.encoder"):
        first = auto_precision(*args, ppl_from(PPL, calls), timer=timer, root=tmp_path)
    assert first.precision == "bfloat16"
    assert calls == ["timer", "float32", "bfloat16"]
    assert "precision probe for tiny-llama" in caplog.text and "bfloat16" in caplog.text
    (entry,) = tmp_path.glob("*.json")
    saved = json.loads(entry.read_text())
    assert saved["precision"] == "bfloat16" and saved["key"]["model"] == "tiny-llama"
    assert saved["key"]["processor"].startswith("cpu ")

    calls.clear()
    again = auto_precision(*args, ppl_from(PPL, calls), timer=timer, root=tmp_path)
    assert calls == [] and again.precision == "bfloat16"  # read back, nothing measured

    # another processor kind (or another model) probes again and keeps its own entry
    monkeypatch.setattr(prec, "processor_id", lambda device: "cpu Other CPU flags:0")
    other = auto_precision(*args, ppl_from(PPL, calls), timer=_timer(
        {"float32": 1.0, "bfloat16": 3.0, "int8": 2.0}, calls), root=tmp_path)  # fmt: skip
    assert other.precision == "float32" and calls[0] == "timer"
    calls.clear()
    auto_precision(tiny.model, "tiny-llama-2", cpu, 1, ppl_from(PPL, calls), timer=timer,
                   root=tmp_path)  # fmt: skip
    assert calls == ["timer", "float32", "bfloat16"]
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_a_corrupt_cache_entry_is_probed_again(tiny, tmp_path):
    calls: list[str] = []
    timer = _timer({"float32": 1.0, "bfloat16": 0.4, "int8": 0.7}, calls)
    args = (tiny.model, "tiny-llama", torch.device("cpu"), 1)
    auto_precision(*args, ppl_from(PPL), timer=timer, root=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    calls.clear()
    assert auto_precision(*args, ppl_from(PPL), timer=timer, root=tmp_path).precision == "bfloat16"
    assert calls == ["timer"]


def test_auto_load_probes_for_real_and_runs_the_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path))
    enc = Encoder.load("tiny-llama", threads=1, precision="auto")
    assert enc.probe is not None and enc.precision == enc.probe.precision
    assert set(enc.probe.seconds) == {"float32", "bfloat16", "int8"}
    assert all(s > 0 for s in enc.probe.seconds.values())
    assert len(list((tmp_path / "precision").glob("*.json"))) == 1
    out = enc.encode_ids(list(range(1, 40)))
    assert out.keys.dtype == np.float32 and out.lse.dtype == np.float32


def test_probe_text_is_about_2k_tokens(tiny):
    assert 1500 <= len(probe_text_ids(tiny.tokenize)) <= prec.PROBE_TOKENS


def test_unknown_and_misplaced_precisions_are_refused(tiny):
    with pytest.raises(EncoderError, match="expected one of"):
        Encoder(tiny.model, tiny.tokenizer, "x", 1, precision="fp8")
    with pytest.raises(EncoderError, match="CPU only"):
        prec.check_precision("int8", torch.device("cuda", 0))


def test_int8_refuses_a_model_without_linear_layers():
    enc = Encoder.load("tiny-gpt2", threads=1)  # GPT-2's Conv1D: nothing to quantise
    with pytest.raises(EncoderError, match="Conv1D"):
        Encoder(enc.model, enc.tokenizer, "tiny-gpt2", 1, precision="int8")


# --- what each precision does to keys and log-probs ------------------------------------------

DOCS = [list(np.random.default_rng(s).integers(5, 2000, size=300)) for s in range(6)]


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_low_precision_keys_match_float32_keys(precision):
    """Cosine similarity of keys and exact top neighbours in a small float16 store."""
    ref_enc = Encoder.load("tiny-llama", threads=1)
    low_enc = Encoder.load("tiny-llama", threads=1, precision=precision)
    assert low_enc.precision == precision and low_enc.model.dtype in (torch.bfloat16, torch.float32)
    assert low_enc.flops_per_token(128) == ref_enc.flops_per_token(128)  # int8 too
    window = WindowConfig(context=128, stride=64)
    ref = ref_enc.encode_many(DOCS, window)
    low = low_enc.encode_many(DOCS, window)
    k32 = np.concatenate([o.keys for o in ref])
    klo = np.concatenate([o.keys for o in low])
    assert klo.dtype == np.float32 and klo.shape == k32.shape
    cos = (k32 * klo).sum(1) / np.linalg.norm(k32, axis=1) / np.linalg.norm(klo, axis=1)
    assert cos.min() > 0.99, cos.min()
    # a store of the first 4 documents' float32 keys, in float16 as the datastore keeps them;
    # queries: the last 2 documents, encoded in each precision
    n_mem = sum(len(o) for o in ref[:4])
    store = k32[:n_mem].astype(np.float16).astype(np.float32)

    def top(q: np.ndarray, k: int) -> np.ndarray:
        d = (q**2).sum(1)[:, None] - 2 * q @ store.T + (store**2).sum(1)[None, :]
        return np.argsort(d, axis=1, kind="stable")[:, :k]

    t32, tlo = top(k32[n_mem:], 8), top(klo[n_mem:], 8)
    same_first = (t32[:, 0] == tlo[:, 0]).mean()
    overlap = np.mean([len(set(a) & set(b)) / 8 for a, b in zip(t32, tlo, strict=True)])
    assert same_first >= 0.95, same_first
    assert overlap >= 0.9, overlap
    # the LM statistics stay float32 and close
    lp32 = np.concatenate([o.target_logprob for o in ref])
    lplo = np.concatenate([o.target_logprob for o in low])
    assert lplo.dtype == np.float32
    assert np.abs(lp32 - lplo).mean() < 0.02


def test_head_and_statistics_are_float32_in_bfloat16():
    enc = Encoder.load("tiny-llama", threads=1, precision="bfloat16")
    assert enc.model.dtype == torch.bfloat16 and enc.head_weight.dtype == torch.float32
    out = enc.encode_ids(DOCS[0][:50])
    # logprobs_for recomputes log p from the float32 head: it agrees with the encoder's
    lp = enc.logprobs_for(out.hidden, out.lse, out.targets[:, None])[:, 0]
    np.testing.assert_allclose(lp, out.target_logprob, atol=1e-4)
    full = enc.full_logprobs(out.hidden)
    assert full.dtype == np.float32
    np.testing.assert_allclose(np.exp(full).sum(1), 1.0, atol=1e-4)


# --- out of memory ---------------------------------------------------------------------------


def test_out_of_memory_halves_the_batch_and_retries(monkeypatch, caplog):
    enc = Encoder.load("tiny-llama", threads=1)
    window = WindowConfig(context=64, stride=32, batch_size=8)
    want = enc.encode_many(DOCS[:3], window)
    real = enc._forward
    sizes: list[int] = []

    def forward(batch, mask, **kw):
        sizes.append(batch.shape[0])
        if batch.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch, mask, **kw)

    monkeypatch.setattr(enc, "_forward", forward)
    with caplog.at_level(logging.WARNING, logger="memlm.encoder"):
        got = enc.encode_many(DOCS[:3], window)
    assert sizes[:3] == [8, 4, 2] and set(sizes[3:]) <= {1, 2}
    assert enc.batch_cap == 2
    assert "out of memory at 8 windows" in caplog.text and "retrying with 2" in caplog.text
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.targets, b.targets)
        np.testing.assert_allclose(a.keys, b.keys, atol=1e-5)
    sizes.clear()
    enc.encode_many(DOCS[:1], window)
    assert max(sizes) == 2  # the next call starts from the size that fit


def test_out_of_memory_at_one_window_is_raised(monkeypatch):
    enc = Encoder.load("tiny-llama", threads=1)

    def forward(batch, mask, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(enc, "_forward", forward)
    with pytest.raises(torch.OutOfMemoryError):
        enc.encode_many(DOCS[:1], WindowConfig(context=64, stride=32, batch_size=2))


def test_other_errors_are_not_retried(monkeypatch):
    enc = Encoder.load("tiny-llama", threads=1)
    calls: list[int] = []

    def forward(batch, mask, **kw):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(enc, "_forward", forward)
    with pytest.raises(RuntimeError, match="boom"):
        enc.encode_many(DOCS[:1], WindowConfig(context=64, stride=32, batch_size=4))
    assert calls == [1]


def test_the_probe_times_the_head_as_the_encoder_runs_it(monkeypatch):
    """bfloat16 runs its head product in bfloat16 (memlm.encoder.head); int8 in float32."""
    made: list[tuple[str, int, int]] = []
    real = prec._timed_op

    def timed_op(p, n_in, n_out, rows, device):
        made.append((p, n_in, n_out))
        return real(p, n_in, n_out, rows, device)

    monkeypatch.setattr(prec, "_timed_op", timed_op)
    cpu = torch.device("cpu")
    body, head = Counter({(8, 8): 2}), Counter({(8, 64): 1})
    out = prec.time_matmuls(body, ["float32", "bfloat16", "int8"], cpu, rows=4, repeats=1,
                            head_shapes=head)  # fmt: skip
    assert set(out) == {"float32", "bfloat16", "int8"} and all(s > 0 for s in out.values())
    heads = sorted(p for p, _, n_out in made if n_out == 64)
    assert heads == ["bfloat16", "float32"]  # int8 shares float32's head timing
