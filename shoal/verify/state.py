"""The cache-state chain a receipt commits to: which inputs a session's cache holds at positions ``[0, p)``.

A step's receipt (:class:`~shoal.wire.schema.Receipt`) says which inputs the step itself decoded, but not
what the cache it attended to held. After a rollback the same positions are computed again from other
inputs, so receipts of one session taken from before and after a rollback are each genuine and yet do
not describe one computation: a client could join a stale receipt of ``[0, 4)`` over inputs X to a
later step that ran on a cache holding Y, and have judges recompute the later step from X, which it
never saw (it then looks wrong: an honest server framed). So every receipt signs ``state``, the chain
digest of positions ``[0, position)`` as its cache held them when the step ran:

    c_0 = sha256(b"shoal/state/1\\0")[:16]
    c_{i+1} = sha256(c_i + hidden[:, i] + position_ids[:, i] + mask[:, i])[:16]

the raw bytes of position ``i``'s hidden row of every batch row (``[B, H]``, row-major, in the dtype the
server decoded), its position id per row (int64, little-endian) and its mask column (one byte per row;
ones when no mask came). A server keeps ``c_0 .. c_length`` per session (16 bytes a position: truncated
on rollback, extended by every step); a judge recomputes the chain from the evidence's tensors, so a
receipt whose ``state`` differs from the chain at its position was signed over another cache than the
evidence shows. A stateless forward's state is ``c_0``. The client keeps the same chain per hop, of what
it sent that hop's session (:mod:`shoal.client.remote.driver`), and refuses a receipt whose ``state`` is not
it: a liar signing any other state would make every piece of evidence against it look forged to judges.
Only a server with a key (one that signs receipts) keeps a chain.

numpy only (views and per-position copies of ``[B, H]``), no torch op: servers and clients hash on their
event loops, and a torch op large enough to go parallel would give that thread an OpenMP pool of its own.
sha256 hashes ~1.3 GB/s here (hardware): a decode step's update costs about 13 us (576 wide) to 21 us
(4096 wide, fp32), a 512-position prefill 1.4 ms (576) to 5.5 ms (4096, fp32); a step larger than
:data:`HASH_INLINE_BYTES` (such a prefill) is hashed on a worker thread (:func:`step_states`).
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
from torch import Tensor

from shoal.wire.tensors import as_numpy

STATE_CONTEXT = b"shoal/state/1\0"
STATE_BYTES = 16
#: the state of an empty cache (position 0, and every stateless forward)
EMPTY_STATE = hashlib.sha256(STATE_CONTEXT).digest()[:STATE_BYTES]
#: a position whose cache contents the server lost track of (a step failed midway): no chain from
#: position 0 reaches it, so evidence over it is rejected as forged rather than judged
UNKNOWN_STATE = bytes(STATE_BYTES)
#: a step's hidden states up to this size are hashed on the event loop (a decode step: microseconds); larger
#: ones (a prefill) on a worker thread (hashlib releases the GIL)
HASH_INLINE_BYTES = 1 << 20


def chain_states(previous: bytes, hidden: Tensor, position_ids: Tensor, mask_columns: Tensor | None) -> bytes:
    """The chain digests ``c_{k+1} .. c_{k+n}`` (``n * 16`` bytes, concatenated) of ``n`` positions
    following ``previous`` (``c_k``): ``hidden`` ``[B, n, H]``, ``position_ids`` ``[B, n]`` and
    ``mask_columns`` ``[B, n]`` (bool; None: all ones) are those positions' inputs, CPU tensors. The one
    function servers and judges both use, so they agree byte for byte."""
    if len(previous) != STATE_BYTES:
        raise ValueError(f"a chain digest is {STATE_BYTES} bytes, got {len(previous)}")
    rows = as_numpy(hidden)
    batch, n = rows.shape[:2]
    positions = np.ascontiguousarray(as_numpy(position_ids).astype("<i8", copy=False).T)  # [n, B]
    if mask_columns is None:
        masks = np.ones((n, batch), dtype=np.uint8)
    else:
        masks = np.ascontiguousarray(as_numpy(mask_columns).astype(np.uint8, copy=False).T)  # [n, B]
    if positions.shape != (n, batch) or masks.shape != (n, batch):
        raise ValueError(f"position_ids and mask columns must be [{batch}, {n}]")
    out = bytearray()
    state = previous
    for i in range(n):
        hasher = hashlib.sha256(state)
        hasher.update(np.ascontiguousarray(rows[:, i]))
        hasher.update(positions[i])
        hasher.update(masks[i])
        state = hasher.digest()[:STATE_BYTES]
        out += state
    return bytes(out)


class StateChain:
    """A session's chain ``c_0 .. c_length`` (16 bytes a position), as its server keeps it. Positions
    past the chain (after :meth:`forget`) have :data:`UNKNOWN_STATE`, and so does what follows them."""

    def __init__(self) -> None:
        self._digests = bytearray(EMPTY_STATE)

    def __len__(self) -> int:
        """How many positions the chain knows."""
        return len(self._digests) // STATE_BYTES - 1

    def at(self, position: int) -> bytes:
        """``c_position``: the state of positions ``[0, position)``."""
        if position < 0:
            raise IndexError(f"negative position {position}")
        if position > len(self):
            return UNKNOWN_STATE
        return bytes(self._digests[position * STATE_BYTES : (position + 1) * STATE_BYTES])

    def next_states(self, position: int, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> bytes:
        """The digests a step at ``position`` would append (``hidden`` ``[B, n, H]``, ``position_ids``
        ``[B, n]``, ``mask`` the step's ``[B, position + n]`` or None); pure, see :meth:`commit`."""
        columns = None if mask is None else mask[:, position:]
        return chain_states(self.at(position), hidden, position_ids, columns)

    def commit(self, position: int, states: bytes) -> None:
        """A step at ``position`` ran: drop what a rollback discarded, append its positions' ``states``."""
        if position > len(self):
            self._digests += UNKNOWN_STATE * (position - len(self))
        del self._digests[(position + 1) * STATE_BYTES :]
        self._digests += states

    def digests(self, end: int) -> bytes:
        """``c_1 .. c_end`` concatenated (what a migrated session's replacement commits at 0)."""
        if not 0 <= end <= len(self):
            raise IndexError(f"the chain knows {len(self)} positions, not {end}")
        return bytes(self._digests[STATE_BYTES : (end + 1) * STATE_BYTES])

    def forget(self, position: int) -> None:
        """The cache from ``position`` on is in no state a chain names (a step there failed midway)."""
        del self._digests[(position + 1) * STATE_BYTES :]


async def step_states(
    chain: StateChain, position: int, hidden: Tensor, position_ids: Tensor, mask: Tensor | None
) -> bytes:
    """:meth:`StateChain.next_states` of a step, off the event loop when it is large (see
    :data:`HASH_INLINE_BYTES`); what servers and clients both call before :meth:`StateChain.commit`."""
    previous = chain.at(position)  # read here: the chain may change while a worker hashes
    columns = None if mask is None else mask[:, position:]
    if hidden.numel() * hidden.element_size() <= HASH_INLINE_BYTES:
        return chain_states(previous, hidden, position_ids, columns)
    return await asyncio.to_thread(chain_states, previous, hidden, position_ids, columns)


def states_of(hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> bytes:
    """``c_0 .. c_P`` of a whole history from position 0 (``[B, P, H]``, ``[B, P]``, ``[B, P]`` or None):
    what a judge checks each receipt's ``state`` against (``c_p`` at bytes ``[16 p, 16 p + 16)``)."""
    return EMPTY_STATE + chain_states(EMPTY_STATE, hidden, position_ids, mask)


__all__ = [
    "EMPTY_STATE",
    "HASH_INLINE_BYTES",
    "STATE_BYTES",
    "STATE_CONTEXT",
    "UNKNOWN_STATE",
    "StateChain",
    "chain_states",
    "states_of",
    "step_states",
]
