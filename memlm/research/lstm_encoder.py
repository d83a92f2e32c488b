"""A trained short-attention-span LM behind the :class:`memlm.encoder.Encoder` interface.

The kNN key of a token is ``h*_t``, the representation that enters the softmax layer
(for a recurrent LM this plays the role of the Transformer's last-layer input); the LM
head is the model's softmax layer ``W*, b``.  A document is read in one pass with the
state reset at its start, exactly as in training: the model has no window limit, so the
harness's :class:`~memlm.encoder.WindowConfig` only names the token cache.  As in the
base class, the first token of a document is context only and tokens 1..n-1 are scored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from memlm.encoder import Encoder, TokenOutputs, WindowConfig
from memlm.research.data import WordTokenizer, word_spans
from memlm.research.lstm_models import ShortSpanLM
from memlm.research.lstm_train import load_checkpoint


class ShortSpanEncoder(Encoder):
    """Word-level :class:`ShortSpanLM` checkpoints for ``memlm.evaluate`` and the engine."""

    def __init__(self, model: ShortSpanLM, tokenizer: WordTokenizer, name: str) -> None:
        # The base constructor expects a Hugging Face model; set the same attributes here.
        self.name = name
        self.compute_key_ce = False
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.words = tokenizer  # typed alias: the base class types ``tokenizer`` as object
        self.threads = torch.get_num_threads()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.head_weight = model.out.weight.detach()  # (V, d)
        self.head_bias = model.out.bias.detach()  # (V,)
        self.vocab_size = model.cfg.vocab_size
        self.hidden_dim = model.cfg.out_dim
        self.dim = model.cfg.out_dim  # keys are h*, the head input
        self.max_positions = 1 << 30  # recurrent: any document length

    @classmethod
    def from_checkpoint(cls, path: Path) -> ShortSpanEncoder:
        """Load a checkpoint written by ``memlm train`` or ``benchmarks/short_attention.py``."""
        model, tok = load_checkpoint(Path(path))
        if tok.get("kind") != "word":
            raise ValueError(f"{path}: only word-level checkpoints have a tokenizer here")
        words = tok["words"]
        assert isinstance(words, list)
        tokenizer = WordTokenizer(words, bool(tok.get("lowercase", True)))
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
        cfg = model.cfg
        return cls(model, tokenizer, f"shortspan-{cfg.arch}-L{cfg.window}-{digest}")

    # -- tokens --

    def tokenize(self, text: str) -> list[int]:
        return self.words.encode(text)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.words.words[int(i)] for i in ids]

    def char_offsets(self, text: str) -> list[tuple[int, int]]:
        return word_spans(text)

    # -- forward --

    @torch.inference_mode()
    def encode_many(
        self,
        docs: Sequence[Sequence[int]],
        window: WindowConfig | None = None,
        progress: bool = False,
        *,
        key_ce: bool | None = None,
    ) -> list[TokenOutputs]:
        """Per-token outputs for whole documents (targets ids[1:], state reset per document)."""
        with_key_ce = self.compute_key_ce if key_ce is None else key_ce
        b = self.words.boundary_id
        out = []
        for ids in docs:
            if len(ids) < 2:
                out.append(self.empty_outputs())
                continue
            x = torch.tensor([[b, *ids[:-1]]], dtype=torch.long)  # (1, n): step j predicts ids[j]
            reset = torch.zeros_like(x, dtype=torch.bool)
            reset[0, 0] = True
            feats = self.model(x, reset).features[0, 1:]  # (n-1, d) predicting ids[1:]
            targets = torch.tensor(list(ids[1:]), dtype=torch.long)
            st = self._stats(feats, feats, targets, with_key_ce)
            out.append(
                TokenOutputs(
                    targets=targets.numpy(),
                    positions=np.arange(1, len(ids), dtype=np.int32),
                    keys=feats.numpy().astype(np.float32),
                    hidden=feats.numpy().astype(np.float32),
                    lse=st["lse"].numpy(),
                    target_logprob=st["tlp"].numpy(),
                    top_id=st["top"].numpy().astype(np.int64),
                    top_logprob=st["toplp"].numpy(),
                    entropy=st["ent"].numpy(),
                    key_ce=st["kce"].numpy(),
                    prev_tokens=np.asarray(ids[:-1], np.int64),
                )
            )
        return out

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs per token: 2 x the matmul parameters (the input embedding is a lookup)."""
        n = sum(p.numel() for name, p in self.model.named_parameters() if name != "embed.weight")
        return float(2 * n)
