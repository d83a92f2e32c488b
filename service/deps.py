"""FastAPI dependencies: typed state, the request's session, the engine, bearer auth."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from memlm.engine import EngineLike
from service.errors import Unauthorized, Unavailable
from service.state import AppState


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.memlm
    return state


State = Annotated[AppState, Depends(get_state)]


_AFTER_COMMIT = "memlm.after_commit"


def after_commit(session: Session, action: Callable[[], None]) -> None:
    """Run ``action`` once the request's unit of work has committed (not if it fails).

    For changes outside the database that must not happen unless the change that calls
    for them is durable (forget: hiding a document, which on Milvus deletes its entries).
    """
    session.info.setdefault(_AFTER_COMMIT, []).append(action)


def get_session(state: State) -> Iterator[Session]:
    """The request's unit of work: committed once after the route returns."""
    with state.sessions() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        for action in session.info.pop(_AFTER_COMMIT, []):
            action()


# scope="function": commit before the response is sent, so a 2xx means committed.
DbSession = Annotated[Session, Depends(get_session, scope="function")]


def get_engine(state: State) -> EngineLike:
    if state.engine is None:
        if state.load_error is not None:
            raise Unavailable("the model failed to load; see the server log")
        raise Unavailable("the model is still loading; retry shortly")
    return state.engine


EngineDep = Annotated[EngineLike, Depends(get_engine)]

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <token>")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _matches(creds: HTTPAuthorizationCredentials | None, *tokens: str) -> bool:
    if creds is None:
        return False
    given = creds.credentials.encode()
    # Compare against every accepted token so timing does not tell which one matched.
    hits = [secrets.compare_digest(given, t.encode()) for t in tokens]
    return any(hits)


def require_admin(state: State, creds: Credentials) -> None:
    if not _matches(creds, state.settings.admin_token.get_secret_value()):
        raise Unauthorized("a valid admin bearer token is required")


def require_ingest(state: State, creds: Credentials) -> None:
    s = state.settings
    if not _matches(creds, s.ingest_token.get_secret_value(), s.admin_token.get_secret_value()):
        raise Unauthorized("a valid ingest bearer token is required")


def read_access(state: State, creds: Credentials) -> bool:
    """Whether the caller may see memorised text (snippets); 401 where reads need a token.

    In development everyone may; elsewhere a read, ingest or admin token is needed.
    """
    s = state.settings
    authorised = _matches(creds, *s.read_tokens())
    if s.reads_protected and not authorised:
        raise Unauthorized("a valid read bearer token is required")
    return authorised or s.env == "development"


# Row ids are INTEGER columns: PostgreSQL's end at 2**31 - 1 (SQLite's at 2**63 - 1). A
# larger id names no row, and the database refused to even compare with it (a 500).
MAX_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ID, description=f"a row id, 1 to {MAX_ID}")]

AdminAuth = Depends(require_admin)
IngestAuth = Depends(require_ingest)
ReadAuth = Depends(read_access)
# The caller's read access as a route parameter: True when it may see snippets.
ReadAccess = Annotated[bool, ReadAuth]
