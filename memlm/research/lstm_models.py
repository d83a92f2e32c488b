"""Short attention spans (Daniluk et al., ICLR 2017): LSTM LMs with a memory of recent outputs.

One class, :class:`ShortSpanLM`, covers the five architectures; they share the embedding,
an LSTM core whose state is zeroed where a document starts, and the softmax layer, and
differ only in how the LSTM output ``h_t`` becomes the representation ``h*_t`` that
scores the next word (``y_t = softmax(W* h*_t + b)``, Eq. 5):

* ``lstm``       -- ``h*_t = tanh(W^x h_t)``: Eq. 4 without the attention term, so that the
  2-gram RNN is exactly this model (same parameters, same outputs).
* ``attention``  -- Eq. 1-4: attention over the previous ``L`` outputs, keys = values = h.
* ``kv``         -- Eq. 6-10: ``h_t = [k_t; v_t]``; keys address, values are read and predict.
* ``kvp``        -- Eq. 11-12: ``h_t = [k_t; v_t; p_t]``; ``p_t`` only predicts.
* ``ngram``      -- Eq. 13: ``h_t = [h^1_t; ...; h^{N-1}_t]`` and
  ``h*_t = tanh(W^N [h^1_t; h^2_{t-1}; ...; h^{N-1}_{t-N+2}])``.  The paper typesets the
  last index as ``t-N+1``, but its text ("the output representations from the previous
  N-1 time steps") and the 2-gram case fix it at ``t-N+2``: N-1 parts from N-1 steps.

The memory (last ``L`` outputs, or last ``N-2`` for the N-gram RNN) is carried across
truncated-BPTT windows like the LSTM state and only holds positions of the current
document: an entry ``d`` steps back is visible iff ``d <= pos_t`` (``pos_t`` = number of
earlier steps of the document).  Tokenisation stays outside (see :mod:`memlm.research.data`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from memlm.research.data import positions_in_document

ARCHS = ("lstm", "attention", "kv", "kvp", "ngram")


@dataclass(frozen=True)
class ShortSpanConfig:
    arch: str
    vocab_size: int
    emb: int = 64  # input word vectors (w in the paper: 300); small for a CPU budget
    hidden: int = 128  # LSTM output size (k for lstm/attention, 2k kv, 3k kvp, (N-1)k ngram)
    window: int = 5  # attention window L; the paper tries 1, 5, 10, 15
    ngram: int = 4  # N of the N-gram RNN; the paper finds 4 best
    init_range: float = 0.1  # uniform(-0.1, 0.1) as in the paper's section 4.1
    forget_bias: float = 1.0  # forget-gate bias 1 (Jozefowicz et al. 2016), section 4.1

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, not {self.arch!r}")
        if self.arch == "ngram" and not 2 <= self.ngram <= 8:
            raise ValueError("ngram must be in 2..8")
        if self.hidden % self.parts:
            raise ValueError(
                f"hidden {self.hidden} must be a multiple of {self.parts} for {self.arch}"
            )
        if self.arch in ("attention", "kv", "kvp") and self.window < 1:
            raise ValueError("window must be at least 1")

    @property
    def parts(self) -> int:
        """Number of equal parts the LSTM output is split into."""
        return _parts(self.arch, self.ngram)

    @property
    def out_dim(self) -> int:
        """Size of h*, the input of the softmax layer (the per-token representation)."""
        return self.hidden // self.parts

    @property
    def memory_len(self) -> int:
        """Number of previous LSTM outputs kept as memory."""
        if self.arch in ("attention", "kv", "kvp"):
            return self.window
        if self.arch == "ngram":
            return self.ngram - 2
        return 0


@dataclass
class ShortSpanState:
    """What carries over from one window to the next (detach it between BPTT windows)."""

    h: torch.Tensor  # (B, H) LSTM output
    c: torch.Tensor  # (B, H) LSTM cell
    memory: torch.Tensor  # (B, M, H) previous LSTM outputs, oldest first
    pos: torch.Tensor  # (B,) long: position in its document of the next step

    def detach(self) -> ShortSpanState:
        return ShortSpanState(self.h.detach(), self.c.detach(), self.memory.detach(), self.pos)


@dataclass
class ShortSpanOutput:
    logits: torch.Tensor  # (B, T, V)
    features: torch.Tensor  # (B, T, d) h*, the softmax input
    state: ShortSpanState
    attention: torch.Tensor | None  # (B, T, L) weights, slot L-1 = previous step; None if no attn
    pos: torch.Tensor  # (B, T) long: position of each step in its document


class ShortSpanLM(nn.Module):
    def __init__(self, cfg: ShortSpanConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, d, w = cfg.hidden, cfg.out_dim, cfg.emb
        self.embed = nn.Embedding(cfg.vocab_size, w)
        # The LSTM is written out (gate order i, f, g, o) because the state must be zeroed
        # per row at document starts inside a window, which nn.LSTM cannot do.
        self.w_ih = nn.Parameter(torch.empty(4 * H, w))
        self.w_hh = nn.Parameter(torch.empty(4 * H, H))
        self.bias = nn.Parameter(torch.empty(4 * H))
        if cfg.arch in ("lstm", "ngram"):
            # W^x of Eq. 4 for lstm, W^N of Eq. 13 for ngram: same name, so ngram N=2 == lstm
            self.proj = nn.Linear(cfg.parts * d, d, bias=False)
        else:
            self.w_y = nn.Linear(d, d, bias=False)  # W^Y, Eq. 1/7
            self.w_h = nn.Linear(d, d, bias=False)  # W^h
            self.w_att = nn.Parameter(torch.empty(d))  # w, Eq. 2/8
            self.w_r = nn.Linear(d, d, bias=False)  # W^r, Eq. 4/10/12
            self.proj = nn.Linear(d, d, bias=False)  # W^x
        self.out = nn.Linear(d, cfg.vocab_size)  # W*, b (untied from the input embedding)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        r = self.cfg.init_range
        for p in self.parameters():
            nn.init.uniform_(p, -r, r)
        H = self.cfg.hidden
        with torch.no_grad():
            self.bias[H : 2 * H].fill_(self.cfg.forget_bias)

    def initial_state(self, batch_size: int, device: torch.device | None = None) -> ShortSpanState:
        H, M = self.cfg.hidden, self.cfg.memory_len
        dev = device if device is not None else self.w_hh.device
        z = torch.zeros(batch_size, H, device=dev)
        return ShortSpanState(
            h=z,
            c=z.clone(),
            memory=torch.zeros(batch_size, M, H, device=dev),
            pos=torch.zeros(batch_size, dtype=torch.long, device=dev),
        )

    def _lstm(
        self, x: torch.Tensor, reset: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gx = self.embed(x) @ self.w_ih.T + self.bias  # (B, T, 4H), one matmul for all steps
        keep = (~reset).to(gx.dtype).unsqueeze(-1)  # (B, T, 1)
        outs = []
        for t in range(x.shape[1]):
            h, c = h * keep[:, t], c * keep[:, t]
            i, f, g, o = (gx[:, t] + h @ self.w_hh.T).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, dim=1), h, c  # (B, T, H)

    def forward(
        self, x: torch.Tensor, reset: torch.Tensor, state: ShortSpanState | None = None
    ) -> ShortSpanOutput:
        """Run one window: ``x`` (B, T) token ids, ``reset`` (B, T) document starts."""
        assert x.dim() == 2 and reset.shape == x.shape and reset.dtype == torch.bool
        cfg = self.cfg
        B, T = x.shape
        if state is None:
            state = self.initial_state(B, x.device)
        hs, h, c = self._lstm(x, reset, state.h, state.c)  # (B, T, H)
        pos = positions_in_document(reset.cpu(), state.pos.cpu()).to(x.device)  # (B, T)
        M = cfg.memory_len
        seq = torch.cat([state.memory, hs], dim=1)  # (B, M+T, H); step t is seq[:, M+t]
        attn = None
        if cfg.arch == "lstm":
            feats = torch.tanh(self.proj(hs))
        elif cfg.arch == "ngram":
            d = cfg.out_dim
            parts = []
            for o in range(cfg.ngram - 1):  # part o+1 of the output o steps back
                part = seq[:, M - o : M - o + T, o * d : (o + 1) * d]  # (B, T, d)
                parts.append(part * (pos >= o).unsqueeze(-1).to(part.dtype))
            feats = torch.tanh(self.proj(torch.cat(parts, dim=-1)))
        else:
            feats, attn = self._attend(seq, hs, pos)
        new_state = ShortSpanState(h=h, c=c, memory=seq[:, seq.shape[1] - M :], pos=pos[:, -1] + 1)
        return ShortSpanOutput(self.out(feats), feats, new_state, attn, pos)

    def _split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key, value, predict) views of LSTM outputs (..., H)."""
        d = self.cfg.out_dim
        if self.cfg.arch == "attention":
            return h, h, h
        if self.cfg.arch == "kv":
            return h[..., :d], h[..., d:], h[..., d:]
        return h[..., :d], h[..., d : 2 * d], h[..., 2 * d :]

    def _attend(
        self, seq: torch.Tensor, hs: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        L, T = self.cfg.window, hs.shape[1]
        keys, values, _ = self._split(seq)  # (B, L+T, d) each
        k_t, _, p_t = self._split(hs)  # (B, T, d)
        # Window of step t = seq[:, t : t+L] (the L outputs before it), slot L-1 = step t-1.
        ky = self.w_y(keys).unfold(1, L, 1)[:, :T]  # (B, T, d, L)
        vw = values.unfold(1, L, 1)[:, :T]  # (B, T, d, L)
        m = torch.tanh(ky + self.w_h(k_t).unsqueeze(-1))  # (B, T, d, L), Eq. 1/7
        scores = torch.einsum("btdl,d->btl", m, self.w_att)  # (B, T, L), Eq. 2/8
        back = torch.arange(L, 0, -1, device=pos.device)  # slot i is L-i steps back
        visible = back.view(1, 1, L) <= pos.unsqueeze(-1)  # (B, T, L): same document only
        scores = scores.masked_fill(~visible, float("-inf"))
        any_visible = visible.any(-1, keepdim=True)
        alpha = torch.softmax(torch.where(any_visible, scores, torch.zeros_like(scores)), -1)
        alpha = alpha * visible.to(alpha.dtype)  # all zero at a document's first step
        r = torch.einsum("btdl,btl->btd", vw, alpha)  # (B, T, d), Eq. 3/9
        feats = torch.tanh(self.w_r(r) + self.proj(p_t))  # Eq. 4/10/12
        return feats, alpha


def count_parameters(cfg: ShortSpanConfig, include_embedding: bool = False) -> int:
    """Parameters of a model; without the input embedding by default (theta_M in the paper)."""
    with torch.device("meta"):
        model = ShortSpanLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    return n if include_embedding else n - model.embed.weight.numel()


def hidden_for_budget(
    budget: int, arch: str, vocab_size: int, max_hidden: int = 4096, **fields: int
) -> int:
    """The hidden size (a multiple of the parts) whose theta_M is closest to ``budget``.

    ``fields`` are the other :class:`ShortSpanConfig` fields (emb, window, ngram).
    """
    base = ShortSpanConfig(arch, vocab_size, hidden=_parts(arch, fields.get("ngram", 4)), **fields)
    step = base.parts

    def count(units: int) -> int:
        return count_parameters(replace(base, hidden=units * step))

    lo, hi = 1, max_hidden // step  # in units of ``step``; theta_M grows with hidden
    while lo < hi:  # the smallest multiple whose count reaches the budget
        mid = (lo + hi) // 2
        if count(mid) < budget:
            lo = mid + 1
        else:
            hi = mid
    best = min((u for u in (lo - 1, lo) if u >= 1), key=lambda u: abs(count(u) - budget))
    return best * step


def _parts(arch: str, ngram: int) -> int:
    return {"lstm": 1, "attention": 1, "kv": 2, "kvp": 3, "ngram": ngram - 1}.get(arch, 1)
