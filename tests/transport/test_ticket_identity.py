"""Tickets, identities and network profiles (no sockets)."""

from __future__ import annotations

import os
import stat

import pytest

from shoal.errors import IdentityError, TicketError
from shoal.transport import (
    EndpointPlan,
    NetworkProfile,
    Ticket,
    TransportConfig,
    endpoint_options,
    endpoint_plan,
    load_or_create_identity,
)

pytestmark = pytest.mark.timeout(30)

PEER = "ab" * 32


def test_ticket_round_trip_with_and_without_swarm():
    for ticket in (
        Ticket(PEER, ("127.0.0.1:4000", "[::1]:4001")),
        Ticket(PEER, (), "https://relay.example/", "swarm-1"),
    ):
        text = str(ticket)
        assert text.startswith("shoal1") and text == text.strip() and " " not in text
        assert Ticket.parse(text) == ticket
        assert Ticket.parse(f"  {text}\n") == ticket


@pytest.mark.parametrize("text", ["", "endpointabc", "shoal1", "shoal1!!!!", "shoal1" + "a" * 5000, str(Ticket("xyz"))])
def test_damaged_tickets_give_a_clear_error(text):
    with pytest.raises(TicketError):
        Ticket.parse(text)


def test_identity_persists_with_mode_0600(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    key = load_or_create_identity(path)
    assert len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_identity(path) == key


@pytest.mark.parametrize("content", [b"", b"short", os.urandom(33)])
def test_corrupt_identity_is_an_error_not_a_new_key(tmp_path, content):
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match="corrupt"):
        load_or_create_identity(path)
    assert path.read_bytes() == content  # never overwritten


def test_network_profiles_produce_the_expected_endpoint_options():
    key = os.urandom(32)
    local = endpoint_plan(TransportConfig(bind_addr="127.0.0.1:0"), [b"shoal/x/1"])
    assert local == EndpointPlan("minimal", "disabled", "127.0.0.1:0", (b"shoal/x/1",))
    internet = endpoint_plan(TransportConfig(profile=NetworkProfile.INTERNET), [b"shoal/x/1"])
    assert internet == EndpointPlan("n0", "default", None, (b"shoal/x/1",))
    options = endpoint_options(local, key)
    assert options.relay_mode is not None and options.bind_addr == "127.0.0.1:0" and options.secret_key == key
    options = endpoint_options(internet, key)
    assert options.relay_mode is None and options.bind_addr is None and options.preset is not None
    assert NetworkProfile("internet") is NetworkProfile.INTERNET
