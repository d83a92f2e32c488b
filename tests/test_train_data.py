import datetime as dt
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.corpus import Document
from memlm.research.data import (
    EncodedCorpus,
    WordTokenizer,
    bptt_batches,
    consecutive_batches,
    document_segments,
    encode_corpus,
    make_segments,
    positions_in_document,
    split_documents,
    stream_segments,
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


def test_make_segments_cut_each_document_on_its_own():
    enc = _corpus([3, 5, 2])  # pairs: 4, 6, 3 -> rows of 4: 1 + 2 + 1
    segs = make_segments(enc, 4)
    assert segs.x.tolist() == [
        [0, 100, 101, 102],
        [0, 200, 201, 202],
        [203, 204, 0, 0],
        [0, 300, 301, 0],
    ]
    assert segs.y[2].tolist() == [204, 0, 0, 0] and segs.y[3].tolist() == [300, 301, 0, 0]
    assert segs.doc.tolist() == [[0] * 4, [1] * 4, [1, 1, -1, -1], [2, 2, 2, -1]]
    assert segs.pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, -1, -1], [0, 1, 2, -1]]
    assert int(segs.valid.sum()) == enc.n_targets


def test_stream_segments_are_full_rows_across_documents():
    enc = _corpus([3, 5, 2])  # 13 pairs -> 3 full rows of 4, the last pair dropped
    segs = stream_segments(enc, 4)
    assert segs.x.tolist() == [[0, 100, 101, 102], [0, 200, 201, 202], [203, 204, 0, 300]]
    assert segs.y.tolist() == [[100, 101, 102, 0], [200, 201, 202, 203], [204, 0, 300, 301]]
    assert segs.doc.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 2, 2]]
    assert segs.pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 0, 1]]
    assert bool(segs.valid.all())
    assert len(stream_segments(enc, 4, rows_multiple=2)) == 2
    assert len(stream_segments(enc, 1)) == enc.n_targets
    with pytest.raises(ValueError):
        stream_segments(enc, 4, rows_multiple=4)  # 13 pairs cannot fill 4 rows of 4


def test_both_layouts_keep_every_pair_with_its_document_and_position():
    enc = _corpus([7, 1, 29, 3, 12, 2, 18])
    for segs in (make_segments(enc, 5), stream_segments(enc, 5)):
        v = segs.valid
        for x, y, d, p in zip(segs.x[v], segs.y[v], segs.doc[v], segs.pos[v], strict=True):
            assert (x, y) == (enc.doc(d)[p], enc.doc(d)[p + 1])
        pairs = list(zip(segs.doc[v].tolist(), segs.pos[v].tolist(), strict=True))
        assert pairs == sorted(pairs) and len(set(pairs)) == len(pairs)
    assert int(make_segments(enc, 5).valid.sum()) == enc.n_targets == 79
    assert int(stream_segments(enc, 5).valid.sum()) == 75  # 15 full rows; 4 pairs dropped


def test_consecutive_batches_hold_whole_groups():
    batches = consecutive_batches(12, batch_segments=4, m=2, seed=0)
    assert [len(b) for b in batches] == [4, 4, 4]
    assert sorted(r for b in batches for r in b) == list(range(12))
    for b in batches:
        assert b[0] % 2 == 0 and b[1] == b[0] + 1 and b[2] % 2 == 0 and b[3] == b[2] + 1
    assert batches == consecutive_batches(12, 4, 2, seed=0)
    assert any(consecutive_batches(12, 4, 2, seed=s) != batches for s in range(1, 4))
    # a row count that is not a multiple of m leaves one short group (and one short batch)
    odd = consecutive_batches(11, 4, 2, seed=0)
    assert sorted(len(b) for b in odd) == [3, 4, 4]
    assert sorted(r for b in odd for r in b) == list(range(11))
    with pytest.raises(ValueError):
        consecutive_batches(12, 6, 4)


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        split_documents([], dev_frac=0.6, test_frac=0.5)
    with pytest.raises(ValueError):
        next(bptt_batches(_corpus([2]), batch_size=0, bptt=4))


@pytest.mark.slow
def test_subword_tokenizer_round_trip_and_cache(tmp_path: Path):
    from memlm.research.data import SubwordTokenizer

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
