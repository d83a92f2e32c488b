"""Each decision checked against hand-computed values of an exact fake LM.

The fake LM: at every position it gives the gold token probability p_gold and its best
token probability p_top; the memory gives p_kNN(gold).  Augmented quantities are then
computed by hand with lambda = 0.25.
"""

import math

import numpy as np
import pytest

from memlm.knnlm import KnnParams, augmented_scores
from memlm.knnlm.policy import FullMem, MoNIM, MoNIMAMT, MoNIMKL, RandMem, TokenScores, make_policy

LAM = 0.25


def fake_scores(p_gold, p_top, knn_gold, key_ce=None):
    """Augmented scores from the fake LM; the kNN memory only knows the gold token."""
    n = len(p_gold)
    # neighbours: one entry per row carrying the gold token (weight 1) or nothing
    has = np.array([k > 0 for k in knn_gold])
    ids = np.where(has, 0, -1)[:, None]
    values = np.where(has, 1, -1)[:, None]
    out = augmented_scores(
        target_lm_logprob=np.log(p_gold),
        top_lm_logprob=np.log(p_top),
        top_id=np.where(np.array(p_top) > np.array(p_gold), 2, 1),
        targets=np.ones(n, np.int64),
        distances=np.zeros((n, 1)),
        ids=ids,
        values=values,
        value_lm_logprob=np.log(np.array(p_gold))[:, None],
        params=KnnParams(k=1, temperature=1.0, lmbda=LAM),
    )
    kce = np.full(n, np.nan) if key_ce is None else np.asarray(key_ce, float)
    return TokenScores(out.target_logprob, out.max_logprob, kce)


def test_fullmem_stores_everything():
    s = fake_scores([0.9, 0.01], [0.9, 0.5], [0, 0])
    assert FullMem().decide(s).tolist() == [True, True]


def test_monim_threshold_on_augmented_logprob():
    # row 0: plain LM (empty memory) p=0.3 -> log 0.3 = -1.20 >= -1.5: skip
    # row 1: plain LM p=0.2 -> -1.61 < -1.5: store
    # row 2: p_LM=0.2 but memory knows it: 0.75*0.2 + 0.25*1 = 0.4 -> -0.92: skip
    s = fake_scores([0.3, 0.2, 0.2], [0.3, 0.5, 0.5], [0, 0, 1])
    assert s.target_logprob[2] == pytest.approx(math.log(0.4))
    assert MoNIM().decide(s).tolist() == [False, True, False]
    assert MoNIM(delta=-0.5).decide(s).tolist() == [True, True, True]


def test_amt_thresholds_by_hand():
    # row 0: gold is top-1 with p=0.1: gap 0 -> delta_t = -1.5/0.5 = -3; log 0.1 = -2.30: skip
    #        (plain MoNIM would store it: -2.30 < -1.5)
    # row 1: gold p=0.05, top 0.5 -> gap log(10)=2.303 -> delta_t = -1.5/2.803 = -0.535;
    #        log 0.05 = -3.0 < -0.535: store
    # row 2: gold p=0.3, top 0.35 -> gap log(0.35/0.3)=0.154 -> delta_t=-1.5/0.654=-2.29;
    #        log 0.3 = -1.20: skip
    s = fake_scores([0.1, 0.05, 0.3], [0.1, 0.5, 0.35], [0, 0, 0])
    amt = MoNIMAMT()
    th = amt.thresholds(s)
    assert th == pytest.approx(
        [-3.0, -1.5 / (math.log(10) + 0.5), -1.5 / (math.log(0.35 / 0.3) + 0.5)]
    )
    assert amt.decide(s).tolist() == [False, True, False]
    assert MoNIM().decide(s).tolist() == [True, True, False]


def test_amt_uses_augmented_max():
    # gold p_LM=0.1, LM top 0.6; memory pushes gold to 0.75*0.1+0.25 = 0.325 > 0.75*0.6 = 0.45?
    # no: 0.45 is still the max -> gap log(0.45/0.325)
    s = fake_scores([0.1], [0.6], [1])
    assert s.max_logprob[0] == pytest.approx(math.log(0.45))
    th = MoNIMAMT().thresholds(s)[0]
    assert th == pytest.approx(-1.5 / (math.log(0.45 / 0.325) + 0.5))
    assert MoNIMAMT().decide(s).tolist() == [math.log(0.325) < th]


def test_monim_kl_stores_what_the_key_does_not_know():
    # key log-prob of gold: -0.5 (known) -> skip; -4.0 (new information) -> store
    s = fake_scores([0.5, 0.5], [0.5, 0.5], [0, 0], key_ce=[0.5, 4.0])
    assert MoNIMKL(delta=-1.5).decide(s).tolist() == [False, True]
    # the default threshold is on the scale of the key's flat projection
    s = fake_scores([0.5, 0.5], [0.5, 0.5], [0, 0], key_ce=[9.0, 11.0])
    assert MoNIMKL().decide(s).tolist() == [False, True]
    assert make_policy("monim-kl").delta == -10.0 and make_policy("monim").delta == -1.5
    with pytest.raises(ValueError, match="key_ce"):
        MoNIMKL().decide(fake_scores([0.5], [0.5], [0]))


def test_randmem_is_seeded_and_near_rate():
    s = fake_scores([0.5] * 20000, [0.5] * 20000, [0] * 20000)
    a = RandMem(0.3, seed=1).decide(s)
    b = RandMem(0.3, seed=1).decide(s)
    assert np.array_equal(a, b)
    assert abs(a.mean() - 0.3) < 0.01
    assert RandMem(0.0).decide(s).sum() == 0


def _doc_scores(n, doc_id):
    nan = np.full(n, np.nan)
    return TokenScores(nan, nan, nan, doc_id=doc_id)


def test_randmem_gives_each_document_its_own_mask_whoever_processes_it():
    pol = RandMem(0.3, seed=4)
    a, b = pol.decide(_doc_scores(200, 1)), pol.decide(_doc_scores(200, 2))
    assert not np.array_equal(a, b)
    # the same document gives the same mask again (a crash and reprocess, another worker),
    # whatever was drawn before, and from another RandMem object of the same stream
    assert np.array_equal(RandMem(0.3, seed=4).decide(_doc_scores(200, 2)), b)
    assert np.array_equal(pol.decide(_doc_scores(200, 1)), a)
    assert np.array_equal(a, np.random.default_rng([4, 1]).random(200) < 0.3)
    # another stream seed, other masks
    assert not np.array_equal(RandMem(0.3, seed=5).decide(_doc_scores(200, 1)), a)
    with pytest.raises(ValueError, match="document id"):
        pol.decide(_doc_scores(3, -1))


def test_randmem_stored_share_over_many_documents_is_the_rate():
    pol = RandMem(0.3, seed=0)
    masks = [pol.decide(_doc_scores(n, d)) for d, n in enumerate(range(50, 450), start=1)]
    share = np.concatenate(masks).mean()  # 100k tokens over 400 documents
    assert abs(share - 0.3) < 0.01
    # the old bug: one fresh generator per document gives every document the same prefix
    firsts = {tuple(m[:50]) for m in masks}
    assert len(firsts) == len(masks)


def test_make_policy():
    assert make_policy("monim-amt", delta=-2.0).delta == -2.0
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("sometimes")
