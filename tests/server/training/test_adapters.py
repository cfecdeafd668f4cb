"""LoRA adapters on a server (the setting: ``test_backward.py``): announced in its info and record,
sorted by name, run on requests that name them; an unknown one is a bad request; a quantised
server refuses them before loading."""

from __future__ import annotations

import pytest
import torch

from shoal.errors import BadRequest, ShoalError
from shoal.ids import BlockRange
from shoal.launch.inprocess import LOOPBACK
from shoal.models.lora import adapter_digest
from shoal.protocols import BLOCKS
from shoal.wire import Message
from shoal.wire.schema import ForwardRequest, OpenRequest
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import inputs
from tests.server.training.bench import (
    HIDDEN,
    SPAN,
    assert_grad_close,
    assert_same,
    backward,
    forward,
    info,
    local_grads,
    local_out,
    open_session,
    padded_inputs,
    random_prompts,
    run,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


def test_a_server_with_an_adapter_announces_it_and_runs_requests_with_it(serve, adapter_dir, adapted_span):
    """``info`` names the adapter with the digest of its whole tensors; a forward, a backward and a
    session with ``adapter="tuned"`` equal the local span under that adapter, and requests without
    an adapter still run the base weights."""
    swarm = serve(adapters=(("tuned", adapter_dir),))
    span, adapters = adapted_span
    tensors = padded_inputs(seed=30)
    grad_output = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(31))
    prompts = random_prompts(2, 1, 2, seed=32)

    async def go(node, ticket):
        reply = await info(node, ticket)
        tuned = await forward(node, ticket, tensors, adapter="tuned")
        base = await forward(node, ticket, tensors)
        grads = await backward((node, ticket), [*tensors, prompts, grad_output], prompts=True, adapter="tuned")
        session = await open_session(node, ticket, max_length=8, adapter="tuned")
        cache = span.allocate_cache(1, 8)
        for position, n in ((0, 3), (3, 1)):
            x = inputs(HIDDEN, n, start=position, seed=33 + position)
            assert_same(
                await session.step(position, x), local_out(span, x, cache, position, adapters=adapters, adapter="tuned")
            )
        await session.close()
        return reply, tuned, base, grads

    reply, tuned, base, grads = run(swarm, go)
    assert [(a.name, a.digest) for a in reply.span.adapters] == [("tuned", adapter_digest(adapter_dir))]
    assert_same(tuned, local_out(span, tensors, adapters=adapters, adapter="tuned"))
    assert_same(base, local_out(span, tensors, adapters=adapters))
    assert (tuned - base).abs().max() > 0.05  # the adapter changes the output
    expected = local_grads(span, tensors, grad_output, prompts, adapters=adapters, adapter="tuned")
    for got, want in zip(grads, expected, strict=True):
        assert_grad_close(got, want)


def test_an_unknown_adapter_is_a_bad_request_naming_it(serve, adapter_dir, span):
    """On a server without adapters and on one with ``tuned``: forward, backward and open naming an
    adapter the server lacks get ``bad_request`` naming it and what the server has; the open reserved
    nothing and the stream goes on."""
    plain, adapted = serve(), serve(adapters=(("tuned", adapter_dir),))
    tensors = inputs(HIDDEN, 3, seed=40)

    async def refused(node, ticket, have: str):
        message = rf"unknown LoRA adapter 'other': this server has {have}"
        stream = await node.open_stream(ticket, BLOCKS)
        with pytest.raises(BadRequest, match=message):
            await stream.request(Message("forward", stream.next_id(), ForwardRequest(adapter="other"), tensors))
        with pytest.raises(BadRequest, match=message):
            await backward(stream, [*tensors, torch.ones(1, 3, HIDDEN)], adapter="other")
        with pytest.raises(BadRequest, match=message):
            await stream.request(Message("open", stream.next_id(), OpenRequest(max_length=4, adapter="other")))
        out = (await stream.request(Message("forward", stream.next_id(), tensors=tensors))).tensors[0]
        await stream.finish()
        reply = await info(node, ticket)
        assert reply.free_cache_tokens == 512 and reply.counters.errors == 3
        return out, reply

    base, plain_info = run(plain, lambda node, ticket: refused(node, ticket, "none"))
    assert plain_info.span.adapters == ()
    assert_same(base, local_out(span, tensors))
    run(adapted, lambda node, ticket: refused(node, ticket, "tuned"))


def test_adapters_on_a_quantised_server_are_refused_before_loading(adapter_dir, model_dir):
    from shoal.quantization import Quantization
    from shoal.server.config import ServerConfig

    with pytest.raises(ShoalError, match=r"LoRA adapters on quantised servers are not supported"):
        ServerConfig(
            model=str(model_dir), blocks=BlockRange(*SPAN), quant=Quantization.INT8, adapters=(("a", adapter_dir),)
        )


def test_the_server_record_carries_the_adapters_sorted_by_name(serve, adapter_dir):
    """What the swarm hears: the loaded server's adapters (name, digest) in its signed record, sorted
    by name, and they survive the record's encoding (a peer decodes the same)."""
    import time

    from shoal.server.announce import Announcement
    from shoal.swarm.gossip import GossipConfig
    from shoal.swarm.records import decode
    from shoal.transport.identity import generate_key

    swarm = serve(adapters=(("zeta", adapter_dir), ("alpha", adapter_dir)))
    digest = adapter_digest(adapter_dir)
    infos = swarm.servers[0].server.info.adapters
    assert [(a.name, a.digest) for a in infos] == [("alpha", digest), ("zeta", digest)]

    async def record():
        key = generate_key()
        node = await swarm.network.start(LOOPBACK, secret_key=key)
        try:
            announcement = Announcement(
                node, key, "ab" * 8, "tiny", BlockRange(*SPAN), ["00" * 32] * 2, 1.0, GossipConfig()
            )
            announcement.adapters = tuple((a.name, a.digest) for a in reversed(infos))
            return decode(announcement.server_record(time.time()).data).record
        finally:
            await node.close()

    assert swarm.runtime.run(record(), 10).adapters == (("alpha", digest), ("zeta", digest))
