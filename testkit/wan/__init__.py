"""A wide-area network emulator for shoal on one machine: UDP proxies between iroh nodes.

``tc netem`` is not available here, and shaping the application (sleeping before each send) would
hide the network from iroh's QUIC congestion control. So the emulator sits on the wire: every
node's QUIC datagrams to another node pass through a proxy that delays, drops and rate-limits them,
and QUIC sees a real round trip, real loss and a real bottleneck.

Topology. A *node* is one iroh endpoint, known by its peer id and the UDP addresses of its ticket
(``Node.ticket()``: one ``127.0.0.1`` socket, one ``[::1]`` socket). For every node D the emulator
binds one *proxy socket* P_D; every other node reaches D through a ticket whose only address is
P_D (:meth:`WanEmulator.ticket`). The proxy tells the sending node S apart by the datagram's source
address and forwards S's datagrams to D from a socket of its own for the pair (S, D), U_SD. D
therefore sees S at U_SD and answers there; U_SD hands the answer back to S from P_D. Both
directions of a pair go through the emulator, whichever side dialled: datagrams S -> D (S's to P_D,
and S's answers on D's connections to it, via U_DS) share one *pipe* with S -> D's conditions and
counters, and D -> S the other. Emulator sockets bind their own host, 127.0.0.2, that no node uses.

Sealing. iroh does not keep to the addresses it is given: peers tell each other their own socket
addresses inside the QUIC connection (NAT traversal) and probe them, and on loopback the probes
succeed, so the connection leaves the emulator within its first requests (seen with iroh 1.2.0:
all traffic went direct, [::1] included). So :meth:`WanEmulator.add_node` *seals* each node: a
classic BPF filter on its UDP sockets makes the kernel drop every datagram not sent from the
emulator's host. The probes then fail and the connection stays on the proxies (tests check this
with :class:`LoopbackCapture`, a packet capture on ``lo``, and the sockets' kernel drop counters).
Sealing needs the node's socket descriptors: in this process directly, in another one (``pid=``)
through pidfd_getfd, which needs ptrace rights over it (a child process has them).

Conditions (:class:`LinkConditions`, per direction, changeable at run time): half the round trip
each way, jitter (uniform, never reordering a direction: a datagram is never delivered before the
one admitted ahead of it), loss (a seeded RNG per direction, so a run repeats), and a bandwidth
limit (a serialising bottleneck with a drop-tail buffer of ``queue_bytes``). A datagram's arrival
time is the kernel's receive timestamp, and the proxies run on a thread of their own that waits
with microsecond timeouts, so the delays hold while the test's event loop is busy (the thread
still needs the GIL to run: a process whose main thread spins in pure Python for milliseconds
delays deliveries by up to the interpreter's switch interval; keep such work in other processes).

A swarm behind the emulator: :class:`~testkit.wan.swarm.WanSwarm` (shoal's in-process swarm
harness on iroh nodes, every node registered and every ticket it hands out the emulator's) does
the wiring below for servers and clients in this process. By hand (servers in-process or as
subprocesses; the emulator lives in the harness's process, the nodes anywhere on this machine's
loopback):

1. start every node bound to loopback only (``TransportConfig(bind_addr="127.0.0.1:0")``, the local
   profile: no relays, no address lookup), clients included, and collect each one's ``ticket()``
   (a subprocess prints it);
2. ``wan.add_node(ticket, name)`` for each (``pid=`` for one in a subprocess), before it sends
   anything (a datagram from an unknown address is dropped and counted in ``stray_datagrams``); a
   server restarted elsewhere under the same identity: ``wan.readdress(name, new_ticket)``, and
   the tickets handed out for it stay valid;
3. wherever a node would be given another's ticket (client configuration, registry records,
   server-to-server push targets), give ``wan.ticket(name)`` instead: same peer id, the proxy's
   address; the nodes' own tickets must not leak to each other (the emulator cannot see traffic
   that bypasses it);
   A node that announces addresses of its choosing (``shoal serve --announce-addr``) needs no
   ticket swapped: ``proxy = wan.reserve(name)`` opens its proxy first, the node starts announcing
   ``proxy``, and ``wan.attach(name, pid)`` registers and seals it as soon as its process has bound
   its sockets (found by pid, while it starts: what it sends before that is dropped, and QUIC
   resends it); ``wan.remove(name)`` once its process has ended;
4. ``wan.set_link(a, b, LinkConditions(...))`` (both directions) or ``wan.set_direction(a, b, ...)``
   at any time; ``wan.stats(a, b)`` reads a direction's counters, ``wan.totals()`` all of them summed,
   ``wan.lateness()`` how late deliveries left; ``wan.close()`` at the end.

Modules: :mod:`~testkit.wan.emulator` (the proxies, pipes and their thread),
:mod:`~testkit.wan.sealing` (the socket filter), :mod:`~testkit.wan.measuring` (packet capture,
kernel drop counters, request round trips), :mod:`~testkit.wan.swarm` (the swarm harness),
:mod:`~testkit.wan.remote` (the emulator in a process of its own, :class:`RemoteEmulator`, for a
harness whose own process keeps the GIL busy).
"""

from __future__ import annotations

from testkit.wan.addresses import Address, parse_address
from testkit.wan.emulator import DirectionStats, Lateness, LinkConditions, WanEmulator, WanNode
from testkit.wan.measuring import (
    CapturedDatagram,
    LoopbackCapture,
    check_capture_against_counters,
    request_rtts,
    udp_drops,
    wait_quiet,
)
from testkit.wan.remote import RemoteEmulator
from testkit.wan.sealing import seal

__all__ = [
    "Address",
    "CapturedDatagram",
    "DirectionStats",
    "Lateness",
    "LinkConditions",
    "LoopbackCapture",
    "RemoteEmulator",
    "WanEmulator",
    "WanNode",
    "WanSwarm",
    "check_capture_against_counters",
    "parse_address",
    "request_rtts",
    "seal",
    "udp_drops",
    "wait_quiet",
]


def __getattr__(name: str):
    # the swarm harness pulls in shoal's server and client (torch, transformers): only when asked for
    if name == "WanSwarm":
        from testkit.wan.swarm import WanSwarm

        return WanSwarm
    raise AttributeError(f"module 'testkit.wan' has no attribute {name!r}")
