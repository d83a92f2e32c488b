import datetime as dt
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.corpus import Document
from memlm.research.data import WordTokenizer
from memlm.research.lstm_encoder import ShortSpanEncoder
from memlm.research.lstm_models import ShortSpanConfig, ShortSpanLM
from memlm.research.lstm_train import save_checkpoint

TEXT = "the cat sat on the mat . the dog sat on the cat in 2017 ."


def _encoder(tmp_path: Path) -> ShortSpanEncoder:
    doc = Document(id="a", text=TEXT, published_at=dt.date(2017, 3, 1), source="s")
    tok = WordTokenizer.build([doc], vocab_size=12)
    torch.manual_seed(0)
    model = ShortSpanLM(ShortSpanConfig("kvp", tok.vocab_size, emb=8, hidden=12, window=3))
    path = tmp_path / "m.pt"
    save_checkpoint(model, path, {"kind": "word", "words": tok.words, "lowercase": True})
    return ShortSpanEncoder.from_checkpoint(path)


def test_outputs_match_the_model_read_from_the_document_start(tmp_path: Path):
    enc = _encoder(tmp_path)
    ids = enc.tokenize(TEXT)
    assert enc.token_strings(ids[:3]) == ["the", "cat", "sat"]
    assert [TEXT[a:b] for a, b in enc.char_offsets(TEXT)][-2:] == ["2017", "."]
    o = enc.encode_ids(ids)
    n = len(ids)
    assert len(o) == n - 1
    assert o.positions.tolist() == list(range(1, n))
    assert o.targets.tolist() == ids[1:]
    assert o.prev_tokens.tolist() == ids[:-1]
    assert o.keys.shape == (n - 1, 4) and enc.dim == enc.hidden_dim == 4
    with torch.no_grad():
        x = torch.tensor([[0, *ids[:-1]]])
        reset = torch.zeros_like(x, dtype=torch.bool)
        reset[0, 0] = True
        out = enc.model(x, reset)
        logp = torch.log_softmax(out.logits[0, 1:], -1)
    expected = logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).numpy()
    np.testing.assert_allclose(o.target_logprob, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o.keys, out.features[0, 1:].numpy(), rtol=1e-6)
    np.testing.assert_allclose(o.entropy, -(logp.exp() * logp).sum(-1).numpy(), rtol=1e-5)
    assert o.top_id.tolist() == logp.argmax(-1).tolist()
    # the harness recomputes LM probabilities of other tokens from hidden + lse
    again = enc.logprobs_for(o.hidden, o.lse, o.targets[:, None])[:, 0]
    np.testing.assert_allclose(again, o.target_logprob, rtol=1e-5, atol=1e-6)
    # documents are independent: encoding two at once changes nothing
    both = enc.encode_many([ids[5:], ids])
    np.testing.assert_allclose(both[1].target_logprob, o.target_logprob, rtol=1e-6)
    assert len(enc.encode_many([[3]])[0]) == 0


@pytest.mark.slow
def test_runs_in_the_streaming_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from memlm.evaluate import EvalConfig, evaluate

    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))

    enc = _encoder(tmp_path)
    rng = np.random.default_rng(0)
    words = TEXT.split()
    docs = [
        Document(
            id=f"d{i:02d}",
            text=" ".join(rng.choice(words, 40)),
            published_at=dt.date(2017, 3, 1 + i // 5),
            source="s",
        )
        for i in range(10)
    ]
    cfg = EvalConfig(policies=("fullmem", "monim"), index_kind="flat", k_max=8, dev_share=0.2)
    report = evaluate(cfg, docs, tmp_path / "eval", encoder=enc, echo=lambda s: None)
    assert (tmp_path / "eval" / "report.json").exists()
    res = report["results"]
    assert set(res) == {"bare", "fullmem", "monim"}
    seen = (
        sum(len(enc.tokenize(d.text)) - 1 for d in docs)
        - res["bare"]["dev_tokens"]
        - res["bare"]["test_tokens"]
    )
    assert res["fullmem"]["tokens_seen"] == res["monim"]["tokens_seen"] == seen
    assert res["fullmem"]["memrate"] == 1.0 and res["fullmem"]["entries"] == seen
    assert 0 < res["monim"]["entries"] <= seen
