"""The gateway's ``/metrics``: what its engines generated and what their clients' verification did,
read at scrape time, summed over the models it serves and, as ``shoal_model_*``, per model.

    shoal_completion_tokens_total, shoal_speculation_*     every model's engines together
    shoal_verify_*                                         the loaded models' clients together
    shoal_model_completion_tokens_total{model}             per model, kept across evictions
    shoal_model_loaded{model}                              1 while its client part is loaded
    shoal_model_requests_in_flight{model}                  generations using it now
    shoal_model_covered{model}                             1 when the swarms covered it at the last look
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from shoal.gateway.catalog import Catalog

__all__ = ["VERIFY_METRICS", "GatewayCollector"]

#: The client's verification counters (:class:`~shoal.client.verification.audit.Verification`) exported as
#: ``shoal_verify_<name>_total``, with their help text.
VERIFY_METRICS = (
    ("audits", "Auditor steps: a second server recomputing a hop's new positions"),
    ("audited_positions", "Positions auditors recomputed"),
    ("disagreements", "Audits whose outputs differed from the audited server's beyond tolerance"),
    ("settled", "Disputes a third replica decided"),
    ("unsettled", "Disputes no third replica could decide (both servers routed around, the answer regenerated)"),
    ("bans", "Servers convicted of lying and never routed over again"),
    ("rollbacks", "Sessions rolled back to a lie's first wrong position and regenerated"),
    ("evidence_sent", "Pieces of evidence of a conviction sent to the liar's judges"),
    ("evidence_confirmed", "Pieces of evidence a judge confirmed"),
    ("evidence_rejected", "Pieces of evidence a judge rejected"),
)
SUMMED = ("completion_tokens", "rounds", "drafted_tokens", "accepted_tokens")


class GatewayCollector(Collector):
    """The catalog's running totals (:class:`~shoal.gateway.engine.Totals`, one per model) and its
    loaded clients' verification counters as Prometheus samples; all zero without a catalog (a
    dashboard-only gateway), whose verify mode reads ``off``."""

    def __init__(self, catalog: Catalog | None):
        self.catalog = catalog

    def collect(self):
        names = list(self.catalog.named) if self.catalog is not None else []
        per_model = {}
        if self.catalog is not None:
            names = sorted({*names, *self.catalog.pool.loaded(), *self.catalog.known()})
            per_model = {name: self.catalog.totals(name).snapshot() for name in names}
        totals = {key: sum(t[key] for t in per_model.values()) for key in SUMMED}
        totals["acceptance_rate"] = (
            totals["accepted_tokens"] / totals["drafted_tokens"] if totals["drafted_tokens"] else 0.0
        )
        totals["mean_window"] = totals["drafted_tokens"] / totals["rounds"] if totals["rounds"] else 0.0
        counters = [
            ("completion_tokens", "Tokens generated for API and chat answers", "completion_tokens"),
            ("speculation_rounds", "Verification rounds of speculative decoding", "rounds"),
            ("speculation_drafted_tokens", "Tokens drafted for the swarm to verify", "drafted_tokens"),
            ("speculation_accepted_tokens", "Drafted tokens the model accepted", "accepted_tokens"),
        ]
        for name, text, key in counters:
            yield CounterMetricFamily(f"shoal_{name}", text, value=totals[key])
        gauges = [
            ("speculation_acceptance_rate", "Accepted / drafted tokens since start", "acceptance_rate"),
            ("speculation_mean_window", "Drafted tokens per verification round since start", "mean_window"),
        ]
        for name, text, key in gauges:
            yield GaugeMetricFamily(f"shoal_{name}", text, value=totals[key])
        yield from self._verification()
        yield from self._models(per_model)

    def _models(self, per_model: dict[str, dict]):
        tokens = CounterMetricFamily("shoal_model_completion_tokens", "Tokens generated per model", labels=["model"])
        loaded = GaugeMetricFamily("shoal_model_loaded", "1 while the model's client part is loaded", labels=["model"])
        flight = GaugeMetricFamily("shoal_model_requests_in_flight", "Generations using the model now",
                                   labels=["model"])  # fmt: skip
        covered = GaugeMetricFamily("shoal_model_covered", "1 when the swarms covered every block at the last look",
                                    labels=["model"])  # fmt: skip
        held = set(self.catalog.pool.loaded()) if self.catalog is not None else set()
        known = self.catalog.known() if self.catalog is not None else {}
        for name, snapshot in per_model.items():
            tokens.add_metric([name], snapshot["completion_tokens"])
            loaded.add_metric([name], float(name in held))
            flight.add_metric([name], self.catalog.pool.in_flight(name))
            if name in known:
                covered.add_metric([name], float(known[name].covered))
        yield from (tokens, loaded, flight, covered)

    def _verification(self):
        engines = self.catalog.engines() if self.catalog is not None else []
        verifications = [v for engine in engines if (v := engine.model.verification) is not None]
        first = verifications[0] if verifications else None
        mode = first.mode if first is not None else "off"
        every = str(first.audit_every) if first is not None and mode != "off" else ""
        yield InfoMetricFamily("shoal_verify", "How this gateway's client verifies servers",
                               value={"mode": mode, "audit_every": every})  # fmt: skip
        for name, text in VERIFY_METRICS:
            value = sum(getattr(v, name, 0) for v in verifications)
            yield CounterMetricFamily(f"shoal_verify_{name}", text, value=value)
        unverified = sum(v.unverified_blocks for v in verifications)
        text = "Blocks of the latest session's chain that no auditor checks"
        yield GaugeMetricFamily("shoal_verify_unverified_blocks", text, value=unverified)
        banned = GaugeMetricFamily("shoal_verify_banned", "Servers convicted of lying (1 each)", labels=["peer"])
        for peer in dict.fromkeys(peer for v in verifications for peer in getattr(v, "banned", ())):
            banned.add_metric([peer], 1.0)
        yield banned
