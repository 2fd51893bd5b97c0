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

# the *_created series double the output and nobody graphs them
disable_created_metrics()

LATENCY_BUCKETS = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    """Every series of a model is labelled by `model` and `version` (model_info: `name`, `version`),
    so that one server of many models can be read model by model; a request's time splits into queue
    time (waiting for its batch to start: Triton's queue_duration) and compute time (the model run:
    compute_infer)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_rows: Callable[[], list[tuple[str, str, float]]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "trainserve_requests",
            "Requests by route template (HTTP) or method (gRPC), status "
            "and the model version that answered",
            ["route", "status", "model", "version"],
            registry=r,
        )
        self.latency = Histogram(
            "trainserve_request_duration_seconds",
            "Request latency, seconds",
            ["route", "model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "trainserve_batch_size",
            "Rows per model run",
            ["model", "version"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "trainserve_inference_duration_seconds",
            "Seconds per model run (compute time)",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "trainserve_queue_duration_seconds",
            "Seconds a request waited for its batch to start (queue time)",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_info = Gauge(
            "trainserve_model_info",
            "The model versions being served (value 1)",
            ["name", "version", "provider", "source"],
            registry=r,
        )
        self.engine_info = Gauge(
            "trainserve_engine_info",
            "How each model version runs (value 1): the execution "
            "provider that really runs it, the variant served (fp32, fp16) and the provider's "
            "options",
            ["model", "version", "provider", "variant", "options"],
            registry=r,
        )
        self.reloads = Counter(
            "trainserve_model_reloads",
            "Model swaps after a registry alias moved",
            ["model"],
            registry=r,
        )
        self.reload_failures = Counter(
            "trainserve_model_reload_failures",
            "Failed loads of the version a registry alias points at",
            ["model", "version"],
            registry=r,
        )
        self.alias = Gauge(
            "trainserve_model_alias_info",
            "The version a followed registry alias points at (value 1)",
            ["model", "alias", "version"],
            registry=r,
        )
        self.behind = Gauge(
            "trainserve_model_behind_alias",
            "1 while the alias points at a version this server "
            "has not loaded (it serves an older one)",
            ["model", "alias"],
            registry=r,
        )
        self.registry.register(_QueueCollector(queue_rows))
        # Each request looks its series up here, not through prometheus_client's labels() (a lock
        # and a tuple of strings each time): a request's own cost is what a server of small requests
        # spends most on.
        self._children: dict[tuple, tuple] = {}

    def observe_request(
        self, route: str, status: int | str, seconds: float, model: str = "", version: str = ""
    ) -> None:
        key = (route, status, model, version)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(route, str(status), model, version),
                self.latency.labels(route, model, version),
            )
        children[0].inc()
        children[1].observe(seconds)

    def watch_drift(self, scores: Callable[[], dict[tuple[str, str, str, str], float]]) -> None:
        """trainserve_input_drift / trainserve_output_drift{model,version,input|output}: the PSI of
        each tensor over the version's sliding window, read at each scrape."""
        self.registry.register(_DriftCollector(scores))

    def watch_shadows(self, reports: Callable[[], dict[str, dict]]) -> None:
        """trainserve_shadow_*{model}: pairs, dropped mirrors, challenger errors, agreement,
        latencies, the verdict (one series with value 1), read at each scrape."""
        self.registry.register(_ShadowCollector(reports))

    def watch_rows(self, rows: Callable[[], list[tuple[str, str, int, int]]]) -> None:
        """trainserve_batch_buffers_in_use and trainserve_requests_arriving{model,version}, read
        from the batchers' rows at each scrape (`rows()`: (model, version, buffers in use,
        requests on their way) each)."""
        self.registry.register(_RowsCollector(rows))

    def watch_front_ends(self, found: Callable[[], tuple[dict[str, int], int]]) -> None:
        """trainserve_front_ends{state} (listening, starting, spare: one waits to replace a front
        end that dies) and trainserve_front_ends_replaced_total, read from the engine's front-end
        processes at each scrape (`found()`: (states, replaced), serving/processes.py)."""
        self.registry.register(_FrontEndsCollector(found))

    def watch_payload_log(self, stats: Callable[[], dict]) -> None:
        """Export the payload log's counters (`PayloadLog.stats`), read at each scrape."""
        self.registry.register(_PayloadLogCollector(stats))

    def observe_batch(
        self, model: str, version: str, rows: int, seconds: float, waits: list[float]
    ) -> None:
        key = ("batch", model, version)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.batch_size.labels(model, version),
                self.inference.labels(model, version),
                self.queue_time.labels(model, version),
            )
        children[0].observe(rows)
        children[1].observe(seconds)
        for wait in waits:
            children[2].observe(wait)

    def set_models(self, served: list[tuple[str, str, str, str, str, str]]) -> None:
        """What is loaded now: (name, version, provider, source, variant, options) per version. The
        run and request series of a version no longer loaded go (an unloaded model or a replaced
        version leaves no stale series: 19 replaced versions left 19x20)."""
        self.model_info.clear()
        self.engine_info.clear()
        for name, version, provider, source, variant, options in served:
            self.model_info.labels(name, version, provider, source).set(1)
            self.engine_info.labels(name, version, provider, variant, options).set(1)
        loaded = {(name, version) for name, version, *_ in served}
        for family in (self.batch_size, self.inference, self.queue_time):
            for labels in list(family._metrics):
                if labels not in loaded:
                    family.remove(*labels)
        # Request series end in (model, version); those of no model ("", "": health, refusals) stay.
        self._children = {
            k: v for k, v in self._children.items() if not k[-2] or tuple(k[-2:]) in loaded
        }
        for family in (self.requests, self.latency):
            for labels in list(family._metrics):
                if labels[-2] and tuple(labels[-2:]) not in loaded:
                    family.remove(*labels)

    def set_alias(self, model: str, alias: str, version: str, behind: bool) -> None:
        # one series per alias: the version it names now
        for labels in list(self.alias._metrics):
            if labels[:2] == (model, alias):
                self.alias.remove(*labels)
        self.alias.labels(model, alias, version).set(1)
        self.behind.labels(model, alias).set(1 if behind else 0)

    def forget_aliases(self, gone) -> None:
        """Drop the alias series of models `gone(model)` says are no longer loaded."""
        for gauge in (self.alias, self.behind):
            for labels in list(gauge._metrics):
                if gone(labels[0]):
                    gauge.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _QueueCollector:
    """trainserve_queue_rows{model,version}, read from the batchers at each scrape."""

    def __init__(self, rows: Callable[[], list[tuple[str, str, float]]]):
        self.rows = rows

    def collect(self):
        family = GaugeMetricFamily(
            "trainserve_queue_rows", "Rows waiting for a model run", labels=["model", "version"]
        )
        for model, version, rows in self.rows():
            family.add_metric([model, version], rows)
        yield family


