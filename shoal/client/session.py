"""An inference session over a chain of remote servers that survives server failures.

The session puts three parts together, none of which changes another's state: the
:class:`~shoal.client.driver.ChainDriver` owns the chain and runs steps through it, the
:class:`~shoal.client.history.SpanHistory` keeps the inputs at the chain's boundaries, and the
:class:`~shoal.client.recovery.ChainRecovery` policy returns a rebuilt chain that the session
installs in the driver (and whose replay outputs it adds to the history). Routing hears about
servers only through :class:`~shoal.client.feedback.RouteFeedback`.

* a hop that fails mid-step is aborted and rebuilt; the step goes on from the first hop replaced;
* a reply flagged ``draining`` (the server is leaving) moves that span the same way, before the
  next step; while nobody can take over, the leaving server keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from shoal.client.blocks import SessionPositions
from shoal.client.driver import ChainDriver, HopFailed
from shoal.client.history import SpanHistory
from shoal.client.hops import Hop, close_all
from shoal.client.recovery import ChainRecovery, Rebuilt, RecoveryRecord
from shoal.errors import BadRequest, ShoalError
from shoal.routing import ServerSpan
from shoal.wire.schema import OpenRequest

if TYPE_CHECKING:
    from shoal.client.sequence import RemoteSequence


class RemoteSession(SessionPositions):
    """A :class:`~shoal.client.blocks.BlockSession` over a chain of servers (one stream each).
    ``prompts``: deep prompts ``[num_blocks, batch or 1, N, hidden]`` every server adds to its
    blocks' inputs at positions ``[0, N)`` (each gets its span's slice when its session opens,
    a replacement too). The session runs with the sequence's adapter, if it has one."""

    def __init__(self, sequence: RemoteSequence, batch_size: int, max_length: int, prompts: Tensor | None = None):
        super().__init__(batch_size, max_length)
        self.runtime = sequence.runtime
        self.num_blocks = sequence.num_blocks
        directory = sequence.directory
        self._driver = ChainDriver(
            directory, sequence.node.config.deadlines.request, push=sequence.push, compression=sequence.compression
        )
        adapter = directory.adapter.name if directory.adapter is not None else None
        request = OpenRequest(
            max_length=max_length, batch_size=batch_size, prompts=prompts is not None, adapter=adapter
        )
        self._recovery = ChainRecovery(
            sequence.node, directory, directory, request, push=sequence.push, prompts=prompts
        )
        self._history = SpanHistory(batch_size)
        self._chain: list[ServerSpan] = []  # the last chain installed (still readable once closed)
        self._closed = False
        self.recoveries: list[RecoveryRecord] = []  # what happened, in order

    @property
    def closed(self) -> bool:
        return self._closed

    def _rolled_back(self, position: int) -> None:
        self._history.truncate(position)

    @property
    def chain(self) -> list[ServerSpan]:
        """The servers the session runs on now (the last ones, once closed)."""
        return list(self._chain)

    @property
    def cache_tokens(self) -> int:
        return self.batch_size * self.max_length

    # ---- opening and closing -------------------------------------------------------------------

    async def open(self) -> None:
        self._install(await self._recovery.open_chain())

    def _install(self, hops: Sequence[Hop]) -> None:
        self._driver.install(hops)
        self._chain = self._driver.chain

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            hops = list(self._driver.hops)
            self._driver.install(())
            self._history.clear()
            self.runtime.run(close_all(hops))

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        n = self._check_step(hidden, attention_mask)
        out = self.runtime.run(self._step(hidden, position_ids, attention_mask))
        self._position += n
        return out

    async def _step(self, hidden: Tensor, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        driver, position = self._driver, self._position
        failed: frozenset[str] = frozenset()
        while (leaving := driver.leaving()) is not None:  # the server said it is leaving: move its span first
            peer = driver.hops[leaving].span.peer_id
            _, failed = await self._recover(leaving, ShoalError(f"server {peer[:10]} is draining"), failed, drain=True)
        inputs: dict[int, Tensor] = {0: hidden}  # block -> this step's input there
        index = 0
        while True:
            try:
                await driver.run(index, inputs, position_ids, mask, position)
                break
            except HopFailed as failure:
                if isinstance(failure.cause, BadRequest):  # our request was wrong: another server would
                    raise failure.cause from None  # refuse it too; the session stays usable
                await driver.hops[failure.index].abort()
                index, failed = await self._recover(failure.index, failure.cause, failed)
        self._history.record(inputs, driver.starts, position_ids, mask, position + hidden.shape[1])
        return inputs[self.num_blocks]

    async def _recover(
        self, index: int, cause: BaseException, failed: frozenset[str], drain: bool = False
    ) -> tuple[int, frozenset[str]]:
        """Rebuild the chain around hop ``index`` and install it. Returns the index of the first
        hop replaced (the step goes on from there) and the servers found failing so far."""
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
        )
        if rebuilt is None:  # draining, and nobody can take over yet
            driver.keep_serving(driver.hops[index])
            return index, failed | {driver.hops[index].span.peer_id}
        self._install(driver.hops[: rebuilt.first] + rebuilt.suffix)
        for block, output in rebuilt.boundaries.items():
            self._history.adopt(block, output)
        await close_all(list(rebuilt.retired))
        self.recoveries.append(rebuilt.record)
        return rebuilt.first, rebuilt.failed


__all__ = ["RemoteSession"]
