"""Client settings: the one frozen object ``from_pretrained`` makes of its keywords.

``AutoDistributedModelForCausalLM.from_pretrained`` (:mod:`shoal.client.auto`) parses what users
write (``min_quality="nf4"``, ``adapter="NAME@DIGEST"``, ``compression="q8"``) and builds one
:class:`ClientConfig`; ``RemoteSequence.connect`` (:mod:`shoal.client.remote.sequence`) and
:class:`~shoal.client.remote.directory.ServerDirectory` get it whole, so a setting is named and checked
once, here, instead of being relayed keyword by keyword.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.client.remote.pipeline import DEFAULT_PREFILL_CHUNK
from shoal.client.verification.audit import DEFAULT_VERIFY, check_verify
from shoal.devices import check_device
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.quantization import DEFAULT_MIN_QUALITY, Quantization
from shoal.routing import AdapterChoice
from shoal.swarm.members import public_key, read_certificate
from shoal.transport import TransportConfig
from shoal.wire import Codec

__all__ = ["ClientConfig"]


LISTING_ANSWER_S = 2.0  # seconds beyond the connect deadline a live peer needs to answer a listing


@dataclass(frozen=True)
class ClientConfig:
    """How one client loads its part of the model, routes, verifies and runs sessions. Checked when
    made (:class:`UsageError`, or ``ValueError`` for a negative ``prefill_chunk``).

    ``verify`` is ``"audit"`` unless set: a second server re-runs every hop of a session each
    ``audit_every`` positions (:mod:`shoal.client.verification.audit`). ``"off"`` checks nothing
    and logs a warning once per client. Never audited, in any mode: stateless forwards
    (``model(...)`` without a session's cache, ``generate(use_cache=False)``, training forwards
    and backwards) and a span no other server serves alike (``model.verification.unverified``)."""

    # the client's own tensors (embeddings, final norm, LM head)
    dtype: torch.dtype = torch.float32  # of the client's tensors (hidden states travel as float32)
    device: str = "cpu"  # where the client's tensors live and run
    revision: str | None = None  # Hub revision of the checkpoint (None: the default branch)
    # transport
    transport: TransportConfig = field(default_factory=TransportConfig)  # deadlines, bind address, network profile
    identity: bytes | None = field(default=None, repr=False)  # the node's secret key (None: a new one each start)
    member_cert: bytes | None = None  # a private swarm's member certificate for ``identity`` (shoal swarm invite)
    compression: Codec = Codec.RAW  # hidden states to and from the servers that announced it (others: raw float32)
    # routing
    push: bool = True  # a session's servers hand a step's output straight to the next (else the client drives hops)
    refresh_period: float = 30.0  # seconds between background refreshes of the server list and latencies (0: never)
    routing_seed: int | None = None  # seeds the random choices of routes (None: unseeded)
    min_quality: Quantization = DEFAULT_MIN_QUALITY  # the lowest weight format of a server routed over
    adapter: AdapterChoice | None = None  # LoRA adapter every block runs with; only its servers are routed over
    route_wait: float = 10.0  # seconds a session waits for a server to join when no live one is left for some blocks
    # blocks this client serves itself, in its own process (shoal.server.hosted): announced to the
    # swarm like any server's, reached by this client without a network hop (None: none)
    local_blocks: BlockRange | None = None
    # verification (shoal.client.verification.audit)
    verify: str = DEFAULT_VERIFY  # "audit" (a second server checks every hop), "redundant" (every step, twice), "off"
    audit_every: int | None = None  # positions between audits of a hop (None: the mode's default; redundant: 1)
    require_verified: bool = False  # fail (UnverifiedBlocks) rather than generate with a block nothing checks
    # sessions
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK  # a longer step is pipelined in chunks of this (None, 0: off)
    # prompt tuning (shoal.client.training.prompts)
    tuning_mode: str | None = None  # None, "ptune" or "deep_ptune"
    pre_seq_len: int = 0  # trainable prompt positions before every sequence (with a tuning_mode)

    def __post_init__(self) -> None:
        if self.member_cert is not None:
            if self.identity is None:
                raise UsageError("a member certificate names a peer id: give the identity key it was issued for")
            cert = read_certificate(self.member_cert)
            if cert.member != public_key(self.identity):
                raise UsageError(f"the member certificate is for peer {cert.member[:10]}, not this identity's "
                                 f"{public_key(self.identity)[:10]}")  # fmt: skip
        check_device(self.device, "device")
        check_verify(self.verify, self.audit_every)
        if self.require_verified and self.verify == "off":
            raise UsageError("require_verified=True needs verify='audit' or 'redundant' ('off' checks nothing)")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be None, 0 (off) or positive, not {self.prefill_chunk}")
        if not self.route_wait >= 0:
            raise UsageError(f"route_wait must be 0 (fail at once) or more seconds, not {self.route_wait}")
        if self.local_blocks is not None and not isinstance(self.local_blocks, BlockRange):
            raise UsageError(f"local_blocks must be a BlockRange (from_pretrained takes 'START:END'), not "
                             f"{self.local_blocks!r}")  # fmt: skip
        if self.tuning_mode is None and self.pre_seq_len:
            raise UsageError(f"pre_seq_len={self.pre_seq_len} needs tuning_mode='ptune' or 'deep_ptune'")

    @property
    def listing_timeout(self) -> float:
        """How long the dial, then the answer, of a request listing servers (a table, an ``info``)
        may each take: a peer that has not answered by then is skipped, so one dead ticket does not
        hold up the rest for a whole request deadline."""
        return self.transport.deadlines.connect + LISTING_ANSWER_S
