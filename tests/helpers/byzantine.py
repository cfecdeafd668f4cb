"""Driving clients into lying servers on purpose, and reading what the liars did.

The verification tests need three things the ordinary harness does not give:

* a client over a chosen set of servers of an :class:`~shoal.launch.InProcessSwarm` (the liar and
  its honest replicas, not every server of the swarm): :func:`connect_over`;
* a chain that runs through the liar, deterministically: :func:`steer_through` gives the wanted
  servers an observed step time of 0 and every other one :data:`AVOIDED_STEP_MS`, so the planner's
  cheapest route is exactly the wanted one (a session's chain is planned when it opens; the
  latencies only pick among servers, they never hide one from audits or repair);
* the liar's own account of its first lie and of the last step it corrupted: :func:`lies`, from the
  fault seam's :class:`~testkit.faults.FaultRecord` (never from the client, which is under test).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import Tensor

from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from testkit.faults import Alteration

#: What the avoided servers seem to cost per step (ms): far above a wanted one (0) plus the per-hop overhead.
AVOIDED_STEP_MS = 50.0


def peer_of(server: LocalServer) -> str:
    return server.ticket.peer_id


@contextlib.contextmanager
def connect_over(swarm: InProcessSwarm, servers: Sequence[LocalServer], **kwargs) -> Iterator:
    """A client (``from_pretrained(**kwargs)``) that knows only ``servers``; closed on exit. No
    background refresh: the latencies :func:`steer_through` sets stay as set."""
    from shoal.client import AutoDistributedModelForCausalLM

    kwargs.setdefault("refresh_period", 0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(swarm.model_dir),
        initial_peers=[s.ticket for s in servers],
        transport=swarm.transport,
        start_node=swarm.start_node,
        **kwargs,
    )
    try:
        yield model
    finally:
        model.close()


def steer_through(model, chain: Sequence[LocalServer]) -> list[str]:
    """Make ``chain`` (servers covering every block, in order) the cheapest route of ``model``'s
    next session; returns the planned route's peer ids (the caller asserts it is ``chain``)."""
    directory = model.blocks.directory
    wanted = {peer_of(s) for s in chain}
    for span in directory.spans:
        directory.latency.observed_ms[span.peer_id] = 0.0 if span.peer_id in wanted else AVOIDED_STEP_MS
    return [s.peer_id for s in directory.route_inference(0, cache_tokens=0, push=model.blocks.config.push)]


def would_route_over(model, server: LocalServer) -> bool:
    """Whether ``model`` would still put ``server`` on a session's chain although it is made the
    cheapest server of its span (a banned liar must never be chosen again)."""
    directory = model.blocks.directory
    peer = peer_of(server)
    for span in directory.spans:
        directory.latency.observed_ms[span.peer_id] = 0.0 if span.peer_id == peer else AVOIDED_STEP_MS
    route = directory.route_inference(0, cache_tokens=0, push=model.blocks.config.push)
    return peer in {s.peer_id for s in route}


@dataclass(frozen=True)
class Lies:
    """What a liar's record says about one generation: the first cache position whose output it
    corrupted and the end of that step, the end of the last step it corrupted, how many it corrupted."""

    first: int
    first_step_end: int
    last_end: int
    steps: int

    @property
    def lag(self) -> int:
        """Positions the liar still computed after the step of its first lie (with every step from
        the first lie on recorded): 0 when that step was audited at once. A single-position step
        caught within K positions has a lag below K."""
        return self.last_end - self.first_step_end


def assert_caught(model, liar: LocalServer, got: Tensor, expected: Tensor, *, lie_from: int, k: int):
    """After ``got = model.generate(...)`` through ``liar`` (lying from cache position ``lie_from``):
    the tokens are the honest ``expected``, the liar alone is banned, at least one dispute settled,
    and the liar was stopped within ``k`` positions of its first lie's step. Returns the client's
    verification summary for the caller's further checks."""
    told = lies(liar.server.record.entries())
    assert told is not None and told.first == lie_from, liar.server.record.entries()
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, f"first wrong token at (row, col) {mismatch[0].tolist()}"
    verification = model.verification
    assert verification.banned == (peer_of(liar),), verification
    assert verification.settled >= 1, verification
    assert told.lag < k, f"caught {told.lag} positions after the step of the first lie"
    return verification


def lies(entries: Sequence[Alteration], *, stale_cache: bool = False) -> Lies | None:
    """The liar's lies of one generation (``entries``: its record since the generation began, in
    order). ``stale_cache``: the record notes the step whose cache write was skipped, but that
    step's own output is right; the first wrong output is the next step's."""
    corrupt = [e for e in entries if e.positions is not None]
    if stale_cache:
        corrupt = corrupt[1:]
    if not corrupt:
        return None
    first = corrupt[0].positions
    return Lies(first[0], first[1], max(e.positions[1] for e in corrupt), len(corrupt))


__all__ = [
    "AVOIDED_STEP_MS",
    "Lies",
    "assert_caught",
    "connect_over",
    "lies",
    "peer_of",
    "steer_through",
    "would_route_over",
]
