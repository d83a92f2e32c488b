"""What every Milvus call of the memory shares: the pymilvus imports, the mapping of a
server that went away to ``MemoryUnavailable``, the deterministic entry ids, the
collection's schema (the index: :mod:`memlm.memory.milvus_index`)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from memlm.index import IndexParams
from memlm.memory.milvus_index import from_index, milvus_index
from memlm.memory.url import MilvusURL
from memlm.unavailable import MemoryUnavailable

with warnings.catch_warnings():  # pymilvus 2.4 imports pkg_resources, deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    # pymilvus imports pkg_resources, which warns (a UserWarning from setuptools 80)
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated")
    import grpc
    from pymilvus import (
        Collection,
        CollectionSchema,
        DataType,
        FieldSchema,
        MilvusException,
        connections,
        utility,
    )
    from pymilvus.exceptions import (
        ConnectError,
        ConnectionNotExistException,
        MilvusUnavailableException,
    )

if TYPE_CHECKING:
    from typing import Protocol

    class _HasURL(Protocol):
        url: MilvusURL


__all__ = [
    "FIELDS",
    "FORMAT",
    "Collection",
    "MilvusException",
    "MilvusMemoryError",
    "POSITION_BITS",
    "connections",
    "entry_ids",
    "mapped",
    "milvus_index",
    "new_schema",
    "utility",
]

POSITION_BITS = 24  # positions < 16.7M tokens per document; doc ids < 2**39
MAX_POSITION = 1 << POSITION_BITS
MAX_DOC_ID = 1 << (63 - POSITION_BITS)
FORMAT = "memlm-memory v1"
FIELDS = ["id", "value", "doc_id", "position", "day", "key"]


class MilvusMemoryError(RuntimeError):
    """The collection exists but is not a memlm memory of this dimension."""


_AWAY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_F = TypeVar("_F", bound=Callable[..., Any])


def server_away(exc: BaseException) -> bool:
    """Whether a pymilvus failure says the server cannot be reached (killed, restarting,
    hung past the call's timeout), not that the request was wrong."""
    if isinstance(exc, ConnectError | MilvusUnavailableException | ConnectionNotExistException):
        return True
    code = exc.code() if isinstance(exc, grpc.RpcError) else getattr(exc, "code", None)
    if code in _AWAY_CODES:
        return True
    # pymilvus's retry loop ends with a MilvusException naming the gRPC code in its text
    text = str(exc)
    return "Retry timeout" in text or "Fail connecting" in text or "UNAVAILABLE" in text


def mapped(fn: _F) -> _F:
    """Raise ``MemoryUnavailable`` (503 in the API, a paused retry in the worker) where
    ``fn`` failed because the Milvus server is away; other failures stay as they are."""

    @functools.wraps(fn)
    def call(self: _HasURL, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (MilvusException, grpc.RpcError) as exc:
            if not server_away(exc):
                raise
            where = f"{self.url.host}:{self.url.port}"
            raise MemoryUnavailable(f"the Milvus server at {where} is unavailable") from exc

    return call  # type: ignore[return-value]


def entry_ids(documents: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The deterministic id of each (document, position) entry."""
    docs = np.asarray(documents, np.int64)
    pos = np.asarray(positions, np.int64)
    if docs.size and (docs.min() < 0 or docs.max() >= MAX_DOC_ID):
        raise ValueError(f"document ids must be in [0, 2**{63 - POSITION_BITS})")
    if pos.size and (pos.min() < 0 or pos.max() >= MAX_POSITION):
        raise ValueError(f"positions must be in [0, 2**{POSITION_BITS})")
    return (docs << POSITION_BITS) | pos


def new_schema(dim: int) -> CollectionSchema:
    """The collection of one memory: ``id`` (the primary key, ``entry_ids``), the next
    token, the provenance and the key (FLOAT_VECTOR: Milvus 2.3 has no float16 vectors)."""
    fields = [
        FieldSchema("id", DataType.INT64, is_primary=True, auto_id=False),
        FieldSchema("value", DataType.INT32),
        FieldSchema("doc_id", DataType.INT64),
        FieldSchema("position", DataType.INT32),
        FieldSchema("day", DataType.INT32),
        FieldSchema("key", DataType.FLOAT_VECTOR, dim=dim),
    ]
    return CollectionSchema(fields, description=f"{FORMAT} dim={dim}")


def served_params(collection: Collection, timeout: int) -> IndexParams:
    """The collection's index as ``IndexParams`` (its search parameters as
    :mod:`memlm.memory.milvus_index` chooses them)."""
    if not collection.has_index(timeout=timeout):
        return IndexParams.exact()
    p = collection.index().params
    return from_index(p.get("index_type"), p.get("params", {}))
