"""Prometheus metrics of one server, in their own registry (not the process-global one)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # the *_created series double the output and nobody graphs them

LATENCY_BUCKETS = (.001, .002, .004, .006, .008, .01, .015, .02, .03, .05, .075, .1, .2, .5, 1, 2, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_rows: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("trainserve_requests", "HTTP requests by route template and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("trainserve_request_duration_seconds", "HTTP request latency, seconds",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("trainserve_batch_size", "Rows per model run", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.inference = Histogram("trainserve_inference_duration_seconds", "Seconds per model run",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("trainserve_queue_rows", "Rows waiting for a model run", registry=r)
        self.queue.set_function(queue_rows)
        self.model_info = Gauge("trainserve_model_info", "The model being served (value 1)",
                                ["name", "version", "provider", "source"], registry=r)
        self.engine_info = Gauge("trainserve_engine_info", "How the model runs (value 1): the execution provider "
                                 "that really runs it, the variant served (fp32, fp16) and the provider's options",
                                 ["provider", "variant", "options"], registry=r)
        self.reloads = Counter("trainserve_model_reloads", "Model swaps after the registry alias moved",
                               registry=r)
        self.reload_failures = Counter("trainserve_model_reload_failures",
                                       "Failed loads of the version the registry alias points at", ["version"],
                                       registry=r)
        self.alias = Gauge("trainserve_model_alias_info", "The version the followed registry alias points at "
                           "(value 1)", ["version"], registry=r)
        self.behind = Gauge("trainserve_model_behind_alias", "1 while the alias points at a version this server "
                            "has not loaded (it serves an older one)", registry=r)

    def watch_payload_log(self, stats: Callable[[], dict]) -> None:
        """Export the payload log's counters (`PayloadLog.stats`), read at each scrape."""
        self.registry.register(_PayloadLogCollector(stats))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def observe_batch(self, rows: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.inference.observe(seconds)

    def set_model(self, name: str, version: str, provider: str, source: str) -> None:
        self.model_info.clear()
        self.model_info.labels(name, version, provider, source).set(1)

    def set_engine(self, provider: str, variant: str, options: str) -> None:
        self.engine_info.clear()
        self.engine_info.labels(provider, variant, options).set(1)

    def set_alias(self, version: str, behind: bool) -> None:
        self.alias.clear()
        self.alias.labels(version).set(1)
        self.behind.set(1 if behind else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PayloadLogCollector:
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        yield CounterMetricFamily("trainserve_payload_log_written", "Records written to the payload log",
                                  value=stats["written"])
        dropped = CounterMetricFamily("trainserve_payload_log_dropped", "Records of the sample not logged: the "
                                      "queue was full, a record was larger than a file may be, or a write failed",
                                      labels=["reason"])
        for reason, count in stats["dropped"].items():
            dropped.add_metric([reason], count)
        yield dropped
        yield GaugeMetricFamily("trainserve_payload_log_bytes", "Bytes in the payload log directory's files",
                                value=stats["bytes"])
