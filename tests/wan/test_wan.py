"""The WAN emulator (testkit.wan) with real iroh nodes: delays, loss, byte accounting, no bypass."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from shoal.errors import RequestTimeout
from shoal.transport import META, Node, Ticket, TransportConfig
from shoal.transport.identity import generate_key
from testkit.wan import (
    LinkConditions,
    LoopbackCapture,
    RemoteEmulator,
    WanEmulator,
    check_capture_against_counters,
    parse_address,
    request_rtts,
    udp_drops,
)
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(60)
CONFIG = TransportConfig(bind_addr="127.0.0.1:0")


async def start_nodes(wan: WanEmulator, *names: str) -> dict[str, Node]:
    nodes = {}
    for name in names:
        node = nodes[name] = await Node.start(CONFIG)
        wan.add_node(node.ticket(), name)
    return nodes


async def close_all(nodes: dict[str, Node]) -> None:
    for node in nodes.values():
        await node.close()


def test_a_request_through_a_link_takes_its_round_trip():
    """Both directions are delayed (R/2 each): a 1 KB ping/echo takes R more than through a link
    without delay, within 10% or 1 ms, and never less than R; QUIC's own RTT estimate (what its
    congestion control works with) agrees. The estimate is the fastest of 9 (the link's delay is
    fixed, and the machine's load only ever adds to it); ``bench.wan`` reports medians too."""

    async def go() -> tuple[dict[float, list[float]], dict[float, float]]:
        with WanEmulator(seed=1) as wan:
            nodes = await start_nodes(wan, "client", "near", "far20", "far50")
            wan.set_link("client", "far20", rtt_ms=20.0)
            wan.set_link("client", "far50", rtt_ms=50.0)
            try:
                client, measured, quic = nodes["client"], {}, {}
                warm_up = await request_rtts(client, wan.ticket("near"), 9)  # a process's first requests are slow
                for rtt, name in ((20.0, "far20"), (50.0, "far50"), (0.0, "near")):
                    measured[rtt] = await request_rtts(client, wan.ticket(name), 9)
                    quic[rtt] = client.rtt_ms(wan.ticket(name), META)
                measured[0.0] += warm_up
                return measured, quic
            finally:
                await close_all(nodes)

    measured, quic = run(go())
    base = min(measured.pop(0.0)) * 1000.0  # the software's own round trip
    for rtt, seconds in measured.items():
        samples = [s * 1000.0 for s in seconds]
        assert min(samples) >= rtt, (rtt, samples)
        assert abs(min(samples) - base - rtt) <= max(0.1 * rtt, 1.0), (rtt, base, samples)
        assert abs(quic[rtt] - rtt) <= max(0.1 * rtt, 1.0), (rtt, quic)


def test_a_link_with_total_loss_times_requests_out_while_others_work():
    async def go() -> None:
        with WanEmulator(LinkConditions(rtt_ms=4.0), seed=2) as wan:
            nodes = await start_nodes(wan, "client", "lossy", "fine")
            try:
                client = nodes["client"]
                await request_rtts(client, wan.ticket("lossy"), 1)
                await request_rtts(client, wan.ticket("fine"), 1)
                before = wan.stats("client", "lossy")
                wan.set_link("client", "lossy", loss=1.0)
                assert wan.conditions("lossy", "client") == LinkConditions(rtt_ms=4.0, loss=1.0)
                started = time.monotonic()
                with pytest.raises(RequestTimeout):
                    await request_rtts(client, wan.ticket("lossy"), 1, timeout=1.0)
                assert 0.9 <= time.monotonic() - started < 3.0
                lost = wan.stats("client", "lossy")
                assert lost.forwarded_datagrams == before.forwarded_datagrams  # nothing got through
                assert lost.dropped_datagrams > before.dropped_datagrams
                rtts = await request_rtts(client, wan.ticket("fine"), 3, timeout=5.0)  # the other link
                assert max(rtts) < 1.0
                wan.set_link("client", "lossy", loss=0.0)  # and the link recovers
                await request_rtts(client, wan.ticket("lossy"), 1, timeout=10.0)
            finally:
                await close_all(nodes)

    run(go())


def test_every_byte_between_nodes_goes_through_the_proxies_and_is_counted():
    """What crossed ``lo`` (a packet capture) between nodes and emulator matches the emulator's
    counters exactly; the request/response payloads are in them; unused links count zero. iroh
    does send around the emulator (peers exchange their real addresses inside the QUIC
    connection and probe them): the sealed node's kernel dropped every one of those datagrams."""

    async def go() -> tuple[WanEmulator, dict[str, frozenset], set, int]:
        wan = WanEmulator(LinkConditions(rtt_ms=2.0), seed=3)
        nodes = await start_nodes(wan, "a", "b", "idle")
        try:
            await request_rtts(nodes["a"], wan.ticket("b"), 4)  # 5 pings of 1 KB, each echoed
            await request_rtts(nodes["b"], wan.ticket("a"), 1)  # 2 the other way, dialled by b
            await asyncio.sleep(0.2)
            node_addrs = {name: wan.node(name).own_addrs for name in nodes}
            emulator = wan.socket_addresses()
            await nodes.pop("a").close()  # the only node that could send to b directly
            await asyncio.sleep(0.2)
            refused_by_b = sum(udp_drops(set(node_addrs["b"])).values())
        finally:
            await close_all(nodes)
        for _ in range(100):  # what the nodes said last (connection close) leaves the emulator
            if wan.in_flight() == 0:
                break
            await asyncio.sleep(0.02)
        return wan, node_addrs, emulator, refused_by_b

    with LoopbackCapture() as capture:
        wan, node_addrs, emulator, refused_by_b = run(go())
        datagrams = capture.close()
    stats = wan.all_stats()
    wan.close()
    into, out_of, around = check_capture_against_counters(datagrams, node_addrs, emulator, stats)
    assert stats[("a", "b")].forwarded_bytes >= 7 * 1024 and stats[("b", "a")].forwarded_bytes >= 7 * 1024
    assert all(s == type(s)() for (src, dst), s in stats.items() if "idle" in (src, dst))
    assert into["idle"] == out_of["idle"] == 0
    assert wan.stray_datagrams == 0
    assert refused_by_b == around["b"]  # every datagram that reached b around the emulator was dropped


def test_a_sealed_node_accepts_datagrams_from_the_emulator_only():
    async def go() -> tuple[dict, dict, dict]:
        with WanEmulator(seed=4) as wan:
            node = await Node.start(CONFIG)
            try:
                addrs = wan.add_node(node.ticket(), "sealed").own_addrs
                before = udp_drops(set(addrs))
                outsider4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                outsider6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                insider = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                insider.bind((wan.host, 0))
                for sock, family in ((outsider4, 4), (outsider6, 6)):
                    for addr in addrs:
                        if (":" in addr[0]) == (family == 6):
                            for _ in range(3):
                                sock.sendto(b"not through the emulator", addr)
                v4 = next(a for a in addrs if ":" not in a[0])
                for _ in range(3):
                    insider.sendto(b"from the emulator's host", v4)
                await asyncio.sleep(0.2)
                after = udp_drops(set(addrs))
                for sock in (outsider4, outsider6, insider):
                    sock.close()
                return before, after, {a: 3 for a in addrs}
            finally:
                await node.close()

    before, after, sent_from_outside = run(go())
    assert set(after) == set(sent_from_outside)  # both sockets (127.0.0.1 and [::]) were found
    assert {a: after[a] - before[a] for a in after} == sent_from_outside  # all 6 dropped, the 3 insiders not


def test_settings_are_validated_and_addresses_parsed():
    assert parse_address("[::1]:5") == ("::1", 5) and parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    for bad in ({"loss": 1.5}, {"rtt_ms": -1.0}, {"bandwidth_mbit": 0.0}, {"jitter_ms": -0.1}):
        with pytest.raises(ValueError):
            LinkConditions(**bad)


class UdpPair:
    """Two plain UDP sockets registered as nodes (unsealed: they are not iroh endpoints), to look at
    single datagrams: numbered, timestamped on sending and on receiving."""

    def __init__(self, wan: WanEmulator):
        self.wan = wan
        self.sender, self.receiver = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
        for name, sock, peer_id in (("tx", self.sender, "1" * 64), ("rx", self.receiver, "2" * 64)):
            sock.bind(("127.0.0.1", 0))
            host, port = sock.getsockname()
            wan.add_node(Ticket(peer_id, (f"{host}:{port}",)), name, sealed=False)
        self.receiver.settimeout(0.2)
        self.target = wan.node("rx").proxy_addr

    def send(self, count: int, size: int, first: int = 0) -> list[float]:
        sent = []
        for i in range(first, first + count):
            sent.append(time.monotonic())
            self.sender.sendto(i.to_bytes(4, "big") + bytes(size - 4), self.target)
        return sent

    def receive(self) -> list[tuple[int, float]]:
        """(number, arrival) of every datagram until none came for 0.2 s."""
        got = []
        with contextlib.suppress(TimeoutError):
            while True:
                data = self.receiver.recv(65536)
                got.append((int.from_bytes(data[:4], "big"), time.monotonic()))
        return got

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def test_loss_is_seeded_jitter_keeps_order_and_bandwidth_paces_and_overflows():
    def lossy_run(seed: int) -> list[int]:
        with WanEmulator(LinkConditions(loss=0.3), seed=seed) as wan:
            pair = UdpPair(wan)
            pair.send(200, 100)
            received = [number for number, _ in pair.receive()]
            stats = wan.stats("tx", "rx")
            pair.close()
        assert stats.forwarded_datagrams == len(received) and stats.dropped_datagrams == 200 - len(received)
        assert stats.forwarded_bytes == 100 * len(received)
        return received

    first = lossy_run(seed=7)
    assert 100 <= len(first) <= 180 and first == sorted(first)
    assert lossy_run(seed=7) == first  # the same seed drops the same datagrams
    assert lossy_run(seed=8) != first

    with WanEmulator(LinkConditions(rtt_ms=10.0, jitter_ms=4.0), seed=9) as wan:
        pair = UdpPair(wan)
        sent = []
        for number in range(50):  # spread out, so that jitter could reorder them if FIFO were not kept
            sent += pair.send(1, 64, first=number)
            time.sleep(0.0005)
        received = pair.receive()
        pair.close()
    assert [number for number, _ in received] == list(range(50))
    delays = [arrived - sent[number] for number, arrived in received]
    assert min(delays) >= 0.0005 and max(delays) - min(delays) > 0.002  # 5 +- 4 ms one way, varied

    rate = 1_000_000  # bytes per second
    with WanEmulator(LinkConditions(bandwidth_mbit=rate * 8 / 1e6, queue_bytes=5000), seed=10) as wan:
        pair = UdpPair(wan)
        sent = pair.send(20, 1000)  # at once: about 5 fit the queue, the rest overflow
        received = pair.receive()
        burst = wan.stats("tx", "rx")
        pair.close()
    assert burst.overflow_datagrams == 20 - len(received) >= 10
    # the last one leaves the bottleneck once all before it and itself were serialised at the rate
    assert received[-1][1] - sent[0] >= len(received) * 1000 / rate - 0.0003


def test_a_restarted_server_is_reached_through_the_ticket_handed_out_before():
    async def go() -> None:
        with WanEmulator(LinkConditions(rtt_ms=2.0), seed=5) as wan:
            key = generate_key()
            client, server = await Node.start(CONFIG), await Node.start(CONFIG, secret_key=key)
            wan.add_node(client.ticket(), "client")
            wan.add_node(server.ticket(), "server")
            ticket = wan.ticket("server")
            try:
                await request_rtts(client, ticket, 1)
                await server.close()
                server = await Node.start(CONFIG, secret_key=key)  # same identity, another port
                moved = wan.readdress("server", server.ticket())
                assert moved.addr != parse_address(ticket.addrs[0]) and wan.ticket("server") == ticket
                assert len(await request_rtts(client, ticket, 2, timeout=10.0)) == 2
            finally:
                await client.close()
                await server.close()

    run(go())


def test_a_node_in_a_subprocess_is_sealed_and_reached_through_its_proxy():
    """As a swarm harness would wire a server it runs as a subprocess: its ticket in, sealed by pid."""
    peer = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.peer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ready = peer.stdout.readline()  # "ticket: ..." once serving (bounded by the test's timeout)
        assert ready.startswith("ticket: "), ready
        ticket = Ticket.parse(ready.removeprefix("ticket: "))

        async def go() -> tuple[list[float], int]:
            with WanEmulator(LinkConditions(rtt_ms=10.0), seed=6) as wan:
                node = wan.add_node(ticket, "peer", pid=peer.pid)
                client = await Node.start(CONFIG)
                try:
                    wan.add_node(client.ticket(), "client")
                    rtts = await request_rtts(client, wan.ticket("peer"), 3)
                    before = sum(udp_drops(set(node.own_addrs)).values())
                    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as outsider:
                        outsider.sendto(b"not through the emulator", node.addr)
                    await asyncio.sleep(0.1)
                    return rtts, sum(udp_drops(set(node.own_addrs)).values()) - before
                finally:
                    await client.close()

        rtts, refused = run(go())
    finally:
        peer.stdin.close()  # the peer serves until its standard input closes
        try:
            peer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            peer.kill()
            raise
    assert min(rtts) >= 0.010
    assert refused >= 1  # ours (and any probe of iroh's around the emulator)


@pytest.mark.parametrize("emulator", [WanEmulator, RemoteEmulator])
def test_a_reserved_proxy_is_announced_by_a_subprocess_that_dials_before_it_is_attached(emulator):
    """The soak's wiring: the proxy opened first, the node started announcing it, attached (found
    and sealed by pid) while it starts and already dials out; then removed when it ends. The same
    with the emulator in a process of its own (sealing here, the proxies there)."""
    with emulator(LinkConditions(rtt_ms=60.0), seed=2) as wan:
        proxy = wan.reserve("peer")

        async def go() -> tuple[Ticket, list[float], int]:
            client = await Node.start(CONFIG)
            try:
                wan.add_node(client.ticket(), "client")
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as early:
                    early.sendto(b"nobody attached yet", proxy)
                args = ["--announce-addr", f"{proxy[0]}:{proxy[1]}", "--ping", str(wan.ticket("client"))]
                peer = subprocess.Popen(
                    [sys.executable, "-m", "tests.helpers.peer", *args],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                try:
                    node = await asyncio.to_thread(wan.attach, "peer", peer.pid, timeout=30.0)
                    ready = await asyncio.to_thread(peer.stdout.readline)  # its ping came through the proxy
                    assert ready.startswith("ticket: "), ready
                    ticket = Ticket.parse(ready.removeprefix("ticket: "))
                    rtts = await request_rtts(client, ticket, 3)
                    assert node.proxy_addr == proxy and node.addr in node.own_addrs
                finally:
                    peer.stdin.close()
                    await asyncio.to_thread(peer.wait, 15)
                return ticket, rtts, wan.stats("peer", "client").forwarded_datagrams
            finally:
                await client.close()

        ticket, rtts, answered = run(go())
        assert ticket.addrs == (f"{proxy[0]}:{proxy[1]}",)  # the only address it hands out: the proxy's
        assert min(rtts) >= 0.060 and answered > 0
        assert wan.stray_datagrams >= 1  # ours, sent before the node was attached
        before = wan.totals()
        wan.remove("peer")
        assert wan.totals() == before and [n.name for n in wan.nodes] == ["client"]
        assert wan.lateness().datagrams == before.forwarded_datagrams
        wan.reserve("peer")  # the name, and its addresses, are free again


def test_attaching_a_process_that_ends_or_binds_nothing_fails_clearly():
    with WanEmulator() as wan:
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(TimeoutError, match=f"process {idle.pid} bound no loopback UDP socket"):
                wan.attach("idle", idle.pid, timeout=0.5)
        finally:
            idle.kill()
            idle.wait()
        with pytest.raises(ProcessLookupError, match="ended before it bound"):
            wan.attach("idle", idle.pid, timeout=5.0)
        wan.reserve("r")
        with pytest.raises(ValueError, match="already registered or reserved"):
            wan.reserve("r")


def test_a_process_s_connected_udp_sockets_are_not_taken_for_its_node_s():
    """A starting process may connect a UDP socket for a moment (to learn a route's source
    address): attaching must neither take it for the node's nor fail when it closes."""
    from testkit.wan.sealing import bound_addresses

    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listening,
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe,
    ):
        listening.bind(("127.0.0.1", 0))
        probe.connect(("::1", 9))
        found = bound_addresses(os.getpid())
        assert listening.getsockname() in found
        assert probe.getsockname()[:2] not in found
