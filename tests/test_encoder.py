import numpy as np
import pytest
import torch

from memlm.encoder import Encoder, EncoderError, WindowConfig, perplexity


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def enc(request):
    return Encoder.load(request.param, threads=1)


def test_windows_score_every_target_once():
    w = WindowConfig(context=8, stride=3)
    for n in (1, 2, 5, 8, 9, 20, 31):
        scored = []
        for b, e, first in w.windows(n):
            assert e - b <= 8 and b <= first - 1 < e
            scored += list(range(first, e))
            # every scored token keeps at least context - stride tokens before it, or all
            assert first - b >= min(first, 8 - 3)
        assert scored == list(range(1, n))


def test_window_validation():
    with pytest.raises(ValueError):
        WindowConfig(context=4, stride=5)
    with pytest.raises(ValueError):
        WindowConfig(context=1, stride=1)
    # no overlap would predict each later window's first target from nothing in it
    with pytest.raises(ValueError, match="largest legal stride for context 512 is 511"):
        WindowConfig(context=512, stride=512)


def test_outputs_match_a_plain_forward(enc):
    ids = list(np.random.RandomState(0).randint(5, 2000, 40))
    out = enc.encode_ids(ids, WindowConfig(context=64, stride=63))
    assert len(out) == 39
    assert out.positions.tolist() == list(range(1, 40))
    assert out.targets.tolist() == ids[1:]
    assert out.prev_tokens.tolist() == ids[:-1]
    with torch.inference_mode():
        logits = enc.model(torch.tensor([ids])).logits[0, :-1]
    logp = torch.log_softmax(logits, -1)
    gold = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(out.target_logprob, gold, atol=1e-4)
    np.testing.assert_allclose(out.top_logprob, logp.max(-1).values.numpy(), atol=1e-4)
    assert out.top_id.tolist() == logp.argmax(-1).tolist()
    ent = -(logp.exp() * logp).sum(-1).numpy()
    np.testing.assert_allclose(out.entropy, ent, atol=1e-4)
    assert out.keys.shape == (39, enc.dim) and out.keys.dtype == np.float32
    assert np.isnan(out.key_ce).all()  # off unless MoNIM(KL) asks for it


def test_logprobs_for_any_token(enc):
    ids = list(range(10, 30))
    out = enc.encode_ids(ids)
    toks = np.array([[3, 7, 11]] * len(out))
    got = enc.logprobs_for(out.hidden, out.lse, toks)
    full = enc.full_logprobs(out.hidden)
    np.testing.assert_allclose(got, full[:, [3, 7, 11]], atol=1e-5)
    np.testing.assert_allclose(
        enc.logprobs_for(out.hidden, out.lse, out.targets[:, None])[:, 0],
        out.target_logprob,
        atol=1e-5,
    )


def test_sliding_windows_batched_equal_unbatched(enc):
    docs = [list(range(100, 100 + n)) for n in (50, 23, 70)]
    w1 = WindowConfig(context=16, stride=8, batch_size=1)
    w4 = WindowConfig(context=16, stride=8, batch_size=4)
    for a, b in zip(enc.encode_many(docs, w1), enc.encode_many(docs, w4), strict=True):
        np.testing.assert_allclose(a.target_logprob, b.target_logprob, atol=1e-4)
        np.testing.assert_allclose(a.keys, b.keys, atol=1e-4)
        assert a.positions.tolist() == b.positions.tolist()


def test_gpt2_key_is_the_last_mlp_input():
    enc = Encoder.load("tiny-gpt2", threads=1)
    ids = torch.tensor([list(range(50, 70))])
    out = enc.encode_ids(ids[0].tolist(), WindowConfig(context=32, stride=31))
    with torch.inference_mode():
        hs = enc.model(ids, output_hidden_states=True).hidden_states
        block = enc.model.transformer.h[-1]
        x = hs[-2]  # input of the last block
        h = x + block.attn(block.ln_1(x))[0]
        key = block.ln_2(h)[0, :-1].numpy()
    np.testing.assert_allclose(out.keys, key, atol=1e-5)


def test_key_ce_when_asked():
    enc = Encoder.load("tiny-llama", threads=1)
    enc.compute_key_ce = True
    ids = list(range(200, 220))
    out = enc.encode_ids(ids)
    logits = torch.from_numpy(out.keys) @ enc.head_weight.T
    expect = (
        torch.logsumexp(logits, -1) - logits.gather(1, torch.from_numpy(out.targets)[:, None])[:, 0]
    )
    np.testing.assert_allclose(out.key_ce, expect.numpy(), atol=1e-4)


def test_too_long_context_and_unknown_model():
    enc = Encoder.load("tiny-llama", threads=1)
    with pytest.raises(EncoderError, match="exceeds"):
        enc.encode_ids(list(range(10)), WindowConfig(context=4096, stride=512))
    with pytest.raises(EncoderError, match="no model hub"):
        Encoder.load("/nonexistent/model-dir")


def test_perplexity():
    assert perplexity(np.log(np.full(4, 0.25))) == pytest.approx(4.0)
    assert np.isnan(perplexity(np.zeros(0)))


@pytest.mark.slow
def test_bundled_smollm2_on_real_news():
    from memlm.corpus import load_news

    enc = Encoder.load("smollm2-135m", threads=2)
    assert (enc.dim, enc.vocab_size, enc.hidden_dim) == (576, 49152, 576)
    assert type(enc.model).__name__ == "LlamaForCausalLM"
    doc = next(d for d in load_news() if d.published_at.isoformat() == "2017-02-13")
    ids = enc.tokenize(doc.text)[:600]
    out = enc.encode_ids(ids, WindowConfig(context=512, stride=256))
    assert len(out) == len(ids) - 1
    # DATA.md: about 15-27 on ordinary news prose with 512-token windows
    assert 8.0 < perplexity(out.target_logprob) < 40.0
