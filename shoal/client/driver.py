"""Drives one inference step through a chain of hops: pushed server to server where both ends can,
sent hop by hop by the client where not.

The step goes to the chain's first server with the rest of the push segment (``push``); each server
of the segment hands its output to the next and also answers the client, which keeps every hop's
output (the session's replay history needs them). A segment ends where a server, or the one after
it, did not announce the :data:`~shoal.wire.schema.PUSH` capability, where pushing is off, or where
a push did not get through (the reply says ``pushed: false``, or a live server's pushed reply never
comes): the client sends the next hop its step itself.

Codecs (:mod:`shoal.wire.codecs`): the client's ``compression`` goes to every hop whose server
announced it (the others get raw), and a server answers and pushes in the codec it was sent, so a
push segment is also one where every server uses the same codec. The client sends what the server
will decode (the codec's round trip of its input) and keeps exactly that in the step's inputs: the
replay history holds what each server computed on.

A late reply (an adaptive deadline from the latencies seen so far) makes the client ping the
server: a live one gets more time, up to the request deadline; a dead one fails the hop
(:class:`HopFailed`). Every decoded token comes through here: the push routes are computed once
per chain, not per step.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence

from torch import Tensor

from shoal.client.feedback import RouteFeedback
from shoal.client.history import step_inputs
from shoal.client.hops import Hop
from shoal.errors import ClosedError, ShoalError, remote_error
from shoal.routing import ServerSpan
from shoal.wire import Codec, Message
from shoal.wire.codecs import carried
from shoal.wire.schema import PUSH, PushHop, StepReply, StepRequest
from shoal.wire.tensors import roundtrip

MIN_DEADLINE = 0.25  # seconds before a late reply makes the client check that the server lives
DEADLINE_FACTOR = 4.0  # ... or this many times the expected reply time, if longer


class HopFailed(Exception):
    """Hop ``index`` of the chain failed this step (its server is dead, broke the stream, or erred)."""

    def __init__(self, index: int, cause: BaseException):
        super().__init__(f"hop {index} failed: {cause}")
        self.index = index
        self.cause = cause


class _PushLost(Exception):
    """A pushed step's reply is late although its server answers pings."""


def codec_for(span: ServerSpan, compression: Codec) -> Codec:
    """The codec of the hidden states sent to ``span``'s server: ``compression`` if it announced
    it, else raw."""
    return compression if span.supports(compression.capability) else Codec.RAW


def push_reach(spans: Sequence[ServerSpan], enabled: bool = True, codecs: Sequence[Codec] | None = None) -> list[int]:
    """For each hop ``k``, the last hop that a step sent to ``k`` reaches by push (``k``: none).
    Server ``k`` pushes to ``k + 1`` only if both announced :data:`PUSH` and use the same codec
    (``codecs``, one per hop; None: all raw); a segment of servers that all do is pushed through
    end to end."""
    reach = list(range(len(spans)))
    if enabled:
        for k in range(len(spans) - 2, -1, -1):
            same = codecs is None or codecs[k] == codecs[k + 1]
            if same and spans[k].supports(PUSH) and spans[k + 1].supports(PUSH):
                reach[k] = reach[k + 1]
    return reach


def push_routes(
    hops: Sequence[Hop], enabled: bool = True, codecs: Sequence[Codec] | None = None
) -> list[tuple[PushHop, ...]]:
    """``push`` of the step sent to each hop: the hops it reaches by push after itself."""
    reach = push_reach([hop.span for hop in hops], enabled, codecs)
    return [tuple(hop.push_hop for hop in hops[k + 1 : last + 1]) for k, last in enumerate(reach)]


