"""MEMLM_DEVICE: device selection with torch's CUDA availability faked, and (on a GPU) the
same document encoded on the CPU and on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.encoder import (
    Encoder,
    EncoderError,
    WindowConfig,
    candidate_precisions,
    processor_id,
    resolve_device,
)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_auto_takes_cuda_when_torch_sees_it(monkeypatch):
    fake_cuda(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(EncoderError, match="sees 2 CUDA device"):
        resolve_device("cuda:2")


def test_auto_takes_the_cpu_without_cuda(monkeypatch):
    fake_cuda(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(EncoderError, match="torch sees no CUDA device.*MEMLM_DEVICE=cpu"):
        resolve_device("cuda")
    with pytest.raises(EncoderError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")


def test_candidates_per_device(monkeypatch):
    assert candidate_precisions(torch.device("cpu")) == ["float32", "bfloat16", "int8"]
    fake_cuda(monkeypatch, 1, bf16=True)
    assert candidate_precisions(torch.device("cuda", 0)) == ["float32", "float16", "bfloat16"]
    fake_cuda(monkeypatch, 1, bf16=False)  # pre-Ampere: no bf16 units
    assert candidate_precisions(torch.device("cuda", 0)) == ["float32", "float16"]


def test_processor_id_names_the_cpu_and_its_flags():
    pid = processor_id(torch.device("cpu"))
    assert pid.startswith("cpu ") and " flags:" in pid
    assert pid == processor_id(torch.device("cpu"))  # stable within a machine


def test_encoder_reports_its_device_and_precision():
    enc = Encoder.load("tiny-llama", threads=1, device="cpu")
    assert enc.device == torch.device("cpu") and enc.precision == "float32"


# --- on a GPU -------------------------------------------------------------------------------

DOC = list(np.random.default_rng(7).integers(5, 2000, size=400))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_cpu_and_cuda_encode_alike(model):
    if not torch.cuda.is_available():
        reason = (
            f"no CUDA device visible to torch {torch.__version__} "
            f"(built for CUDA {torch.version.cuda or 'none'})"
        )
        print(f"SKIP gpu test: {reason}")
        pytest.skip(reason)
    window = WindowConfig(context=128, stride=64, batch_size=4)
    cpu = Encoder.load(model, threads=1, device="cpu").encode_ids(DOC, window)
    gpu_enc = Encoder.load(model, threads=1, device="cuda")
    assert gpu_enc.device.type == "cuda"
    gpu = gpu_enc.encode_ids(DOC, window)
    np.testing.assert_array_equal(cpu.targets, gpu.targets)
    np.testing.assert_allclose(gpu.keys, cpu.keys, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(gpu.target_logprob, cpu.target_logprob, atol=1e-3)
    np.testing.assert_allclose(gpu.lse, cpu.lse, atol=1e-3)
    # exact log-probs after the fact and a decoding step run on the device too
    lp = gpu_enc.logprobs_for(gpu.hidden, gpu.lse, gpu.targets[:, None])[:, 0]
    np.testing.assert_allclose(lp, cpu.target_logprob, atol=1e-3)
    keys, hidden, state = gpu_enc.start([DOC[:20], DOC[:12]], cache=True)
    assert keys.device.type == "cpu" and keys.dtype == torch.float32
    k, h = gpu_enc.extend(state, np.array([0, 1]), np.array([5, 6]))
    assert k.device.type == "cpu" and k.shape == (2, gpu_enc.dim)
    # half precision on the GPU: keys close to float32's
    half = Encoder.load(model, threads=1, device="cuda", precision="float16").encode_ids(
        DOC, window
    )
    cos = (half.keys * cpu.keys).sum(1) / (
        np.linalg.norm(half.keys, axis=1) * np.linalg.norm(cpu.keys, axis=1)
    )
    assert cos.min() > 0.99


@pytest.mark.gpu
def test_continual_finetuning_trains_on_the_encoders_device():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device visible to torch {torch.__version__}")
    import datetime as dt

    from memlm.corpus import Document
    from memlm.evaluate.finetune import FinetuneConfig, continual_finetune
    from memlm.evaluate.plan import DayPlan

    day = dt.date(2021, 3, 1)
    text = " ".join(["the council voted on the budget for the schools"] * 8)
    doc = Document("t", text, day, "src")
    plans = [DayPlan(day, [doc], [], [Document("x", text, day, "src")])]
    window = WindowConfig(context=32, stride=16)
    scores = {}
    for device in ("cpu", "cuda"):
        enc = Encoder.load("tiny-llama", threads=1, device=device)
        out, _ = continual_finetune(enc, plans, window, FinetuneConfig(lr=1e-3), resamples=10)
        scores[device] = out["test_ppl"]
    assert scores["cuda"] == pytest.approx(scores["cpu"], rel=1e-2)
