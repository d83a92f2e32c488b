"""Datastore: round trips, segments, crash recovery, truncation, deletion, validation."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from memlm.datastore import (
    COMPACT_CRASH_POINTS,
    CRASH_POINTS,
    DELETE_CRASH_POINTS,
    MANIFEST,
    Compaction,
    Datastore,
    DatastoreError,
    SimulatedCrash,
)

DIM = 8


def batch(n: int, seed: int, doc: int = 1, day: int = 17_000, pos0: int = 0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, DIM)).astype(np.float16)
    values = rng.integers(0, 50_000, n).astype(np.int32)
    doc_ids = np.full(n, doc, dtype=np.int64)
    positions = np.arange(pos0, pos0 + n, dtype=np.int32)
    days = np.full(n, day, dtype=np.int32)
    return keys, values, doc_ids, positions, days


def test_create_append_and_read_back(tmp_path: Path) -> None:
    ds = Datastore.open(tmp_path / "ds", dim=DIM)
    b1 = batch(10, 0, doc=7, day=3)
    b2 = batch(5, 1, doc=8, day=4, pos0=100)
    assert ds.append(*b1) == range(0, 10)
    assert ds.append(*b2) == range(10, 15)
    assert len(ds) == 15
    ids = np.array([14, 0, 9, 10])
    keys = np.concatenate([b1[0], b2[0]])
    values = np.concatenate([b1[1], b2[1]])
    np.testing.assert_array_equal(ds.keys(ids), keys[ids])
    assert ds.keys(ids).dtype == np.float16
    np.testing.assert_array_equal(ds.values(ids), values[ids])
    doc_ids, positions, days = ds.provenance(ids)
    np.testing.assert_array_equal(doc_ids, [8, 7, 7, 8])
    np.testing.assert_array_equal(positions, [104, 0, 9, 100])
    np.testing.assert_array_equal(days, [4, 3, 3, 4])
    assert (doc_ids.dtype, positions.dtype, days.dtype) == (np.int64, np.int32, np.int32)


def test_reopen_reads_through_memmap(tmp_path: Path) -> None:
    b = batch(20, 2)
    Datastore.open(tmp_path, dim=DIM).append(*b)
    ds = Datastore.open(tmp_path)
    assert len(ds) == 20 and ds.dim == DIM
    np.testing.assert_array_equal(ds.keys(np.arange(20)), b[0])
    assert isinstance(ds._segment_maps(0)["keys"], np.memmap)
    # Maps are re-created when the segment grows after they were made.
    ds.append(*batch(3, 3))
    np.testing.assert_array_equal(ds.values([20, 21, 22]), batch(3, 3)[1])


def test_open_checks_dim_and_requires_it_to_create(tmp_path: Path) -> None:
    with pytest.raises(DatastoreError, match="no dim given"):
        Datastore.open(tmp_path / "x")
    Datastore.open(tmp_path / "x", dim=DIM)
    with pytest.raises(DatastoreError, match="has dim 8, caller expects 16"):
        Datastore.open(tmp_path / "x", dim=16)


def test_segment_rollover(tmp_path: Path) -> None:
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=4)
    b = batch(10, 4)
    assert ds.append(*[x[:3] for x in b]) == range(0, 3)
    assert ds.append(*[x[3:] for x in b]) == range(3, 10)  # spans segments 0, 1, 2
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [s["entries"] for s in manifest["segments"]] == [4, 4, 2]
    assert (tmp_path / "seg-000002.keys").stat().st_size == 2 * DIM * 2
    ds.close()
    ds = Datastore.open(tmp_path)  # the store keeps its own segment size
    assert ds.max_segment_entries == 4
    np.testing.assert_array_equal(ds.keys(np.arange(10)[::-1]), b[0][::-1])
    chunks = list(ds.iter_chunks(1, 9, chunk=3))
    assert [(first, len(k)) for first, k, _ in chunks] == [(1, 3), (4, 3), (7, 1), (8, 1)]
    np.testing.assert_array_equal(np.concatenate([v for _, _, v in chunks]), b[1][1:9])


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_at_each_point_then_reopen(tmp_path: Path, point: str) -> None:
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=4)
    before = batch(6, 5)
    ds.append(*before)
    sizes_before = {f.name: f.stat().st_size for f in tmp_path.iterdir()}
    crashing = batch(5, 6, doc=2)  # fills segment 1 and opens segment 2
    with pytest.raises(SimulatedCrash, match=point):
        ds.append(*crashing, crash_at=point)
    with pytest.raises(DatastoreError, match="closed"):
        ds.append(*crashing)

    ds = Datastore.open(tmp_path)
    committed = point == "after_manifest"
    assert len(ds) == (11 if committed else 6)
    np.testing.assert_array_equal(ds.keys(np.arange(6)), before[0])
    if committed:
        np.testing.assert_array_equal(ds.keys(np.arange(6, 11)), crashing[0])
    else:
        # Tails cut back, the new segment's files and the manifest temp file removed.
        assert {f.name: f.stat().st_size for f in tmp_path.iterdir()} == sizes_before
        assert ds.append(*batch(2, 7)) == range(6, 8)
        ds.close()
        with Datastore.open(tmp_path) as ds:
            assert len(ds) == 8
            np.testing.assert_array_equal(ds.keys([6, 7]), batch(2, 7)[0])


def test_reopen_refuses_missing_committed_bytes(tmp_path: Path) -> None:
    Datastore.open(tmp_path, dim=DIM).append(*batch(4, 8))
    (tmp_path / "seg-000000.values").write_bytes(b"\0" * 8)
    with pytest.raises(DatastoreError, match="8 bytes on disk, manifest commits 16"):
        Datastore.open(tmp_path)


def test_truncate(tmp_path: Path) -> None:
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=4)
    b = batch(10, 9)
    ds.append(*b)
    gen = ds.generation
    ds.truncate(5)
    assert len(ds) == 5
    assert sorted(f.name for f in tmp_path.glob("seg-000002.*")) == []  # dropped segment
    # The cut tail of segment 1 stays on disk (a reader process may map it) until the
    # next writer open.
    assert (tmp_path / "seg-000001.keys").stat().st_size == 4 * DIM * 2
    assert ds.unchanged_below(gen) == 5
    assert ds.unchanged_below(ds.generation) > 10**12
    with pytest.raises(DatastoreError, match="out of range"):
        ds.keys([5])
    c = batch(3, 10)
    assert ds.append(*c) == range(5, 8)
    np.testing.assert_array_equal(ds.keys(np.arange(8)), np.concatenate([b[0][:5], c[0]]))
    ds.close()
    ds = Datastore.open(tmp_path)
    assert (tmp_path / "seg-000001.keys").stat().st_size == 4 * DIM * 2  # 1 + 3 entries
    np.testing.assert_array_equal(ds.keys(np.arange(8)), np.concatenate([b[0][:5], c[0]]))
    ds.truncate(6)
    ds.close()
    ds = Datastore.open(tmp_path)
    assert (tmp_path / "seg-000001.keys").stat().st_size == 2 * DIM * 2
    ds.truncate(0)
    assert len(Datastore.open(tmp_path, readonly=True)) == 0
    with pytest.raises(DatastoreError, match="truncate"):
        ds.truncate(1)


def test_single_writer_and_readonly_reader(tmp_path: Path) -> None:
    writer = Datastore.open(tmp_path, dim=DIM)
    with pytest.raises(DatastoreError, match="another writer holds LOCK"):
        Datastore.open(tmp_path)
    with pytest.raises(DatastoreError, match="read-only open"):
        Datastore.open(tmp_path / "missing", readonly=True)
    reader = Datastore.open(tmp_path, readonly=True)
    assert reader.readonly and not writer.readonly
    b = batch(6, 30)
    writer.append(*b)
    assert len(reader) == 0  # until it reloads the manifest
    assert reader.reload() is True
    assert reader.reload() is False
    np.testing.assert_array_equal(reader.keys(np.arange(6)), b[0])
    writer.truncate(2)
    c = batch(3, 31)
    writer.append(*c)
    writer.delete_document(1)
    assert reader.reload() is True
    np.testing.assert_array_equal(reader.keys(np.arange(5)), np.concatenate([b[0][:2], c[0]]))
    assert reader.num_live == 0
    with pytest.raises(DatastoreError, match="read-only"):
        reader.append(*batch(1, 32))
    with pytest.raises(DatastoreError, match="read-only"):
        reader.truncate(0)
    assert writer.reload() is False
    writer.close()
    with pytest.raises(DatastoreError, match="closed"):
        writer.append(*batch(1, 33))
    Datastore.open(tmp_path).close()  # the lock was released


def test_delete_document_persists(tmp_path: Path) -> None:
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=4)
    ds.append(*batch(3, 11, doc=1))
    ds.append(*batch(4, 12, doc=2))
    ds.append(*batch(2, 13, doc=1, pos0=3))
    np.testing.assert_array_equal(ds.entries_of_document(1), [0, 1, 2, 7, 8])
    assert ds.delete_document(1) == 5
    assert ds.delete_document(1) == 0
    assert ds.num_live == 4
    ds.close()
    ds = Datastore.open(tmp_path)
    assert ds.deleted_documents == {1}
    np.testing.assert_array_equal(ds.live_mask(np.arange(9)), [0, 0, 0, 1, 1, 1, 1, 0, 0])
    assert ds.num_live == 4
    ds.append(*batch(1, 14, doc=1))  # a deleted document stays deleted
    assert ds.num_live == 4
    assert ds.stats() == {
        "entries": 10,
        "live_entries": 4,
        "deleted_documents": 1,
        "retired_entries": 0,
        "bytes_on_disk": sum(f.stat().st_size for f in tmp_path.iterdir()),
        "bytes_reclaimed": 0,
        "dim": DIM,
        "segments": 3,
        "rows": 10,
    }
    # Keys 10 x 8 x 2 + values 4 + doc ids 8 + positions 4 + days 4 bytes, the one
    # tombstone (8 bytes), plus the manifest.
    manifest = (tmp_path / MANIFEST).stat().st_size
    assert ds.stats()["bytes_on_disk"] == 10 * (16 + 20) + 8 + manifest


def test_bad_inputs_raise(tmp_path: Path) -> None:
    ds = Datastore.open(tmp_path, dim=DIM)
    k, v, d, p, t = batch(3, 15)
    with pytest.raises(DatastoreError, match=r"keys: expected shape \(n, 8\)"):
        ds.append(k[:, :4], v, d, p, t)
    with pytest.raises(DatastoreError, match="keys: expected float16 or float32"):
        ds.append(k.astype(np.int32), v, d, p, t)
    with pytest.raises(DatastoreError, match="float16 range"):
        ds.append(np.full((3, DIM), 1e6, dtype=np.float32), v, d, p, t)
    with pytest.raises(DatastoreError, match=r"values: expected shape \(3,\)"):
        ds.append(k, v[:2], d, p, t)
    with pytest.raises(DatastoreError, match="values: expected integers"):
        ds.append(k, v.astype(np.float32), d, p, t)
    with pytest.raises(DatastoreError, match="token ids must be >= 0"):
        ds.append(k, -v - 1, d, p, t)
    with pytest.raises(DatastoreError, match="positions: values outside the int32 range"):
        ds.append(k, v, d, p.astype(np.int64) + 2**40, t)
    with pytest.raises(DatastoreError, match="days: expected integers"):
        ds.append(k, v, d, p, t.astype(bool))
    with pytest.raises(DatastoreError, match="ids: expected integers"):
        ds.keys(np.array([0.5]))
    with pytest.raises(ValueError, match="crash_at must be one of"):
        ds.append(k, v, d, p, t, crash_at="nope")
    assert len(ds) == 0
    # Scalars broadcast for doc_ids and days; float32 keys are stored as float16.
    assert ds.append(k.astype(np.float32), v, 5, p, 19_000) == range(0, 3)
    np.testing.assert_array_equal(ds.provenance([2])[0], [5])
    np.testing.assert_array_equal(ds.keys([0, 1, 2]), k)


def test_reads_during_appends(tmp_path: Path) -> None:
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=16)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                n = len(ds)
                if n:
                    got = ds.values(np.arange(n))
                    # Every value was written as its own global id.
                    assert np.array_equal(got, np.arange(len(got)))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(30):
        k, _, d, p, days = batch(5, i)
        ds.append(k, np.arange(5 * i, 5 * i + 5), d, p, days)
    stop.set()
    t.join()
    assert errors == []
    assert len(ds) == 150


# --- shared writers: several processes append in turn ----------------------------------------


def test_shared_writers_append_in_turn(tmp_path: Path) -> None:
    a = Datastore.open(tmp_path, dim=DIM, shared=True, max_segment_entries=16)
    b = Datastore.open(tmp_path, shared=True)
    b1, b2, b3 = batch(10, 0, doc=1), batch(12, 1, doc=2), batch(3, 2, doc=3)
    assert a.append(*b1) == range(0, 10)
    assert b.append(*b2) == range(10, 22)  # b reloads a's commit before it writes
    assert a.append(*b3) == range(22, 25)  # across the segment boundary at 16
    for ds in (a, b):
        ds.reload()
        assert len(ds) == 25
        np.testing.assert_array_equal(ds.keys(np.arange(25)), np.concatenate([b1[0], b2[0], b3[0]]))
        np.testing.assert_array_equal(
            ds.provenance(np.arange(25))[0], [1] * 10 + [2] * 12 + [3] * 3
        )
    assert b.delete_document(2) == 12 and a.truncate(22) is None
    b.reload()
    assert (len(b), b.num_live, a.num_live) == (22, 10, 10)


def test_exclusive_sections_exclude_other_writers(tmp_path: Path) -> None:
    a = Datastore.open(tmp_path, dim=DIM, shared=True)
    b = Datastore.open(tmp_path, shared=True)
    entered = threading.Event()

    def write_b() -> None:
        with b.exclusive():
            entered.set()
            b.append(*batch(2, 5, doc=9))

    with a.exclusive():
        a.append(*batch(4, 4, doc=8))
        t = threading.Thread(target=write_b)
        t.start()
        assert not entered.wait(0.3)  # b waits while a holds the lock
        assert len(a) == 4  # so a's view inside the block is final
    t.join(5)
    assert entered.is_set()
    a.reload()
    assert a.provenance(np.arange(6))[0].tolist() == [8] * 4 + [9] * 2


def test_exclusive_writer_keeps_shared_writers_out(tmp_path: Path) -> None:
    owner = Datastore.open(tmp_path, dim=DIM)
    opened: list[Datastore] = []
    t = threading.Thread(target=lambda: opened.append(Datastore.open(tmp_path, shared=True)))
    t.start()
    t.join(0.3)
    assert not opened  # waits for the exclusive writer
    owner.close()
    t.join(5)
    assert len(opened) == 1 and opened[0].shared
    with pytest.raises(ValueError, match="not both"):
        Datastore.open(tmp_path, readonly=True, shared=True)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_shared_writer_crash_leaves_a_store_the_next_writer_continues(
    tmp_path: Path, point: str
) -> None:
    a = Datastore.open(tmp_path, dim=DIM, shared=True)
    b = Datastore.open(tmp_path, shared=True)
    first = batch(5, 0, doc=1)
    a.append(*first)
    with pytest.raises(SimulatedCrash):
        a.append(*batch(7, 1, doc=2), crash_at=point)
    committed = point == "after_manifest"
    nxt = batch(3, 2, doc=3)
    start = 12 if committed else 5
    assert b.append(*nxt) == range(start, start + 3)  # the lock was not left behind
    keys = np.concatenate([first[0], batch(7, 1)[0]] if committed else [first[0]])
    np.testing.assert_array_equal(b.keys(np.arange(start)), keys)
    np.testing.assert_array_equal(b.keys(np.arange(start, start + 3)), nxt[0])
    with pytest.raises(DatastoreError, match="closed"):
        a.append(*nxt)


# --- forget: tombstone log, live count, compaction ------------------------------------


def _bytes_of_dir(path: Path) -> bytes:
    return b"".join(f.read_bytes() for f in sorted(path.iterdir()) if f.is_file())


def _three_docs(tmp_path: Path) -> tuple[Datastore, list[tuple]]:
    """Documents 1, 2, 3 across segments of 4 ids: 1 = ids 0-4, 2 = 5-10, 3 = 11-13."""
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=4)
    parts = [batch(5, 40, doc=1), batch(6, 41, doc=2), batch(3, 42, doc=3)]
    for p in parts:
        ds.append(*p)
    return ds, parts


def test_compact_removes_deleted_rows_and_keeps_ids(tmp_path: Path) -> None:
    ds, parts = _three_docs(tmp_path)
    reader = Datastore.open(tmp_path, readonly=True)
    keys = np.concatenate([p[0] for p in parts])
    assert ds.delete_document(2, entries=range(5, 11)) == 6
    # 6 rows of 36 bytes leave; each rewritten segment keeps 1 row and a 4-byte id for it
    assert ds.compact() == Compaction(segments=2, rows_removed=6, bytes_reclaimed=6 * 36 - 8)
    assert ds.compact() == Compaction(0, 0, 0)  # nothing left to remove
    # No byte of document 2's keys is left in any file; the others' are all there.
    blob = _bytes_of_dir(tmp_path)
    assert all(parts[1][0][i].tobytes() not in blob for i in range(6))
    assert all(k.tobytes() in blob for k in np.concatenate([parts[0][0], parts[2][0]]))
    assert (len(ds), ds.num_live, ds.stats()["rows"], ds.bytes_reclaimed) == (14, 8, 8, 208)
    kept = np.r_[0:5, 11:14]
    np.testing.assert_array_equal(ds.keys(kept), keys[kept])
    np.testing.assert_array_equal(ds.provenance(kept)[0], [1] * 5 + [3] * 3)
    np.testing.assert_array_equal(ds.live_mask(np.arange(14)), np.isin(np.arange(14), kept))
    with pytest.raises(DatastoreError, match="entry 6 was compacted away"):
        ds.keys([0, 6])
    chunks = [(first, len(k)) for first, k, _ in ds.iter_chunks(0, 14, chunk=3)]
    assert chunks == [(0, 3), (3, 1), (4, 1), (11, 1), (12, 2)]
    np.testing.assert_array_equal(ds.entries_of_document(3), [11, 12, 13])
    # A reader that mapped the old files switches to the new ones when it reloads.
    assert reader.reload() is True
    np.testing.assert_array_equal(reader.keys(kept), keys[kept])
    assert reader.num_live == 8 and not reader.live_mask([7])[0]
    # Appends continue the compacted last segment (ids 14, 15) and then a new one.
    more = batch(3, 43, doc=4)
    assert ds.append(*more) == range(14, 17)
    ds.close()
    ds = Datastore.open(tmp_path)
    np.testing.assert_array_equal(ds.keys([14, 15, 16]), more[0])
    np.testing.assert_array_equal(ds.keys(kept), keys[kept])
    assert (ds.num_live, ds.stats()["rows"]) == (11, 11)
    # A truncation inside a compacted segment cuts by id.
    ds.truncate(13)
    assert (len(ds), ds.num_live) == (13, 7)
    np.testing.assert_array_equal(ds.keys([11, 12]), keys[[11, 12]])
    ds.close()
    assert Datastore.open(tmp_path).num_live == 7


@pytest.mark.parametrize("point", COMPACT_CRASH_POINTS)
def test_compact_crash_at_each_point(tmp_path: Path, point: str) -> None:
    ds, parts = _three_docs(tmp_path)
    ds.delete_document(2)
    with pytest.raises(SimulatedCrash, match=point):
        ds.compact(crash_at=point)
    with pytest.raises(DatastoreError, match="closed"):
        ds.compact()
    ds = Datastore.open(tmp_path)  # the next writer: nothing lost, document 2 hidden
    keys = np.concatenate([p[0] for p in parts])
    kept = np.r_[0:5, 11:14]
    np.testing.assert_array_equal(ds.keys(kept), keys[kept])
    assert (len(ds), ds.num_live) == (14, 8)
    assert not ds.live_mask(np.arange(5, 11)).any()
    committed = point == "after_manifest"
    assert ds.stats()["rows"] == (8 if committed else 14)
    # Whatever the crash left (new files before the commit, old ones after) is gone, and
    # compacting again finishes the job.
    ds.compact()
    blob = _bytes_of_dir(tmp_path)
    assert all(parts[1][0][i].tobytes() not in blob for i in range(6))
    assert ds.stats()["rows"] == 8 and ds.bytes_reclaimed == 6 * 36 - 8
    np.testing.assert_array_equal(ds.keys(kept), keys[kept])


@pytest.mark.parametrize("point", DELETE_CRASH_POINTS)
def test_delete_crash_at_each_point(tmp_path: Path, point: str) -> None:
    ds, _ = _three_docs(tmp_path)
    ds.delete_document(1)
    with pytest.raises(SimulatedCrash, match=point):
        ds.delete_document(3, crash_at=point)
    ds = Datastore.open(tmp_path)
    committed = point == "after_manifest"
    assert ds.deleted_documents == ({1, 3} if committed else {1})
    assert ds.num_live == (6 if committed else 9)
    assert (tmp_path / "tombstones").stat().st_size == 8 * len(ds.deleted_documents)
    assert ds.delete_document(3) == (0 if committed else 3)  # the retry after the crash
    assert ds.num_live == 6


def test_tombstone_bookkeeping_is_proportional_to_the_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work counted, not timed: after deletions, an append reads no stored document id
    and num_live reads nothing; a deletion given its range reads only that range and
    writes one 8-byte tombstone, and the manifest does not grow with the deletions."""
    ds = Datastore.open(tmp_path, dim=DIM, max_segment_entries=64)
    for doc in range(40):
        ds.append(*batch(5, doc, doc=doc))
    manifest0 = (tmp_path / MANIFEST).stat().st_size
    read: list[int] = []
    real = Datastore._gather

    def counting(self: Datastore, column: str, ids: object) -> np.ndarray:
        out = real(self, column, ids)
        read.append(len(out))
        return out

    monkeypatch.setattr(Datastore, "_gather", counting)
    monkeypatch.setattr(Datastore, "_all_doc_ids", lambda self: pytest.fail("full scan"))
    for doc in range(30):
        assert ds.delete_document(doc, entries=range(5 * doc, 5 * doc + 5)) == 5
    assert read == [5] * 30
    assert (tmp_path / "tombstones").stat().st_size == 30 * 8
    assert (tmp_path / MANIFEST).stat().st_size == manifest0  # same digits, same size
    read.clear()
    ds.append(*batch(10, 99, doc=3))  # entries of a deleted document stay hidden
    assert ds.num_live == 10 * 5
    ds.append(*batch(10, 98, doc=77))
    assert ds.num_live == 10 * 5 + 10
    assert read == []


def test_open_upgrades_a_v1_manifest(tmp_path: Path) -> None:
    ds, _ = _three_docs(tmp_path)
    ds.close()
    raw = json.loads((tmp_path / MANIFEST).read_text())
    v1 = {
        **{k: raw[k] for k in ("format", "dim", "max_segment_entries", "generation")},
        "format_version": 1,
        "segments": [{"name": s["name"], "entries": s["entries"]} for s in raw["segments"]],
        "deleted_documents": [2],
        "truncations": [],
    }
    (tmp_path / MANIFEST).write_text(json.dumps(v1))
    reader = Datastore.open(tmp_path, readonly=True)
    assert (reader.deleted_documents, reader.num_live) == ({2}, 8)
    ds = Datastore.open(tmp_path)
    assert json.loads((tmp_path / MANIFEST).read_text())["format_version"] == 2
    assert (ds.deleted_documents, ds.num_live) == ({2}, 8)
    assert ds.delete_document(3) == 3 and ds.num_live == 5


def test_a_reload_in_another_thread_never_turns_a_shared_writer_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's poll reloads the manifest from its own thread while the embedded worker
    appends on the same handle. A manifest read before the worker's commit and swapped in
    after it turned the handle back, and the worker's next append overwrote committed
    entries (issue 31: entries of documents marked done were missing)."""
    from memlm.datastore import recovery

    path = tmp_path / "ds"
    Datastore.open(path, dim=DIM).close()
    ds = Datastore.open(path, shared=True)
    Datastore.open(path, shared=True).append(*batch(4, 0, doc=1))  # another worker process
    real = recovery._Manifest.from_json
    poll_read, worker_appended = threading.Event(), threading.Event()

    def from_json(text: str, where: Path) -> object:
        m = real(text, where)
        if threading.current_thread().name == "poll":  # the poll holds what it read ...
            poll_read.set()
            worker_appended.wait(timeout=1.0)  # ... until the worker appended (or 1 s)
        return m

    monkeypatch.setattr(recovery._Manifest, "from_json", staticmethod(from_json))
    poll = threading.Thread(target=ds.reload, name="poll")
    poll.start()
    assert poll_read.wait(10)
    a, b = batch(3, 1, doc=2), batch(2, 2, doc=3)
    with ds.exclusive():  # the worker's append-and-commit step
        ids_a = ds.append(*a)
        worker_appended.set()
        poll.join()
        ids_b = ds.append(*b)
    assert (ids_a, ids_b, len(ds)) == (range(4, 7), range(7, 9), 9)
    np.testing.assert_array_equal(ds.values(np.arange(4, 9)), np.concatenate([a[1], b[1]]))
    np.testing.assert_array_equal(ds.provenance(np.arange(9))[0], [1] * 4 + [2] * 3 + [3] * 2)


def test_a_full_disk_fails_an_append_whole_and_gives_its_bytes_back(tmp_path: Path) -> None:
    """On a real 256 kB filesystem: the append that meets ENOSPC raises it, commits
    nothing, leaves no byte of its own (tails, temp manifest) holding space; once space
    comes back the next append and a reopen see exactly the committed entries."""
    import errno

    from tests.small_fs import resize, small_filesystem

    with small_filesystem(tmp_path / "fs", "256k") as fs:
        ds = Datastore.open(fs / "ds", dim=DIM)
        stored = []
        with pytest.raises(OSError) as err:
            for i in range(100):  # 1000 entries are 36 kB: 256 kB fills within 8 batches
                b = batch(1000, i, doc=i)
                ds.append(*b)
                stored.append(b)
        assert err.value.errno == errno.ENOSPC
        n = 1000 * len(stored)
        assert len(ds) == ds.num_live == n
        per_entry = {"keys": 2 * DIM, "values": 4, "doc_ids": 8, "positions": 4, "days": 4}
        files = {f.name: f.stat().st_size for f in (fs / "ds").iterdir()}
        assert files == {
            "LOCK": 0,
            MANIFEST: len((fs / "ds" / MANIFEST).read_bytes()),
            **{f"seg-000000.{c}": n * size for c, size in per_entry.items()},
        }
        resize(fs, "1m")
        last = batch(1000, 999, doc=999)
        assert ds.append(*last) == range(n, n + 1000)
        stored.append(last)
        ds.close()
        again = Datastore.open(fs / "ds")
        ids = np.arange(n + 1000)
        np.testing.assert_array_equal(again.values(ids), np.concatenate([b[1] for b in stored]))
        np.testing.assert_array_equal(again.keys(ids), np.concatenate([b[0] for b in stored]))
        again.close()
