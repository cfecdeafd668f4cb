"""The network seams of a faulty server (:mod:`testkit.faulty`): the streams it answers on delay,
drop or garble replies (:class:`FaultyStream`), and the node it pushes through hands out streams
that push another tensor than the reply (:class:`FaultyNode`: equivocation)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from shoal.wire import Message
from testkit.faults import Alteration

if TYPE_CHECKING:
    from testkit.faulty import FaultState


class _Wrapped:
    """Stands in for ``inner`` (a stream or a node): what a subclass does not override goes to it."""

    def __init__(self, inner: Any, state: FaultState):
        self._inner = inner
        self._state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FaultyStream(_Wrapped):
    """A stream the server answers on: replies are delayed, or dropped, as the faults say."""

    async def send(self, message: Message) -> None:
        state = self._state
        if state.crashed:
            return
        issued = state.find(message.tensors[0], remove=True) if message.tensors else None
        call = None if issued is None else issued.call
        step, session = (None, None) if call is None else (call.step, call.session)
        if issued is not None and issued.drop:
            state.record.add(Alteration(fault="drop_reply", step=step, session=session, positions=call.positions,
                                        detail=f"reply {message.id} dropped"))  # fmt: skip
            return
        if issued is not None and issued.garbage is not None:
            state.record.add(Alteration(fault="malformed", step=step, session=session, positions=call.positions,
                                        detail=f"reply {message.id} sent as garbage"))  # fmt: skip
            await self._inner.send_raw(issued.garbage)
            return
        if state.delay:
            state.record.add(Alteration(fault="reply_delay", step=step, session=session,
                                        detail=f"{message.kind} {message.id} delayed {state.delay:g} s"))  # fmt: skip
            await asyncio.sleep(state.delay)
            if state.crashed:
                return
        await self._inner.send(message)


class _PushStream(_Wrapped):
    """A stream to the next server of a chain: an equivocating server swaps the pushed output."""

    async def send(self, message: Message) -> None:
        state = self._state
        if state.crashed:
            return
        issued = state.find(message.tensors[0]) if message.kind == "push" and message.tensors else None
        if issued is not None and issued.push is not None:
            call = issued.call
            state.record.add(Alteration(fault="equivocate", step=call.step, session=call.session,
                                        positions=call.positions, size=issued.push_size,
                                        detail="pushed another output than the reply"))  # fmt: skip
            message = Message(message.kind, message.id, message.meta, [issued.push, *message.tensors[1:]])
        await self._inner.send(message)


class FaultyNode(_Wrapped):
    """The node a faulty server pushes through: every stream it opens is a :class:`_PushStream`."""

    async def open_stream(self, *args: Any, **kwargs: Any) -> _PushStream:
        return _PushStream(await self._inner.open_stream(*args, **kwargs), self._state)
