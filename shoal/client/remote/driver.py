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

Receipts (:mod:`shoal.verify.receipts`): every hop whose server announced
:data:`~shoal.wire.schema.RECEIPTS` is asked for a signed receipt of each step (a push segment is
all such servers or none, so a pushing server asks on only where the next one knows the field), and
each is checked: signed by the hop's peer id, the blocks, session, positions and step asked, the
inputs the client sent (for a pushed hop: the previous hop's reply as the client received it, which
catches a server that pushed one tensor and answered another), the output received, the cache state
(the driver keeps, per hop, the chain of what that hop's session was sent, :mod:`shoal.verify.state`:
truncated at each step's position and extended with its inputs once its receipt checks) and, after the
hop's first receipt, the same ``compute``. A hop is a session: a new one (a replacement, an auditor)
starts from the empty chain, and a replay to it (:meth:`ChainDriver.replay`) is one of its steps. A
failed check bans the server held responsible for an hour and fails its hop (:class:`HopFailed`: the
session re-routes around it, as around a crash). Keeping the chain costs one sha256 pass over each
step's inputs (what the input digest also hashes): about 20 us a decode step on the event loop; a step
over 1 MiB (a prefill) is hashed on a worker thread.

A late reply (an adaptive deadline from the latencies seen so far) makes the client ping the
server: a live one gets more time, up to the request deadline; a dead one fails the hop
(:class:`HopFailed`). Every decoded token comes through here: the push segments are computed once
per chain, not per step; a step's route only adds each pushed hop's token for it (bound to the hop
before and to the step: :mod:`shoal.verify.tokens`, an HMAC: a few microseconds). A long step may
instead travel in chunks (:mod:`shoal.client.remote.pipeline`), which sends and checks each chunk
with the same :meth:`ChainDriver.send_step` and :meth:`ChainDriver.accept` as :meth:`ChainDriver.run`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from shoal.client.remote.feedback import RouteFeedback
from shoal.client.remote.history import step_inputs
from shoal.client.remote.hops import Hop
from shoal.errors import ClosedError, ShoalError, remote_error
from shoal.routing import ServerSpan
from shoal.verify.receipts import LIAR_BAN_SECONDS, ReceiptError, adapter_tag, expected_receipt, verify_receipt
from shoal.verify.state import StateChain, step_states
from shoal.wire import Codec, Message
from shoal.wire.codecs import carried
from shoal.wire.schema import (
    MIGRATE,
    PUSH,
    RECEIPTS,
    MigratedReply,
    MigrateRequest,
    PushHop,
    Receipt,
    StepReply,
    StepRequest,
)
from shoal.wire.tensors import roundtrip

log = logging.getLogger(__name__)

MIN_DEADLINE = 0.25  # seconds before a late reply makes the client check that the server lives
DEADLINE_FACTOR = 4.0  # ... or this many times the expected reply time, if longer

log = logging.getLogger(__name__)


class HopFailed(Exception):
    """Hop ``index`` of the chain failed this step (its server is dead, broke the stream, or erred)."""

    def __init__(self, index: int, cause: BaseException):
        super().__init__(f"hop {index} failed: {cause}")
        self.index = index
        self.cause = cause


class PushLost(Exception):
    """A pushed step's reply is late although its server answers pings."""


@dataclass
class _Signed:
    """What a hop's checked receipts so far commit to: the chain of the inputs its session was sent, and
    how its server computes (its first receipt's ``compute``; None before it)."""

    chain: StateChain = field(default_factory=StateChain)
    compute: str | None = None


def codec_for(span: ServerSpan, compression: Codec) -> Codec:
    """The codec of the hidden states sent to ``span``'s server: ``compression`` if it announced
    it, else raw."""
    return compression if span.supports(compression.capability) else Codec.RAW


def push_reach(
    spans: Sequence[ServerSpan], enabled: bool = True, codecs: Sequence[Codec] | None = None, receipts: bool = False
) -> list[int]:
    """For each hop ``k``, the last hop that a step sent to ``k`` reaches by push (``k``: none).
    Server ``k`` pushes to ``k + 1`` only if both announced :data:`PUSH` and use the same codec
    (``codecs``, one per hop; None: all raw), and, asking for ``receipts``, both or neither
    announced :data:`RECEIPTS`; a segment of servers that all do is pushed through end to end."""
    reach = list(range(len(spans)))
    if enabled:
        for k in range(len(spans) - 2, -1, -1):
            same = codecs is None or codecs[k] == codecs[k + 1]
            same = same and (not receipts or spans[k].supports(RECEIPTS) == spans[k + 1].supports(RECEIPTS))
            if same and spans[k].supports(PUSH) and spans[k + 1].supports(PUSH):
                reach[k] = reach[k + 1]
    return reach


def push_route(
    hops: Sequence[Hop], k: int, last: int, asks: Sequence[bool], *, step: int, position: int, n: int
) -> tuple[PushHop, ...]:
    """``push`` of step ``step`` (``n`` positions at ``position``) sent to hop ``k``: hops ``k + 1``
    to ``last``, each with the token that lets only the hop before it push only this step, asking a
    receipt as ``asks`` says of it (an HMAC each: a few microseconds)."""
    return tuple(
        hops[j].push_hop(hops[j - 1].span.peer_id, step=step, position=position, n=n, receipt=asks[j])
        for j in range(k + 1, last + 1)
    )


class ChainDriver:
    """Owns the session's chain of hops (installed whole, see :meth:`install`) and runs steps
    through it; what it learns of each server goes to ``feedback``. ``compression``: the codec of
    the hidden states, on every hop whose server announced it. ``receipts``: ask every server that
    announced :data:`RECEIPTS` for a signed receipt of each step, and check it."""

    def __init__(
        self,
        feedback: RouteFeedback,
        request_deadline: float,
        *,
        push: bool = True,
        compression: Codec = Codec.RAW,
        receipts: bool = True,
        adapter: str | None = None,
        prompts: bool = False,
    ):
        self.feedback = feedback
        self.adapter = adapter  # what the session's servers run with: their receipts state it
        self.prompts = prompts
        self.request_deadline = request_deadline
        self.push = push
        self.compression = compression
        self.receipts = receipts
        self.hops: tuple[Hop, ...] = ()
        self.starts: frozenset[int] = frozenset()  # first block of every hop: the chain's boundaries
        self.codecs: tuple[Codec, ...] = ()  # of each hop's hidden states
        self.asks: tuple[bool, ...] = ()  # whether each hop is asked for receipts
        self._reach: list[int] = []  # the last hop a step sent to each hop reaches by push
        self._step_id = 0
        self._signed: weakref.WeakKeyDictionary[Hop, _Signed] = weakref.WeakKeyDictionary()  # a hop's, while it lives
        self.migration_mismatches = 0  # replacements that reported pages of other inputs (see migrate)

    def install(self, hops: Sequence[Hop]) -> None:
        self.hops = tuple(hops)
        self.starts = frozenset(hop.span.start for hop in self.hops)
        self.codecs = tuple(codec_for(hop.span, self.compression) for hop in self.hops)
        self.asks = tuple(self._asks(hop) for hop in self.hops)
        self._reach = push_reach(self.chain, self.push, self.codecs, self.receipts)

    def _asks(self, hop: Hop) -> bool:
        return self.receipts and hop.span.supports(RECEIPTS)

    @property
    def chain(self) -> list[ServerSpan]:
        return [hop.span for hop in self.hops]

    def segments(self) -> list[tuple[int, int]]:
        """The chain's push segments, in order: (first hop, last hop). The client sends a step to a
        segment's first hop, whose server pushes it on through the last."""
        segments, k = [], 0
        while k < len(self.hops):
            last = self._reach[k]
            segments.append((k, last))
            k = last + 1
        return segments

    def next_id(self) -> int:
        """Step ids grow over the whole session (a server drops pushes older than its last step)."""
        self._step_id += 1
        return self._step_id

    def leaving(self) -> int | None:
        """Index of the first hop whose server said it is draining and is due a replacement, if any."""
        now = time.monotonic()
        for index, hop in enumerate(self.hops):
            if hop.draining and now >= hop.replace_after:
                return index
        return None

    def keep_serving(self, hop: Hop, retry_after: float) -> None:
        """No one can take over from draining ``hop`` yet: use it while it serves, and look for a
        replacement again in ``retry_after`` seconds (its replies keep raising the flag)."""
        hop.draining = False
        hop.replace_after = time.monotonic() + retry_after

    async def run(
        self,
        index: int,
        inputs: MutableMapping[int, Tensor],
        position_ids: Tensor,
        mask: Tensor | None,
        position: int,
        receipts: dict[int, Receipt] | None = None,
    ) -> None:
        """Run the step from hop ``index`` to the end of the chain. ``inputs`` maps a block to this
        step's hidden states entering it: it must hold the first block of hop ``index`` and gets
        the output of every hop (at the hop's end block); a hop's input there becomes what its
        server decodes (the codec's round trip). ``receipts`` gets every checked receipt, at the
        hop's first block. Raises :class:`HopFailed` (a failed receipt check too)."""
        hops = self.hops
        n = position_ids.shape[1]
        count = len(hops)
        k = index
        while k < count:
            step_id = self.next_id()
            tensors = await self.send_step(k, step_id, inputs, position_ids, mask, position)
            last = self._reach[k]
            sent_to = k
            while True:  # replies of hop k, then of the hops it pushed to
                sent = tensors if k == sent_to else step_inputs(inputs[hops[k].span.start], position_ids, mask)
                try:
                    output, reply, receipt = await self.accept(k, step_id, n, position, sent, pushed=k > sent_to)
                except PushLost:
                    break  # the server lives but the push never reached it: send it the step ourselves
                if receipt is not None and receipts is not None:
                    receipts[hops[k].span.start] = receipt
                inputs[hops[k].span.end] = output
                k += 1
                if k > last or reply.pushed is False:
                    break

    async def send_step(
        self,
        k: int,
        step_id: int,
        inputs: MutableMapping[int, Tensor],
        position_ids: Tensor,
        mask: Tensor | None,
        position: int,
    ) -> list[Tensor]:
        """Send hop ``k`` step ``step_id`` (pushed on along its route) over ``inputs`` at its first
        block, which becomes what its server decodes (the codec's round trip); returns the tensors
        sent. Raises :class:`HopFailed`."""
        hop, n = self.hops[k], position_ids.shape[1]
        push = push_route(self.hops, k, self._reach[k], self.asks, step=step_id, position=position, n=n)
        request = StepRequest(session=hop.session, position=position, push=push, receipt=self.asks[k])
        codec = carried(self.codecs[k], inputs[hop.span.start].dtype)
        hidden = inputs[hop.span.start] = roundtrip(inputs[hop.span.start], codec)  # raises if it cannot carry it
        tensors = step_inputs(hidden, position_ids, mask)
        try:
            await hop.stream.send(Message("step", step_id, request, tensors, (codec,)))
        except ShoalError as exc:
            raise HopFailed(k, exc) from exc
        return tensors

    async def accept(
        self, k: int, step_id: int, n: int, position: int, sent: Sequence[Tensor], pushed: bool
    ) -> tuple[Tensor, StepReply, Receipt | None]:
        """Hop ``k``'s reply to step ``step_id`` (``n`` positions at ``position``), its receipt checked
        against ``sent`` (what its server decoded, if honest: for a ``pushed`` step, the previous hop's
        reply as the client got it): (output, reply, checked receipt or None). Raises
        :class:`HopFailed` (a failed receipt check too), :class:`PushLost`."""
        hop = self.hops[k]
        started = time.perf_counter()
        try:
            message = await self._reply(hop, step_id, n, pushed=pushed)
            reply = message.reply(StepReply)
        except (ShoalError, TimeoutError) as exc:
            raise HopFailed(k, exc) from exc
        receipt = None
        if self.asks[k]:
            pushed_by = self.hops[k - 1] if pushed else None
            try:
                receipt = self._check(hop, k, reply.receipt, message.tensors[0], sent, step_id, position,
                                      message.codec_of(0), pushed_by)  # fmt: skip
            except ReceiptError as exc:  # the hop of the server blamed (the earlier one for equivocation)
                raise HopFailed(k if exc.hop is None else exc.hop, exc) from exc
            await self._advance(hop, position, sent)
        if n == 1:
            self.feedback.observed_step(hop.span.peer_id, (time.perf_counter() - started) * 1e3)
        self.feedback.succeeded(hop.span.peer_id)
        hop.draining = reply.draining
        return message.tensors[0], reply, receipt

    async def migrate(self, source: Hop, target: Hop, position: int) -> bool:
        """Have ``source``'s server (leaving) hand its session's KV pages of ``[0, position)`` to
        ``target``, a fresh session on a server of the same span (:mod:`shoal.server.migrate`). True
        once the replacement reported the chain digest of those positions' inputs and it is the one
        this client keeps for ``source`` (what it sent there): ``target`` then holds the session
        and its receipts are checked against that chain. False (the caller replays instead) when
        either server cannot (no receipts asked, no :data:`MIGRATE`, other weights), refused, failed,
        timed out, or reported another digest (counted in :attr:`migration_mismatches`)."""
        signed = self._signed.get(source)
        why = self._cannot_migrate(source, target) or (None if signed and len(signed.chain) >= position else "no chain")
        if why is not None:
            log.info("no migration from %s: %s; replaying instead", source.span.peer_id[:10], why)
            return False
        step_id = self.next_id()
        to = target.migrate_hop(source.span.peer_id, step=step_id, position=position)
        request = MigrateRequest(session=source.session, position=position, step=step_id, to=to)
        try:
            await source.stream.send(Message("migrate", step_id, request))
            await self._reply(source, step_id, position)  # the pages were taken (or an error)
            reply = (await self._reply(target, step_id, position)).reply(MigratedReply)
        except (ShoalError, TimeoutError) as exc:
            log.info("migration from %s failed (%s): replaying instead", source.span.peer_id[:10], exc)
            return False
        if reply.position != position or reply.state != signed.chain.at(position):
            self.migration_mismatches += 1
            log.warning("server %s took pages of other inputs than this session's: replaying instead",
                        target.span.peer_id[:10])  # fmt: skip
            return False
        chain = StateChain()
        chain.commit(0, signed.chain.digests(position))
        self._signed[target] = _Signed(chain)
        return True

    def _cannot_migrate(self, source: Hop, target: Hop) -> str | None:
        """Why ``source``'s pages cannot go to ``target`` (None: they can be offered)."""
        if not (self._asks(source) and self._asks(target)):
            return "receipts are not asked of both (no chain to check the pages against)"
        if not (source.span.supports(MIGRATE) and target.span.supports(MIGRATE)):
            return "a server does not announce the migrate capability"
        a, b = source.span.info, target.span.info  # the servers check dtype too (records may not say it)
        if (source.span.blocks, a.fingerprints, a.quantization) != (target.span.blocks, b.fingerprints, b.quantization):
            return "the servers hold other blocks or weights"
        return None

    async def replay(self, hop: Hop, tensors: list[Tensor], n: int, position: int = 0) -> Tensor:
        """One step over positions ``[position, position + n)`` on ``hop`` (not pushed on): its
        output. Raw, so the new server computes on exactly the history (whatever codecs it was made
        with). A replay starts at 0; an audit (:mod:`shoal.client.verification.audit`) where its auditor stopped."""
        step_id = self.next_id()
        asks = self._asks(hop)
        request = StepRequest(session=hop.session, position=position, receipt=asks)
        await hop.stream.send(Message("step", step_id, request, tensors))
        message = await self._reply(hop, step_id, n)
        reply = message.reply(StepReply)
        if asks:  # a ReceiptError fails the replacement, as any error would
            self._check(hop, None, reply.receipt, message.tensors[0], tensors, step_id, position, message.codec_of(0))
            await self._advance(hop, position, tensors)
        return message.tensors[0]

    def _check(
        self,
        hop: Hop,
        index: int | None,
        receipt: Receipt | None,
        output: Tensor,
        sent: Sequence[Tensor],
        step_id: int,
        position: int,
        codec: Codec,
        pushed_by: Hop | None = None,
    ) -> Receipt:
        """``hop``'s receipt of a step, checked against what was asked, ``sent`` (the tensors its
        server decoded, if honest) and ``output`` (what the client received). A failed check bans
        the server it blames (``pushed_by``, the hop before, when the inputs differ from what that
        one answered: equivocation) and raises the :class:`ReceiptError`. ``codec``: the one the
        output came in. The receipt must state the hop's chain at ``position`` and, after its first,
        the same ``compute``; :meth:`_advance` then records the step."""
        span = hop.span
        info = span.info
        signed = self._signed.setdefault(hop, _Signed())
        expected = expected_receipt(
            start=span.start, end=span.end, fingerprints=info.fingerprints, quantization=info.quantization.value,
            session=hop.session, position=position, step=step_id, sent=sent, output=output, codec=codec,
            adapter=announced_adapter(span, self.adapter), prompts=self.prompts, dtype=info.dtype,
            state=signed.chain.at(position), compute=signed.compute or info.compute,
        )  # fmt: skip
        previous = pushed_by.span.peer_id if pushed_by is not None else None
        try:
            checked = verify_receipt(receipt, span.peer_id, expected, hop=index, previous=previous)
        except ReceiptError as exc:  # a protocol violation: other weights or compute than announced, ...
            log.warning("refused a receipt of server %s on blocks %s: %s", exc.peer[:10], span.blocks, exc)
            self.feedback.failed(exc.peer, LIAR_BAN_SECONDS)
            raise
        signed.compute = checked.compute
        return checked

    async def _advance(self, hop: Hop, position: int, sent: Sequence[Tensor]) -> None:
        """``hop``'s step at ``position`` over ``sent`` (hidden, position ids, mask?) checked: its
        session's cache now holds those inputs there, and nothing after them."""
        chain = self._signed[hop].chain
        mask = sent[2] if len(sent) > 2 else None
        chain.commit(position, await step_states(chain, position, sent[0], sent[1], mask))

    async def _reply(self, hop: Hop, step_id: int, n: int, pushed: bool = False) -> Message:
        """The reply to step ``step_id`` from ``hop``. Late: ping the server; a live one gets more
        time (up to the request deadline), a dead one fails the hop. A live server late with a
        ``pushed`` step may never have received it: :class:`PushLost` (the caller resends)."""
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
                    raise PushLost()
                continue
            if message.id != step_id:
                continue  # a late reply to an earlier (abandoned) step
            if message.kind == "error":
                raise remote_error(*message.error_info())
            return message


def announced_adapter(span: ServerSpan, adapter: str | None) -> bytes:
    """What ``span``'s receipts must state running ``adapter``: the digest its server announced for that
    name (a pinned choice routes only over servers announcing the pinned one); b"" for none."""
    return adapter_tag(dict(span.info.adapters).get(adapter)) if adapter else b""


__all__ = [
    "DEADLINE_FACTOR",
    "MIN_DEADLINE",
    "ChainDriver",
    "HopFailed",
    "PushLost",
    "announced_adapter",
    "codec_for",
    "push_reach",
    "push_route",
]
