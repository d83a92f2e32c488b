"""Where the kNN key comes from: the input of the last decoder layer's MLP (as in kNN-LM),
caught by a forward pre-hook into a list that belongs to the running forward."""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch import nn

from memlm.encoder.loading import EncoderError

# Where the key hook of the forward running in this thread (context) puts what it captures.
# The API executor, the in-process ingest worker and the builder run forwards of one model
# in several threads at once; a capture list owned by the call and found through a
# ContextVar keeps every forward's keys its own (a hook writing to the module or the
# encoder would hand one thread's keys to another).
_KEY_SINK: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "memlm_key_sink", default=None
)
_HOOKED = "_memlm_key_hook"  # attribute marking an MLP that already carries the hook


def _capture_key(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    sink = _KEY_SINK.get()
    if sink is not None:
        sink.append(args[0])


def last_mlp(model: Any) -> nn.Module:
    """The last decoder layer's MLP: its input is the kNN key."""
    base = model.base_model
    for attr in ("layers", "h"):  # Llama family / GPT-2 family
        layers = getattr(base, attr, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            mlp = getattr(layers[-1], "mlp", None)
            if isinstance(mlp, nn.Module):
                return mlp
    raise EncoderError(f"cannot find the last decoder layer's MLP in {type(model).__name__}")


def hook_key(model: Any) -> None:
    """Put the key hook on the model's last MLP (once per module, however many encoders)."""
    mlp = last_mlp(model)
    if not getattr(mlp, _HOOKED, False):
        mlp.register_forward_pre_hook(_capture_key)
        setattr(mlp, _HOOKED, True)


def capture_keys() -> tuple[list[torch.Tensor], contextvars.Token[list[torch.Tensor] | None]]:
    """A fresh sink for the forward this context is about to run; reset the token after."""
    sink: list[torch.Tensor] = []
    return sink, _KEY_SINK.set(sink)


def release_keys(token: contextvars.Token[list[torch.Tensor] | None]) -> None:
    _KEY_SINK.reset(token)
