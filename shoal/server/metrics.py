"""Prometheus metrics and health checks of a server (``shoal serve --metrics-port PORT``), read at
request time from the counters the server keeps anyway: :class:`~shoal.server.handler.Counters`,
the :class:`~shoal.server.budget.CacheBudget`, the swarm table's rejected records and the node's
rejected frames. Nothing on the serving path changes when no one scrapes.

    GET /metrics   the samples below (Prometheus text format)
    GET /healthz   200 ``{"status": "ok"}`` while the process answers
    GET /readyz    200 when the span is loaded, announced online (in a swarm) and not draining;
                   503 with ``{"ready": false, "reason": ...}`` otherwise (see :func:`readiness`)

Exposed (all prefixed ``shoal_``)::

    server_info{model,start,end,dtype,version}  1 while a span is loaded
    tokens_served_total{kind="session"|"forward"|"backward"}
    backward_requests_total
    compute_tasks_total{class="inference"|"forward"|"training"}   tasks the compute thread ran
    compute_queue_jumps_total{class,over}   tasks run before earlier-queued work of a lower class
    steps_total, step_latency_seconds (summary: _count, _sum), positions_rolled_back_total
    sessions_active, sessions_opened_total, sessions_ended_total{reason}, sessions_rejected_total{reason}
    cache_capacity_tokens, cache_reserved_tokens, cache_free_tokens
    prefix_cache_pages, prefix_hit_tokens_total   the prefix cache (shoal.server.prefix)
    request_errors_total, pushes_total{outcome}
    evidence_total{outcome="received"|"confirmed"|"rejected"}   others' lies judged (shoal.server.judge)
    evidence_rejected_by_reason_total{reason}   malformed, not_judged, forged, replayed, framing
    rejected_records_total{reason}   swarm records refused by this server's table
    rejected_frames_total{reason}    malformed wire frames answered with a wire error
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from shoal.swarm.records import State
from shoal.verify.evidence import Reason

log = logging.getLogger(__name__)
#: The reasons a judge rejects evidence, each a counter of its own (``evidence_<reason>``)
EVIDENCE_REASONS = tuple(reason.value for reason in Reason)

__all__ = ["MetricsServer", "ServerCollector", "readiness", "start_metrics"]


class ServerCollector(Collector):
    """``server()`` is the span server now loaded (None while loading or moving); ``table()`` the
    swarm's record table (None outside a swarm); ``node`` the endpoint."""

    def __init__(
        self,
        server: Callable[[], Any],
        node: Any = None,
        table: Callable[[], Any] | None = None,
    ):
        self.server = server
        self.node = node
        self.table = table or (lambda: None)

    def collect(self):
        server = self.server()
        if server is not None:
            yield from self._server(server)
        table = self.table()
        rejected = CounterMetricFamily(
            "shoal_rejected_records", "Swarm records this server's table refused", labels=["reason"]
        )
        for reason, count in sorted(dict(table.rejected if table is not None else {}).items()):
            rejected.add_metric([reason], count)
        yield rejected
        frames = CounterMetricFamily(
            "shoal_rejected_frames", "Malformed wire frames answered with a wire error", labels=["reason"]
        )
        for reason, count in sorted(dict(getattr(self.node, "rejected_frames", {})).items()):
            frames.add_metric([reason], count)
        yield frames

    def _server(self, server):
        c, info, budget = server.describe().counters, server.info, server.budget
        labels = ["model", "start", "end", "dtype", "version"]
        up = GaugeMetricFamily("shoal_server_info", "The span this server hosts (1 while loaded)", labels=labels)
        up.add_metric([info.model, str(info.blocks.start), str(info.blocks.end), info.dtype, info.version], 1)
        yield up
        tokens = CounterMetricFamily(
            "shoal_tokens_served", "Token positions run through this server's blocks", labels=["kind"]
        )
        tokens.add_metric(["session"], c.positions_processed)
        tokens.add_metric(["forward"], c.forward_tokens)
        tokens.add_metric(["backward"], c.backward_tokens)
        yield tokens
        yield CounterMetricFamily(
            "shoal_backward_requests",
            "Backward passes (gradients of a span's inputs) served",
            value=c.backward_requests,
        )
        tasks = CounterMetricFamily(
            "shoal_compute_tasks", "Tasks the compute thread ran, by priority class", labels=["class"]
        )
        for name, value in (("inference", c.inference_tasks), ("forward", c.forward_tasks)):
            tasks.add_metric([name], value)
        tasks.add_metric(["training"], c.training_chunks)
        yield tasks
        jumps = CounterMetricFamily(
            "shoal_compute_queue_jumps",
            "Compute tasks run before earlier-queued work of a lower priority class",
            labels=["class", "over"],
        )
        jumps.add_metric(["inference", "forward"], c.inference_ahead_of_forward)
        jumps.add_metric(["inference", "training"], c.inference_ahead_of_training)
        jumps.add_metric(["forward", "training"], c.forward_ahead_of_training)
        yield jumps
        yield CounterMetricFamily("shoal_steps", "Inference session steps served", value=c.steps)
        yield CounterMetricFamily(
            "shoal_positions_rolled_back",
            "Cached positions a session step overwrote (rejected speculative drafts, replays)",
            value=c.positions_rolled_back,
        )
        yield SummaryMetricFamily(
            "shoal_step_latency_seconds",
            "Compute time of a session step through this server's blocks",
            count_value=c.steps,
            sum_value=getattr(c, "step_seconds", 0.0),
        )
        yield GaugeMetricFamily("shoal_sessions_active", "Inference sessions open now", value=c.sessions_active)
        yield CounterMetricFamily("shoal_sessions_opened", "Inference sessions opened", value=c.sessions_opened)
        ended = CounterMetricFamily("shoal_sessions_ended", "Inference sessions ended, by reason", labels=["reason"])
        for reason, value in (
            ("closed", c.sessions_closed),
            ("abandoned", c.sessions_abandoned),
            ("timed_out", c.sessions_timed_out),
            ("drained", getattr(c, "sessions_drained", 0)),
        ):
            ended.add_metric([reason], value)
        yield ended
        rejected = CounterMetricFamily("shoal_sessions_rejected", "Session opens refused", labels=["reason"])
        rejected.add_metric(["busy"], c.sessions_rejected_busy)
        yield rejected
        yield GaugeMetricFamily("shoal_cache_capacity_tokens", "KV cache budget", value=budget.capacity_tokens)
        yield GaugeMetricFamily(
            "shoal_cache_reserved_tokens",
            "KV positions live sessions committed (max_length)",
            value=budget.reserved_tokens,
        )
        yield GaugeMetricFamily("shoal_kv_pages", "KV pages of the pool", value=c.kv_pages_total)
        yield GaugeMetricFamily(
            "shoal_kv_pages_in_use", "KV pages held (by sessions or the prefix cache)", value=c.kv_pages_in_use
        )
        yield CounterMetricFamily("shoal_batches", "Batched forwards run (a lone step is a batch of one)",
                                  value=c.batches)  # fmt: skip
        yield CounterMetricFamily("shoal_batched_steps", "Session steps (or prefill chunks) batches carried",
                                  value=c.batched_steps)  # fmt: skip
        yield CounterMetricFamily("shoal_steps_deferred", "Times a waiting step was left out of a batch that ran",
                                  value=c.steps_deferred)  # fmt: skip
        yield GaugeMetricFamily("shoal_batch_groups", "Groups the sessions run in, a batch each (as many as their "
                                "chains keep busy)", value=c.batch_groups)  # fmt: skip
        yield GaugeMetricFamily("shoal_cache_free_tokens", "KV cache free for new sessions", value=budget.free_tokens)
        yield GaugeMetricFamily(
            "shoal_prefix_cache_pages",
            "KV pages only the prefix cache holds (closed sessions' full pages, reclaimed least recently used)",
            value=c.prefix_cache_pages,
        )
        yield CounterMetricFamily(
            "shoal_prefix_hit_tokens",
            "Session positions answered from cached pages instead of recomputed (shared prefixes)",
            value=c.prefix_hit_tokens,
        )
        yield CounterMetricFamily("shoal_request_errors", "Requests answered with an error", value=c.errors)
        pushes = CounterMetricFamily("shoal_pushes", "Server-to-server step pushes", labels=["outcome"])
        for outcome in ("sent", "received", "failed", "rejected"):
            pushes.add_metric([outcome], getattr(c, f"pushes_{outcome}", 0))
        yield pushes
        evidence = CounterMetricFamily(
            "shoal_evidence", "Evidence of other servers' lies this server judged, by outcome", labels=["outcome"]
        )
        for outcome in ("received", "confirmed", "rejected"):
            evidence.add_metric([outcome], getattr(c, f"evidence_{outcome}", 0))
        yield evidence
        rejected = CounterMetricFamily(
            "shoal_evidence_rejected_by_reason", "Evidence this server rejected, by reason", labels=["reason"]
        )
        for reason in EVIDENCE_REASONS:
            rejected.add_metric([reason], getattr(c, f"evidence_{reason}", 0))
        yield rejected


