"""Prometheus metrics of one app instance (its own registry, so tests can build many)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "memlm_request_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.queue_depth = Gauge(
            "memlm_queue_depth", "Requests waiting for the model executor", registry=self.registry
        )
        self.pending = Gauge(
            "memlm_documents_pending",
            "Documents waiting for the ingest worker",
            registry=self.registry,
        )
        self.entries = Gauge(
            "memlm_entries", "Live entries in the served memory", registry=self.registry
        )
        self.memrate = Gauge(
            "memlm_memrate",
            "Cumulative MemRate: tokens stored / tokens seen",
            registry=self.registry,
        )
        self.index_version = Gauge(
            "memlm_index_version", "Version of the served index (0: none)", registry=self.registry
        )

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.latency.labels(method, route, str(status)).observe(seconds)

    def track_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(lambda: float(depth()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
