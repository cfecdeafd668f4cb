"""Pure views of a swarm's status (:func:`shoal.swarm.status.summarize`, as the watcher pulls it):
each server's latest load, the graph the dashboard draws, and whether a gateway is ready.

The graph has one node per server the table lists and one edge per RTT published by a server that
is not offline, to a server the table lists (an offline record keeps its last RTTs, which no
longer route anything); ``routes`` are the chains the gateway's own sessions run on now.
"""

from __future__ import annotations

from collections.abc import Iterator

from shoal.gateway.history import Sample
from shoal.routing.chain import format_blocks

__all__ = ["readiness", "servers_of", "swarm_graph", "with_load"]


def servers_of(status: dict) -> Iterator[dict]:
    """Every server entry of ``status``: those of each model, then those without a model record."""
    for model in status["models"]:
        yield from model["servers"]
    yield from status["unverified_servers"]


def with_load(status: dict, sample: Sample | None) -> dict:
    """``status`` with each server's ``tokens_per_s`` and ``sessions_active`` from ``sample`` (None
    where it has none) and the sample's time as ``load_time``; ``status`` itself is left as it is."""
    loads = sample.servers if sample is not None else {}

    def server(entry: dict) -> dict:
        load = loads.get(entry["peer"])
        return {
            **entry,
            "tokens_per_s": load.tokens_per_s if load is not None else None,
            "sessions_active": load.sessions_active if load is not None else None,
        }

    models = [{**m, "servers": [server(s) for s in m["servers"]]} for m in status["models"]]
    unverified = [server(s) for s in status["unverified_servers"]]
    load_time = sample.t if sample is not None else None
    return {**status, "models": models, "unverified_servers": unverified, "load_time": load_time}


def swarm_graph(status: dict, routes: list[list[dict]]) -> dict:
    """``{"nodes": [...], "edges": [...], "routes": [[peer, ...], ...]}`` (see the module docstring)."""
    nodes, names = [], {}
    for model in status["models"]:
        for s in model["servers"]:
            names[s["peer"]] = model["name"]
    for s in servers_of(status):
        entry = {"peer": s["peer"], "state": s["state"], "start": s["start"], "end": s["end"]}
        entry["convicted"] = s.get("convicted", False)  # the swarm's verdicts convict it of lying
        nodes.append({**entry, "model": names.get(s["peer"])})
    listed = {n["peer"] for n in nodes}
    edges = [
        {"from": s["peer"], "to": peer, "ms": ms}
        for s in servers_of(status)
        if s["state"] != "offline"
        for peer, ms in sorted(s["rtts_ms"].items())
        if peer in listed
    ]
    return {"nodes": nodes, "edges": edges, "routes": [[hop["peer"] for hop in route] for route in routes]}


def readiness(status: dict, model: str | None) -> tuple[bool, dict]:
    """Whether the swarm can serve ``model`` now: a member answered and every block of the model
    has an online server. ``model`` None (a dashboard): a member answered is enough."""
    if status.get("via") is None:
        return False, {"ready": False, "reason": status.get("error") or "no swarm member answered"}
    if model is None:
        return True, {"ready": True, "swarm": status["swarm"]}
    found = [m for m in status["models"] if m["name"] == model]
    if not found:
        return False, {"ready": False, "reason": f"the swarm has no record of model {model}", "model": model}
    (entry,) = found
    online = sum(s["state"] == "online" for s in entry["servers"])
    facts = {"model": model, "num_blocks": entry["num_blocks"], "servers_online": online}
    if entry["uncovered"]:
        uncovered = entry["uncovered"]
        which = f"block {uncovered[0]}" if len(uncovered) == 1 else f"blocks {format_blocks(uncovered)}"
        reason = f"{which} of {model} {'has' if len(uncovered) == 1 else 'have'} no online server"
        return False, {"ready": False, "reason": reason, **facts, "uncovered": uncovered}
    return True, {"ready": True, **facts}
