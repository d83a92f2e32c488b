"""The errors of backup and restore; each message says what to do."""

from __future__ import annotations


class BackupError(RuntimeError):
    """A backup or a restore cannot be made (the message says why and what to do)."""


class TargetNotEmpty(BackupError):
    """The backup's destination, or the restore's data directory or database, holds data."""


class BackupCorrupt(BackupError):
    """A backup file is missing or differs from the checksum its manifest records."""
