"""The client's error when no server at all hosts some blocks (:func:`missing_servers`): one line
naming the blocks and how to add a server for them, in a swarm or over standalone servers."""

from __future__ import annotations

from shoal.client.remote.listing import missing_servers
from shoal.ids import BlockRange
from shoal.routing import NoRouteError, block_runs


def test_block_runs_are_the_contiguous_runs_of_missing_blocks():
    assert block_runs([2, 3, 7, 9, 10, 11]) == [BlockRange(2, 4), BlockRange(7, 8), BlockRange(9, 12)]
    assert block_runs([0]) == [BlockRange(0, 1)]


def test_in_a_swarm_the_new_server_joins_it():
    error = missing_servers(list(range(15, 30)), swarm=True)
    assert isinstance(error, NoRouteError) and error.missing == list(range(15, 30))
    assert str(error) == (
        "no server hosts blocks 15-29: start one with `shoal serve MODEL --blocks 15:30 --join TICKET`, "
        "or pass the ticket of a server hosting them with another --join"
    )


def test_over_standalone_servers_the_new_servers_ticket_is_passed_too():
    assert str(missing_servers([3, 4, 5], swarm=False)) == (
        "no server hosts blocks 3-5: start one with `shoal serve MODEL --blocks 3:6` and pass its ticket "
        "with another --join"
    )


def test_every_gap_is_named_and_peers_that_did_not_answer_are_counted():
    assert str(missing_servers([2, 3, 7], swarm=False, silent=1)) == (
        "no server hosts blocks 2-3, 7 (1 of the given peers did not answer): start one with "
        "`shoal serve MODEL --blocks 2:4` (and one with --blocks 7:8) and pass its ticket with another --join"
    )
