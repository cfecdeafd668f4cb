"""The block stack on remote servers, the client's session driving over the swarm:
:class:`RemoteSequence` (routing, stateless forwards; :mod:`.sequence`) and :class:`RemoteSession`
(a chain of servers that survives failures; :mod:`.session`), put together from the step driver
(:mod:`.driver`, one server's part: :mod:`.hops`), pipelined prefill (:mod:`.pipeline`), the replay
history (:mod:`.history`), the recovery policy (:mod:`.recovery`), and the servers known and
measured (:mod:`.directory`, its narrow faces: :mod:`.feedback`).

The two classes are imported on first use: the modules of this package import the client's config
and verification, which import parts of this package in turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.client.remote.sequence import RemoteSequence
    from shoal.client.remote.session import RemoteSession

__all__ = ["RemoteSequence", "RemoteSession"]


def __getattr__(name: str):
    if name == "RemoteSequence":
        from shoal.client.remote.sequence import RemoteSequence

        return RemoteSequence
    if name == "RemoteSession":
        from shoal.client.remote.session import RemoteSession

        return RemoteSession
    raise AttributeError(f"module 'shoal.client.remote' has no attribute {name!r}")
