"""A Python client of the memlm API: :class:`Client` (blocking) and :class:`AsyncClient`.

Answers are the API's own pydantic models (``memlm.api``, shared, never copied);
error answers raise the typed exceptions of :mod:`memlm.client.errors`, which carry the
``{"error", "detail"}`` body::

    from memlm.client import Client

    with Client("http://127.0.0.1:8000", token="change-me") as c:
        ids = [d.id for d in c.ingest([{"text": "...", "published_at": "2017-02-07",
                                          "source": "bbc", "external_id": "bbc-1"}])]
        c.wait(ids)
        print(c.predict("The prime minister said", top_n=5).suggestions[0].token)
"""

from memlm.api import GenerateDone, GeneratedTokenOut, GenerateResponse
from memlm.client.async_ import AsyncClient
from memlm.client.errors import (
    BadRequest,
    Conflict,
    MemlmError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ServerError,
    TransportError,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from memlm.client.sync import Client

__all__ = [
    "AsyncClient",
    "BadRequest",
    "Client",
    "Conflict",
    "GenerateDone",
    "GenerateResponse",
    "GeneratedTokenOut",
    "MemlmError",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "ServerError",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "ValidationFailed",
]
