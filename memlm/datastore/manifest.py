"""``manifest.json``: the only source of truth of a datastore directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memlm.datastore.layout import FORMAT, FORMAT_VERSION, DatastoreError, _segment_name


@dataclass
class _Manifest:
    dim: int
    max_segment_entries: int
    counts: list[int] = field(default_factory=list)  # committed ids per segment
    # rows on disk per segment (== counts[i] until a compaction removes some) and the base
    # name of its files: _segment_name(i) while dense, with a "-c<generation>" suffix (and
    # an ids column) once compacted
    rows: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    tombstones: int = 0  # committed length of the tombstone log
    retired: int = 0  # committed length of the retired-entries log (pairs)
    live: int = 0  # committed entries whose document is not deleted
    reclaimed_bytes: int = 0  # data-file bytes removed by compactions, cumulative
    generation: int = 0  # +1 for every committed change
    # (generation, n) for every truncate: lets an index built at an older generation
    # know which of its ids now name different entries (see ``unchanged_below``).
    truncations: list[tuple[int, int]] = field(default_factory=list)
    legacy_deleted: list[int] | None = None  # a v1 manifest's inline deleted documents
    # The encoder precision the keys were made with (MEMLM_PRECISION). Keys of two
    # precisions are two key spaces: a store never mixes them (Datastore.open refuses).
    # Stores written before the field existed hold float32 keys.
    key_precision: str = "float32"

    @property
    def total(self) -> int:
        return sum(self.counts)

    def sparse(self, seg: int) -> bool:
        return self.names[seg] != _segment_name(seg)

    def changed(self, **kw: Any) -> _Manifest:
        """A copy with ``kw`` replaced and the generation advanced (lists copied)."""
        out = _Manifest(
            dim=self.dim,
            max_segment_entries=self.max_segment_entries,
            counts=list(self.counts),
            rows=list(self.rows),
            names=list(self.names),
            tombstones=self.tombstones,
            retired=self.retired,
            live=self.live,
            reclaimed_bytes=self.reclaimed_bytes,
            generation=self.generation + 1,
            truncations=list(self.truncations),
            key_precision=self.key_precision,
        )
        for k, v in kw.items():
            setattr(out, k, v)
        return out

    def to_json(self) -> str:
        assert self.legacy_deleted is None, "a v1 manifest is rewritten before any commit"
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "dim": self.dim,
                "key_precision": self.key_precision,
                "max_segment_entries": self.max_segment_entries,
                "generation": self.generation,
                "segments": [
                    {"name": _segment_name(i), "entries": c, "rows": r, "files": f}
                    for i, (c, r, f) in enumerate(
                        zip(self.counts, self.rows, self.names, strict=True)
                    )
                ],
                "tombstones": self.tombstones,
                "retired": self.retired,
                "live_entries": self.live,
                "reclaimed_bytes": self.reclaimed_bytes,
                "truncations": [list(t) for t in self.truncations],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: Path) -> _Manifest:
        try:
            raw = json.loads(text)
            version = raw.get("format_version")
            if raw.get("format") != FORMAT or version not in (1, FORMAT_VERSION):
                raise DatastoreError(f"{where}: not a {FORMAT} v1/v{FORMAT_VERSION} manifest")
            segs = raw["segments"]
            counts = [int(s["entries"]) for s in segs]
            m = cls(
                dim=int(raw["dim"]),
                max_segment_entries=int(raw["max_segment_entries"]),
                counts=counts,
                rows=[int(s.get("rows", c)) for s, c in zip(segs, counts, strict=True)],
                names=[str(s.get("files", s["name"])) for s in segs],
                generation=int(raw["generation"]),
                truncations=[(int(g), int(n)) for g, n in raw["truncations"]],
                key_precision=str(raw.get("key_precision", "float32")),
            )
            if version == 1:
                m.legacy_deleted = sorted({int(d) for d in raw["deleted_documents"]})
            else:
                m.tombstones = int(raw["tombstones"])
                m.retired = int(raw.get("retired", 0))  # stores made before consolidation
                m.live = int(raw["live_entries"])
                m.reclaimed_bytes = int(raw["reclaimed_bytes"])
            names = [s["name"] for s in segs]
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DatastoreError):
                raise
            raise DatastoreError(f"{where}: malformed manifest: {exc}") from exc
        if names != [_segment_name(i) for i in range(len(names))]:
            raise DatastoreError(f"{where}: segment names out of order: {names}")
        cap = m.max_segment_entries
        if any(c != cap for c in m.counts[:-1]) or any(not 0 <= c <= cap for c in m.counts):
            raise DatastoreError(f"{where}: segment counts {m.counts} break the layout")
        bad_rows = any(
            not 0 <= r <= c or (r != c and not m.sparse(i))
            for i, (c, r) in enumerate(zip(m.counts, m.rows, strict=True))
        )
        if bad_rows or any(not f.startswith(_segment_name(i)) for i, f in enumerate(m.names)):
            raise DatastoreError(f"{where}: segment rows {m.rows} or files {m.names} are invalid")
        return m
