"""Where the encoder runs (``MEMLM_DEVICE=auto|cpu|cuda[:N]``) and what identifies it.

``auto`` takes the first CUDA device when torch sees one, and the CPU otherwise. Asking
for CUDA where torch sees none is an error rather than a silent fall back to the CPU:
a GPU worker that quietly ran on its host's cores would be a hundred times slower and
nobody would know why.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import re

import torch

from memlm.encoder.loading import EncoderError

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device of a ``MEMLM_DEVICE`` value; raises EncoderError when unusable."""
    spec = spec.strip().lower()
    if not re.match(DEVICE_PATTERN, spec):
        raise EncoderError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        raise EncoderError(
            f"device {spec!r}: torch sees no CUDA device (torch {torch.__version__}, built "
            f"for CUDA {torch.version.cuda or 'none'}); use MEMLM_DEVICE=cpu or auto"
        )
    index = int(spec.split(":")[1]) if ":" in spec else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise EncoderError(f"device {spec!r}: torch sees {count} CUDA device(s) (0..{count - 1})")
    return torch.device("cuda", index)


def candidate_precisions(device: torch.device) -> list[str]:
    """Precisions the probe may choose on ``device`` (float32 first: the reference)."""
    if device.type == "cuda":
        out = ["float32", "float16"]
        if torch.cuda.is_bf16_supported():
            out.append("bfloat16")
        return out
    # int8 is torch's dynamic quantisation of Linear layers, a CPU-only kernel
    return ["float32", "bfloat16", "int8"]


@functools.cache
def _cpu_model_and_flags() -> tuple[str, str]:
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:  # not Linux: the platform's name is all there is
        pass
    return name or platform.processor() or platform.machine(), flags


def processor_id(device: torch.device) -> str:
    """Identifies the processor kind, for the precision cache: name plus a flags digest.

    Machines of one kind can get different processors (DATA.md: fast bf16 on one, slow on
    another), so the cached choice of one must never be reused on the other.
    """
    if device.type == "cuda":
        index = device.index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm{major}{minor}"
    name, flags = _cpu_model_and_flags()
    return f"cpu {name} flags:{hashlib.sha1(flags.encode()).hexdigest()[:12]}"


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the error a device raises when a batch does not fit its memory."""
    return isinstance(exc, torch.OutOfMemoryError)


def free_cached_memory(device: torch.device) -> None:
    """Give the blocks the failed batch held back to the device before a retry."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
