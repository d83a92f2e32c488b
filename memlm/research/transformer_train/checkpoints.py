"""Checkpoints (HF folder + trainer state, resumable exactly) and the final model folder."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlm.research.transformer_train.objective import TrainConfig

STATE_FILE = "trainer_state.pt"
# Fields that do not change the weights a run ends with: a run may resume with other values.
OPERATIONAL_FIELDS = ("save_every", "keep_checkpoints", "threads")


def resume_key(config: dict[str, Any]) -> dict[str, Any]:
    """A run's configuration (``asdict(TrainConfig)``) without the operational fields."""
    return {k: v for k, v in config.items() if k not in OPERATIONAL_FIELDS}


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """An HF tokenizer (``save_pretrained``) or memlm's word vocabulary (``save``)."""
    if tokenizer is None:
        return
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    else:
        tokenizer.save(folder / "word_tokenizer.json")


def _write_model_folder(
    folder: Path, model: nn.Module, tokenizer: Any, extra: Callable[[Path], None]
) -> None:
    """HF model + tokenizer + ``extra(tmp)`` files into a temp dir, then renamed into place.

    An existing ``folder`` is moved aside first and deleted after: at every moment either
    the old or the new folder is complete.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        model.save_pretrained(tmp)  # type: ignore[operator]
        save_tokenizer(tokenizer, tmp)
        extra(tmp)
        if folder.exists():
            old = folder.with_name(f".{folder.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(
    folder: Path,
    model: nn.Module,
    tokenizer: Any,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    cfg: TrainConfig,
    history: list[dict[str, float]],
) -> None:
    """Write an HF folder + trainer state to a temp dir, then rename it into place."""

    def state(tmp: Path) -> None:
        torch.save(
            {
                "step": step,
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "config": asdict(cfg),
                "history": history,
            },
            tmp / STATE_FILE,
        )

    _write_model_folder(folder, model, tokenizer, state)


def load_checkpoint(
    ckpt: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    cfg: TrainConfig,
) -> tuple[int, list[dict[str, float]]]:
    """Restore weights, optimizer, schedule and RNG from ``ckpt``; its step and history.

    Refuses a checkpoint written with another configuration (operational fields aside).
    """
    from safetensors.torch import load_file

    # weights_only: a checkpoint folder is data, never code to run (plain dicts, lists,
    # numbers and tensors are all that save_checkpoint writes)
    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    saved, wanted = resume_key(state["config"]), resume_key(asdict(cfg))
    if saved != wanted:
        diff = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
        raise ValueError(f"{ckpt} was written with another configuration ({', '.join(diff)})")
    weights = load_file(str(ckpt / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:  # a tied lm_head is not stored
        raise ValueError(f"{ckpt}: missing {missing}, unexpected {unexpected}")
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"]), list(state["history"])


def saved_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoint folders under ``out_dir/checkpoints``, by increasing step."""
    root = out_dir / "checkpoints"
    found = [p for p in root.glob("step-*") if (p / STATE_FILE).exists()] if root.exists() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    for old in saved_checkpoints(out_dir)[: -max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint folder with the highest step under ``out_dir/checkpoints``."""
    found = saved_checkpoints(out_dir)
    return found[-1] if found else None


def save_final(
    out_dir: Path,
    model: nn.Module,
    tokenizer: Any,
    cfg: TrainConfig,
    history: list[dict[str, float]],
) -> None:
    """``out_dir/model``: HF folder + tokenizer + ``memlm_train.json``, renamed into place."""

    def meta(tmp: Path) -> None:
        final_loss = history[-1]["loss"] if history else None
        text = json.dumps({"train_config": asdict(cfg), "final_loss": final_loss}, indent=2)
        (tmp / "memlm_train.json").write_text(text)

    _write_model_folder(out_dir / "model", model, tokenizer, meta)
