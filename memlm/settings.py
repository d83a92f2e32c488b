"""One typed settings object for the service, the workers and the scheduler.

Every field reads ``MEMLM_<NAME>`` from the environment (or a ``.env`` file in the
working directory). It is validated once at start-up and passed in; nothing reads
the environment elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from memlm.knnlm import DEFAULT_TAU
from memlm.knnlm.consolidate import DEFAULT_BUDGET_CRITERION, DEFAULT_BUDGET_RECENT, Criterion
from memlm.knnlm.policy import check_policy

# The development default for both tokens; refused when ``env`` is not "development".
DEFAULT_SECRET = "change-me"
# Outside development a token shorter than this is refused: 16 random URL-safe characters
# are 96 bits, beyond guessing over HTTP (secrets.token_urlsafe(32) gives 43).
MIN_TOKEN_CHARS = 16

POLICIES = ("fullmem", "randmem", "monim", "monim-amt", "monim-kl")


class Settings(BaseSettings):
    """Configuration of the memlm service (env prefix ``MEMLM_``)."""

    model_config = SettingsConfigDict(
        env_prefix="MEMLM_", env_file=".env", extra="ignore", validate_default=True
    )

    env: Literal["development", "test", "production"] = "development"

    # --- storage --------------------------------------------------------------------------
    data_dir: Path = Path("memlm-data")
    # None means the embedded default: sqlite:///<data_dir>/memlm.sqlite
    database_url: str | None = None
    # The vector memory: unset or "faiss" = the embedded files under data_dir;
    # milvus://host:port/collection = a Milvus server (memlm.memory.url; docs/service.md).
    memory_url: str | None = None

    # How an ingest worker tells that another one lives (a live worker's claims are left
    # alone): "file", a lock file under data_dir/workers (workers on one data directory);
    # "database", a PostgreSQL advisory lock (workers that share only the database and a
    # memory server). auto: "database" with PostgreSQL and a memory outside the data
    # directory (memory_url set), else "file" (``liveness``).
    worker_liveness: Literal["auto", "file", "database"] = "auto"

    # --- model and memory -----------------------------------------------------------------
    model: str = "smollm2-135m"
    policy: str = "monim"
    # The policy's threshold; None takes the policy's own default (-1.5 for MoNIM as in
    # the MoNIM paper; MoNIM(KL) works on another scale and has its own).
    delta: float | None = None
    # RandMem's share of tokens stored, or "monim": the MemRate MoNIM measured on this
    # stream (cumulative over the days its variants ran), as in MoNIM's RandMem baseline.
    randmem_rate: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["monim"] = 0.3
    # Seed of RandMem's streams: a document's mask depends only on (seed, document id).
    randmem_seed: int = Field(default=0, ge=0)
    # k, temperature, lambda of the kNN-LM; None keeps the engine's defaults.
    knn_k: int | None = Field(default=None, ge=1)
    knn_temperature: float | None = Field(default=None, gt=0)
    knn_lambda: float | None = Field(default=None, ge=0.0, le=1.0)
    # Candidates each search re-ranks exactly (IVF-PQ); None: the index's default,
    # max(4 k, 1024) (docs/memory.md, "Each caller pays for its own depth").
    rerank_depth: int | None = Field(default=None, ge=1)
    # The same for MoNIM's decision while ingesting only (None: MEMLM_RERANK_DEPTH's).
    # 512 at 1.5M entries changed none of 4,431 decisions and took the one-thread worker
    # from 0.83x to 0.93x the encoder alone (docs/memory.md, "Overlap the model and the
    # memory"); the held-out records keep the served depth.
    ingest_rerank_depth: int | None = Field(default=None, ge=1)
    # RetoMaton's pointers for /score and the policy's decision: a token searches only
    # when fewer than this many successors of the last token's neighbours beat the learned
    # distance; None: every token searches (docs/memory.md, "Reuse what the last token found")
    pointers: int | None = Field(default=None, ge=1)
    # The ingest worker encodes the next pending document on a thread of its own while the
    # current one is searched, decided and committed (the model and the memory side by
    # side): same decisions, 1.12-1.28x the sequential worker at 1.5M entries on a quiet
    # 2-core machine (docs/memory.md, "Overlap the model and the memory"). Several workers
    # on one database peek the same next document: there most encodes ahead are wasted
    # (never wrong), so turn it off
    encode_ahead: bool = True
    # Retrieval gate: skip the search when the calibrator's lambda is below this (0: off).
    gate_theta: float = Field(default=0.0, ge=0.0, le=1.0)
    # tau of TRIME local / long-term memory for requests that ask for it and name none
    # (the value `memlm eval --local-memory` tuned on dev for SmolLM2, docs/trime.md).
    trime_tau: float = Field(default=DEFAULT_TAU, gt=0)
    # The NN calibrator: each rebuild trains it on held-out tokens recorded while ingesting
    # (docs/calibrator.md). Off: no records, no training (an existing calibrator still serves).
    calibrator_training: bool = True
    # Seeded share of ingested documents recorded (plus the first document of each day).
    calibrator_sample: float = Field(default=0.05, ge=0.0, le=1.0)
    # At most this many recorded tokens a day (~560 bytes each at k = 64).
    calibrator_day_tokens: int = Field(default=2048, ge=1)
    # A rebuild trains only once the training set holds this many held-out tokens (half a
    # day at the daily cap). A calibrator trained on a few articles learns that a small
    # memory does not help; it serves only joined to the evidence (max of the two), where
    # that beats the evidence alone in both views (memlm.calibrator.combined), so it cannot
    # switch close neighbours off. 1,024 against 8,192: docs/results/slice20-served.
    calibrator_min_tokens: int = Field(default=1024, ge=1)
    # The training set keeps the newest this many tokens (oldest days leave first), so it
    # and each retrain stay bounded on a long stream (64 days at the daily cap).
    calibrator_max_tokens: int = Field(default=131_072, ge=1)
    # torch threads and the threads of each faiss search (on every calling thread);
    # honours MEMLM_THREADS; None: one per core, at most 8.
    threads: int | None = Field(default=None, ge=1)
    # What the encoder's transformer runs in. auto probes once per processor and model
    # (matmul speed of each precision, perplexity within 0.5% of float32 on a bundled
    # text), caches the choice in the cache directory and logs it; an existing datastore
    # keeps the precision its keys were made with. float16 is for CUDA; int8 for the CPU.
    precision: Literal["auto", "float32", "bfloat16", "float16", "int8"] = "auto"
    # Where the encoder runs: auto takes CUDA when torch sees it, else the CPU.
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")

    # --- consolidation and the memory budget (issue 35; memlm.memory.consolidation) ---------
    # Stored entries re-tested at each build against today's memory (a window rotating
    # through the memory); 0: none. The test uses the log p_LM the engine keeps for each
    # entry it stored (docs/memory.md).
    consolidate_sample: int = Field(default=0, ge=0)
    # Live entries the build keeps at most (None: no budget); over it, the build retires
    # what costs least by MEMLM_BUDGET_CRITERION. spread (the default, measured best on
    # slice14d, docs/results/slice14d-spread): the newest MEMLM_BUDGET_RECENT_SHARE of the
    # budget stays whole (none by default), every older day is thinned to the same size,
    # the entries the LM predicts best first. At 45% of FullMem's entries FullMem under it
    # scores FullMem's test ppl (27.73 vs 27.74) and the earlier month still improves
    # (-0.7%), where the age budget (the oldest first) loses 0.18% and forgets (+2.7%).
    # Also: usage (fewest hits of the entry's block, then most redundant), redundancy,
    # random.
    memory_budget_entries: int | None = Field(default=None, ge=0)
    budget_criterion: Criterion = DEFAULT_BUDGET_CRITERION
    # spread: the share of the budget that keeps the newest entries whole; the older days
    # are thinned to the same size each (memlm.memory.consolidation.spread). 0 measured
    # best: the same test ppl as 0.25 and half the forgetting over 57 days
    # (docs/results/stream57-spread)
    budget_recent_share: float = Field(default=DEFAULT_BUDGET_RECENT, ge=0.0, le=1.0)

    # --- scheduling -----------------------------------------------------------------------
    # Crontab (minute hour day month weekday) of the rebuild, in UTC. Nightly by default.
    rebuild_cron: str = "0 3 * * *"
    worker_poll_seconds: float = Field(default=2.0, gt=0)
    # A document whose preparation fails for a passing reason (a busy database, an
    # out-of-memory batch...) is tried again, at most this many tries in all, waiting
    # backoff * 2^(failures - 1) seconds (capped) between tries; bad text fails at once.
    ingest_max_attempts: int = Field(default=5, ge=1)
    ingest_retry_backoff_seconds: float = Field(default=5.0, ge=0)
    ingest_retry_backoff_max_seconds: float = Field(default=300.0, ge=0)
    # How often the API checks for a new index version and new datastore entries.
    index_poll_seconds: float = Field(default=5.0, gt=0)
    # Run the ingest worker as a thread of the API process, sharing its engine (one model
    # in RAM, one datastore writer). Off when the worker runs as its own process.
    embedded_worker: bool = True
    # At shutdown, how long the API waits for the embedded worker to finish the document it
    # holds. A worker still busy after that is abandoned with the process: its claim goes
    # back to the queue (another worker sees it dead, or the next start takes it back) and
    # the datastore is cut back to the last commit, so nothing is lost or counted twice.
    shutdown_seconds: float = Field(default=300.0, ge=0)

    # --- HTTP -----------------------------------------------------------------------------
    ingest_token: SecretStr = SecretStr(DEFAULT_SECRET)
    admin_token: SecretStr = SecretStr(DEFAULT_SECRET)
    # A token for /predict and /score only (the ingest and admin tokens also read).
    read_token: SecretStr | None = None
    # Require a token (read, ingest or admin) for /predict and /score. None: required
    # outside development. Reads left open outside development answer neighbours without
    # snippets of memorised text unless the caller sends a token (docs/service.md).
    protect_read: bool | None = None
    # Neighbours one /predict may ask for; each costs a snippet from its document.
    max_neighbours: int = Field(default=100, ge=0, le=1000)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_documents_per_request: int = Field(default=256, ge=1)
    max_text_chars: int = Field(default=200_000, ge=1)
    max_context_chars: int = Field(default=20_000, ge=1)
    # Tokens of /score's text; longer texts get 413 (the model thread scores about 150
    # tokens/s of SmolLM2 on one CPU thread, so 2048 tokens hold it some 15 s).
    max_score_tokens: int = Field(default=2048, ge=2)
    # Admission by expected wait: a request is queued only when the work ahead of it plus
    # its own (tokens x the measured seconds per token) fits this budget; else 429.
    queue_budget_s: float = Field(default=2.0, gt=0)
    # Hard cap on requests waiting for the model, whatever the estimate says.
    queue_size: int = Field(default=64, ge=1)
    # Concurrent /predict requests answered by one pass of the executor.
    max_batch: int = Field(default=8, ge=1)
    # The least Retry-After of a 429; the header is the queue's expected drain time.
    retry_after_seconds: int = Field(default=1, ge=1)
    # A 429 is sent after this many seconds (at most its Retry-After): a client that
    # retries at once, ignoring Retry-After, then costs the event loop a few refusals a
    # second instead of thousands. An asyncio sleep: no thread and no model time. 0: off.
    overload_delay_seconds: float = Field(default=0.5, ge=0, le=10)
    # Tokens one /generate may ask for (max_tokens): each is a one-token forward and a
    # search on the model thread, about 20-60 ms with SmolLM2 on one CPU thread.
    max_generate_tokens: int = Field(default=256, ge=1)
    # Tokens a /generate job runs before the model thread takes other requests: small
    # enough that /predict waits at most a few steps, large enough that the queue hop
    # (well under 1 ms) is noise next to a step.
    generate_chunk_tokens: int = Field(default=4, ge=1, le=64)

    # --- dashboard (GET /dashboard) -----------------------------------------------------
    # How often the page polls /admin/stats/history.
    dashboard_refresh_seconds: float = Field(default=10.0, ge=1, le=3600)
    # Lifetime of the session cookie the login form sets (changing the admin token ends
    # every session at once).
    dashboard_session_hours: float = Field(default=12.0, gt=0, le=24 * 30)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of {', '.join(POLICIES)}")
        return v

    @field_validator("rebuild_cron")
    @classmethod
    def _five_fields(cls, v: str) -> str:
        if len(v.split()) != 5:
            raise ValueError("rebuild_cron needs 5 fields: minute hour day month weekday")
        return v

    @field_validator("database_url")
    @classmethod
    def _supported_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("sqlite", "postgresql")):
            raise ValueError("database_url must be a sqlite:// or postgresql+psycopg:// URL")
        return v

    @field_validator("memory_url")
    @classmethod
    def _supported_memory_url(cls, v: str | None) -> str | None:
        from memlm.memory.url import parse_memory_url

        parse_memory_url(v)  # raises ValueError naming what is wrong
        return v

    @model_validator(mode="after")
    def _meaningful_delta(self) -> Settings:
        # The same rule as PUT /admin/policy: a NaN delta would store nothing at all.
        try:
            check_policy(self.policy, self.delta, {})
        except ValueError as e:
            raise ValueError(f"MEMLM_POLICY / MEMLM_DELTA: {e}") from None
        return self

    @model_validator(mode="after")
    def _liveness_needs_postgres(self) -> Settings:
        if self.worker_liveness == "database" and not self.db_url.startswith("postgresql"):
            raise ValueError(
                "MEMLM_WORKER_LIVENESS=database needs a PostgreSQL MEMLM_DATABASE_URL "
                "(workers hold an advisory lock there)"
            )
        return self

    @model_validator(mode="after")
    def _calibrator_bounds(self) -> Settings:
        if self.calibrator_max_tokens < self.calibrator_min_tokens:
            raise ValueError(
                f"MEMLM_CALIBRATOR_MAX_TOKENS ({self.calibrator_max_tokens}) must be at least "
                f"MEMLM_CALIBRATOR_MIN_TOKENS ({self.calibrator_min_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _no_default_secret_outside_development(self) -> Settings:
        if self.read_token is not None and not self.read_token.get_secret_value():
            raise ValueError("MEMLM_READ_TOKEN is empty; leave it unset or set a secret")
        if self.env == "development":
            return self
        how = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        for name in ("ingest_token", "admin_token", "read_token"):
            if getattr(self, name) is None:
                continue
            value = getattr(self, name).get_secret_value()
            var = f"MEMLM_{name.upper()}"
            if value == DEFAULT_SECRET:
                raise ValueError(
                    f"{var} is the development default; set a real secret when "
                    f"MEMLM_ENV={self.env} (e.g. {how})"
                )
            if not value.strip():
                raise ValueError(f"{var} is empty; set a secret when MEMLM_ENV={self.env}")
            if len(value) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"{var} has {len(value)} characters; use at least {MIN_TOKEN_CHARS} "
                    f"when MEMLM_ENV={self.env} (e.g. {how})"
                )
        if self.ingest_token.get_secret_value() == self.admin_token.get_secret_value():
            raise ValueError(
                "MEMLM_INGEST_TOKEN equals MEMLM_ADMIN_TOKEN: whoever may ingest could also "
                f"administer; set two different secrets when MEMLM_ENV={self.env}"
            )
        return self

    @property
    def db_url(self) -> str:
        """The database URL, defaulting to a SQLite file in the data directory."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'memlm.sqlite').resolve()}"

    @property
    def datastore_dir(self) -> Path:
        return self.data_dir / "memory"

    @property
    def liveness(self) -> Literal["file", "database"]:
        """``worker_liveness`` with auto resolved (see the field)."""
        if self.worker_liveness != "auto":
            return self.worker_liveness
        from memlm.memory.url import parse_memory_url

        apart = parse_memory_url(self.memory_url) is not None  # no data directory to share
        return "database" if apart and self.db_url.startswith("postgresql") else "file"

    @property
    def workers_dir(self) -> Path:
        """Where each live ingest worker holds a lock file named after it."""
        return self.data_dir / "workers"

    @property
    def reads_protected(self) -> bool:
        """Whether /predict and /score need a token (``protect_read``, else not in development)."""
        return self.env != "development" if self.protect_read is None else self.protect_read

    def read_tokens(self) -> list[str]:
        """The tokens that may read: the read token if set, the ingest and admin tokens."""
        tokens = [self.ingest_token.get_secret_value(), self.admin_token.get_secret_value()]
        if self.read_token is not None:
            tokens.insert(0, self.read_token.get_secret_value())
        return tokens

    def uses_default_secret(self) -> bool:
        return any(
            t is not None and t.get_secret_value() == DEFAULT_SECRET
            for t in (self.ingest_token, self.admin_token, self.read_token)
        )
