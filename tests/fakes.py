"""An exact fake of the engine facade for logic tests of the service and the workers.

Words are tokens (``text.split()``); the key of position t is the word before it, the
value is the word at t. The "LM" is uniform over a fixed vocabulary, so every number
is predictable by hand:

* p_LM(y) = 1 / len(VOCAB) for y in VOCAB (other words get 0),
* p_kNN(y) = live entries with key == last word and value y / all live entries with that key,
* lambda = 0.5 when such entries exist, else 0.0,
* FullMem stores every predicted token; MoNIM stores a token whose (key, value) pair
  is not in the live memory yet (the augmented model "was surprised"),
* whole words are the suggestions themselves (every fake token is a word),
* local memory (TRIME): every earlier position of the input with the same key adds a
  mass of 1 to its value beside the LM's total mass of 1 (tau is ignored),
* ``char_spans`` gives each word's characters (and counts its calls),
* generation (``start_generation``) appends " word" after " word" drawn from ``predict``'s
  distribution: greedy takes its first suggestion, sampling draws with the seeded numpy
  generator; ``generation_positions`` words of context plus new words at most,
* token ids (the OpenAI-compatible API): a word's id is the order in which the fake first
  saw it, ``vocab_size`` the words seen so far; the top tokens of a position are
  ``predict``'s suggestions there; there is no chat template.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memlm.engine import (
    Committed,
    ContextFit,
    EngineInputError,
    IngestResult,
    MemoryBehind,
    Neighbour,
    Prediction,
    Recovered,
    ScoreResult,
    Suggestion,
)
from memlm.engine.generation import FinishReason, GenerateConfig, GeneratedToken, StopText
from memlm.knnlm import MemoryOptions
from memlm.knnlm.policy import Policy
from memlm.knnlm.words import WordSuggestion
from memlm.locks import LockBusy
from memlm.memory import BuildInfo, IndexParams

if TYPE_CHECKING:
    from memlm.engine import EngineLike

__all__ = [
    "VOCAB",
    "BuildInfo",
    "FakeCrash",
    "FakeEngine",
    "FakeGeneration",
    "FakePrepared",
    "IngestResult",
    "Neighbour",
    "Prediction",
    "ScoreResult",
    "Suggestion",
    "WordSuggestion",
]

VOCAB = ("the", "a", "of", "and", "to", "in")


class FakeCrash(RuntimeError):
    pass


@dataclass(frozen=True)
class FakePrepared:
    """The fake's prepared document: its words and policy (the real one carries the
    encoder's outputs and the policy's decision, which the fake makes at the append)."""

    doc_id: int
    day: int
    words: list[str]
    policy: str
    char_spans: np.ndarray | None = None


def _policy_name(policy: Policy | str | None, default: str) -> str:
    if policy is None:
        return default
    return policy if isinstance(policy, str) else policy.name


def _local_memory(words: list[str], t: int) -> dict[str, int]:
    """Values of the earlier positions j < t whose key (the word before) is words[t - 1]."""
    hits = [words[j] for j in range(1, t) if words[j - 1] == words[t - 1]]
    return {w: hits.count(w) for w in set(hits)}


def _with_local(lm: float, local: dict[str, int], w: str) -> float:
    """p(w) with the local memory's counts beside the LM's mass of 1."""
    return (lm + local.get(w, 0)) / (1 + sum(local.values()))


@dataclass
class _Entry:
    doc_id: int
    position: int
    key: str
    value: str
    day: int


@dataclass
class FakeEngine:
    policy: str = "monim"
    entries: list[_Entry] = field(default_factory=list)
    deleted: set[int] = field(default_factory=set)
    hidden: set[int] = field(default_factory=set)  # hide_documents: a forget accepted
    built_version: int = 0
    served_version: int = 0
    processed: list[int] = field(default_factory=list)
    fail_on: str | None = None  # a word that makes process_document raise EngineInputError
    span: int = 512  # words at the end of a context that predict reads (fit_context)
    span_calls: list[str] = field(default_factory=list)  # texts given to char_spans
    ahead: list[str] = field(default_factory=list)  # next_text of each prepare_document
    # the datastore's write lock and the build lock, for workers sharing this fake
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _build: threading.RLock = field(default_factory=threading.RLock, repr=False)

    # --- helpers --------------------------------------------------------------------------

    def _live(self) -> list[_Entry]:
        gone = self.deleted | self.hidden
        return [e for e in self.entries if e.doc_id not in gone]

    def _knn(self, key: str) -> dict[str, float]:
        hits = [e.value for e in self._live() if e.key == key]
        return {v: hits.count(v) / len(hits) for v in sorted(set(hits))}

    def _stores(self, policy: str, key: str, value: str, memory: set[tuple[str, str]]) -> bool:
        return policy == "fullmem" or (key, value) not in memory

    # --- the facade -------------------------------------------------------------------------

    def process_document(
        self,
        doc_id: int,
        text: str,
        day: int,
        *,
        policy: Policy | str | None = None,
        crash_at: str | None = None,
    ) -> IngestResult:
        return self.store_document(
            self.prepare_document(doc_id, text, day, policy=policy), crash_at=crash_at
        )

    def prepare_document(
        self,
        doc_id: int,
        text: str,
        day: int,
        *,
        policy: Policy | str | None = None,
        next_text: str | None = None,
    ) -> FakePrepared:
        words = text.split()
        if self.fail_on is not None and self.fail_on in words:
            raise EngineInputError(f"cannot encode the word {self.fail_on!r}")
        spans = np.array([m.span() for m in re.finditer(r"\S+", text)], np.int64).reshape(-1, 2)
        if next_text is not None:  # the engine starts its encode once this one is encoded
            self.ahead.append(next_text)
        return FakePrepared(doc_id, day, words, _policy_name(policy, self.policy), spans)

    def char_spans(self, text: str) -> np.ndarray:
        self.span_calls.append(text)
        return np.array([m.span() for m in re.finditer(r"\S+", text)], np.int64).reshape(-1, 2)

    def store_document(self, prep: FakePrepared, *, crash_at: str | None = None) -> IngestResult:
        with self.exclusive():
            # the policy looks at the memory as it is when the entries are appended
            memory = {(e.key, e.value) for e in self._live()}
            first, words = len(self.entries), prep.words
            for t in range(1, len(words)):
                if self._stores(prep.policy, words[t - 1], words[t], memory):
                    self.entries.append(_Entry(prep.doc_id, t, words[t - 1], words[t], prep.day))
                    memory.add((words[t - 1], words[t]))
        if crash_at == "after_append":
            raise FakeCrash("crash after append")
        self.processed.append(prep.doc_id)
        return IngestResult(len(words) - 1, len(self.entries) - first, first, len(self.entries))

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._lock:
            yield

    # why the memory cannot be searched (a test sets it; None: it can), and how often asked
    memory_away: str | None = None
    memory_probes: int = 0

    def memory_unavailable(self) -> str | None:
        self.memory_probes += 1
        return self.memory_away

    @contextlib.contextmanager
    def building(self, timeout: float | None = None) -> Iterator[None]:
        if not self._build.acquire(timeout=-1 if timeout is None else timeout):
            raise LockBusy("another worker is building")
        try:
            yield
        finally:
            self._build.release()

    def fit_context(self, context: str, *, long_segments: int = 0) -> ContextFit:
        starts = [m.start() for m in re.finditer(r"\S+", context)]
        keep = self.span * (1 + long_segments)
        if len(starts) <= keep:
            return ContextFit(context, len(starts), len(starts))
        return ContextFit(context[starts[-keep] :], keep, len(starts))

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    generation_positions: int = 64

    def start_generation(self, context: str, cfg: GenerateConfig) -> FakeGeneration:
        words = context.split()
        if not words:
            raise EngineInputError("the context is empty after tokenisation")
        if len(words) + cfg.max_tokens > self.generation_positions:
            raise EngineInputError("too long")
        return FakeGeneration(self, words, cfg)

    def predict(
        self,
        context: str,
        *,
        top_n: int = 10,
        neighbours: int = 0,
        words: int = 0,
        memory: MemoryOptions | None = None,
    ) -> Prediction:
        toks = context.split()
        if not toks:
            raise EngineInputError("the context is empty after tokenisation")
        last = toks[-1]
        knn = self._knn(last)
        lam = 0.5 if knn else 0.0
        local = _local_memory(toks, len(toks)) if memory is not None else None
        cands = sorted(set(VOCAB) | set(knn) | set(local or {}))
        sugg = []
        for w in cands:
            lm = 1.0 / len(VOCAB) if w in VOCAB else 0.0
            kp = knn.get(w, 0.0)
            tp = None if local is None else _with_local(lm, local, w)
            base = lm if tp is None else tp
            sugg.append(Suggestion(w, hash(w) % 1000, (1 - lam) * base + lam * kp, lm, kp, tp))
        sugg.sort(key=lambda s: (-s.prob, s.token))
        gone = self.deleted | self.hidden
        ids = [i for i, e in enumerate(self.entries) if e.doc_id not in gone]
        hits = [i for i in ids if self.entries[i].key == last][:neighbours]
        nbrs = [
            Neighbour(
                i,
                self.entries[i].doc_id,
                self.entries[i].position,
                self.entries[i].value,
                0,
                float(rank),
            )
            for rank, i in enumerate(hits)
        ]
        found = [
            WordSuggestion(s.token, (s.token_id,), (s.token,), s.prob, s.lm_prob, s.knn_prob)
            for s in sugg[:words]
        ]
        return Prediction(
            sugg[:top_n],
            lam,
            nbrs,
            context_tokens=len(toks),
            words=found,
            index_version=self.served_version or None,
        )

    def score(
        self,
        text: str,
        *,
        policy: Policy | str | None = None,
        memory: MemoryOptions | None = None,
    ) -> ScoreResult:
        words = text.split()
        if len(words) < 2:
            raise EngineInputError("the text must hold at least two tokens")
        name = _policy_name(policy, self.policy)
        memory_pairs = {(e.key, e.value) for e in self._live()}
        lm_lp: list[float] = []
        lp: list[float] = []
        store: list[bool] = []
        trime: list[float] = []
        knn_lp: list[float] = []
        lams: list[float] = []
        for t in range(1, len(words)):
            knn = self._knn(words[t - 1])
            lam = 0.5 if knn else 0.0
            kp = knn.get(words[t], 0.0)
            knn_lp.append(math.log(kp) if kp > 0 else -math.inf)
            lams.append(lam)
            lm = 1.0 / len(VOCAB) if words[t] in VOCAB else 1e-6
            base = lm
            if memory is not None:
                base = _with_local(lm, _local_memory(words, t), words[t])
                trime.append(math.log(base))
            lm_lp.append(math.log(lm))
            lp.append(math.log((1 - lam) * base + lam * knn.get(words[t], 0.0)))
            store.append(self._stores(name, words[t - 1], words[t], memory_pairs))
        return ScoreResult(
            words,
            lm_lp,
            lp,
            math.exp(-sum(lm_lp) / len(lm_lp)),
            math.exp(-sum(lp) / len(lp)),
            store,
            trime if memory is not None else None,
            math.exp(-sum(trime) / len(trime)) if memory is not None else None,
            knn_logprobs=knn_lp,
            lambdas=lams,
        )

    # --- token ids -------------------------------------------------------------------------

    _vocab: list[str] = field(default_factory=list, repr=False)
    _ids: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def _id(self, word: str) -> int:
        with self._lock:  # request threads tokenise at once
            if word not in self._ids:
                self._ids[word] = len(self._vocab)
                self._vocab.append(word)
            return self._ids[word]

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return [self._id(w) for w in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(self._vocab[i] for i in ids)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self._vocab[i] for i in ids]

    def tokenizer_info(self) -> dict[str, Any]:
        return {
            "eos_token": None,
            "bos_token": None,
            "pad_token": None,
            "chat_template": None,
            "max_positions": self.generation_positions,
        }

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        raise EngineInputError("the fake engine has no chat template: use /v1/completions")

    def score_ids(
        self,
        ids: Sequence[int],
        *,
        policy: Policy | str | None = None,
        memory: MemoryOptions | None = None,
        top: int = 0,
        nearest: bool = False,
    ) -> ScoreResult:
        words = [self._vocab[i] for i in ids]
        res = self.score(" ".join(words), policy=policy, memory=memory)
        preds = [
            self.predict(" ".join(words[:t]), top_n=top, neighbours=int(nearest))
            for t in range(1, len(words))
        ]
        return dataclasses.replace(
            res,
            tokens=words[1:],  # the scored tokens, as the engine's (score's fake keeps them all)
            top=[
                [(self._id(x.token), x.token, math.log(x.prob)) for x in p.suggestions]
                for p in preds
            ]
            if top
            else None,
            nearest=[p.neighbours[0] if p.neighbours else None for p in preds] if nearest else None,
        )

    def start_generation_ids(self, ids: Sequence[int], cfg: GenerateConfig) -> FakeGeneration:
        return self.start_generation(self.detokenize(ids), cfg)

    def rebuild(self, *, crash_at: str | None = None, retrain: bool = False) -> BuildInfo:
        self.built_version += 1
        self.retrained = retrain
        n = len(self._live())
        return BuildInfo(
            version=self.built_version,
            entries=n,
            upto=len(self.entries),
            params=IndexParams.exact(),
            train_seconds=0.0,
            add_seconds=0.0,
            path=Path(f"v{self.built_version:06d}"),
        )

    def reload_index(self) -> bool:
        changed = self.served_version != self.built_version
        self.served_version = self.built_version
        return changed

    def forget_document(
        self, doc_id: int, text: str | None = None, *, entries: range | None = None
    ) -> int:
        if doc_id in self.deleted:
            return 0
        self.deleted.add(doc_id)
        return sum(1 for e in self.entries if e.doc_id == doc_id)

    def rollback(self, committed: Committed, document: int | None = None) -> int:
        """The faiss memory's rule: entries past the committed end go."""
        with self.exclusive():
            end = committed.end()
            cut = max(0, len(self.entries) - end)
            del self.entries[end:]
            return cut

    def recover(self, committed: Committed) -> Recovered:
        with self.exclusive():
            before, end = len(self.entries), committed.end()
            if before < end:
                raise MemoryBehind(
                    f"datastore has {before} entries but committed documents own {end}"
                )
            self.rollback(committed)
            return Recovered(before, len(self.entries))

    def hide_documents(self, doc_ids: list[int]) -> int:
        """Hidden at once (the fake's forget is as quick)."""
        self.hidden.update(doc_ids)
        return len(self.hidden)

    def sync(self) -> int:
        return 0

    def reconcile_index(self, recorded: Collection[int], *, delete: bool = False) -> list[int]:
        """Nothing versioned: nothing to reconcile."""
        return []

    def stats(self) -> dict[str, Any]:
        live = len(self._live())
        return {
            "entries": live,
            "datastore_entries": len(self.entries),
            "bytes_on_disk": 8 * len(self.entries),
            "bytes_in_ram": 8 * live,
            "index_version": self.served_version or None,
        }


