import datetime as dt
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.corpus import Document
from memlm.train.data import (
    EncodedCorpus,
    WordTokenizer,
    bptt_batches,
    document_segments,
    encode_corpus,
    positions_in_document,
    segment_batches,
    split_documents,
    word_spans,
    word_tokens,
)


def _doc(i: int, text: str, day: int = 1) -> Document:
    return Document(id=f"d{i:03d}", text=text, published_at=dt.date(2017, 3, day), source="s")


def _corpus(lengths: list[int]) -> EncodedCorpus:
    """Document i holds tokens 100*(i+1) + 0..n-1 between boundaries 0."""
    seqs = [
        np.array([0, *range(100 * (i + 1), 100 * (i + 1) + n), 0]) for i, n in enumerate(lengths)
    ]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    return EncodedCorpus(
        ids=np.concatenate(seqs).astype(np.int32),
        offsets=offsets.astype(np.int64),
        doc_ids=[f"d{i}" for i in range(len(lengths))],
        boundary_id=0,
    )


def test_split_is_deterministic_disjoint_and_sized():
    docs = [_doc(i, f"text {i}", day=1 + i % 5) for i in range(200)]
    a = split_documents(docs, dev_frac=0.05, test_frac=0.1, seed=3)
    b = split_documents(list(reversed(docs)), dev_frac=0.05, test_frac=0.1, seed=3)
    assert [d.id for d in a.dev] == [d.id for d in b.dev]
    assert (len(a.train), len(a.dev), len(a.test)) == (170, 10, 20)
    ids = [d.id for d in a.train + a.dev + a.test]
    assert sorted(ids) == sorted(d.id for d in docs)
    assert {d.id for d in a.test} == {d.id for d in b.test}
    c = split_documents(docs, dev_frac=0.05, test_frac=0.1, seed=4)
    assert {d.id for d in c.dev} != {d.id for d in a.dev}
    # stream order kept inside a split
    keys = [(d.published_at, d.id) for d in a.train]
    assert keys == sorted(keys)


def test_word_tokens_map_numbers_to_N():
    assert word_tokens("In 2016, 1,200 people paid $3.5m; it's well-known.") == [
        "in", "N", ",", "N", "people", "paid", "$", "N", "m", ";", "it's", "well-known", ".",
    ]  # fmt: skip
    assert word_tokens("Rome 12:30", lowercase=False) == ["Rome", "N"]
    text = "It's 12:30, Rome."
    assert [text[a:b] for a, b in word_spans(text)] == ["It's", "12:30", ",", "Rome", "."]


def test_word_vocabulary_is_fixed_with_unk(tmp_path: Path):
    docs = [_doc(0, "a a a b b c"), _doc(1, "a b d 7")]
    tok = WordTokenizer.build(docs, vocab_size=4)
    assert tok.words == ["<eos>", "<unk>", "a", "b"]
    assert tok.encode("a c b zz 9") == [2, 1, 3, 1, 1]
    assert tok.decode([2, 1]) == "a <unk>"
    tok.save(tmp_path / "v.json")
    assert WordTokenizer.load(tmp_path / "v.json").words == tok.words
    # ties are broken by the word, so the vocabulary does not depend on document order
    assert WordTokenizer.build(list(reversed(docs)), vocab_size=6).words == [
        "<eos>", "<unk>", "a", "b", "N", "c",
    ]  # fmt: skip


def test_encode_corpus_adds_boundaries_and_caches(tmp_path: Path):
    docs = [_doc(0, "a b"), _doc(1, "b b c")]
    tok = WordTokenizer.build(docs, vocab_size=10)
    enc = encode_corpus(docs, tok, tmp_path)
    a, b, c = tok.index["a"], tok.index["b"], tok.index["c"]
    assert enc.doc(0).tolist() == [0, a, b, 0]
    assert enc.doc(1).tolist() == [0, b, b, c, 0]
    assert enc.n_targets == 3 + 4
    cached = list(tmp_path.glob("*/done.json"))
    assert len(cached) == 1
    again = encode_corpus(docs, tok, tmp_path)
    assert again.ids.tolist() == enc.ids.tolist() and again.offsets.tolist() == enc.offsets.tolist()
    changed = encode_corpus([_doc(0, "a a"), docs[1]], tok, tmp_path)
    assert changed.doc(0).tolist() == [0, a, a, 0]
    assert len(list(tmp_path.glob("*/done.json"))) == 2


