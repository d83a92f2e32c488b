import pytest
import torch

from memlm.research.lstm_models import (
    ShortSpanConfig,
    ShortSpanLM,
    count_parameters,
    hidden_for_budget,
)

V = 50


def _model(arch: str, hidden: int = 12, seed: int = 0, **kw: int) -> ShortSpanLM:
    torch.manual_seed(seed)
    return ShortSpanLM(ShortSpanConfig(arch, V, emb=8, hidden=hidden, **kw))


def _inputs(B: int = 3, T: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[:, 0] = True
    reset[1, 4] = True  # a second document starts at step 4 of row 1
    return x, reset


@pytest.mark.parametrize(
    ("arch", "kw", "hidden", "d", "mem", "att"),
    [
        ("lstm", {}, 12, 12, 0, None),
        ("attention", {"window": 4}, 12, 12, 4, 4),
        ("kv", {"window": 3}, 12, 6, 3, 3),
        ("kvp", {"window": 5}, 12, 4, 5, 5),
        ("ngram", {"ngram": 2}, 12, 12, 0, None),
        ("ngram", {"ngram": 4}, 12, 4, 2, None),
        ("ngram", {"ngram": 5}, 12, 3, 3, None),
    ],
)
def test_shapes(arch, kw, hidden, d, mem, att):
    model = _model(arch, hidden, **kw)
    assert (model.cfg.out_dim, model.cfg.memory_len) == (d, mem)
    x, reset = _inputs()
    out = model(x, reset)
    assert out.logits.shape == (3, 9, V)
    assert out.features.shape == (3, 9, d)
    assert out.state.h.shape == out.state.c.shape == (3, hidden)
    assert out.state.memory.shape == (3, mem, hidden)
    assert out.state.pos.tolist() == [9, 5, 9]
    assert out.pos[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    if att is None:
        assert out.attention is None
    else:
        assert out.attention is not None and out.attention.shape == (3, 9, att)


def test_config_checks_and_parts():
    with pytest.raises(ValueError, match="multiple of 3"):
        ShortSpanConfig("kvp", V, hidden=10)
    with pytest.raises(ValueError, match="multiple of 2"):
        ShortSpanConfig("kv", V, hidden=9)
    with pytest.raises(ValueError, match="arch"):
        ShortSpanConfig("gru", V)
    with pytest.raises(ValueError, match="ngram"):
        ShortSpanConfig("ngram", V, hidden=12, ngram=1)
    assert ShortSpanConfig("ngram", V, hidden=12, ngram=4).parts == 3


def test_initialisation_as_in_the_paper():
    model = _model("kvp", hidden=12, window=3)
    H = 12
    assert torch.equal(model.bias[H : 2 * H], torch.ones(H))
    for name, p in model.named_parameters():
        values = p.detach().flatten()
        if name == "bias":
            values = torch.cat([values[:H], values[2 * H :]])
        assert float(values.abs().max()) <= 0.1, name


def test_attention_masks_follow_document_positions():
    model = _model("attention", window=4)
    x, reset = _inputs()
    with torch.no_grad():
        a = model(x, reset).attention
    assert a is not None
    # step t of a document sees min(t, L) slots, the most recent ones
    for t in range(9):
        visible = min(t, 4)
        assert int((a[0, t] > 0).sum()) == visible
        assert torch.all(a[0, t, : 4 - visible] == 0)
        if visible:
            assert float(a[0, t].sum()) == pytest.approx(1.0, abs=1e-6)
    # row 1: the document restarting at step 4 sees nothing of the first one
    assert torch.all(a[1, 4] == 0)
    assert int((a[1, 5] > 0).sum()) == 1 and int((a[1, 6] > 0).sum()) == 2


def _reference_attention(model: ShortSpanLM, hs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Eq. 1-4 / 7-10 / 12 step by step over explicit windows of earlier outputs."""
    L = model.cfg.window
    k_all, v_all, p_all = model._split(hs)
    feats = torch.zeros(hs.shape[0], hs.shape[1], model.cfg.out_dim)
    for b in range(hs.shape[0]):
        for t in range(hs.shape[1]):
            n = min(L, int(pos[b, t]))
            p = model.proj(p_all[b, t])
            if n == 0:
                feats[b, t] = torch.tanh(p)
                continue
            keys = k_all[b, t - n : t]  # (n, d): only earlier steps of this document
            vals = v_all[b, t - n : t]
            m = torch.tanh(model.w_y(keys) + model.w_h(k_all[b, t]))
            alpha = torch.softmax(m @ model.w_att, 0)
            feats[b, t] = torch.tanh(model.w_r(alpha @ vals) + p)
    return feats


@pytest.mark.parametrize("arch", ["attention", "kv", "kvp"])
def test_attention_equals_reference_over_the_previous_window(arch):
    model = _model(arch, window=3)
    x, reset = _inputs()
    with torch.no_grad():
        out = model(x, reset)
        hs, _, _ = model._lstm(x, reset, torch.zeros(3, 12), torch.zeros(3, 12))
        ref = _reference_attention(model, hs, out.pos)
    torch.testing.assert_close(out.features, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["attention", "kv", "kvp", "ngram"])
def test_outputs_depend_on_past_only(arch):
    model = _model(arch, window=3)
    x, reset = _inputs()
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % V  # change the future from step 6 on
    with torch.no_grad():
        a, b = model(x, reset).logits, model(y, reset).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6], b[:, 6])
    # row 1: the document starting at step 4 ignores the one before it
    z = x.clone()
    z[1, :4] = (z[1, :4] + 7) % V
    with torch.no_grad():
        c = model(z, reset).logits
    torch.testing.assert_close(a[1, 4:], c[1, 4:], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arch", "kw"), [("attention", {"window": 4}), ("kvp", {"window": 5}), ("ngram", {"ngram": 4})]
)
def test_state_and_memory_carry_across_windows(arch, kw):
    model = _model(arch, **kw)
    x, reset = _inputs(T=12)
    with torch.no_grad():
        whole = model(x, reset)
        first = model(x[:, :5], reset[:, :5])
        second = model(x[:, 5:], reset[:, 5:], first.state)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole.logits)
    if whole.attention is not None:
        assert second.attention is not None
        torch.testing.assert_close(second.attention, whole.attention[:, 5:])


def test_ngram_uses_earlier_parts():
    model = _model("ngram", ngram=4)  # parts of 4: h^1_t, h^2_{t-1}, h^3_{t-2}
    x, reset = _inputs()
    with torch.no_grad():
        out = model(x, reset)
        hs, _, _ = model._lstm(x, reset, torch.zeros(3, 12), torch.zeros(3, 12))
        b, t = 0, 5
        cat = torch.cat([hs[b, t, 0:4], hs[b, t - 1, 4:8], hs[b, t - 2, 8:12]])
        torch.testing.assert_close(out.features[b, t], torch.tanh(model.proj(cat)))
        # first step of row 1's second document: earlier parts are zero
        cat = torch.cat([hs[1, 4, 0:4], torch.zeros(8)])
        torch.testing.assert_close(out.features[1, 4], torch.tanh(model.proj(cat)))


def test_two_gram_rnn_is_the_lstm_output_path():
    lstm, two = _model("lstm", seed=5), _model("ngram", seed=5, ngram=2)
    assert lstm.state_dict().keys() == two.state_dict().keys()
    for k, v in lstm.state_dict().items():
        assert torch.equal(v, two.state_dict()[k]), k
    x, reset = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(lstm(x, reset).logits, two(x, reset).logits, rtol=0, atol=0)
        other = _model("ngram", seed=9, ngram=2)
        other.load_state_dict(lstm.state_dict())
        torch.testing.assert_close(other(x, reset).logits, lstm(x, reset).logits, rtol=0, atol=0)


def test_parameter_count_and_budget():
    cfg = ShortSpanConfig("lstm", 1000, emb=16, hidden=20)
    lstm_core = 4 * 20 * (16 + 20) + 4 * 20
    assert count_parameters(cfg) == lstm_core + 20 * 20 + 1000 * 20 + 1000
    assert count_parameters(cfg, include_embedding=True) == count_parameters(cfg) + 1000 * 16
    budget = count_parameters(cfg)
    for arch, kw, parts in [("kvp", {"window": 5}, 3), ("ngram", {"ngram": 5}, 4), ("kv", {}, 2)]:
        h = hidden_for_budget(budget, arch, 1000, emb=16, **kw)
        assert h % parts == 0
        n = count_parameters(ShortSpanConfig(arch, 1000, emb=16, hidden=h, **kw))
        lower = count_parameters(ShortSpanConfig(arch, 1000, emb=16, hidden=h - parts, **kw))
        upper = count_parameters(ShortSpanConfig(arch, 1000, emb=16, hidden=h + parts, **kw))
        assert abs(n - budget) <= min(abs(lower - budget), abs(upper - budget))
    assert hidden_for_budget(budget, "lstm", 1000, emb=16) == 20
