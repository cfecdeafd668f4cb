"""An inference session over a chain of remote servers that survives server failures.

The session puts three parts together, none of which changes another's state: the
:class:`~shoal.client.remote.driver.ChainDriver` owns the chain and runs steps through it, the
:class:`~shoal.client.remote.history.SpanHistory` keeps the inputs at the chain's boundaries, and the
:class:`~shoal.client.remote.recovery.ChainRecovery` policy returns a rebuilt chain that the session
installs in the driver (and whose replay outputs it adds to the history). Routing hears about
servers only through :class:`~shoal.client.remote.feedback.RouteFeedback`.

* a hop that fails mid-step is aborted and rebuilt; the step goes on from the first hop replaced;
* a step longer than ``prefill_chunk`` positions is pipelined (:mod:`shoal.client.remote.pipeline`): its
  chunks are steps of their own in the history; after a failure the hop is rebuilt as above and the
  step finishes sequentially from the chunks every hop answered;
* a reply flagged ``draining`` (the server is leaving) moves that span the same way, before the
  next step; while nobody can take over, the leaving server keeps serving;
* in audit mode (:mod:`shoal.client.verification.audit`), every hop has an auditor that gets the hop's recorded
  inputs every ``audit_every`` positions (and when :meth:`RemoteSession.audit` is called); a liar
  found by a majority is banned, the session rolled back to its first wrong output and the liar's
  hop replaced, and the step (or ``audit``) raises :class:`~shoal.client.verification.audit.LieDetected`;
  a dispute no third replica settles is repaired the same way around both of its servers, or fails
  the session with :class:`~shoal.client.verification.audit.UnsettledDispute` when no route is left without them;
* in redundant mode the same, with the audits after every step on auditors that are none of the
  chain's servers (a second chain).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from shoal.client.blocks import SessionPositions
from shoal.client.remote.driver import ChainDriver, HopFailed
from shoal.client.remote.history import SpanHistory, cat_serial
from shoal.client.remote.hops import Hop, close_all
from shoal.client.remote.pipeline import Chunk, chunk_bounds, positions, run_pipelined
from shoal.client.remote.recovery import DRAIN_RETRY_SECONDS, MAX_RECOVERIES, ChainRecovery, Rebuilt, RecoveryRecord
from shoal.client.verification.audit import Conviction, LieDetected, UnsettledDispute, UnverifiedBlocks, Verification
from shoal.client.verification.auditors import Audits
from shoal.errors import BadRequest, ShoalError
from shoal.routing import NoRouteError, ServerSpan, format_blocks
from shoal.verify.receipts import ReceiptError
from shoal.wire.schema import RECEIPTS, OpenRequest, Receipt

if TYPE_CHECKING:
    from shoal.client.remote.sequence import RemoteSequence

log = logging.getLogger(__name__)


class RemoteSession(SessionPositions):
    """A :class:`~shoal.client.blocks.BlockSession` over a chain of servers (one stream each).
    ``prompts``: deep prompts ``[num_blocks, batch or 1, N, hidden]`` every server adds to its
    blocks' inputs at positions ``[0, N)`` (each gets its span's slice when its session opens,
    a replacement too). ``share``: positions ``[0, share)`` whose KV pages servers may let other
    peers reuse (:mod:`shoal.server.prefix`; 0: only this peer's own later sessions). The session
    runs with the sequence's adapter, if it has one."""

    def __init__(
        self, sequence: RemoteSequence, batch_size: int, max_length: int, prompts: Tensor | None = None, share: int = 0
    ):
        super().__init__(batch_size, max_length)
        self.runtime = sequence.runtime
        self.num_blocks = sequence.num_blocks
        directory = sequence.directory
        self._directory = directory  # where the servers are listed (looked at again while waiting)
        adapter = sequence.adapter
        config = sequence.config
        request_deadline = config.transport.deadlines.request
        self._driver = ChainDriver(
            directory, request_deadline, push=config.push, compression=config.compression, adapter=adapter,
            prompts=prompts is not None,
        )  # fmt: skip
        request = OpenRequest(
            max_length=max_length, batch_size=batch_size, prompts=prompts is not None, adapter=adapter, share=share
        )
        self._recovery = ChainRecovery(
            sequence.node,
            directory,
            directory,
            request,
            push=config.push,
            prompts=prompts,
            route_wait=config.route_wait,
        )
        self._history = SpanHistory(batch_size)
        self._chain: list[ServerSpan] = []  # the last chain installed (still readable once closed)
        self._closed = False
        self.recoveries: list[RecoveryRecord] = []  # what happened, in order
        self.verification: Verification = sequence.verification
        self._push = config.push
        self._require_verified = config.require_verified  # no step with a block nothing checks
        self._sequence = sequence  # its prefill_chunk, read at every step (a model reuses its session)
        self._audits: Audits | None = None
        if self.verification.auditing:
            self._audits = Audits(
                sequence.node, directory, directory, self._recovery, self._driver.replay, self.verification,
                compression=config.compression, request_deadline=request_deadline,
                adapter=adapter, witness=sequence.witness,  # the client's: testimony outlives the session
            )  # fmt: skip

    @property
    def closed(self) -> bool:
        return self._closed

    def _rolled_back(self, position: int) -> None:
        self._history.truncate(position)
        if self._audits is not None:
            self._audits.rolled_back(position)

    @property
    def chain(self) -> list[ServerSpan]:
        """The servers the session runs on now (the last ones, once closed)."""
        return list(self._chain)

    @property
    def migration_mismatches(self) -> int:
        """Replacements that reported KV pages of other inputs than this session's (then replayed)."""
        return self._driver.migration_mismatches

    @property
    def cache_tokens(self) -> int:
        return self.batch_size * self.max_length

    def verified(self) -> dict[tuple[int, int], bool]:
        """Whether an auditor checks each hop's span ``(start, end)`` (all False: not auditing)."""
        if self._audits is None:
            return {(s.start, s.end): False for s in self._chain}
        return self._audits.verified()

    @property
    def audited_position(self) -> int:
        """Positions ``[0, result)`` whose outputs every checked hop's auditor confirmed (the whole
        session when nothing is audited): the tokens up to and at it stand."""
        return self._audits.checked_up_to(self._position) if self._audits is not None else self._position

    # ---- opening and closing -------------------------------------------------------------------

    async def open(self) -> None:
        try:
            self._install(await self._recovery.open_chain())
        except NoRouteError as exc:
            raise self._unsettled(exc) from exc
        if self._audits is not None:
            await self._audits.follow(self._driver.hops, self._history, self._position, ())
            if self._require_verified:
                await self._wait_for_checkers(self._recovery.route_wait)
        self._check_verified()

    async def _wait_for_checkers(self, timeout: float) -> None:
        """Under ``require_verified``, a chain with blocks nothing checks waits up to ``timeout``
        seconds (the client's ``route_wait``) for a server able to check them to join, as a chain
        missing blocks waits for one to serve them, rather than failing at once."""
        assert self._audits is not None
        deadline = time.monotonic() + timeout
        if self.verification.unverified and timeout > 0:
            log.warning(
                "no other server can check blocks %s yet: waiting up to %g s for one to join",
                format_blocks(list(self.verification.unverified)),
                timeout,
            )
        while self.verification.unverified and (left := deadline - time.monotonic()) > 0:
            await self._directory.look_again(left)
            await self._audits.staff_unchecked(self._history)

    def _unsettled(self, error: NoRouteError) -> NoRouteError:
        """``error``, or the :class:`UnsettledDispute` that explains it: a dispute's servers would
        have covered blocks nothing else covers."""
        if isinstance(error, UnsettledDispute):
            return error
        missing = set(error.missing)
        for dispute in reversed(self.verification.disputes):
            if missing & set(dispute.blocks.blocks()):
                return UnsettledDispute(dispute, error.missing)
        return error

    def _install(self, hops: Sequence[Hop]) -> None:
        if self._audits is not None:
            # an audit pins a lie on a hop only if it computed on the inputs recorded for it: for a
            # pushed hop, its receipts prove that (the driver checks them); without, the client sends
            self._driver.push = self._push and self._driver.receipts and all(h.span.supports(RECEIPTS) for h in hops)
        self._driver.install(hops)
        self._chain = self._driver.chain

    async def _follow(self, adopted: Collection[int]) -> None:
        """The audits follow the chain just installed (``adopted``: blocks whose history a replay made)."""
        if self._audits is not None:
            await self._audits.follow(self._driver.hops, self._history, self._position, adopted)
        self._check_verified()

    def _check_verified(self) -> None:
        """With ``require_verified``: :class:`UnverifiedBlocks` if a block of the chain has no checker
        (nothing is computed on them: the chain is checked before every step is sent)."""
        if self._require_verified and self.verification.unverified:
            raise UnverifiedBlocks(self.verification.unverified)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            hops = list(self._driver.hops)
            self._driver.install(())
            self._history.clear()
            self.runtime.run(close_all(hops))
            if self._audits is not None:
                self.runtime.run(self._audits.close())

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """One step (pipelined in chunks when longer than the sequence's ``prefill_chunk``); in audit mode, every
        ``audit_every`` positions (redundant: every step), the audits (may raise :class:`LieDetected`:
        the step's output is void, the session rolled back)."""
        self._check_step(hidden, attention_mask)
        out = self.runtime.run(self._step(hidden, position_ids, attention_mask))
        if self._audits is not None and self._audits.due(self._position):
            self.runtime.run(self._audit_round())
        return out

    def audit(self) -> None:
        """Audit every position not audited yet, until every checked hop is audited up to the
        session's position (``generate`` calls it before it returns). Raises :class:`LieDetected`."""
        if self._audits is None or self._closed:
            return
        for _ in range(MAX_RECOVERIES):
            if not self._audits.pending(self._position):
                return
            self.runtime.run(self._audit_round())
        raise ShoalError(f"audits still pending after {MAX_RECOVERIES} rounds (auditors kept failing)")

    async def _audit_round(self) -> None:
        conviction = await self._audits.round(self._history, self._position)
        if conviction is not None:
            await self._repair(conviction)
        self._check_verified()

    async def _repair(self, conviction: Conviction) -> None:
        """Roll back to the first wrong output, replace the liar's hop if it is still on the chain,
        and raise :class:`LieDetected`; :class:`UnsettledDispute` when a dispute's hop has no
        route left without its servers."""
        position, dispute = conviction.position, conviction.dispute
        self.verification.rollbacks += 1
        self.position = position  # the history and the audits forget what follows
        if conviction.replace:
            hop = self._driver.hops[conviction.index]
            await hop.abort()
            peer = hop.span.peer_id
            cause = ShoalError(f"server {peer[:10]} lied from position {position}" if dispute is None
                               else f"servers {dispute.reason}")  # fmt: skip
            try:
                await self._recover(conviction.index, cause, frozenset({peer}), blame=dispute is None)
            except NoRouteError as exc:
                if dispute is None:
                    raise
                raise UnsettledDispute(dispute, exc.missing or list(dispute.blocks.blocks())) from exc
        raise LieDetected(position, conviction.peer, conviction.blocks, dispute.peers if dispute else ())

    async def _step(self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        """Run the step; the session's position (and history) advance with each part that every hop
        answered (the chunks of a pipelined step, then the rest). A step that fails leaves the
        session where it was, as a failed sequential step does."""
        start, n = self._position, hidden.shape[1]
        outputs: list[Tensor] = []
        try:
            failed = await self._move_draining()
            done = 0
            chunk = self._sequence.prefill_chunk
            bounds = chunk_bounds(n, chunk) if len(self._driver.hops) > 1 else [(0, n)]
            if len(bounds) > 1:
                done, failed = await self._pipelined(hidden, position_ids, mask, bounds, outputs, failed)
            if done:  # the rest, after the chunks that went through
                hidden, position_ids = positions(hidden, done, n), positions(position_ids, done, n)
            if done < n:
                outputs.append(await self._sequential(hidden, position_ids, mask, failed))
        except BaseException:
            if self._position > start:
                self.position = start  # the history forgets the chunks that went through
            raise
        return outputs[0] if len(outputs) == 1 else cat_serial(outputs, dim=1)

    async def _move_draining(self) -> frozenset[str]:
        """A server said it is leaving: move its span first. Returns the servers found failing."""
        driver = self._driver
        failed: frozenset[str] = frozenset()
        while (leaving := driver.leaving()) is not None:
            peer = driver.hops[leaving].span.peer_id
            _, failed = await self._recover(leaving, ShoalError(f"server {peer[:10]} is draining"), failed, drain=True)
        return failed

    async def _pipelined(
        self,
        hidden: Tensor,
        position_ids: Tensor,
        mask: Tensor | None,
        bounds: list[tuple[int, int]],
        outputs: list[Tensor],
        failed: frozenset[str],
    ) -> tuple[int, frozenset[str]]:
        """The step in chunks ``bounds`` through the chain at once (:mod:`shoal.client.remote.pipeline`); each
        chunk every hop answered is recorded as a step of its own, its output appended to ``outputs``.
        After a failure, the failed hop is recovered. Returns the positions done, the servers failing."""
        chunks = [Chunk.cut(hidden, position_ids, mask, self._position, a, b) for a, b in bounds]
        complete, failure = await run_pipelined(self._driver, chunks)
        for chunk in chunks[:complete]:
            self._record(chunk.inputs, chunk.position_ids, chunk.mask, chunk.n, chunk.receipts)
            outputs.append(chunk.inputs[self.num_blocks])
        if failure is not None:
            _, failed = await self._failed(failure, failed)
        return (chunks[complete].start if complete < len(chunks) else hidden.shape[1]), failed

    async def _sequential(
        self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None, failed: frozenset[str]
    ) -> Tensor:
        """The step as one message down the chain, recovering every hop that fails on the way."""
        inputs: dict[int, Tensor] = {0: hidden}  # block -> this step's input there
        receipts: dict[int, Receipt] = {}  # block -> the signed receipt of the hop starting there
        index = 0
        while True:
            try:
                await self._driver.run(index, inputs, position_ids, mask, self._position, receipts)
                break
            except HopFailed as failure:
                index, failed = await self._failed(failure, failed)
        self._record(inputs, position_ids, mask, hidden.shape[1], receipts)
        return inputs[self.num_blocks]

    async def _failed(self, failure: HopFailed, failed: frozenset[str]) -> tuple[int, frozenset[str]]:
        """Hop ``failure.index`` failed at the session's position: abort and recover it (see
        :meth:`_recover`); a bad request is raised instead (another server would refuse it too)."""
        driver = self._driver
        if isinstance(failure.cause, BadRequest):  # the session stays usable
            raise failure.cause from None
        if isinstance(failure.cause, ReceiptError) and self._audits is not None:
            blocks = driver.hops[failure.index].span.blocks  # its signed receipt says another computation
            self._audits.convict(failure.cause.peer, blocks, self._position)
        await driver.hops[failure.index].abort()
        return await self._recover(failure.index, failure.cause, failed)

    def _record(
        self, inputs: dict[int, Tensor], position_ids: Tensor, mask: Tensor | None, n: int, receipts: dict[int, Receipt]
    ) -> None:
        """A step of ``n`` positions went through every hop: into the history, and the session moves on."""
        driver = self._driver
        starts = driver.starts | {self.num_blocks} if self._audits is not None else driver.starts
        self._history.record(inputs, starts, position_ids, mask, self._position + n, receipts)
        self._position += n

    async def _recover(
        self, index: int, cause: BaseException, failed: frozenset[str], drain: bool = False, blame: bool = True
    ) -> tuple[int, frozenset[str]]:
        """Rebuild the chain around hop ``index`` and install it. Returns the index of the first
        hop replaced (the step goes on from there) and the servers found failing so far (``blame``:
        whether hop ``index``'s server is one; not when a dispute takes it off the route)."""
        driver = self._driver
        rebuilt: Rebuilt | None = await self._recovery.rebuild(
            driver.hops,
            index,
            cause,
            failed=failed,
            history=self._history,
            position=self._position,
            replay=driver.replay,
            drain=drain,
            migrate=driver.migrate,
            blame=blame,
        )
        if rebuilt is None:  # draining, and nobody can take over yet
            driver.keep_serving(driver.hops[index], DRAIN_RETRY_SECONDS)
            return index, failed | {driver.hops[index].span.peer_id}
        self._install(driver.hops[: rebuilt.first] + rebuilt.suffix)
        for block, output in rebuilt.boundaries.items():
            self._history.adopt(block, output)
        await close_all(list(rebuilt.retired))
        self.recoveries.append(rebuilt.record)
        await self._follow(rebuilt.boundaries.keys())
        return rebuilt.first, rebuilt.failed


__all__ = ["RemoteSession"]
