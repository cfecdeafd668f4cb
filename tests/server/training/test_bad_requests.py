"""Bad training requests to a server (the setting: ``test_backward.py``): a malformed backward or
session prompts are refused naming the problem, reserve nothing, and the stream keeps serving."""

from __future__ import annotations

import pytest
import torch

from shoal.errors import BadRequest
from shoal.protocols import BLOCKS
from shoal.wire import Message
from shoal.wire.schema import OpenReply, OpenRequest
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, inputs
from tests.server.training.bench import (
    HIDDEN,
    assert_grad_close,
    assert_same,
    backward,
    chunks,
    info,
    local_grads,
    local_out,
    padded_inputs,
    random_prompts,
    run,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]


# ---- bad requests --------------------------------------------------------------------------------
BAD_BACKWARDS = {
    "grad_wrong_shape": (
        lambda t, g, p: [*t, g[:, :5]],
        False,
        r"grad_output must be float32, float16 or bfloat16 \[2, 6, 64\] \(the output's shape\), "
        r"got torch\.float32 \[2, 5, 64\]",
    ),
    "grad_not_float": (
        lambda t, g, p: [*t, g.long()],
        False,
        r"grad_output must be .* \[2, 6, 64\] \(the output's shape\), got torch\.int64 \[2, 6, 64\]",
    ),
    "prompts_of_three_blocks": (
        lambda t, g, p: [*t, torch.cat([p, p[:1]]), g],
        True,
        r"deep prompts must be \[2 \(the span's blocks\), 1 or 2, N <= 6, 64\], got \[3, 1, 2, 64\]",
    ),
    "prompts_longer_than_the_pass": (
        lambda t, g, p: [*t, torch.zeros(2, 1, 7, HIDDEN), g],
        True,
        r"deep prompts must be \[2 \(the span's blocks\), 1 or 2, N <= 6, 64\], got \[2, 1, 7, 64\]",
    ),
    "prompts_not_float": (
        lambda t, g, p: [*t, p.to(torch.int32), g],
        True,
        r"deep prompts must be float32, float16 or bfloat16, got torch\.int32",
    ),
    "no_grad_output": (
        lambda t, g, p: t[:2],
        False,
        r"expected \[hidden, position_ids, attention_mask\?, grad_output\], got 2 tensors",
    ),
    "prompts_announced_not_sent": (
        lambda t, g, p: [*t[:2], g],
        True,
        r"expected \[hidden, position_ids, attention_mask\?, prompts, grad_output\], got 3 tensors",
    ),
}


def test_bad_backwards_are_refused_naming_the_problem_and_the_stream_keeps_serving(serve, span):
    """Each bad backward gets ``bad_request`` naming what is wrong, on one stream; a correct backward
    on that stream afterwards equals local autograd; none of the refused ones ran."""
    swarm = serve()
    tensors = padded_inputs(seed=12)
    grad_output = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(13))
    prompts = random_prompts(2, 1, 2, seed=14)

    async def go(node, ticket):
        stream = await node.open_stream(ticket, BLOCKS)
        for make, with_prompts, message in BAD_BACKWARDS.values():
            with pytest.raises(BadRequest, match=message):
                await backward(stream, make(tensors, grad_output, prompts), prompts=with_prompts)
        grads = await backward(stream, [*tensors, prompts, grad_output], prompts=True)
        await stream.finish()
        return grads, await info(node, ticket)

    grads, reply = run(swarm, go)
    for got, want in zip(grads, local_grads(span, tensors, grad_output, prompts), strict=True):
        assert_grad_close(got, want)
    c = reply.counters
    assert c.errors == len(BAD_BACKWARDS) and c.backward_requests == 1 and c.training_chunks == chunks(2)


def test_bad_session_prompts_are_refused_at_open_and_reserve_nothing(serve, span):
    """Opens whose prompts do not fit the session are refused naming the problem, on a stream that
    then opens a good session; the cache budget is untouched by the refused ones."""
    swarm = serve()
    good = random_prompts(2, 2, 4, seed=15)
    bad_opens = [
        (
            OpenRequest(max_length=8, batch_size=2, prompts=True),
            [],
            r"open takes one tensor \(the deep prompts\), got 0",
        ),
        (OpenRequest(max_length=8, batch_size=2), [good], r"open takes no tensors \(without prompts\), got 1"),
        (
            OpenRequest(max_length=3, batch_size=2, prompts=True),
            [good],
            r"deep prompts must be \[2 \(the span's blocks\), 1 or 2, N <= 3, 64\], got \[2, 2, 4, 64\]",
        ),
        (
            OpenRequest(max_length=8, batch_size=3, prompts=True),
            [good],
            r"deep prompts must be \[2 \(the span's blocks\), 1 or 3, N <= 8, 64\], got \[2, 2, 4, 64\]",
        ),
    ]

    async def go(node, ticket):
        stream = await node.open_stream(ticket, BLOCKS)
        for meta, tensors, message in bad_opens:
            with pytest.raises(BadRequest, match=message):
                await stream.request(Message("open", stream.next_id(), meta, tensors))
        assert (await info(node, ticket)).free_cache_tokens == 512
        meta = OpenRequest(max_length=8, batch_size=2, prompts=True)
        session = Session(
            stream, (await stream.request(Message("open", stream.next_id(), meta, [good]))).reply(OpenReply)
        )
        x = inputs(HIDDEN, 5, batch=2, seed=16)
        assert_same(await session.step(0, x), local_out(span, x, span.allocate_cache(2, 8), 0, prompts=good))
        await session.close()
        return await info(node, ticket)

    reply = run(swarm, go)
    assert reply.counters.errors == len(bad_opens) and reply.counters.sessions_opened == 1