class FakeGeneration:
    """``memlm.engine.generation.Generation`` over the fake engine's predictions (see the module doc)."""

    def __init__(self, engine: FakeEngine, words: list[str], cfg: GenerateConfig) -> None:
        self.engine, self.words, self.cfg = engine, list(words), cfg
        self.context_tokens = len(words)
        self.seed = None if cfg.greedy else (cfg.seed if cfg.seed is not None else 7)
        self.rng = None if self.seed is None else np.random.default_rng(self.seed)
        self.index_version = engine.served_version or None
        self.new: list[str] = []
        self._text = StopText(lambda ids: "".join(f" {self.new[i]}" for i in ids), cfg.stop)
        self.finish_reason: FinishReason | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text.final if self._text.final is not None else self._text.emitted

    @property
    def stop_matched(self) -> str | None:
        return self._text.matched

    def step(self, n: int) -> list[GeneratedToken]:
        out: list[GeneratedToken] = []
        while len(out) < n and not self.done:
            pred = self.engine.predict(
                " ".join(self.words), top_n=100, neighbours=1 if self.cfg.neighbour else 0
            )
            probs = np.array([s.prob for s in pred.suggestions])
            if self.rng is None:
                pick = 0
            else:
                pick = int(self.rng.choice(len(probs), p=probs / probs.sum()))
            s = pred.suggestions[pick]
            self.words.append(s.token)
            self.new.append(s.token)
            last = len(self.new) >= self.cfg.max_tokens
            delta = self._text.push(range(len(self.new)), last)
            if self._text.matched is not None:
                self.finish_reason = "stop"
            elif last:
                self.finish_reason = "length"
            nb = pred.neighbours[0] if pred.neighbours else None
            top = tuple(
                (self.engine._id(x.token), x.token, x.prob)
                for x in pred.suggestions[: self.cfg.top]
            )
            out.append(
                GeneratedToken(
                    s.token_id,
                    f" {s.token}",
                    delta,
                    s.prob,
                    s.lm_prob,
                    s.knn_prob,
                    pred.lam,
                    nb,
                    top,
                )
            )
        return out


if TYPE_CHECKING:  # mypy checks the fake against the contract (make lint)
    _contract: EngineLike[FakePrepared] = FakeEngine()