def test_truncate_and_subset():
    enc = _corpus([3, 5, 2])  # 4, 6, 3 targets
    assert enc.truncate_tokens(10).doc_ids == ["d0", "d1"]
    assert enc.truncate_tokens(9).doc_ids == ["d0"]
    assert enc.truncate_tokens(1).doc_ids == ["d0"]
    assert enc.subset([2]).doc(0).tolist() == [0, 300, 301, 0]


def test_bptt_batches_keep_documents_whole_and_mark_resets():
    enc = _corpus([3, 5, 2, 4])  # pairs: 4, 6, 3, 5
    batches = list(bptt_batches(enc, batch_size=2, bptt=4))
    assert [b.first for b in batches] == [True, False, False]
    x = torch.cat([b.x for b in batches], 1)
    y = torch.cat([b.y for b in batches], 1)
    reset = torch.cat([b.reset for b in batches], 1)
    mask = torch.cat([b.mask for b in batches], 1)
    # shortest row first: doc 0 -> row 0 (4), doc 1 -> row 1 (6), doc 2 -> row 0 (7), doc 3 -> row 1
    assert x[0].tolist() == [0, 100, 101, 102, 0, 300, 301] + [0] * 5
    assert y[0].tolist() == [100, 101, 102, 0, 300, 301, 0] + [0] * 5
    assert reset[0].nonzero().flatten().tolist() == [0, 4]
    assert mask[0].tolist() == [True] * 7 + [False] * 5
    assert x[1].tolist() == [0, 200, 201, 202, 203, 204, 0, 400, 401, 402, 403, 0]
    assert y[1, :11].tolist() == [200, 201, 202, 203, 204, 0, 400, 401, 402, 403, 0]
    assert reset[1].nonzero().flatten().tolist() == [0, 6]
    assert mask[1].tolist() == [True] * 11 + [False]
    assert int(mask.sum()) == enc.n_targets


def test_bptt_batches_shuffle_is_seeded():
    enc = _corpus([3, 5, 2, 4, 6, 1])
    first = [b.x for b in bptt_batches(enc, 2, 5, shuffle_seed=1)]
    again = [b.x for b in bptt_batches(enc, 2, 5, shuffle_seed=1)]
    other = [b.x for b in bptt_batches(enc, 2, 5, shuffle_seed=2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=False))


def test_positions_in_document():
    reset = torch.tensor([[False, False, True, False], [True, False, False, False]])
    pos = positions_in_document(reset, start=torch.tensor([7, 3]))
    assert pos.tolist() == [[7, 8, 0, 1], [0, 1, 2, 3]]


def test_document_segments_are_consecutive():
    seq = np.array([0, 5, 6, 7, 8, 9, 0])
    segs = document_segments(seq, 4)
    assert [s[0].tolist() for s in segs] == [[0, 5, 6, 7], [8, 9]]
    assert [s[1].tolist() for s in segs] == [[5, 6, 7, 8], [9, 0]]


def test_segment_batches_group_m_segments_of_one_document():
    enc = _corpus([8, 1])  # doc 0: 9 pairs -> 3 segments of 3; doc 1: 2 pairs -> 1 segment
    batches = list(segment_batches(enc, seg_len=3, m=2, batch_size=8))
    assert len(batches) == 1
    b = batches[0]
    assert b.x.shape == (3, 2, 3)
    assert b.doc_index.tolist() == [0, 0, 1]
    assert b.first_segment.tolist() == [0, 2, 0]
    assert b.x[0].tolist() == [[0, 100, 101], [102, 103, 104]]
    assert b.y[1, 0].tolist() == [106, 107, 0]
    assert b.mask[1].tolist() == [[True] * 3, [False] * 3]
    assert b.x[2, 0].tolist() == [0, 200, 0] and b.mask[2, 0].tolist() == [True, True, False]
    assert int(b.mask.sum()) == enc.n_targets


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        split_documents([], dev_frac=0.6, test_frac=0.5)
    with pytest.raises(ValueError):
        next(bptt_batches(_corpus([2]), batch_size=0, bptt=4))


@pytest.mark.slow
def test_subword_tokenizer_round_trip_and_cache(tmp_path: Path):
    from memlm.train.data import SubwordTokenizer

    tok = SubwordTokenizer(tmp_path)
    assert (tok.vocab_size, tok.boundary_id) == (49152, 0)
    assert (tmp_path / "smollm2-tokenizer" / "tokenizer.json").exists()
    text = "Russia's ideal location between China and Europe"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    again = SubwordTokenizer(tmp_path)
    assert again.encode(text) == ids
    enc = encode_corpus([_doc(0, text)], again, tmp_path)
    assert enc.doc(0).tolist() == [0, *ids, 0]
