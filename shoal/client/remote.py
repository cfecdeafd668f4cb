"""The block stack on remote servers: :class:`RemoteSequence` (routing, stateless forwards) and
:class:`RemoteSession` (a chain of servers that survives failures). They live in
:mod:`shoal.client.sequence` and :mod:`shoal.client.session`, which put together the step driver
(:mod:`~shoal.client.driver`), the replay history (:mod:`~shoal.client.history`), the recovery
policy (:mod:`~shoal.client.recovery`) and routing feedback (:mod:`~shoal.client.feedback`)."""

from shoal.client.sequence import RemoteSequence
from shoal.client.session import RemoteSession

__all__ = ["RemoteSequence", "RemoteSession"]