class ChainDriver:
    """Owns the session's chain of hops (installed whole, see :meth:`install`) and runs steps
    through it; what it learns of each server goes to ``feedback``. ``compression``: the codec of
    the hidden states, on every hop whose server announced it."""

    def __init__(
        self, feedback: RouteFeedback, request_deadline: float, *, push: bool = True, compression: Codec = Codec.RAW
    ):
        self.feedback = feedback
        self.request_deadline = request_deadline
        self.push = push
        self.compression = compression
        self.hops: tuple[Hop, ...] = ()
        self.starts: frozenset[int] = frozenset()  # first block of every hop: the chain's boundaries
        self.codecs: tuple[Codec, ...] = ()  # of each hop's hidden states
        self._routes: list[tuple[PushHop, ...]] = []
        self._step_id = 0

    def install(self, hops: Sequence[Hop]) -> None:
        self.hops = tuple(hops)
        self.starts = frozenset(hop.span.start for hop in self.hops)
        self.codecs = tuple(codec_for(hop.span, self.compression) for hop in self.hops)
        self._routes = push_routes(self.hops, self.push, self.codecs)

    @property
    def chain(self) -> list[ServerSpan]:
        return [hop.span for hop in self.hops]

    def next_id(self) -> int:
        """Step ids grow over the whole session (a server drops pushes older than its last step)."""
        self._step_id += 1
        return self._step_id

    def leaving(self) -> int | None:
        """Index of the first hop whose server said it is draining, if any."""
        for index, hop in enumerate(self.hops):
            if hop.draining:
                return index
        return None

    def keep_serving(self, hop: Hop) -> None:
        """No one can take over from draining ``hop`` yet: use it while it serves (its next reply
        raises the flag again)."""
        hop.draining = False

    async def run(
        self,
        index: int,
        inputs: MutableMapping[int, Tensor],
        position_ids: Tensor,
        mask: Tensor | None,
        position: int,
    ) -> None:
        """Run the step from hop ``index`` to the end of the chain. ``inputs`` maps a block to this
        step's hidden states entering it: it must hold the first block of hop ``index`` and gets
        the output of every hop (at the hop's end block); a hop's input there becomes what its
        server decodes (the codec's round trip). Raises :class:`HopFailed`."""
        hops, routes, feedback = self.hops, self._routes, self.feedback
        n = position_ids.shape[1]
        count = len(hops)
        k = index
        while k < count:
            hop = hops[k]
            step_id = self.next_id()
            push = routes[k]
            request = StepRequest(session=hop.session, position=position, push=push)
            hidden = inputs[hop.span.start]
            codec = carried(self.codecs[k], hidden.dtype)
            hidden = inputs[hop.span.start] = roundtrip(hidden, codec)  # raises if the codec cannot carry it
            tensors = step_inputs(hidden, position_ids, mask)
            try:
                await hop.stream.send(Message("step", step_id, request, tensors, (codec,)))
            except ShoalError as exc:
                raise HopFailed(k, exc) from exc
            last = k + len(push)
            sent_to = k
            while True:  # replies of hop k, then of the hops it pushed to
                hop = hops[k]
                started = time.perf_counter()
                try:
                    message = await self._reply(hop, step_id, n, pushed=k > sent_to)
                    reply = message.reply(StepReply)
                except _PushLost:
                    break  # the server lives but the push never reached it: send it the step ourselves
                except (ShoalError, TimeoutError) as exc:
                    raise HopFailed(k, exc) from exc
                peer = hop.span.peer_id
                if n == 1:
                    feedback.observed_step(peer, (time.perf_counter() - started) * 1e3)
                feedback.succeeded(peer)
                hop.draining = reply.draining
                inputs[hop.span.end] = message.tensors[0]
                k += 1
                if k > last or reply.pushed is False:
                    break

    async def replay(self, hop: Hop, tensors: list[Tensor], n: int) -> Tensor:
        """One step over positions ``[0, n)`` on ``hop`` (not pushed on): its output. Raw, so the
        new server computes on exactly the history (whatever codecs it was made with)."""
        step_id = self.next_id()
        await hop.stream.send(Message("step", step_id, StepRequest(session=hop.session, position=0), tensors))
        message = await self._reply(hop, step_id, n)
        message.reply(StepReply)
        return message.tensors[0]

    async def _reply(self, hop: Hop, step_id: int, n: int, pushed: bool = False) -> Message:
        """The reply to step ``step_id`` from ``hop``. Late: ping the server; a live one gets more
        time (up to the request deadline), a dead one fails the hop. A live server late with a
        ``pushed`` step may never have received it: :class:`_PushLost` (the caller resends)."""
        estimate = self.feedback.expected_step_ms(hop.span) / 1e3
        deadline = max(MIN_DEADLINE, DEADLINE_FACTOR * estimate) * max(1.0, n / 8)
        give_up = time.monotonic() + self.request_deadline * max(1.0, n / 256)
        while True:
            message = await hop.receive(deadline)
            if message is None:
                if time.monotonic() > give_up:
                    raise TimeoutError(f"no reply from {hop.span.peer_id[:10]} within the request deadline")
                if not await self.feedback.alive(hop.span):
                    raise ClosedError(f"server {hop.span.peer_id[:10]} stopped answering")
                if pushed:
                    raise _PushLost()
                continue
            if message.id != step_id:
                continue  # a late reply to an earlier (abandoned) step
            if message.kind == "error":
                raise remote_error(*message.error_info())
            return message


__all__ = ["DEADLINE_FACTOR", "MIN_DEADLINE", "ChainDriver", "HopFailed", "codec_for", "push_reach", "push_routes"]