class _RowsCollector:
    def __init__(self, rows: Callable[[], list[tuple[str, str, int, int]]]):
        self.rows = rows

    def collect(self):
        labels = ["model", "version"]
        buffers = GaugeMetricFamily(
            "trainserve_batch_buffers_in_use",
            "Batch buffers holding requests' rows or a run's (of the version's few)",
            labels=labels,
        )
        arriving = GaugeMetricFamily(
            "trainserve_requests_arriving",
            "Requests whose head is in and whose body is arriving (a batch may wait for them)",
            labels=labels,
        )
        for model, version, in_use, on_the_way in self.rows():
            buffers.add_metric([model, version], in_use)
            arriving.add_metric([model, version], on_the_way)
        yield buffers
        yield arriving


class _FrontEndsCollector:
    def __init__(self, found: Callable[[], tuple[dict[str, int], int]]):
        self.found = found

    def collect(self):
        states, replaced = self.found()
        family = GaugeMetricFamily(
            "trainserve_front_ends",
            "Front-end processes taking requests in, by state (a spare waits to replace one)",
            labels=["state"],
        )
        for state, count in states.items():
            family.add_metric([state], count)
        yield family
        yield CounterMetricFamily(
            "trainserve_front_ends_replaced",
            "Front-end processes that died and were replaced",
            value=replaced,
        )


