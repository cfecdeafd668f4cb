"""Automatic placement across processes: ``shoal serve`` without ``--blocks`` on a 12-block tiny llama.

* 4 servers with ``--num-blocks 4`` (the first creates the swarm, 3 join it at once) cover every
  block, and then hold still: with every block covered no move can raise the bottleneck by the 20%
  hysteresis margin, so nobody moves over several re-check periods;
* one of them leaves (SIGTERM; one whose blocks nobody else covers): its record is ``offline`` in every
  survivor's table, and the 3 survivors move until they tile the model (0:4, 4:8, 8:12);
* a server that measures its throughput announces plausible ``throughput`` and ``step_ms`` (a one-token
  step of one block of a model with hidden size 64 is well under 50 ms on any CPU, and throughput is
  1000 / step_ms without a peer to measure the network with); a second start reuses the cached
  measurement (the same ``step_ms``, bit for bit, and the log says so); a server joining through a peer
  also measures the network, so its throughput is at most 1000 / step_ms;
* without a swarm, ``--blocks`` stays required (exit code 2, a message naming the flags).

Gossip periods are short (tests/helpers/registry.py: round 0.5 s, expiry 3 s) and servers re-check
their placement every ``--balance-period 1`` s (+-20%). Every wait polls every server's own table
against a deadline.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.checkpoints import save_sharded
from shoal.launch import ServerProcess, join_flags, start_parallel, stop_all
from shoal.swarm.records import State
from shoal.transport import Node, Ticket
from testkit.tiny import tiny_model
from tests.helpers.aio import run
from tests.helpers.registry import ENV, LOOPBACK, ONE_THREAD, SWARM_FLAGS, View, fetch_view, poll_views

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NUM_BLOCKS = 12
N = 4
COVER_TIMEOUT = 60.0  # from the last server's start (or the leave) until every block is covered
STILL_PERIODS = 3  # re-check periods a covered swarm of 4 must hold still
BALANCE_PERIOD = 1.0
MOVE = re.compile(r"moving from blocks (\d+):(\d+) to (\d+):(\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = tiny_model("llama", seed=5, num_hidden_layers=NUM_BLOCKS)
    return save_sharded(model, model.config, tmp_path_factory.mktemp("placement-model"))


def auto_server(model_dir: Path, home: Path, join: Ticket | None, *extra: str) -> ServerProcess:
    """``shoal -v serve MODEL`` without ``--blocks``, creating the swarm (``join`` None) or joining it."""
    args = ["-m", "shoal.cli.main", "-v", "serve", str(model_dir), "--host", "127.0.0.1", *ONE_THREAD]
    return ServerProcess([*args, *SWARM_FLAGS, *join_flags(join), *extra], 120, {**ENV, "SHOAL_HOME": str(home)})


def start_all(count: int, start) -> list[ServerProcess]:
    """``count`` processes started at once (``start(i)``); all must come up."""
    started, errors = start_parallel([lambda i=i: start(i) for i in range(count)])
    if errors:
        stop_all([s for s in started if s is not None])
        raise RuntimeError("servers did not start:\n" + "\n".join(errors))
    return started


def moves(process: ServerProcess) -> list[tuple[int, int, int, int]]:
    return [tuple(map(int, m.groups())) for m in MOVE.finditer("".join(process.output))]


def covering(view: View, peers: set[str]) -> dict[str, tuple[int, int]] | None:
    """The spans of ``peers`` if every one is online in ``view`` and together they cover every block."""
    online = {p: r for p, r in view.servers().items() if p in peers and r.state is State.ONLINE}
    if set(online) != peers:
        return None
    covered = {b for r in online.values() for b in range(r.start, r.end)}
    return {p: (r.start, r.end) for p, r in online.items()} if covered == set(range(NUM_BLOCKS)) else None


async def wait_covered(tickets: dict[str, Ticket], timeout: float, gone: set[str] = frozenset()) -> dict:
    """Poll every peer's table until, in each, the peers cover every block (and ``gone`` peers are
    offline or absent); the spans as the last table read says."""
    peers = set(tickets)

    def done(view: View) -> bool:
        servers = view.servers()
        left = all(p not in servers or servers[p].state is State.OFFLINE for p in gone)
        return left and covering(view, peers) is not None

    async with await Node.start(LOOPBACK) as node:
        await poll_views(node, tickets, done, timeout, interval=0.2, what="every block covered")
        views = [await fetch_view(node, t) for t in tickets.values()]
    spans = [covering(v, peers) for v in views]
    assert all(s == spans[0] for s in spans), f"tables disagree on the spans: {spans}"
    return spans[0]


@pytest.fixture(scope="module")
def four(model_dir, tmp_path_factory):
    """4 servers with --num-blocks 4 and no --blocks in one swarm, placed by themselves."""
    home = tmp_path_factory.mktemp("placement-home")
    extra = ("--num-blocks", str(N), "--throughput", "10", "--balance-period", str(BALANCE_PERIOD))
    founder = auto_server(model_dir, home, None, *extra)
    servers = [founder]
    try:
        servers += start_all(3, lambda i: auto_server(model_dir, home, founder.ticket, *extra))
        yield servers
    finally:  # SIGKILL: how they leave is not the point here (the victim's clean exit is tested), and
        for server in servers:  # survivors that lost a peer take seconds to leave cleanly
            server.kill()


def _tickets(servers: list[ServerProcess]) -> dict[str, Ticket]:
    return {s.ticket.peer_id: s.ticket for s in servers}


def _check_alive(servers: list[ServerProcess]) -> None:
    dead = [s for s in servers if s.proc.poll() is not None]
    assert not dead, "servers died:\n" + "\n".join("".join(s.output)[-3000:] for s in dead)


def test_four_servers_cover_every_block_and_hold_still(four):
    started = time.monotonic()
    spans = run(wait_covered(_tickets(four), COVER_TIMEOUT), COVER_TIMEOUT + 10)
    print(f"covered after {time.monotonic() - started:.1f} s: {sorted(spans.values())}")
    assert all(end - start == N for start, end in spans.values())
    before = [len(moves(s)) for s in four]
    time.sleep(STILL_PERIODS * BALANCE_PERIOD * 1.2 + 0.5)
    _check_alive(four)
    assert [len(moves(s)) for s in four] == before, "a covered swarm moved without a clear gain"
    assert run(wait_covered(_tickets(four), 10.0), 20.0) == spans


def test_survivors_move_until_every_block_is_covered_again(four):
    _check_alive(four)
    spans = run(wait_covered(_tickets(four), COVER_TIMEOUT), COVER_TIMEOUT + 10)

    # the victim: the server covering most blocks that nobody else covers (usually all 4 of its own)
    def alone(peer: str) -> int:
        start, end = spans[peer]
        return sum(all(not s <= b < e for p, (s, e) in spans.items() if p != peer) for b in range(start, end))

    victim = max(four, key=lambda s: alone(s.ticket.peer_id))
    assert alone(victim.ticket.peer_id) > 0  # 4 x 4 blocks cover 12 blocks with at most 4 blocks to spare
    survivors = [s for s in four if s is not victim]
    before = {s.ticket.peer_id: len(moves(s)) for s in survivors}
    started = time.monotonic()
    victim.stop()
    assert victim.proc.returncode == 0, "".join(victim.output)[-3000:]
    print(f"victim {spans[victim.ticket.peer_id]} exited in {time.monotonic() - started:.1f} s")
    after = run(wait_covered(_tickets(survivors), COVER_TIMEOUT, gone={victim.ticket.peer_id}), COVER_TIMEOUT + 10)
    print(f"re-covered after {time.monotonic() - started:.1f} s: {sorted(after.values())}")
    history = "\n".join(line for s in four for line in s.output if "placed at" in line or "moving" in line)
    assert sorted(after.values()) == [(0, 4), (4, 8), (8, 12)], history
    moved = [s for s in survivors if len(moves(s)) > before[s.ticket.peer_id]]
    assert moved, f"the victim's blocks were covered by nobody else: someone must have moved\n{history}"
    assert sum(len(moves(s)) - before[s.ticket.peer_id] for s in survivors) <= 6, f"too many moves:\n{history}"
    for server in moved:  # each move ends where the server now is
        assert moves(server)[-1][2:] == after[server.ticket.peer_id]


def test_measured_throughput_is_announced_and_cached(model_dir, tmp_path):
    home = tmp_path / "home"

    async def record_of(process: ServerProcess):
        async with await Node.start(LOOPBACK) as node:
            view = await fetch_view(node, process.ticket)
        return view.server(process.ticket.peer_id)

    first = auto_server(model_dir, home, None, "--num-blocks", "12")
    processes = [first]
    try:
        record = run(record_of(first), 20.0)
        cache = json.loads((home / "throughput.json").read_text())
        processes.append(joiner := auto_server(model_dir, home, first.ticket, "--num-blocks", "12"))
        joined = run(record_of(joiner), 20.0)
    finally:
        stop_all(processes)
    assert "measured: step" in "".join(first.output)
    assert 0 < record.step_ms < 50
    assert record.throughput == pytest.approx(1000 / record.step_ms, rel=1e-3)
    (entry,) = cache.values()
    assert round(entry["step_ms"], 4) == record.step_ms and entry["prompt_tokens"] == 512
    # a second start (the joiner) takes the measurement from the cache, and measures its link too
    joiner_log = "".join(joiner.output)
    assert "cached: step" in joiner_log and "network not measured" not in joiner_log
    assert joined.step_ms == record.step_ms
    assert 0 < joined.throughput <= 1000 / joined.step_ms * 1.001


def test_blocks_are_required_outside_a_swarm(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "shoal.cli.main", "serve", str(model_dir), "--num-blocks", "4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--blocks START:END is required outside a swarm" in out.stderr and "--new-swarm" in out.stderr
