"""Splitting a stream by document, and the encoded train / dev / test splits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memlm.corpus import Document
from memlm.research.data.cache import default_cache_dir
from memlm.research.data.encoded import EncodedCorpus, encode_corpus
from memlm.research.data.tokenizers import SubwordTokenizer, Tokenizer, WordTokenizer


@dataclass(frozen=True)
class Splits:
    train: list[Document]
    dev: list[Document]
    test: list[Document]


def split_documents(
    docs: Sequence[Document], dev_frac: float = 0.05, test_frac: float = 0.05, seed: int = 0
) -> Splits:
    """Deterministic split by document: a seeded permutation of the ids sorted by id.

    ``round(dev_frac * n)`` documents go to dev, ``round(test_frac * n)`` to test, the rest
    to train.  Each split is in stream order (date, id).  5%/5% by default: the
    word-level dev and test sets then hold about 120k tokens each, enough for stable
    perplexities, while train keeps 90% of the stream.
    """
    if not (0 <= dev_frac < 1 and 0 <= test_frac < 1 and dev_frac + test_frac < 1):
        raise ValueError(f"bad split fractions dev={dev_frac} test={test_frac}")
    ids = sorted(d.id for d in docs)
    if len(set(ids)) != len(ids):
        raise ValueError("document ids must be unique to split by document")
    order = np.random.default_rng(seed).permutation(len(ids))
    n_dev, n_test = round(dev_frac * len(ids)), round(test_frac * len(ids))
    dev_ids = {ids[i] for i in order[:n_dev]}
    test_ids = {ids[i] for i in order[n_dev : n_dev + n_test]}
    stream = sorted(docs, key=lambda d: (d.published_at, d.id))
    return Splits(
        train=[d for d in stream if d.id not in dev_ids and d.id not in test_ids],
        dev=[d for d in stream if d.id in dev_ids],
        test=[d for d in stream if d.id in test_ids],
    )


@dataclass(frozen=True)
class EncodedSplits:
    train: EncodedCorpus
    dev: EncodedCorpus
    test: EncodedCorpus
    tokenizer: Tokenizer


def load_encoded_splits(
    corpus: str = "news",
    tokenizer: str = "word",
    vocab_size: int = 10_000,
    lowercase: bool = True,
    dev_frac: float = 0.05,
    test_frac: float = 0.05,
    seed: int = 0,
    cache_dir: Path | None = None,
    docs: Sequence[Document] | None = None,
) -> EncodedSplits:
    """Split a stream by document and encode it; ``tokenizer`` is ``word`` or ``subword``.

    ``docs`` replaces the named ``corpus`` when given (``memlm train --data FILE``). The
    word vocabulary is built from the training split only.
    """
    from memlm.corpus import load_corpus

    stream = load_corpus(corpus) if docs is None else docs
    splits = split_documents(stream, dev_frac, test_frac, seed)
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    tok: Tokenizer
    if tokenizer == "word":
        tok = WordTokenizer.build(splits.train, vocab_size, lowercase)
    elif tokenizer == "subword":
        tok = SubwordTokenizer(cache)
    else:
        raise ValueError(f"tokenizer must be 'word' or 'subword', not {tokenizer!r}")
    return EncodedSplits(
        train=encode_corpus(splits.train, tok, cache),
        dev=encode_corpus(splits.dev, tok, cache),
        test=encode_corpus(splits.test, tok, cache),
        tokenizer=tok,
    )