def readiness(server: Any, table: Any, peer: str) -> tuple[bool, dict]:
    """Whether this server takes new sessions, and why not: ``server`` is the loaded span server
    (None while loading or moving), ``table`` the swarm's record table (None outside a swarm, where
    loaded and not draining is enough), ``peer`` this server's peer id."""
    if server is None:
        return False, {"ready": False, "reason": "no span loaded (the server is loading or moving its blocks)"}
    blocks = server.info.blocks
    span = {"model": server.info.model, "blocks": str(blocks)}
    if server.draining:
        return False, {"ready": False, "reason": "draining: the server is leaving the swarm or moving", **span}
    if table is not None:
        own = table.get(f"s:{peer}")
        record = own.record if own is not None else None
        if record is None or record.state is not State.ONLINE or record.blocks != blocks:
            state = "not announced" if record is None else f"{record.state} for blocks {record.blocks}"
            return False, {"ready": False, "reason": f"not announced online yet (record: {state})", **span}
    return True, {"ready": True, **span}


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # a probe every few seconds is not worth a log line
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up the exit


def _json(start_response, status: str, body: dict) -> list[bytes]:
    payload = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
    return [payload]


def _app(registry: CollectorRegistry, ready: Callable[[], tuple[bool, dict]]):
    """``/healthz`` and ``/readyz`` as JSON; every other path is prometheus_client's (``/metrics``)."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _json(start_response, "200 OK", {"status": "ok"})
        if path == "/readyz":
            ok, body = ready()
            return _json(start_response, "200 OK" if ok else "503 Service Unavailable", body)
        return metrics(environ, start_response)

    return app


@dataclass
class MetricsServer:
    """The running exporter; ``port`` is the bound one (useful with port 0)."""

    httpd: Any
    thread: Any
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics(
    host: str, port: int, server: Callable[[], Any], node: Any = None, table: Callable[[], Any] | None = None
) -> MetricsServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` from a daemon thread (see
    :class:`ServerCollector` and :func:`readiness`)."""
    collector = ServerCollector(server, node, table)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)  # CPU, memory, open files of the server process

    def ready() -> tuple[bool, dict]:
        return readiness(collector.server(), collector.table(), node.id if node is not None else "")

    class HTTPServer(_ThreadingServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    httpd = make_server(host, port, _app(registry, ready), HTTPServer, handler_class=_Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="shoal-metrics", daemon=True)
    thread.start()
    bound = httpd.server_address[1]
    log.info("metrics on http://%s:%d/metrics (health: /healthz, /readyz)", host, bound)
    return MetricsServer(httpd, thread, host, bound)
