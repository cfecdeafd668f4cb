"""Block servers whose KV migration (:mod:`shoal.server.migrate`) goes wrong on purpose, made from honest
ones at existing seams (no hook in ``shoal/``); each is a :data:`~shoal.launch.inprocess.Prepare`:

* :func:`refusing`: a replacement that refuses every session's pages (as one out of KV memory does);
* :func:`tampering`: a draining server whose pages go out with another chain digest than its
  session's (the last position's digest flipped), through the node seam its pushes use too.

    swarm.add(span, refusing)   # or tampering
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.errors import BusyError
from shoal.server.handler import BlockServer
from shoal.server.migrate import Migrations
from shoal.wire import Message


class _Refusing(Migrations):
    async def receive(self, message: Message, peer_id: str) -> Message:
        self.server.counters.migrations_failed += 1
        raise BusyError("no room for the pages (refused on purpose)")


def refusing(server: BlockServer) -> BlockServer:
    """``server``, refusing every ``pages`` it is sent."""
    server.migrations = _Refusing(server)
    return server


def _flipped(message: Message) -> Message:
    keys, values, chain = message.tensors
    chain = chain.clone()
    chain[-1] ^= 0xFF  # c_position: what the replacement reports to the client
    return Message(message.kind, message.id, message.meta, [keys, values, chain], message.codecs)


class _TamperingStream:
    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send(self, message: Message) -> None:
        await self._inner.send(_flipped(message) if message.kind == "pages" else message)

    async def request(self, message: Message, timeout: float | None = None) -> Message:
        return await self._inner.request(_flipped(message) if message.kind == "pages" else message, timeout)


class _TamperingNode:
    def __init__(self, inner: Any):
        self._inner = inner
        self.tampered = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def open_stream(self, *args: Any, **kwargs: Any) -> _TamperingStream:
        return _TamperingStream(await self._inner.open_stream(*args, **kwargs))


def tampering(server: BlockServer) -> BlockServer:
    """``server``, sending every session's pages with a wrong last chain digest."""
    if server.pusher.node is not None:
        server.pusher = server.pusher.via(_TamperingNode(server.pusher.node))
    return server


__all__ = ["refusing", "tampering"]

_ = torch  # the tensors altered are torch's (clone, xor)
