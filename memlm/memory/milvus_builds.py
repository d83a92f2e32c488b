"""Builds of a Milvus memory: index it in place, or re-create its index in the next
generation beside the served one and switch the alias (the blue-green re-index of
:mod:`memlm.memory.milvus_generations`).

:class:`MilvusIndexed` adds the maintenance calls to
:class:`~memlm.memory.milvus_collection.MilvusCollection` (which reads and writes the
generations); only the single builder of a memory calls them.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from memlm.datastore import SimulatedCrash
from memlm.index import IndexParams
from memlm.memory.milvus_client import MilvusException, connections, entry_ids, mapped, utility
from memlm.memory.milvus_collection import MilvusCollection
from memlm.memory.milvus_generations import (
    drop_extra,
    generation_name,
    generation_of,
    generations,
    switch,
)
from memlm.memory.milvus_index import milvus_index

log = logging.getLogger(__name__)

# Where a build that re-creates the index may stop (tests kill it at each): the new
# generation filled, indexed and loaded but not named; the alias switched, the old
# generation not dropped yet.
SWAP_CRASH_POINTS = ("after_copy", "after_switch")
# Seconds the old generation stays after the switch before it is dropped: searches of
# this process already under way on it end there (a search that meets the drop fails
# after ~0.8 s, "delegator closed", and is retried on the new one).
DROP_GRACE_S = 1.0
# Seconds a build waits, at most, for the query nodes to serve the sealed, indexed
# segments of what it flushed (``wait_handed_over``); until then searches read the rows
# from growing segments (every row found, by brute force), or from two copies of a
# compacted segment at once.
HANDOFF_WAIT_S = 300.0
# Milvus's segment states (common.proto): rows still in memory, and written out.
_GROWING, _FLUSHED = 2, 4


class MilvusIndexed(MilvusCollection):
    """A Milvus memory's collection with its builds (see the module docstring)."""

    @mapped
    def flush(self) -> float:
        """Seal the growing segments (they get indexed); returns the seconds it took."""
        t0 = time.perf_counter()
        self.collection.flush(timeout=self.timeout)
        return time.perf_counter() - t0

    @mapped
    def build_index(
        self,
        params: IndexParams | None = None,
        *,
        retrain: bool = False,
        crash_at: str | None = None,
    ) -> dict[str, Any]:
        """Index what the memory holds: in place (flush, so new rows are sealed and
        indexed, and compact deleted rows away) while the index stays the same; when the
        size or the URL calls for another index, or ``retrain`` asks to train the IVF
        lists again, in the next generation beside the served one (``_rebuild_beside``),
        which is served throughout. ``crash_at``: one of ``SWAP_CRASH_POINTS`` (tests)."""
        if crash_at is not None and crash_at not in SWAP_CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {SWAP_CRASH_POINTS}, got {crash_at!r}")
        # Long server-side steps wait at least 10 minutes. An int: pymilvus stops waiting
        # for an index build only at an int timeout (a float one waits forever).
        long_wait = math.ceil(max(self.timeout, 600))
        with self._lock:
            t0 = time.perf_counter()
            # the deletes sent before this build's flush: its compaction takes them in
            # (or loses them: found after it); those sent later stay for the next build
            before = self.deletes.pending()[1]
            self._follow()  # what the alias names now (another process may have switched)
            n = self.count()
            want = params or self.params_for(n)
            other = milvus_index(want) != milvus_index(self.params)
            # (a retrain re-creates what k-means trained: IVF lists, PQ codebooks)
            recreated = other or (retrain and want.kind.startswith("ivf"))
            steps: dict[str, Any] = {}
            if recreated:
                # the new generation is compacted by construction: only live rows are
                # copied. Its index may take an hour: nothing is unavailable meanwhile,
                # a slow (or shared) index node only delays the switch.
                steps = self._rebuild_beside(want, max(long_wait, 3600), crash_at)
                n = self.count()
            else:
                steps["flush_seconds"] = round(self.flush(), 3)
                t1 = time.perf_counter()
                try:
                    self.collection.compact(timeout=self.timeout)
                    self.collection.wait_for_compaction_completed(timeout=long_wait)
                except MilvusException as exc:
                    # Milvus 2.3 may refuse a compaction right after a flush ("segment in
                    # flushed state not found"). Compaction only merges segments and drops
                    # deleted rows, which searches filter anyway: the build goes on, the
                    # next one compacts.
                    log.warning("Milvus compaction skipped: %s", exc)
                steps["compact_seconds"] = round(time.perf_counter() - t1, 3)
            t2 = time.perf_counter()
            if not recreated:  # (a new generation is indexed and handed over before its
                # switch; a compaction of its upserts may index a merged segment again
                # afterwards, searched meanwhile by brute force: nothing to wait for)
                utility.wait_for_index_building_complete(
                    self.collection.name, using=self.alias, timeout=long_wait
                )
                steps["handoff_seconds"], steps["handed_over"] = self.wait_handed_over(
                    self.collection.name
                )
            self.params = want  # the index Milvus holds now, and its nprobe
            # the compaction done and its segments served: rows a lost delete left
            steps["deletes_reapplied"] = self._settle_deletes(before)
            return {
                "backend": self.name,
                "entries": n,
                "params": self.params.to_json(),
                "index_recreated": recreated,
                "collection": self.collection.name,
                # searches never wait for a build: the served collection stays loaded
                "unavailable_seconds": 0.0,
                **steps,
                "index_wait_seconds": round(time.perf_counter() - t2, 3),
                "seconds": round(time.perf_counter() - t0, 3),
            }

    def _rebuild_beside(
        self, want: IndexParams, long_wait: int, crash_at: str | None
    ) -> dict[str, Any]:
        """The blue-green switch: the next generation created with ``want``'s index and
        loaded, every live entry copied into it (writes reach it from its creation on:
        ``_write``), the rows that a forget took from the served one during the copy
        deleted, its index built and loaded; then the alias names it (one call), this
        process serves it and the old generation is dropped. Until the switch the old one
        serves every search; a failure before it drops the new one, a kill leaves it to
        the next start's ``cleanup``."""
        old = self.collection
        last = max(
            generation_of(self.base, n) or 0
            for n in generations(self.base, self.alias, self.timeout)
        )
        name = generation_name(self.base, last + 1)
        t0 = time.perf_counter()
        try:
            new = self._handle(self._create(name, want, long_wait))
            new.load(timeout=long_wait)
            copied = 0
            for keys, values, docs, pos, days in self._pages(old):
                self._upsert_into(new, entry_ids(docs, pos), keys, values, docs, pos, days)
                copied += len(values)
            copy_s = time.perf_counter() - t0
            new.flush(timeout=long_wait)
            # rows a forget deleted while the copy was running
            removed = drop_extra(new, old, long_wait)
            utility.wait_for_index_building_complete(name, using=self.alias, timeout=long_wait)
            utility.wait_for_loading_complete(name, using=self.alias, timeout=long_wait)
            # served from its sealed, indexed segments before the alias names it
            handoff_s, handed_over = self.wait_handed_over(name)
        except SimulatedCrash:
            raise
        except BaseException:
            self._drop_quietly(name)
            raise
        index_s = time.perf_counter() - t0 - copy_s
        if crash_at == "after_copy":
            raise SimulatedCrash(crash_at)
        t1 = time.perf_counter()
        switch(self.base, name, self.alias, self.timeout)
        switch_s = time.perf_counter() - t1
        if crash_at == "after_switch":
            raise SimulatedCrash(crash_at)
        self._serve(name)
        time.sleep(DROP_GRACE_S)
        # searches of other processes still on the old one resolve the alias again when
        # it is gone (``_read``); if the drop fails, the next start's cleanup drops it
        self._drop_quietly(old.name)
        log.info(
            "Milvus generation %s serves %s: %d entries copied in %.1f s, %d forgotten meanwhile",
            name,
            self.url,
            copied,
            copy_s,
            removed,
        )
        return {
            "previous_collection": old.name,
            "copied": copied,
            "removed_after_copy": removed,
            "copy_seconds": round(copy_s, 3),
            # flush, the forgotten rows deleted, the index built and loaded
            "index_seconds": round(index_s, 3),
            "switch_seconds": round(switch_s, 3),
            "handoff_seconds": handoff_s,
            "handed_over": handed_over,
        }

    def _settle_deletes(self, before: int) -> int:
        """Delete again the rows that the journal's lasting deletes named and the served
        collection still holds (a server lost the delete, in a compaction); returns how
        many rows that was. Each group of (at most 1,000) values in which rows were found
        is written down again, for the next build to check after its own compaction; the
        others written ``before`` the build (the journal's ``pending`` end then) leave the
        journal (``memlm.memory.milvus_deletes``): its compaction took them in. A delete
        sent during the build may have met its compaction and stays for the next one."""
        named, _ = self.deletes.pending()
        found = 0
        again: dict[str, list[int]] = {}
        for field, values in named.items():
            for part, n in self._delete_groups(field, values):
                if n:
                    found += n
                    again.setdefault(field, []).extend(part)
        for field, part in again.items():  # before the settle: a crash keeps them
            self.deletes.record(field, part)
        self.deletes.settle(before)
        if found:
            log.warning(
                "Milvus collection %s served %d rows that forgets or retirements had deleted "
                "(a delete lost in a compaction: Milvus %s; fixed in 2.3.15): deleted again",
                self.collection.name,
                found,
                self.server_version,
            )
        return found

    def handed_over(self, name: str) -> bool:
        """Whether the query nodes serve ``name``'s written rows from exactly the segments
        written out: each flushed segment loaded sealed, and no other sealed one (no copy
        of segments a compaction merged away). Milvus loads a sealed segment once its
        index is built (a FLAT one has none to build). Growing segments of rows appended
        since the flush are no concern: they are not written out yet."""
        handler = connections._fetch_handler(self.alias)  # noqa: SLF001 - no public call
        written = {
            s.segmentID
            for s in handler.get_persistent_segment_infos(name, timeout=self.timeout)
            if s.state == _FLUSHED and s.num_rows > 0
        }
        served = utility.get_query_segment_info(name, timeout=self.timeout, using=self.alias)
        return {s.segmentID for s in served if s.state != _GROWING} == written

    def wait_handed_over(self, name: str, timeout: float = HANDOFF_WAIT_S) -> tuple[float, bool]:
        """Wait until ``handed_over(name)`` (at most ``timeout`` seconds); returns the
        seconds waited and whether it was. Milvus hands a flushed segment from the growing
        copy to the sealed, indexed one in the background (the query coordinator's target
        moves every ``queryCoord.updateNextTargetInterval``, 10 s by default); a build
        that returned before it left the first searches on the growing copy: every row
        found, by brute force, and not the index the build reports. Not handed over in
        time: logged, and the build goes on (searches stay correct, only slower)."""
        t0 = time.perf_counter()
        while not self.handed_over(name):
            if time.perf_counter() - t0 > timeout:
                log.warning(
                    "Milvus collection %s: the query nodes do not serve its indexed segments "
                    "%.0f s after the build; searches read its growing segments meanwhile",
                    name,
                    timeout,
                )
                return round(time.perf_counter() - t0, 3), False
            time.sleep(0.2)
        return round(time.perf_counter() - t0, 3), True

    def _drop_quietly(self, name: str) -> None:
        self._handles.pop(name, None)
        try:
            utility.drop_collection(name, timeout=self.timeout, using=self.alias)
        except Exception as exc:  # noqa: BLE001 - the next start's cleanup drops it
            log.warning("could not drop Milvus collection %s: %s", name, exc)

    @mapped
    def cleanup(self, keep: str | None = None) -> list[str]:
        """Serve ``keep`` (the collection a recorded version names) when it still exists
        and the alias names another (a build killed after its switch, before its record),
        and drop every other generation (builds killed before their switch, old ones a
        killed build did not drop). Run by the single builder, at its start."""
        names = generations(self.base, self.alias, self.timeout)
        self._follow()
        if keep is not None and keep in names and keep != self.collection.name:
            log.warning(
                "serving %s again: the build that switched away from it was not recorded", keep
            )
            switch(self.base, keep, self.alias, self.timeout)
            self._serve(keep)
        dropped = [n for n in names if n != self.collection.name]
        for n in dropped:
            log.warning("dropping Milvus collection %s, left by a build that did not finish", n)
            self._drop_quietly(n)
        return dropped

    def drop(self) -> None:
        """Delete the whole memory: the alias and every generation (tests,
        ``migrate-memory --replace``)."""
        names = generations(self.base, self.alias, self.timeout)
        if self.base not in names and utility.has_collection(
            self.base, using=self.alias, timeout=self.timeout
        ):
            utility.drop_alias(self.base, timeout=self.timeout, using=self.alias)
        for n in names:
            self._drop_quietly(n)
