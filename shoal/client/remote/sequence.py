"""The block stack as a chain of remote servers: a :class:`~shoal.client.blocks.BlockSequence`
over the ``shoal/blocks/2`` protocol, routed over the servers a
:class:`~shoal.client.remote.directory.ServerDirectory` knows.

Stateless forwards draw a route each; sessions (:class:`~shoal.client.remote.session.RemoteSession`) keep
one and survive server failures. A forward whose input (or deep prompts) requires grad is
differentiable: :mod:`shoal.client.training.backward` sends its backward to the servers that computed it.
The synchronous methods (called from transformers' generate) hand coroutines to the process's
client event loop (:mod:`shoal.client.runtime`). A forward to a server that announced
:data:`~shoal.wire.schema.RECEIPTS` asks for a signed receipt and checks it (:mod:`shoal.verify.receipts`):
one that does not vouch for the answer bans the server for an hour and re-routes, like a failure.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from shoal.client.config import ClientConfig
from shoal.client.remote.directory import ServerDirectory
from shoal.client.remote.driver import announced_adapter, codec_for
from shoal.client.remote.history import step_inputs
from shoal.client.remote.recovery import MAX_RECOVERIES, gave_up
from shoal.client.remote.session import RemoteSession
from shoal.client.runtime import LoopThread, shared_loop
from shoal.client.training.backward import Traced, differentiable_forward
from shoal.client.verification.audit import verification_for
from shoal.client.verification.witness import Witness
from shoal.errors import BadRequest, ShoalError
from shoal.protocols import BLOCKS
from shoal.routing import ServerSpan
from shoal.transport import BaseNode, Node, StartNode, Ticket
from shoal.verify.receipts import LIAR_BAN_SECONDS, ReceiptError, expected_receipt, verify_receipt
from shoal.verify.state import EMPTY_STATE
from shoal.wire import Message
from shoal.wire.codecs import carried
from shoal.wire.schema import RECEIPTS, TRAIN, ForwardReply, ForwardRequest, InfoReply, Receipt
from shoal.wire.tensors import roundtrip

if TYPE_CHECKING:
    from shoal.server.config import ServerConfig
    from shoal.server.hosted import HostedSpan

log = logging.getLogger(__name__)


class RemoteSequence:
    """Blocks ``[0, num_blocks)`` served by the servers a :class:`ServerDirectory` knows, run by the
    client's ``config`` (the directory's too): ``config.push``: sessions let servers hand a step's
    output straight to the next (where both can); ``config.compression``: the codec of the hidden
    states sent to every server that announced it; ``config.verify``: audit mode (``verification``
    counts what audits did). ``prefill_chunk`` (``config.prefill_chunk`` at first): a session step of
    more positions travels the chain in chunks of this many, pipelined (:mod:`shoal.client.remote.pipeline`;
    None or 0: off); read at every step of every session, so setting it takes effect at the next.
    Forwards, backwards and sessions run with the config's adapter, if it has one."""

    def __init__(
        self,
        node: BaseNode,
        runtime: LoopThread,
        directory: ServerDirectory,
        num_blocks: int,
        config: ClientConfig,
        hosted: HostedSpan | None = None,
    ):
        self.node = node
        self.hosted = hosted  # the span this process serves (config.local_blocks), closed with the sequence
        self.config = config
        self.verification = verification_for(config.verify, config.audit_every)  # audit mode: the counters
        if not self.verification.auditing:
            log.warning("verify='off': answers from untrusted servers are not checked")
        self.runtime = runtime
        self.directory = directory
        self.num_blocks = num_blocks
        self.prefill_chunk = config.prefill_chunk
        self._route = directory.route_inference(0, cache_tokens=0, push=config.push)  # until a session opens
        self._session: RemoteSession | None = None  # the latest one opened
        directory.vouched = self.verification.vouched  # what its audits see decides whose verdicts count
        self.witness = Witness(node, directory, self.verification)  # testifies for every session (audit mode)
        # closed by close(), when garbage-collected, or at the latest at interpreter exit (runtime.shutdown)
        self._token = runtime.track(_closer(node, directory, self.witness, hosted))
        self._finalizer = weakref.finalize(self, runtime.close_soon, self._token)

    @classmethod
    def connect(
        cls,
        initial_peers: Sequence[str | Ticket],
        num_blocks: int,
        hidden_size: int,
        config: ClientConfig | None = None,
        *,
        model: str | None = None,
        runtime: LoopThread | None = None,
        start_node: StartNode = Node.start,
        host: ServerConfig | None = None,
    ) -> RemoteSequence:
        """Tickets with a swarm id: pull the swarm's table through any of them and route over it
        (servers of ``model`` whose fingerprints match the swarm's model record). Plain tickets
        (standalone servers): ask each peer what it hosts. Both kinds may be mixed; a block no
        server hosts is a :class:`~shoal.routing.NoRouteError` that says how to add one.
        ``config``: the client's settings (default: all defaults),
        shared with the directory. ``start_node``: how the client's node starts with
        ``config.transport`` (iroh by default; e.g. ``MemoryNetwork.start`` for a swarm inside
        this process). ``host``: a span to serve in this process first (``config.local_blocks``, see
        :mod:`shoal.server.hosted`), on a node started by ``start_node`` too, which the client's node
        reaches in-process; it closes with the sequence."""
        config = config if config is not None else ClientConfig()
        runtime = runtime or shared_loop()
        tickets = [t if isinstance(t, Ticket) else Ticket.parse(t) for t in initial_peers]
        if not tickets:
            raise ValueError("initial_peers is empty: give at least one server ticket")

        async def setup() -> RemoteSequence:
            hosted = None
            if host is not None:
                from shoal.server.hosted import host_span

                hosted = await host_span(host, start_node)
            try:
                keyed = {"secret_key": config.identity} if config.identity is not None else {}
                node = await start_node(config.transport, **keyed)
            except BaseException:
                if hosted is not None:
                    await hosted.close()
                raise
            node.credential = config.member_cert  # presented to every server it dials (private swarms)
            known = tickets
            if hosted is not None:  # listed first: its table has its own record at once
                node.add_local_peer(hosted.node)
                known = [hosted.ticket, *tickets]
            try:
                directory = ServerDirectory(node, known, model, num_blocks, hidden_size, config)
                await directory.refresh()
                directory.check_coverage()
                sequence = cls(node, runtime, directory, num_blocks, config, hosted)
                directory.start()
                return sequence
            except BaseException:
                await node.close()
                if hosted is not None:
                    await hosted.close()
                raise

        sequence = runtime.run(setup())
        log.info("route: %s", " -> ".join(f"{s.peer_id[:8]}[{s.start}:{s.end})" for s in sequence.chain))
        return sequence

    @property
    def chain(self) -> list[ServerSpan]:
        """The route of the latest session (as it is now, or was when it closed); before any
        session, the route planned at connect."""
        session = self._session
        return session.chain if session is not None else list(self._route)

    def describe_route(self) -> list[dict]:
        """The chain, and whether an auditor checks each span (``verified``; audit mode)."""
        verified = self._session.verified() if self._session is not None else {}
        return [
            {"peer": s.peer_id, "start": s.start, "end": s.end, "verified": verified.get((s.start, s.end), False)}
            for s in self.chain
        ]

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter every request runs with (None: the base weights)."""
        return self.config.adapter.name if self.config.adapter is not None else None

    def forward(
        self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None, prompts: Tensor | None = None
    ) -> Tensor:
        """Stateless pass; ``prompts``: deep prompts ``[num_blocks, batch or 1, N, hidden]``. With
        autograd on and ``hidden`` or ``prompts`` requiring grad, the result is differentiable."""
        if torch.is_grad_enabled() and (hidden.requires_grad or (prompts is not None and prompts.requires_grad)):
            return differentiable_forward(self, hidden, position_ids, attention_mask, prompts)
        return self.runtime.run(self.run_forward(hidden, position_ids, attention_mask, prompts))

    async def run_forward(
        self,
        hidden: Tensor,
        position_ids: Tensor,
        mask: Tensor | None,
        prompts: Tensor | None = None,
        *,
        start: int = 0,
        end: int | None = None,
        trace: list[Traced] | None = None,
        failed: set[str] | None = None,
    ) -> Tensor:
        """The stateless pass as a coroutine (:meth:`forward` runs it; :mod:`shoal.client.training.backward` too,
        tracing it), over blocks ``[start, end)``; each call draws its own route
        (capacity-weighted). A failing server is banned, added to ``failed`` and the rest of the
        pass re-routed from the block it should have started at. ``trace`` gets each span's server
        and input (a backward goes to the same servers), and then only servers announcing
        :data:`TRAIN` are used, as for deep ``prompts``."""
        directory = self.directory
        end = self.num_blocks if end is None else end
        failed = set() if failed is None else failed
        needs = (TRAIN,) if prompts is not None or trace is not None else ()
        block, recoveries = start, 0
        while block < end:
            route = directory.route_forward(block, exclude=failed, end=end, needs=needs)
            for span in route:
                try:
                    # the node's deadlines: connect for the dial (a dead server costs that much), request for the reply
                    sent, out = await self._forward_span(span, hidden, position_ids, mask, prompts, trace is not None)
                except BadRequest:
                    raise
                except ShoalError as exc:
                    recoveries += 1
                    failed.add(span.peer_id)
                    directory.failed(span.peer_id, LIAR_BAN_SECONDS if isinstance(exc, ReceiptError) else None)
                    log.warning("forward through %s failed (%s); re-routing", span.peer_id[:10], exc)
                    if recoveries > MAX_RECOVERIES:
                        raise gave_up(directory, failed, block, exc, needs) from exc
                    break
                directory.succeeded(span.peer_id)
                if trace is not None:
                    trace.append(Traced(span, sent))
                hidden, block = out, span.end
        return hidden

    async def _forward_span(
        self,
        span: ServerSpan,
        hidden: Tensor,
        position_ids: Tensor,
        mask: Tensor | None,
        prompts: Tensor | None,
        exact: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """(the input sent, ``span``'s output). ``exact``: the input sent is what the server
        decodes (the codec's round trip of ``hidden``), for a backward to recompute on."""
        codec = carried(codec_for(span, self.config.compression), hidden.dtype)
        asks = span.supports(RECEIPTS)
        sent = roundtrip(hidden, codec) if exact or asks else hidden  # a receipt digests what the server decodes
        tensors = step_inputs(sent, position_ids, mask)
        if prompts is not None:
            tensors.append(prompts[span.start : span.end].contiguous())
        meta = ForwardRequest(prompts=prompts is not None, adapter=self.adapter, receipt=asks)
        reply = await self.node.request(span.ticket, BLOCKS, Message("forward", 1, meta, tensors, (codec,)))
        if asks:
            receipt = reply.reply(ForwardReply).receipt
            check_forward_receipt(span, receipt, tensors, reply, adapter=self.adapter, prompts=prompts is not None)
        return sent, reply.tensors[0]

    def open_session(
        self, batch_size: int, max_length: int, prompts: Tensor | None = None, share: int = 0
    ) -> RemoteSession:
        """A session over a chain of servers; ``prompts``: its deep prompts, ``share``: the positions
        other peers may reuse (see :class:`RemoteSession`)."""
        prompts = None if prompts is None else prompts.detach()
        session = RemoteSession(self, batch_size, max_length, prompts, share=share)
        try:
            self.runtime.run(session.open())
        except BaseException:  # e.g. UnverifiedBlocks once the chain is open: close what it opened
            session.close()
            raise
        self._session = session
        return session

    def server_infos(self) -> list[InfoReply]:
        """Fresh ``info`` of every server on the current route (counters included)."""

        async def gather() -> list[InfoReply]:
            replies = [await self.node.request(s.ticket, BLOCKS, Message("info", 1)) for s in self.chain]
            return [reply.reply(InfoReply) for reply in replies]

        return self.runtime.run(gather())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the background refresh and the witness, and close the node (idempotent)."""
        if self._finalizer.detach() is None:
            return
        close = self.runtime.untrack(self._token)
        if close is not None and not self.runtime.stopped:  # else the loop's shutdown at exit closed it
            self.runtime.run(close())


def _closer(
    node: BaseNode, directory: ServerDirectory, witness: Witness, hosted: HostedSpan | None = None
) -> Callable[[], Awaitable[None]]:
    """How a sequence's resources end; holds them, not the sequence (which may be collected first).
    The span this process hosts goes last, as ``shoal serve`` leaves (other peers' sessions move on)."""

    async def close() -> None:
        await witness.close()  # testimony still on its way, bounded (its judges answer meanwhile)
        await directory.stop()
        await node.close()
        if hosted is not None:
            await hosted.close()

    return close


def check_forward_receipt(
    span: ServerSpan, receipt: Receipt | None, sent: list[Tensor], reply: Message, *, adapter: str | None,
    prompts: bool,
) -> Receipt:  # fmt: skip
    """``span``'s receipt of a forward (request id 1): the span, the tensors sent (as the server
    decodes them), the output ``reply`` carries, ``adapter`` (by the digest ``span`` announced for it)
    and deep ``prompts`` as asked, computed in the dtype ``span`` announced (when known), on the empty
    cache; raises a :class:`~shoal.verify.receipts.ReceiptError`."""
    info = span.info
    expected = expected_receipt(
        start=span.start, end=span.end, fingerprints=info.fingerprints, quantization=info.quantization.value,
        session="", position=0, step=1, sent=sent, output=reply.tensors[0], codec=reply.codec_of(0),
        adapter=announced_adapter(span, adapter), prompts=prompts, dtype=info.dtype, state=EMPTY_STATE,
        compute=info.compute,
    )  # fmt: skip
    return verify_receipt(receipt, span.peer_id, expected)


__all__ = ["RemoteSequence", "check_forward_receipt"]
