"""Testifying: after a majority convicted a server, send the evidence to the servers that serve its blocks.

(Being built: :class:`Witness` is the seam the audits call; see the evidence kind in
:mod:`shoal.wire.schema` and the judge in :mod:`shoal.server.judge`.)
"""

from __future__ import annotations

from shoal.client.audit import Verification
from shoal.client.history import SpanHistory
from shoal.ids import PeerId
from shoal.routing import ServerSpan
from shoal.transport import BaseNode


class Witness:
    """Builds evidence of a settled lie and sends it, in the background, to every other server of
    the swarm that serves the liar's blocks; counts what the judges found in ``verification``."""

    def __init__(self, node: BaseNode, directory, verification: Verification):
        self.node = node
        self.directory = directory
        self.verification = verification

    def report(self, span: ServerSpan, liar: PeerId, position: int, history: SpanHistory) -> None:
        """``liar`` (the server of ``span``) answered wrong outputs from ``position`` on. Takes what
        the evidence needs from ``history`` now (the session rolls back right after), then testifies
        without blocking the session."""

    async def close(self) -> None:
        """Wait (bounded) for testimony still on its way, then stop."""
