"""Backup and restore of a service: a consistent snapshot of its data directory and its
database, taken while it runs, restored into an empty data directory and database.

Modules, one responsibility each::

    take.py      ``backup``: the moment under the write lock, then the copy
    restore.py   ``restore``: checks, files, rows, in that order; all or nothing
    manifest.py  ``backup.json``: what a backup holds, with every file's checksum
    files.py     copying with checksums, emptiness checks
    errors.py    ``BackupError``, ``TargetNotEmpty``, ``BackupCorrupt``

The database's rows are copied by :mod:`memlm.db.dump`.
"""

from memlm.backup.errors import BackupCorrupt, BackupError, TargetNotEmpty
from memlm.backup.manifest import MANIFEST, BackupManifest
from memlm.backup.restore import restore
from memlm.backup.take import backup

__all__ = [
    "MANIFEST",
    "BackupCorrupt",
    "BackupError",
    "BackupManifest",
    "TargetNotEmpty",
    "backup",
    "restore",
]
