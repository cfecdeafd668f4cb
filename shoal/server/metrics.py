"""Prometheus metrics of a server (``shoal serve --metrics-port PORT``), read at scrape time from the
counters the server keeps anyway: :class:`~shoal.server.handler.Counters`, the
:class:`~shoal.server.budget.CacheBudget`, the swarm table's rejected records and the node's
rejected frames. Nothing on the serving path changes when no one scrapes.

Exposed (all prefixed ``shoal_``)::

    server_info{model,start,end,dtype,version}  1 while a span is loaded
    tokens_served_total{kind="session"|"forward"}
    steps_total, step_latency_seconds (summary: _count, _sum)
    sessions_active, sessions_opened_total, sessions_ended_total{reason}, sessions_rejected_total{reason}
    cache_capacity_tokens, cache_reserved_tokens, cache_free_tokens
    request_errors_total, pushes_total{outcome}
    rejected_records_total{reason}   swarm records refused by this server's table
    rejected_frames_total{reason}    malformed wire frames answered with a wire error
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

__all__ = ["MetricsServer", "ServerCollector", "start_metrics"]


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
        c, info, budget = server.counters, server.info, server.budget
        labels = ["model", "start", "end", "dtype", "version"]
        up = GaugeMetricFamily("shoal_server_info", "The span this server hosts (1 while loaded)", labels=labels)
        up.add_metric([info.model, str(info.blocks.start), str(info.blocks.end), info.dtype, info.version], 1)
        yield up
        tokens = CounterMetricFamily(
            "shoal_tokens_served", "Token positions run through this server's blocks", labels=["kind"]
        )
        tokens.add_metric(["session"], c.positions_processed)
        tokens.add_metric(["forward"], c.forward_tokens)
        yield tokens
        yield CounterMetricFamily("shoal_steps", "Inference session steps served", value=c.steps)
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
            "shoal_cache_reserved_tokens", "KV cache held by sessions", value=budget.reserved_tokens
        )
        yield GaugeMetricFamily("shoal_cache_free_tokens", "KV cache free for new sessions", value=budget.free_tokens)
        yield CounterMetricFamily("shoal_request_errors", "Requests answered with an error", value=c.errors)
        pushes = CounterMetricFamily("shoal_pushes", "Server-to-server step pushes", labels=["outcome"])
        for outcome in ("sent", "received", "failed", "rejected"):
            pushes.add_metric([outcome], getattr(c, f"pushes_{outcome}", 0))
        yield pushes


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
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (see :class:`ServerCollector`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server, node, table))
    ProcessCollector(registry=registry)  # CPU, memory, open files of the server process
    httpd, thread = start_http_server(port, host, registry=registry)
    bound = httpd.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(httpd, thread, host, bound)
