"""The dashboard's session: a login form trades the admin token for a signed cookie.

Why a cookie and not the token in the page (docs/service.md, "Dashboard"): the token
never reaches the page's JavaScript, the address bar, the history or a log. The form
POSTs it once; the answer sets ``memlm_dashboard`` (HttpOnly, SameSite=Strict, Path=/,
Secure under HTTPS) whose value is ``<expiry>.<HMAC-SHA256(admin token, expiry)>``:

* stateless, so every API process that knows the admin token accepts it, and changing
  the token ends every session;
* it reveals nothing about the token (an HMAC cannot be inverted);
* it is accepted only by the dashboard's GET routes (the page and its data), which
  change nothing; every other route still wants the bearer token.

CSRF: SameSite=Strict keeps browsers from sending the cookie with any request another
site starts, and the cookie authorises no state change. The two POSTs (login, logout)
refuse a cross-site ``Origin`` or ``Sec-Fetch-Site`` all the same (login CSRF).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from urllib.parse import urlsplit

from fastapi import Request, Response

from service.deps import Credentials, State
from service.errors import Unauthorized

COOKIE = "memlm_dashboard"
_CONTEXT = b"memlm-dashboard-session:v1:"


def _signature(token: str, expiry: int) -> str:
    return hmac.new(token.encode(), _CONTEXT + str(expiry).encode(), hashlib.sha256).hexdigest()


def session_value(token: str, lifetime_s: float, now: float | None = None) -> str:
    """A cookie value valid for ``lifetime_s`` seconds from ``now``."""
    expiry = int((time.time() if now is None else now) + lifetime_s)
    return f"{expiry}.{_signature(token, expiry)}"


def valid_session(value: str | None, token: str, now: float | None = None) -> bool:
    """Whether a cookie value was signed with ``token`` and has not expired."""
    if not value or value.count(".") != 1:
        return False
    expiry_s, sig = value.split(".")
    if not expiry_s.isdigit() or len(expiry_s) > 12:
        return False
    expiry = int(expiry_s)
    if expiry < (time.time() if now is None else now):
        return False
    return secrets.compare_digest(sig.encode(), _signature(token, expiry).encode())


def is_admin(request: Request, state: State, creds: Credentials) -> bool:
    """The admin bearer token, or a valid dashboard cookie (GET routes of the dashboard)."""
    token = state.settings.admin_token.get_secret_value()
    if creds is not None and secrets.compare_digest(creds.credentials.encode(), token.encode()):
        return True
    return valid_session(request.cookies.get(COOKIE), token)


def require_dashboard_admin(request: Request, state: State, creds: Credentials) -> None:
    if not is_admin(request, state, creds):
        raise Unauthorized("an admin bearer token or a dashboard session (log in at /dashboard)")


def same_origin(request: Request) -> bool:
    """False for a request another site's page started (a cross-site form POST)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return urlsplit(origin).netloc.lower() == host.lower()


def set_session(response: Response, request: Request, token: str, lifetime_s: float) -> None:
    response.set_cookie(
        COOKIE,
        session_value(token, lifetime_s),
        max_age=int(lifetime_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )
