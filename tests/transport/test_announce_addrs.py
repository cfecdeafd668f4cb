"""``--announce-addr``: a peer announces given addresses (a public address forwarded to it, a proxy
in front of it) instead of its bound ones, in its ticket and in its swarm records."""

from __future__ import annotations

import time

import pytest

from shoal.cli.main import build_parser
from shoal.errors import UsageError
from shoal.ids import BlockRange, socket_address
from shoal.server.announce import Announcement
from shoal.server.hosted import beside
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.records import decode
from shoal.transport import Node, TransportConfig
from shoal.transport.identity import generate_key
from tests.helpers.aio import run

pytestmark = pytest.mark.timeout(60)

ANNOUNCED = ("203.0.113.7:7000", "[2001:db8::1]:7001")


@pytest.mark.parametrize(
    ("text", "normal"),
    [("127.0.0.2:5000", "127.0.0.2:5000"), (" [::1]:05 ", "[::1]:5"), ("[2001:DB8::0:1]:80", "[2001:db8::1]:80")],
)
def test_an_announced_address_is_normalised(text, normal):
    assert socket_address(text) == normal


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("example.org:80", "not an IP address"),
        ("127.0.0.1", "IP:PORT"),
        (":80", "IP:PORT"),
        ("127.0.0.1:0", "within 1..65535"),
        ("127.0.0.1:70000", "within 1..65535"),
        ("127.0.0.1:http", "within 1..65535"),
        ("::1:80", "IPv6 address goes in brackets"),
    ],
)
def test_a_bad_announced_address_is_refused_with_a_clear_error(text, says):
    with pytest.raises(ValueError, match=says):
        socket_address(text)
    with pytest.raises(ValueError, match=says):
        TransportConfig(announce_addrs=(text,))
    with pytest.raises(UsageError, match=rf"--announce-addr: .*{says}"):
        build_parser().parse_args(["serve", "m", "--blocks", "0:1", "--announce-addr", text])


def test_serve_and_api_flags_reach_the_transport_normalised():
    from shoal.cli.args import transport_config

    args = build_parser().parse_args(
        ["serve", "m", "--blocks", "0:1", "--announce-addr", "[2001:DB8::1]:7001", "--announce-addr", "1.2.3.4:9"]
    )
    assert transport_config(args, "127.0.0.1:0").announce_addrs == ("[2001:db8::1]:7001", "1.2.3.4:9")
    assert transport_config(build_parser().parse_args(["serve", "m"]), "127.0.0.1:0").announce_addrs == ()
    api = build_parser().parse_args(
        ["api", "m", "--join", "x", "--serve-blocks", "0:1", "--announce-addr", "1.2.3.4:9"]
    )
    assert api.announce_addr == ["1.2.3.4:9"]


def test_the_api_refuses_an_announced_address_without_a_span_to_announce():
    args = build_parser().parse_args(["api", "m", "--join", "x", "--announce-addr", "1.2.3.4:9"])
    with pytest.raises(UsageError, match="--announce-addr goes with --serve-blocks"):
        args.func(args)


def test_only_the_span_node_beside_a_client_announces():
    config = TransportConfig(bind_addr="127.0.0.1:7000", announce_addrs=ANNOUNCED)
    assert beside(config).announce_addrs == () and beside(config).bind_addr == "127.0.0.1:0"


def test_the_ticket_and_the_server_record_carry_exactly_the_announced_addresses():
    async def go():
        key = generate_key()
        config = TransportConfig(bind_addr="127.0.0.1:0", announce_addrs=ANNOUNCED)
        async with (
            await Node.start(config, secret_key=key) as node,
            await Node.start(TransportConfig("local", "127.0.0.1:0")) as plain,
        ):
            ticket = node.ticket("ab" * 8)
            announcement = Announcement(
                node, key, "ab" * 8, "tiny", BlockRange(0, 2), ["00" * 32] * 2, 1.0, GossipConfig()
            )
            record = decode(announcement.server_record(time.time()).data).record
            return ticket, record, plain.ticket()

    ticket, record, plain = run(go(), 30)
    assert ticket.addrs == ANNOUNCED and ticket.swarm_id == "ab" * 8
    assert record.addrs == ANNOUNCED and record.peer == ticket.peer_id
    assert plain.addrs and all(a.startswith(("127.0.0.1:", "[::1]:")) for a in plain.addrs)  # bound ones by default
