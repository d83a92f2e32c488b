"""The shared training data pipeline: splits, tokenizers, encoded corpora, batches.

A stream of documents is split by document into train/dev/test, encoded with a
word-level vocabulary (as in Daniluk et al. 2017: numbers -> ``N``, the most frequent
words of the training split, everything else ``<unk>``) or with the SmolLM2 subword
tokenizer, and stored as one flat int32 array with document offsets.

Every document is encoded as ``[B, t_1, ..., t_n, B]`` where ``B`` is the tokenizer's
boundary id: the leading ``B`` is the input that predicts ``t_1`` (the recurrent state is
reset there) and the trailing ``B`` is the end-of-document target.  So a document of
``n`` tokens gives ``n + 1`` (input, target) pairs and no pair crosses two documents.

Two layouts are offered:

* :func:`bptt_batches` -- truncated BPTT over ``batch_size`` rows, each row a
  concatenation of whole documents; ``reset[b, t]`` says that the state must be zeroed
  before step ``t`` (a document starts there) and ``mask`` marks real targets.
* :class:`Segments` -- fixed-length rows with the document and position of every pair,
  for the Transformer: :func:`make_segments` cuts each document on its own (evaluation),
  :func:`stream_segments` cuts the stream of documents into full rows (training), and
  :func:`consecutive_batches` groups consecutive rows for TRIME's long-term memory.

The package, one concern a module: :mod:`~memlm.research.data.splits` (by document),
:mod:`~memlm.research.data.tokenizers`, :mod:`~memlm.research.data.encoded` (flat arrays and
their cache, :mod:`~memlm.research.data.cache`) and :mod:`~memlm.research.data.batches`.
"""

from memlm.research.data.batches import (
    BPTTBatch,
    Segments,
    bptt_batches,
    consecutive_batches,
    document_segments,
    make_segments,
    positions_in_document,
    stream_segments,
)
from memlm.research.data.cache import default_cache_dir
from memlm.research.data.encoded import EncodedCorpus, encode_corpus
from memlm.research.data.splits import EncodedSplits, Splits, load_encoded_splits, split_documents
from memlm.research.data.tokenizers import (
    HFTokenizerAdapter,
    SubwordTokenizer,
    Tokenizer,
    WordTokenizer,
    word_spans,
    word_tokens,
)

__all__ = [
    "BPTTBatch",
    "EncodedCorpus",
    "EncodedSplits",
    "HFTokenizerAdapter",
    "Segments",
    "Splits",
    "SubwordTokenizer",
    "Tokenizer",
    "WordTokenizer",
    "bptt_batches",
    "consecutive_batches",
    "default_cache_dir",
    "document_segments",
    "encode_corpus",
    "load_encoded_splits",
    "make_segments",
    "positions_in_document",
    "split_documents",
    "stream_segments",
    "word_spans",
    "word_tokens",
]