class _PayloadLogCollector:
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        yield CounterMetricFamily(
            "trainserve_payload_log_written",
            "Records written to the payload log",
            value=stats["written"],
        )
        dropped = CounterMetricFamily(
            "trainserve_payload_log_dropped",
            "Records of the sample not logged: the "
            "queue was full, a record was larger than a file may be, or a write failed",
            labels=["reason"],
        )
        for reason, count in stats["dropped"].items():
            dropped.add_metric([reason], count)
        yield dropped
        yield GaugeMetricFamily(
            "trainserve_payload_log_bytes",
            "Bytes in the payload log directory's files",
            value=stats["bytes"],
        )


class _DriftCollector:
    def __init__(self, scores: Callable[[], dict[tuple[str, str, str, str], float]]):
        self.scores = scores

    def collect(self):
        families = {
            kind: GaugeMetricFamily(
                f"trainserve_{kind[:-1]}_drift",
                f"Population stability index of each "
                f"{kind[:-1]} over the version's last requests against the training data "
                "(< 0.1 none, > 0.2 a shift)",
                labels=["model", "version", kind[:-1]],
            )
            for kind in ("inputs", "outputs")
        }
        for (model, version, kind, name), value in self.scores().items():
            families[kind].add_metric([model, version, name], value)
        yield from families.values()


class _ShadowCollector:
    def __init__(self, reports: Callable[[], dict[str, dict]]):
        self.reports = reports

    def collect(self):
        reports = self.reports()
        counters = {
            key: CounterMetricFamily(
                f"trainserve_shadow_{key}", text, labels=["model", "challenger_version"]
            )
            for key, text in (
                ("pairs", "Requests answered by both the champion and the challenger"),
                ("dropped", "Mirrored requests shed (queue full or the champion busy)"),
                ("challenger_errors", "Mirrored requests the challenger failed"),
                ("labels", "Labels joined with a shadowed answer"),
            )
        }
        agreement = GaugeMetricFamily(
            "trainserve_shadow_agreement",
            "Top-1 agreement of challenger and champion",
            labels=["model", "challenger_version"],
        )
        latency = GaugeMetricFamily(
            "trainserve_shadow_latency_ms",
            "p50 and p99 latency of each side, ms",
            labels=["model", "challenger_version", "side", "quantile"],
        )
        verdict = GaugeMetricFamily(
            "trainserve_shadow_verdict",
            "The shadow verdict (value 1): promote, reject or undecided",
            labels=["model", "challenger_version", "verdict"],
        )
        for model, report in reports.items():
            version = str(report.get("challenger_version"))
            for key, family in counters.items():
                family.add_metric([model, version], report.get(key, 0))
            if "agreement" in report:
                agreement.add_metric([model, version], report["agreement"])
            for key, value in (report.get("latency_ms") or {}).items():
                side, _, quantile = key.partition("_")
                latency.add_metric([model, version, side, quantile], value)
            verdict.add_metric([model, version, report["verdict"]], 1)
        yield from (*counters.values(), agreement, latency, verdict)


def merged(texts: list[bytes]) -> bytes:
    """Several processes' expositions as one (the engine's and its front ends':
    serving/front_ends.py): each family once, its samples of the same name and labels added up
    (the front ends' request counts and latency buckets with one another's), families and samples
    in the order first seen."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            seen = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in seen:
                    seen[key][2] += sample.value
                else:
                    seen[key] = [sample.name, sample.labels, sample.value]
    for name, family in families.items():
        for sample_name, labels, value in values[name].values():
            family.add_sample(sample_name, labels, value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        yield from self.families
