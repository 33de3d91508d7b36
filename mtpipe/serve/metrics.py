"""``GET /metrics``: what a server did, in Prometheus' text format, through ``prometheus_client`` (in the ``serve``
extra; without it ``/metrics`` answers 501 and the rest serves on).

Two kinds of metric, so that nothing is counted twice:

* observed as requests are answered (:class:`Metrics`): ``POST /translate`` requests by status, their latency and
  queue wait, the sentences a worker decodes together, source and target tokens;
* read at each scrape from the counters the server keeps anyway (the batcher's, the connection guard's, the
  decoding processes'; the same numbers ``/info`` shows): queue depth, cancelled and failed requests, refused
  connections, read timeouts, worker restarts, readiness.
"""

from __future__ import annotations

from typing import Any, Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# Counters read at each scrape: (name without _total, help, where it is kept under which key).
READ_COUNTERS = (
    ("mtpipe_cancelled_requests", "Requests cancelled before their answer: the client went away, or "
     "serve.request_timeout_s passed (their remaining decoding dropped)", "cancelled"),
    ("mtpipe_timed_out_requests", "Requests answered 504 after serve.request_timeout_s", "timed_out"),
    ("mtpipe_dropped_sentences", "Sentences of cancelled requests that no worker had started", "dropped_sentences"),
    ("mtpipe_failed_requests", "Requests whose decoding failed (500)", "failed"),
    ("mtpipe_rejected_queue_full", "Requests refused with 503 because serve.max_queue requests waited",
     "rejected_queue_full"),
    ("mtpipe_rejected_work", "Requests refused with 413 over serve.max_request_work", "rejected_work"),
    ("mtpipe_abandoned_requests", "Requests answered 503 by the drain (serve.drain_s after SIGTERM)", "abandoned"),
    ("mtpipe_refused_connections", "Connections refused past serve.max_connections", "refused_connections"),
    ("mtpipe_bad_requests", "Requests the HTTP parser rejected (400)", "bad_requests"),
    ("mtpipe_read_timeouts", "Connections closed after serve.read_timeout_s", "read_timeouts"),
    ("mtpipe_client_disconnects", "Clients that went away before their answer", "client_disconnects"),
    ("mtpipe_worker_restarts", "Decoding processes restarted after one died (serve.workers > 1)", "worker_restarts"),
)
READ_GAUGES = (
    ("mtpipe_queue_depth", "Requests waiting for a worker (at most serve.max_queue)", "queued"),
    ("mtpipe_open_connections", "Client connections open", "open_connections"),
    ("mtpipe_workers_down", "Decoding processes dead or restarting", "workers_down"),
    ("mtpipe_ready", "1 while GET /health/ready answers 200", "ready"),
)


def available() -> bool:
    """Whether ``prometheus_client`` is installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class Metrics:
    """A registry of the server's own (not the process-global one, so that a test's or an embedding program's
    metrics never mix with it). ``read()`` gives, at each scrape, the counters and gauges named in
    :data:`READ_COUNTERS` and :data:`READ_GAUGES` by key."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("mtpipe_requests", "POST /translate requests answered, by HTTP status", ["status"],
                                registry=r)
        self.latency = Histogram("mtpipe_request_seconds", "Seconds from a POST /translate request's arrival to its "
                                 "answer", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("mtpipe_queue_wait_seconds", "Seconds a decoded request waited before a worker "
                                    "took its first sentences", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_sentences = Histogram("mtpipe_batch_sentences", "Sentences a worker decodes together, each time "
                                         "it takes requests", buckets=SIZE_BUCKETS, registry=r)
        self.batch_requests = Histogram("mtpipe_batch_requests", "Requests a worker decodes together, each time it "
                                        "takes requests", buckets=SIZE_BUCKETS, registry=r)
        self.source_tokens = Counter("mtpipe_source_tokens", "Source tokens (SentencePiece pieces, no EOS) of the "
                                     "requests answered", registry=r)
        self.target_tokens = Counter("mtpipe_target_tokens", "Tokens (no EOS) of the best translations answered",
                                     registry=r)
        r.register(_Read(read))

    def batch(self, requests: int, sentences: int) -> None:
        """What a worker holds each time it takes requests (:class:`mtpipe.serve.batcher.Batcher`'s ``on_batch``)."""
        self.batch_requests.observe(requests)
        self.batch_sentences.observe(sentences)

    def answered(self, status: int, seconds: float) -> None:
        self.requests.labels(str(status)).inc()
        self.latency.observe(seconds)

    def decoded(self, queue_s: float, source_tokens: int, target_tokens: int) -> None:
        self.queue_wait.observe(queue_s)
        self.source_tokens.inc(source_tokens)
        self.target_tokens.inc(target_tokens)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of a scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Read:
    """The counters and gauges kept elsewhere, read at each scrape."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self.read = read

    def describe(self) -> list[Any]:
        return self._families({})

    def collect(self) -> list[Any]:
        return self._families(self.read())

    @staticmethod
    def _families(values: dict[str, int]) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: list[Any] = []
        for name, text, key in READ_COUNTERS:
            family = CounterMetricFamily(name, text)
            if values:
                family.add_metric([], values.get(key, 0))
            families.append(family)
        for name, text, key in READ_GAUGES:
            family = GaugeMetricFamily(name, text)
            if values:
                family.add_metric([], values.get(key, 0))
            families.append(family)
        return families


__all__ = ["Metrics", "available"]
