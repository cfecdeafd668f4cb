"""``AutoDistributedModelForCausalLM.from_pretrained``: a Hugging Face causal LM whose blocks run
on the swarm. The client loads the config, tokenizer and generation config, and only the
embeddings, final norm and LM head; never a block's weights."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer, GenerationConfig

from shoal.checkpoints import load_config, load_tensors, model_name, resolve_model
from shoal.client.config import ClientConfig
from shoal.client.model import DistributedModelForCausalLM
from shoal.client.remote import RemoteSequence
from shoal.client.remote.pipeline import DEFAULT_PREFILL_CHUNK
from shoal.client.training.prompts import PromptTuning
from shoal.client.verification.audit import DEFAULT_VERIFY
from shoal.errors import ModelNotFoundError, ShoalError, UsageError
from shoal.ids import BlockRange
from shoal.models import get_family
from shoal.quantization import DEFAULT_MIN_QUALITY, Quantization, parse_min_quality
from shoal.routing import AdapterChoice
from shoal.swarm.members import parse_certificate
from shoal.transport import Node, StartNode, Ticket, TransportConfig
from shoal.weights.join import fetches_from_swarm
from shoal.wire import Codec

if TYPE_CHECKING:
    from shoal.server.config import ServerConfig

log = logging.getLogger(__name__)


class AutoDistributedModelForCausalLM:
    @staticmethod
    def from_pretrained(
        model: str,
        initial_peers: Sequence[str | Ticket],
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        transport: TransportConfig | None = None,
        revision: str | None = None,
        push: bool = True,
        compression: str | Codec | None = None,
        refresh_period: float = 30.0,
        routing_seed: int | None = None,
        start_node: StartNode = Node.start,
        min_quality: str | Quantization = DEFAULT_MIN_QUALITY,
        tuning_mode: str | None = None,
        pre_seq_len: int = 0,
        adapter: str | None = None,
        verify: str = DEFAULT_VERIFY,
        audit_every: int | None = None,
        require_verified: bool = False,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        route_wait: float = 10.0,
        identity: bytes | None = None,
        member_cert: bytes | str | None = None,
        local_blocks: str | BlockRange | None = None,
    ) -> DistributedModelForCausalLM:
        """``model``: a local Hugging Face directory, a known model name (``smollm2``) or a Hub id
        (only config, tokenizer and the shard with the client's tensors are downloaded).
        ``initial_peers``: tickets of swarm members (any one per swarm) and of standalone servers,
        in any mix; the servers they lead to must together host every block. ``push``: servers
        hand a step's output straight to the next server (else the client drives every hop).
        ``compression``: how hidden states travel to and from every server that announced the
        codec (the others get raw float32): None or
        ``"raw"`` (float32, exact), ``"bf16"``, ``"fp16"`` (2 bytes a value) or ``"q8"`` (8-bit
        blocks of 64 values, ~1.06 bytes a value; see :mod:`shoal.wire.codecs`).
        ``refresh_period``: seconds between background refreshes of the server list and measured
        latencies. ``route_wait``: when no live server is left for some blocks during a session,
        seconds to wait for one to join before :class:`~shoal.routing.NoRouteError` (0: at once).
        ``routing_seed``: seeds the random
        choices of routes (stateless forward spreads load by drawing servers). ``start_node``: how
        the client's node starts (iroh by default; ``MemoryNetwork.start`` reaches a swarm of
        servers inside this process, see :mod:`shoal.launch`). ``min_quality``: the lowest weight format
        of a server to route over: ``"int8"`` (the default: full precision and int8), ``"nf4"``
        (anything), or ``"fp32"`` (``"bf16"``, ``"fp16"``: full precision only).
        ``tuning_mode``: None, ``"ptune"`` or ``"deep_ptune"``, with ``pre_seq_len`` trainable prompt
        positions (see :mod:`shoal.client.training.prompts`; ``model.save_prompts`` / ``load_prompts``).
        ``adapter``: ``"NAME"`` or ``"NAME@DIGEST"`` (sha256 of the adapter's tensors): route only
        over servers serving that LoRA adapter, and run every block with it. ``verify``: ``"audit"``
        (the default): every hop of a session is checked by a second server every ``audit_every``
        positions (default 16) and before ``generate`` returns; ``"redundant"``: every step also
        runs on a second chain with no server of the main one, hop by hop on the same inputs, so a
        lie is caught at the step that told it (``audit_every`` is then 1: leave it unset; any
        other value raises :class:`UsageError`); or ``"off"``: nothing is checked (the client logs
        a warning once). Auditing, a disagreement is settled by a third opinion, a liar banned and
        the answer repaired (:mod:`shoal.client.verification.audit`; ``model.verification`` counts
        what audits did). Not audited in any mode: stateless forwards (``model(...)`` logits
        without a session's cache, ``generate(use_cache=False)``, training forwards and
        backwards), and a span nobody else can check (``model.verification.unverified`` lists its
        blocks; the session goes on). ``require_verified``: with a mode that audits, a session
        whose chain has a block no other server can check fails with
        :class:`~shoal.client.verification.audit.UnverifiedBlocks` instead of generating.
        ``prefill_chunk``: a session step of more positions (a long prompt) travels the chain in
        chunks of this many, pipelined: the second server computes chunk 1 while the first
        computes chunk 2 (same tokens; None or 0: off; see :mod:`shoal.client.remote.pipeline`);
        ``model.blocks.prefill_chunk`` changes it from the next step on.
        ``identity``: the client node's 32-byte secret key (default: a new one), and ``member_cert``
        a private swarm's member certificate issued for it (``shoal swarm invite``; its text or bytes).
        ``local_blocks``: ``"START:END"`` (or a :class:`~shoal.ids.BlockRange`): blocks this process
        serves itself, built as ``shoal serve`` builds them and announced to the swarm of
        ``initial_peers`` like any server (other clients' sessions use them too); this client reaches
        them without a network hop and routes the rest. They stop with ``model.close()``.
        Every setting but ``start_node`` lands, checked before anything is loaded, on one frozen
        :class:`~shoal.client.config.ClientConfig` (``model.blocks.config``) that the client runs from."""
        client_config = ClientConfig(
            dtype=dtype,
            device=device,
            revision=revision,
            transport=transport if transport is not None else TransportConfig(),
            compression=_compression(compression),
            push=push,
            refresh_period=refresh_period,
            routing_seed=routing_seed,
            min_quality=parse_min_quality(min_quality),
            adapter=AdapterChoice.parse(adapter) if adapter is not None else None,
            verify=verify,
            audit_every=audit_every,
            require_verified=require_verified,
            prefill_chunk=prefill_chunk,
            route_wait=route_wait,
            tuning_mode=tuning_mode,
            pre_seq_len=pre_seq_len,
            identity=identity,
            member_cert=parse_certificate(member_cert) if isinstance(member_cert, str) else member_cert,
            local_blocks=_block_range(local_blocks),
        )
        return AutoDistributedModelForCausalLM.from_client_config(
            model, initial_peers, client_config, start_node=start_node
        )

    @staticmethod
    def from_client_config(
        model: str,
        initial_peers: Sequence[str | Ticket],
        client_config: ClientConfig,
        *,
        start_node: StartNode = Node.start,
    ) -> DistributedModelForCausalLM:
        """:meth:`from_pretrained` with its settings already one :class:`ClientConfig` (``shoal api``
        and ``shoal chat`` make one of their flags): one path from settings to a running client."""
        if initial_peers and fetches_from_swarm(model):
            fetch_client_part(model, initial_peers, client_config, start_node)
        model_dir = resolve_model(model, client=True, revision=client_config.revision)
        config = load_config(model_dir)
        family = get_family(config)
        tensors = load_tensors(model_dir, family.client_tensor_names(config))
        head = family.build_client_head(config, tensors, client_config.dtype, client_config.device)
        del tensors
        num_blocks = family.num_blocks(config)
        prompts = None
        if client_config.tuning_mode is not None:
            prompts = PromptTuning(client_config.tuning_mode, client_config.pre_seq_len, config.hidden_size, num_blocks)
            prompts = prompts.to(client_config.device)
        host = None
        if client_config.local_blocks is not None:
            host, client_config = _hosted(model, initial_peers, client_config, num_blocks)
        blocks = RemoteSequence.connect(
            initial_peers, num_blocks, config.hidden_size, client_config, model=model_name(model),
            start_node=start_node, host=host,
        )  # fmt: skip
        distributed = DistributedModelForCausalLM(config, head, blocks, prompts=prompts)
        if (Path(model_dir) / "generation_config.json").is_file():
            distributed.generation_config = GenerationConfig.from_pretrained(model_dir)
        distributed.tokenizer = _tokenizer(model_dir)
        return distributed


def fetch_client_part(
    model: str, initial_peers: Sequence[str | Ticket], config: ClientConfig, start_node: StartNode = Node.start
) -> None:
    """Fetch the client's part of ``model`` (config, tokenizer, embeddings and head) from the members
    of a swarm ``initial_peers`` lead to (:func:`shoal.weights.join.fetch_client_from_swarm`; each
    swarm in turn, until one gives it): a model with no files here. A known model no swarm gives
    comes from its package."""
    with _fetching(model):  # one fetch of a model's part at a time here: a second finds it whole
        _fetch_client_part(model, initial_peers, config, start_node)


_FETCHES: dict[str, threading.Lock] = {}
_FETCHES_LOCK = threading.Lock()


def _fetching(model: str) -> threading.Lock:
    """The lock of fetches of ``model``'s client part in this process (e.g. a gateway's first requests
    for a model, at once): two fetches into one folder would collide."""
    with _FETCHES_LOCK:
        return _FETCHES.setdefault(model, threading.Lock())


def _fetch_client_part(
    model: str, initial_peers: Sequence[str | Ticket], config: ClientConfig, start_node: StartNode
) -> None:
    from shoal.checkpoints import KNOWN_MODELS
    from shoal.client.runtime import shared_loop
    from shoal.weights.join import fetch_weights

    swarms: dict[str, list[Ticket]] = {}
    for peer in initial_peers:
        ticket = peer if isinstance(peer, Ticket) else Ticket.parse(peer)
        if ticket.swarm_id is not None:  # a standalone server gives no files
            swarms.setdefault(ticket.swarm_id, []).append(ticket)
    failures: list[str] = []
    for tickets in swarms.values():
        fetching = fetch_weights(start_node, config.transport, tuple(tickets), model, None,
                                 credential=config.member_cert, secret_key=config.identity)  # fmt: skip
        try:
            report = shared_loop().run(fetching)
        except ShoalError as exc:  # no member answered, no such model, or no files of it given
            failures.append(str(exc))
            continue
        if report.fetched:
            log.info("fetched %s's embeddings and head (%.1f MB) from %d members", model, report.bytes / 1e6,
                     len(report.by_giver))  # fmt: skip
        return
    if not failures:  # no swarm among the tickets: resolving the name says what it is
        return
    if model in KNOWN_MODELS:
        log.info("%s; fetching %s from its package instead", "; ".join(failures), model)
        return
    raise ModelNotFoundError(
        f"unknown model {model!r}: no directory, Hub id (org/name) or known model of that name here, and no "
        f"swarm gave its files ({'; '.join(failures)})"
    )


def _block_range(value: str | BlockRange | None) -> BlockRange | None:
    if value is None or isinstance(value, BlockRange):
        return value
    try:
        return BlockRange.parse(value)
    except ValueError as exc:
        raise UsageError(f"local_blocks: {exc}") from None


def _hosted(
    model: str, initial_peers: Sequence[str | Ticket], config: ClientConfig, num_blocks: int
) -> tuple[ServerConfig, ClientConfig]:
    """The server settings of ``config.local_blocks`` (:mod:`shoal.server.hosted`), and the client's:
    the span's node binds the given address (peers dial it), the client's any free port beside it."""
    from shoal.server.hosted import beside, hosted_config

    blocks = config.local_blocks
    if blocks is None or not blocks.within(num_blocks):
        raise UsageError(f"local_blocks {blocks}: the model has {num_blocks} blocks")
    tickets = [t if isinstance(t, Ticket) else Ticket.parse(t) for t in initial_peers]
    host = hosted_config(model, blocks, tickets, config.dtype, config.device, config.transport)
    return host, replace(config, transport=beside(config.transport))


def _compression(value: str | Codec | None) -> Codec:
    if value is None:
        return Codec.RAW
    try:
        return Codec(value)
    except ValueError:
        names = ", ".join(repr(c.value) for c in Codec)
        raise UsageError(f"compression must be None or one of {names}, not {value!r}") from None


def _tokenizer(model_dir: Path):
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:  # a checkpoint without tokenizer files (e.g. random test models)
        log.info("no tokenizer in %s: %s", model_dir, exc)
        return None
