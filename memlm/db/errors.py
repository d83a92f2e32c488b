"""Typed errors raised by repositories; the HTTP layer maps each to one status code."""

from __future__ import annotations


class DomainError(Exception):
    """Base of errors whose message is safe to show to a client."""

    status_code = 400
    error = "bad_request"


class NotFound(DomainError):
    status_code = 404
    error = "not_found"


class Conflict(DomainError):
    status_code = 409
    error = "conflict"


class DatabaseNotMigrated(RuntimeError):
    """The database schema is not at the migration head; start-up refuses to continue."""
