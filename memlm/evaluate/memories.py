"""Where a policy's run keeps its memory: the faiss files in its work directory (the
default) or a Milvus collection of its own, behind :class:`memlm.memory.MemoryBackend`.

``run_policy`` opens the memory here and then talks to it only through the protocol, so
the same stream slice can be ingested on both backends and compared (issue 32, "ppl
parity"). The two differ only in what ``--index-kind auto`` builds (``auto_params``)
and in what a fresh start and a discarded store remove. A resumed run's memory is cut
back to its checkpoint by the protocol (``restore``); the LM's log-probability of each
stored entry, which consolidation asks for, is kept beside it by entry id
(``entry_logprobs``, ``memlm.memory.entry_lm``).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from memlm.evaluate.checkpoint import RunState
from memlm.index import IndexParams
from memlm.memory import MemoryBackend, MilvusURL, open_faiss, open_milvus, parse_memory_url
from memlm.memory.entry_lm import EntryLM


class RunMemory(Protocol):
    """How one policy's run opens, sizes and discards its memory."""

    backend: str  # "faiss" or "milvus": what the report records

    def open(self, workdir: Path, dim: int, *, fresh: bool) -> MemoryBackend:
        """The run's memory (its build records under ``workdir/index``); ``fresh``: a
        new run, whatever an earlier one left (``workdir`` itself was emptied)."""
        ...

    def auto_params(self, live: int, dim: int) -> IndexParams | None:
        """The index of an evening's build under ``--index-kind auto`` (None: the
        memory's own rule)."""
        ...

    def discard(self, workdir: Path) -> None:
        """Delete the stored entries and index of a finished run (not ``--keep-stores``);
        the checkpoint and the month-end scores stay."""
        ...

    def describe(self) -> dict[str, Any]:
        """The report's record of the memory."""
        ...


@dataclass(frozen=True)
class FaissRunMemory:
    """The datastore and the index versions in the work directory."""

    backend = "faiss"

    def open(self, workdir: Path, dim: int, *, fresh: bool) -> MemoryBackend:
        return open_faiss(workdir, dim)

    def auto_params(self, live: int, dim: int) -> IndexParams | None:
        # sized to the live entries every evening, as the harness always built (a new
        # size's parameters train again; the service's build keeps its base's until the
        # store doubles): the reports before this module stay comparable
        return IndexParams.for_size(live, dim)

    def discard(self, workdir: Path) -> None:
        for part in ("datastore", "index"):
            shutil.rmtree(workdir / part, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "url": None}


@dataclass(frozen=True)
class MilvusRunMemory:
    """One Milvus collection (``url``'s), with the build records in the work directory."""

    url: MilvusURL
    backend = "milvus"

    def open(self, workdir: Path, dim: int, *, fresh: bool) -> MemoryBackend:
        if fresh:  # an earlier run's collection of this name: start empty
            self._drop()
        return open_milvus(self.url, dim, root=workdir / "index")

    def _drop(self) -> None:
        """Drop the collection (its alias and generations) where it is a memlm memory."""
        from memlm.memory.milvus_client import MilvusMemoryError

        try:  # dim None: open what is there, never create
            memory = open_milvus(self.url, None)
        except MilvusMemoryError:  # none of this name (or not a memlm memory: kept)
            return
        try:
            memory.drop()
        finally:
            memory.close()

    def auto_params(self, live: int, dim: int) -> IndexParams | None:
        return None  # the Milvus memory's own rule (MilvusCollection.params_for)

    def discard(self, workdir: Path) -> None:
        self._drop()
        shutil.rmtree(workdir / "index", ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "url": str(self.url)}


FAISS = FaissRunMemory()


def _slug(policy: str) -> str:
    """A policy name as a piece of a Milvus collection name (``monim+cons`` ->
    ``monim_cons``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", policy)


def run_memory(url: str | None, policy: str) -> RunMemory:
    """The memory of ``policy``'s run: the faiss files (``url`` None, empty or ``faiss``),
    or the collection ``<prefix>_<policy>`` on the server ``milvus://host:port/prefix``
    names (with its options)."""
    parsed = parse_memory_url(url)
    if parsed is None:
        return FAISS
    return MilvusRunMemory(replace(parsed, collection=f"{parsed.collection}_{_slug(policy)}"))


def identity_of(url: str | None) -> str | None:
    """What of ``url`` a resumed run must share with its checkpoints (None: the faiss
    files): the collections and the options that change results, not the server's
    address (an embedded server's port changes from one start to the next)."""
    parsed = parse_memory_url(url)
    if parsed is None:
        return None
    return f"milvus/{parsed.collection}?index={parsed.index}&rerank={int(parsed.rerank)}"


def describe_memory(url: str | None, policies: Sequence[str]) -> dict[str, Any]:
    """The report's record of where the policies' memories lived."""
    parsed = parse_memory_url(url)
    if parsed is None:
        return {"backend": FAISS.backend, "url": None}
    return {
        "backend": MilvusRunMemory.backend,
        "url": url,
        "index": parsed.index,
        "rerank": parsed.rerank,
        "collections": {p: run_memory(url, p).describe()["url"] for p in policies},
    }


@dataclass(frozen=True)
class _Checkpointed:
    """What the checkpoint says the memory committed (memlm.memory.base.Committed): the
    entries before ``end`` (faiss: a datastore length), the documents up to ``doc_no``."""

    end_: int
    doc_no: int

    def end(self) -> int:
        return self.end_

    def holds(self, doc_ids: Sequence[int]) -> set[int]:
        return {int(d) for d in doc_ids if d <= self.doc_no}


def restore(memory: MemoryBackend, state: RunState) -> None:
    """Serve the checkpointed index version and take out the unfinished day's entries."""
    memory.reconcile([] if state.index_version is None else [state.index_version])
    memory.recover(_Checkpointed(state.datastore_len, state.doc_no))
    memory.refresh()


def entry_logprobs(workdir: Path, end: int) -> EntryLM:
    """log p_LM of each stored entry's value, by entry id, kept beside the run's memory
    for consolidation (``entry_lm.npz``, as the service keeps it): the entries of the
    checkpoint (ids below ``end``)."""
    out = EntryLM.load(workdir)
    out.keep_below(end)
    return out
