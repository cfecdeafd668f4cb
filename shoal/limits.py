"""Every bound a node keeps against its peers, in one frozen value with a flag per limit.

A swarm is made of machines owned by strangers, so nothing a peer sends may make a node hold
unbounded memory, streams, work or cache. Each limit is named here once, with its default and its
``shoal`` flag (``--max-streams-per-peer`` for :attr:`Limits.max_streams_per_peer`, and so on);
:mod:`shoal.wire` reads the message limits, :mod:`shoal.transport` the per-peer and per-node ones,
:mod:`shoal.server` the work and cache ones. ``scope`` says which commands carry the flag: ``node``
limits guard every node (servers, clients, the gateway), ``server`` ones only a server.

Import-light (no torch, no transport): the command line builds its flags from these fields.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

K = TypeVar("K")

MiB = 1 << 20
MAX_FRAME_PAYLOAD = 4 * MiB  # data bytes per DATA frame; a protocol constant (shoal.wire re-exports it)


def _limit(default: Any, scope: str, help: str) -> Any:
    return field(default=default, metadata={"scope": scope, "help": help})


@dataclass(frozen=True)
class Limits:
    """What a node accepts from any one peer, and from all of them together."""

    # ---- messages (every node) -----------------------------------------------------------------
    max_message_bytes: int = _limit(256 * MiB, "node", "bytes of one message's tensors")
    max_header_bytes: int = _limit(64 * 1024, "node", "bytes of one message header")
    max_tensors: int = _limit(64, "node", "tensors in one message")
    max_ping_bytes: int = _limit(16 * MiB, "node", "bytes of one ping (an echo for measuring throughput)")
    max_gossip_bytes: int = _limit(64 * MiB, "node", "bytes of one gossip message (swarm records)")
    data_timeout: float = _limit(10.0, "node", "seconds a message that started may wait for its next bytes")
    # ---- per peer and per node (every node) ------------------------------------------------------
    max_inflight_bytes_per_peer: int = _limit(
        512 * MiB, "node", "bytes of unfinished messages one peer may have this node hold"
    )
    max_inflight_bytes: int = _limit(2048 * MiB, "node", "bytes of unfinished messages of all peers together")
    max_connections_per_peer: int = _limit(16, "node", "connections one peer may hold open to this node")
    max_streams_per_peer: int = _limit(256, "node", "streams one peer may have open to this node at once")
    # ---- work and cache (servers) ----------------------------------------------------------------
    max_forward_positions: int = _limit(
        16384, "server", "positions (rows x tokens) of one stateless forward; longer ones are refused"
    )
    max_unchunked_row_tokens: int = _limit(
        2048, "server", "tokens of one row of a pass that cannot run in chunks (a backward, deep prompts)"
    )
    max_sessions_per_peer: int = _limit(16, "server", "inference sessions one peer may hold open at once")
    max_unstepped_rows_per_peer: int = _limit(64, "server", "rows of one peer's sessions that have not stepped yet")
    reclaim_idle_after: float = _limit(
        10.0,
        "server",
        "seconds without a message after which a session's unused KV reservation goes to a "
        "session that needs pages (one that never stepped gives it to another peer at once)",
    )
    first_step_timeout: float = _limit(
        60.0, "server", "seconds an opened session may wait for its first step before it is closed"
    )
    session_timeout: float = _limit(300.0, "server", "seconds a session may go without a message before it is freed")

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"limit {item.name} must be positive, got {value!r}")
        if self.max_message_bytes > self.max_inflight_bytes_per_peer:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) must not exceed max_inflight_bytes_per_peer "
                f"({self.max_inflight_bytes_per_peer}): such a message could never arrive"
            )
        if self.max_inflight_bytes_per_peer > self.max_inflight_bytes:
            raise ValueError("max_inflight_bytes_per_peer must not exceed max_inflight_bytes")

    @functools.cached_property
    def max_frame_bytes(self) -> int:
        return max(MAX_FRAME_PAYLOAD, self.max_header_bytes) + 1

    @functools.cached_property
    def kind_max_bytes(self) -> dict[str, int]:
        """Tensor bytes a message of each kind may carry, when less than ``max_message_bytes``:
        kinds that carry no tensors take none."""
        return {
            "hello": 0,
            "info": 0,
            "close": 0,
            "manifest": 0,
            "chunk": 0,
            "held": 0,
            "error": 0,
            "migrate": 0,
            "ping": min(self.max_ping_bytes, self.max_message_bytes),
            "gossip": min(self.max_gossip_bytes, self.max_message_bytes),
        }

    def max_bytes_of(self, kind: str) -> int:
        return self.kind_max_bytes.get(kind, self.max_message_bytes)


KiB = 1 << 10


@dataclass(frozen=True)
class RegistryLimits:
    """What a peer's swarm registry (:class:`shoal.swarm.table.RecordTable`, fed by
    :class:`shoal.swarm.gossip.Gossiper`) holds and takes, whoever signs or sends the records.

    Keys are free (an ed25519 key pair per record), so no cap may be "per key" alone: the table
    caps each signer, each model and the whole, and past a cap refuses what is new rather than
    evicting what it holds (:mod:`shoal.swarm.table` writes the rule down). Senders are peers
    that reach us: each has a budget of records and bytes, and only records we asked a sender
    for are merged beyond a handful (:mod:`shoal.swarm.quota`). Swarm-wide conventions, not
    flags: a peer whose caps differ refuses records its peers keep.
    """

    # ---- the table -----------------------------------------------------------------------------
    #: records of every kind: a 10,000-server swarm of one model (the scale the registry is built
    #: for, ``bench/registry.py``) with 1.6x headroom, plus room for models and verdicts.
    max_records: int = 32768
    #: their bytes as signed: 4 KiB on average for 16,384 records (an honest server record is
    #: about 1.2 KiB), so a table of record-size floods still fits in a few hundred MB decoded.
    max_table_bytes: int = 64 * MiB
    #: distinct model names that records (model or server) name: a swarm serves a few models;
    #: made-up names must not multiply the per-model cap.
    max_models: int = 64
    #: server records of one model: 10,000 servers with 1.6x headroom.
    max_servers_per_model: int = 16384
    #: model records one key signs: a server vouches for the one model it serves; 2 lets a
    #: publisher define a model and its successor.
    max_models_per_signer: int = 2
    #: verdicts one key signs (one per accused): a judge convicts a few liars at a time.
    max_verdicts_per_signer: int = 16
    #: seconds a server or model record may claim to live. Servers re-sign every 60 s and their
    #: records live 180 s by default (``--refresh-period``, ``--expiry``); a crashed server lingers
    #: for its expiry, and a record signed once and flooded lives this long without its signer: 10
    #: minutes bounds both. Verdicts live 30 minutes (``VERDICT_LIFETIME``; the table's
    #: ``max_lifetime`` bounds them).
    max_announce_lifetime: float = 600.0
    # ---- each sender ---------------------------------------------------------------------------
    #: records a sender may hand us per second, sustained (asked for, or not): at 10,000 servers a
    #: peer learns 167 records/s from a few dozen senders; a backlog beyond the burst waits for
    #: the next round, or comes in our own syncs' replies (not charged).
    sender_records_per_s: float = 64.0
    #: records a sender may hand us at once (what we ask it for in one reply at most).
    sender_records_burst: int = 1024
    #: request bytes a sender may send per second, sustained: syncs (16 bytes per record held;
    #: 160 KiB at 10,000 servers), offers and pushes of the records asked for.
    sender_bytes_per_s: int = 512 * KiB
    #: request bytes at once: two syncs of a full table (``MAX_SYNC`` entries) fit.
    sender_bytes_burst: int = 4 * MiB
    #: records of one push that we did not ask the sender for that are still merged (a leaving
    #: server pushes its one offline record unasked); the rest of the push is dropped undecoded.
    max_unasked_per_push: int = 4
    #: senders whose budgets are remembered; past it the least recently heard is forgotten (it
    #: starts again with a full budget: many senders are the table caps' business, not these).
    max_senders: int = 4096
    #: keys asked for and not yet pushed, of all senders together (8-byte ids, about 100 bytes
    #: each held); an ask lapses after ``ask_timeout``, and past this many the sender holding the
    #: most open asks loses them.
    max_asked: int = 65536
    #: seconds an ask stays open: a push answers an offer within a round trip or two; a later push
    #: counts as unasked (its records also come through other peers' offers and syncs).
    ask_timeout: float = 15.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"registry limit {item.name} must be positive, got {value!r}")
        if self.max_servers_per_model > self.max_records:
            raise ValueError("max_servers_per_model must not exceed max_records")


def count_down(counter: Counter[K], key: K, n: int) -> None:
    """Take ``n`` off ``key``'s count of what it holds against a limit; a count that reaches 0 is
    dropped (a table keyed by peer must not keep every peer ever seen)."""
    left = counter[key] - n
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)


def flag_of(name: str) -> str:
    """The command-line flag of limit ``name``."""
    return "--" + name.replace("_", "-")


def limit_fields(scope: str | None = None) -> list[Any]:
    """The limits' dataclass fields (of one ``scope``, or all), in declaration order."""
    return [f for f in fields(Limits) if scope is None or f.metadata["scope"] == scope]


__all__ = ["MAX_FRAME_PAYLOAD", "KiB", "Limits", "MiB", "RegistryLimits", "count_down", "flag_of", "limit_fields"]
