"""The generations of one Milvus memory and the alias that names the served one: the
blue-green switch of a build that re-creates the index.

A memory named ``news`` (the URL's collection) is an alias, ``news``, over physical
collections ``news__g0001``, ``news__g0002``, ... (a collection created before aliases,
named ``news`` itself, is generation 0). A build that needs another index fills the next
generation beside the served one, loads it, switches the alias (one atomic call) and
drops the old one; searches never meet a released collection.

Why readers do not search through the alias: the proxy resolves an alias several times
in one request and may mix two collections' metadata while it changes
(milvus-io/milvus#52351, #25662 "search failed occasionally after switching the collection
alias"), and a ``Collection`` object keeps the schema of the collection its alias named
when it was made (milvus-io/pymilvus#1028). So each process resolves the alias to a
physical name once and searches that name; when the name is gone (dropped after a
switch) or not loaded, it resolves again and retries once (``MilvusCollection``).

Writes reach every generation, oldest first, then the generations listed again after the
write (``MilvusCollection._write``). A build creates its generation before it copies, so
a write either lands before the copy reads it or finds the new generation on its second
listing; forgets that raced the copy are removed after it (``drop_extra``).
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

from memlm.memory.milvus_client import Collection, MilvusException, utility

SEPARATOR = "__g"
# Milvus: "collection not found" (dropped, or never made) and "collection not loaded".
GONE, NOT_LOADED = 100, 101


def generation_name(base: str, generation: int) -> str:
    return f"{base}{SEPARATOR}{generation:04d}"


def generation_of(base: str, name: str) -> int | None:
    """The generation of collection ``name`` in memory ``base`` (0: the collection created
    before aliases, named ``base``); None when it is not one of the memory's."""
    if name == base:
        return 0
    m = re.fullmatch(re.escape(base + SEPARATOR) + r"(\d+)", name)
    return None if m is None else int(m.group(1))


def generations(base: str, using: str, timeout: int) -> list[str]:
    """The memory's physical collections, oldest generation first (one listing)."""
    mine = [
        (g, n)
        for n in utility.list_collections(timeout=timeout, using=using)
        if (g := generation_of(base, n)) is not None
    ]
    return [n for _, n in sorted(mine)]


def gone(exc: BaseException) -> bool:
    """Whether a failure says the collection named in the call is gone or not loaded (a
    switch dropped it): the caller resolves the alias again."""
    code = getattr(exc, "code", None)
    text = str(exc)
    return (
        code in (GONE, NOT_LOADED)
        or "collection not found" in text
        or "collection not loaded" in text
        or "not exist" in text  # pymilvus's SchemaNotReadyException for a missing one
    )


def _named(base: str, using: str, timeout: int) -> str | None:
    """What ``base`` names: itself (a collection), its alias's target, or None."""
    if not utility.has_collection(base, using=using, timeout=timeout):
        return None
    try:  # has_collection is true for an alias too: describe names the target
        return str(Collection(base, using=using).describe(timeout=timeout)["collection_name"])
    except MilvusException as exc:
        if not gone(exc):
            raise
        return None


def resolve(base: str, using: str, timeout: int) -> str | None:
    """The physical collection served: the alias's target, else the collection named
    ``base`` (generation 0), else the newest generation (a switch that dropped
    generation 0 before it could name the new one), else None."""
    name = _named(base, using, timeout)
    if name is not None:
        return name
    names = generations(base, using, timeout)
    return names[-1] if names else None


def switch(base: str, target: str, using: str, timeout: int) -> None:
    """Name ``target`` by the alias ``base`` in one call (``alter_alias``). A memory whose
    served collection is still named ``base`` itself (generation 0) drops it first: an
    alias cannot take a collection's name (for that moment ``resolve`` finds the newest
    generation, ``target``)."""
    named = _named(base, using, timeout)
    if named is not None and named != base:
        utility.alter_alias(target, base, timeout=timeout, using=using)
        return
    if named == base:
        utility.drop_collection(base, timeout=timeout, using=using)
    utility.create_alias(target, base, timeout=timeout, using=using)


def ids_of(coll: Collection, timeout: int) -> npt.NDArray[np.int64]:
    """Every primary key the collection holds now (strong consistency), sorted."""
    out: list[int] = []
    it = coll.query_iterator(
        batch_size=16384, expr="", output_fields=["id"], consistency_level="Strong", timeout=timeout
    )
    try:
        while page := it.next():
            out.extend(int(r["id"]) for r in page)
    finally:
        it.close()
    return np.unique(np.asarray(out, np.int64))


def drop_extra(new: Collection, old: Collection, timeout: int) -> int:
    """Delete from ``new`` what ``old`` no longer holds: rows the copy read before a forget
    (or a rollback) deleted them from ``old`` and then wrote to ``new`` after the forget's
    own write to ``new``. ``new`` is listed before ``old`` (writers write ``old`` first),
    and each candidate is checked again right before it goes."""
    extra = np.setdiff1d(ids_of(new, timeout), ids_of(old, timeout))
    dropped = 0
    for a in range(0, len(extra), 4096):
        part = extra[a : a + 4096].tolist()
        back = old.query(
            f"id in {part}", output_fields=["id"], consistency_level="Strong", timeout=timeout
        )
        still = sorted(set(part) - {int(r["id"]) for r in back})
        if still:
            new.delete(f"id in {still}", timeout=timeout)
            dropped += len(still)
    return dropped
