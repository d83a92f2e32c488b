"""Every database query of memlm lives in this package, one module per table or concern;
callers commit (one place per unit of work).

- :mod:`~memlm.db.repositories.documents`: documents (accept, claim, finish, forget...);
- :mod:`~memlm.db.repositories.spans`: the character spans of a document's tokens;
- :mod:`~memlm.db.repositories.provenance`: a neighbour's card and windows of its text
  (the API's hot path: never whole documents);
- :mod:`~memlm.db.repositories.stats`: per-day counters (MemRate);
- :mod:`~memlm.db.repositories.builds`: index builds and their recorded versions;
- :mod:`~memlm.db.repositories.policy`: the policy the service runs.
"""

from memlm.db.repositories.builds import (
    BuildRepository,
)
from memlm.db.repositories.common import (
    content_hash,
    utcnow,
)
from memlm.db.repositories.documents import (
    Accepted,
    DocumentRepository,
    NewDocument,
)
from memlm.db.repositories.policy import (
    PolicyRepository,
)
from memlm.db.repositories.provenance import (
    WINDOWS_PER_QUERY,
    DocumentCard,
    ProvenanceRepository,
    TextWindow,
)
from memlm.db.repositories.spans import (
    SpanRepository,
    decode_spans,
    encode_spans,
)
from memlm.db.repositories.stats import (
    StatsRepository,
)

__all__ = [
    "Accepted",
    "BuildRepository",
    "DocumentCard",
    "DocumentRepository",
    "NewDocument",
    "PolicyRepository",
    "ProvenanceRepository",
    "SpanRepository",
    "StatsRepository",
    "TextWindow",
    "WINDOWS_PER_QUERY",
    "content_hash",
    "decode_spans",
    "encode_spans",
    "utcnow",
]
