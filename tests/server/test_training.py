"""Training through a server (issue 20, the server side): ``backward``, deep prompts on forwards and
sessions, LoRA adapters, and training at the compute thread's lowest priority.

Real servers (:mod:`shoal.server.builder`) in this process on an in-memory network
(:class:`shoal.launch.InProcessSwarm`), one torch thread, talked to with raw typed messages. "Equal"
means: the same blocks run locally (:func:`shoal.checkpoints.load_span`) give the same values, for
gradients within ``max|diff| <= 1e-4 * max|g| + 1e-7`` of local autograd.

A backward runs block by block (one compute task per block and pass, through ``span.sub_span``): a
span of B blocks takes 2B - 1 training chunks (B - 1 no-grad forwards, B gradient blocks).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import nullcontext

import pytest
import torch

from shoal.checkpoints import load_config, load_span
from shoal.errors import BadRequest, ShoalError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LOOPBACK
from shoal.models.lora import SpanAdapters, adapter_digest, read_adapter
from shoal.protocols import BLOCKS
from shoal.server.backend import row_groups
from shoal.server.scheduler import Priority
from shoal.transport import MessageStream
from shoal.wire import Message
from shoal.wire.schema import BackwardRequest, ForwardRequest, InfoReply, OpenReply, OpenRequest
from testkit.tiny import tiny_checkpoint, tiny_model
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, inputs

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_server_errors")]

HIDDEN = 64
SPAN = (1, 3)
SEED = 1


def chunks(blocks: int, row_groups: int = 1) -> int:
    """Training chunks of one backward through ``blocks`` blocks: per group of rows a no-grad pass
    (every block but the last) and a gradient pass (every block), then one that joins the answer."""
    return row_groups * (2 * blocks - 1) + 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-training"), "llama", seed=SEED)


@pytest.fixture(scope="module")
def span(model_dir):
    return load_span(model_dir, *SPAN)[0]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A LoRA adapter of the tiny llama made with peft, B matrices non-zero (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(7)
    model = get_peft_model(tiny_model("llama", SEED), config)
    out = tmp_path_factory.mktemp("tiny-lora")
    model.save_pretrained(out)
    return out


@pytest.fixture
def serve(model_dir):
    """``serve(span=SPAN, **settings)``: an :class:`InProcessSwarm` of one server, closed after the test."""
    swarms: list[InProcessSwarm] = []

    def make(span=SPAN, **settings) -> InProcessSwarm:
        swarm = InProcessSwarm(model_dir, [], cache_tokens=512)
        swarms.append(swarm)
        swarm.add(BlockRange(*span), **settings)  # any ServerConfig field: dtype, adapters ...
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()


def run(swarm: InProcessSwarm, coro_fn, timeout: float = 30.0):
    """Run ``coro_fn(node, ticket)`` on the swarm's loop with a fresh client node."""

    async def go():
        node = await swarm.network.start(LOOPBACK)
        try:
            return await coro_fn(node, swarm.servers[0].ticket)
        finally:
            await node.close()

    return swarm.runtime.run(go(), timeout)


# ---- what the server should answer ---------------------------------------------------------------
def padded_inputs(batch: int = 2, n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """``[hidden, position_ids, attention_mask]``, the first row left-padded by 2."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, n, HIDDEN, generator=generator)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, :2] = False
    position_ids = (mask.long().cumsum(1) - 1).clamp_min(0)
    return [hidden, position_ids, mask]


def random_prompts(blocks: int, batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(blocks, batch, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def local_grads(span, tensors, grad_output, prompts=None, adapters=None, adapter=None) -> list[torch.Tensor]:
    """Local autograd of the same blocks: the gradients w.r.t. the hidden states (and prompts)."""
    hidden, position_ids, mask = tensors
    x = hidden.clone().requires_grad_()
    p = None if prompts is None else prompts.clone().requires_grad_()
    with adapters.active(adapter) if adapters is not None else nullcontext():
        out = span(x, position_ids, mask, prompts=p)
    return list(torch.autograd.grad(out, [x] if p is None else [x, p], grad_output))


@torch.inference_mode()
def local_out(span, tensors, cache=None, past_length=0, prompts=None, adapters=None, adapter=None):
    hidden, position_ids, *mask = tensors
    with adapters.active(adapter) if adapters is not None else nullcontext():
        return span(hidden, position_ids, mask[0] if mask else None, cache, past_length, prompts=prompts)


def assert_grad_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    bound = 1e-4 * expected.abs().max().item() + 1e-7
    assert (got - expected).abs().max().item() <= bound, ((got - expected).abs().max().item(), bound)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


async def backward(target, tensors, prompts: bool = False, adapter: str | None = None) -> list[torch.Tensor]:
    """A backward request on ``target``: a stream, or a ``(node, ticket)`` pair."""
    message = Message("backward", 1, BackwardRequest(prompts=prompts, adapter=adapter), list(tensors))
    if isinstance(target, MessageStream):
        message.id = target.next_id()
        return (await target.request(message)).tensors
    node, ticket = target
    return (await node.request(ticket, BLOCKS, message)).tensors


async def forward(node, ticket, tensors, prompts: bool = False, adapter: str | None = None) -> torch.Tensor:
    message = Message("forward", 1, ForwardRequest(prompts=prompts, adapter=adapter), list(tensors))
    return (await node.request(ticket, BLOCKS, message)).tensors[0]


async def open_session(node, ticket, max_length: int, batch_size: int = 1, prompts=None, adapter=None) -> Session:
    stream = await node.open_stream(ticket, BLOCKS)
    meta = OpenRequest(max_length=max_length, batch_size=batch_size, prompts=prompts is not None, adapter=adapter)
    reply = await stream.request(Message("open", 1, meta, [] if prompts is None else [prompts]))
    return Session(stream, reply.reply(OpenReply))


async def info(node, ticket) -> InfoReply:
    return (await node.request(ticket, BLOCKS, Message("info", 1))).reply(InfoReply)


# ---- gradients -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_batch", [None, 1, 2], ids=["no_prompts", "prompts_batch_1", "prompts_batch_2"])
def test_backward_equals_local_autograd_for_hidden_states_and_deep_prompts(serve, span, prompt_batch):
    """A padded batch of 2 through blocks 1:3: the gradients w.r.t. the hidden states and the deep
    prompts (3 positions, one per row or shared by both) equal local autograd; counted as one
    backward of 12 tokens in 4 training chunks (1 no-grad block, 2 gradient blocks, the answer)."""
    swarm = serve()
    tensors = padded_inputs(seed=3)
    grad_output = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(4))
    prompts = None if prompt_batch is None else random_prompts(2, prompt_batch, 3, seed=5)
    expected = local_grads(span, tensors, grad_output, prompts)

    async def go(node, ticket):
        sent = [*tensors, *([] if prompts is None else [prompts]), grad_output]
        return await backward((node, ticket), sent, prompts=prompts is not None), await info(node, ticket)

    grads, reply = run(swarm, go)
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected, strict=True):
        assert_grad_close(got, want)
    c = reply.counters
    assert (c.backward_requests, c.backward_tokens, c.training_chunks) == (1, 12, chunks(2))
    assert c.forward_requests == 0 and c.errors == 0


@pytest.mark.parametrize("prompt_batch", [1, 5], ids=["shared_prompts", "prompts_per_row"])
def test_a_batch_over_the_chunk_budget_is_cut_into_groups_of_rows_with_the_same_gradients(serve, span, prompt_batch):
    """5 rows of 60 tokens: at most TRAINING_CHUNK_POSITIONS (128) positions a task, so groups of 2, 2
    and 1 rows, each through both passes; the gradients (the prompts' summed over the groups when
    shared) equal local autograd."""
    assert row_groups(5, 60) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    swarm = serve()
    tensors = padded_inputs(batch=5, n=60, seed=8)
    grad_output = torch.randn(5, 60, HIDDEN, generator=torch.Generator().manual_seed(9))
    prompts = random_prompts(2, prompt_batch, 4, seed=10)
    expected = local_grads(span, tensors, grad_output, prompts)

    async def go(node, ticket):
        return await backward((node, ticket), [*tensors, prompts, grad_output], prompts=True), await info(node, ticket)

    grads, reply = run(swarm, go)
    for got, want in zip(grads, expected, strict=True):
        assert_grad_close(got, want)
    assert reply.counters.training_chunks == chunks(2, row_groups=3)


def test_backward_of_a_bfloat16_server_returns_gradients_in_the_inputs_dtype(serve, model_dir):
    """A bf16 span, fp32 hidden states and prompts: fp32 gradients, close to the bf16 local ones
    (both run the same bf16 blocks)."""
    swarm = serve(dtype=torch.bfloat16)
    local = load_span(model_dir, *SPAN, dtype=torch.bfloat16)[0]
    tensors = padded_inputs(seed=6)
    prompts = random_prompts(2, 1, 2, seed=7)
    grad_output = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(8))
    expected = local_grads(local, tensors, grad_output, prompts)

    async def go(node, ticket):
        return await backward((node, ticket), [*tensors, prompts, grad_output], prompts=True)

    grads = run(swarm, go)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


# ---- deep prompts on forwards and sessions -------------------------------------------------------
def test_forward_with_deep_prompts_equals_the_local_span(serve, span):
    swarm = serve()
    tensors = padded_inputs(seed=9)
    prompts = random_prompts(2, 2, 4, seed=10)

    async def go(node, ticket):
        return await forward(node, ticket, [*tensors, prompts], prompts=True), await forward(node, ticket, tensors)

    with_prompts, without = run(swarm, go)
    assert_same(with_prompts, local_out(span, tensors, prompts=prompts))
    assert_same(without, local_out(span, tensors))
    assert (with_prompts - without).abs().max() > 0.1  # the prompts did something


def test_a_session_opened_with_deep_prompts_adds_them_at_every_step(serve, span):
    """Prompts of 3 positions on a batch-2 session: a 2-token prefill, a 2-token step across the
    prompts' end (position 2 gets its prompt, 3 not) and two decode steps equal the local span run
    with the same prompts at the same positions; a session without prompts beside it is unaffected."""
    swarm = serve()
    prompts = random_prompts(2, 1, 3, seed=11)

    async def go(node, ticket):
        session = await open_session(node, ticket, max_length=8, batch_size=2, prompts=prompts)
        plain = await open_session(node, ticket, max_length=8, batch_size=2)
        cache, plain_cache = span.allocate_cache(2, 8), span.allocate_cache(2, 8)
        position = 0
        for n in (2, 2, 1, 1):
            x = inputs(HIDDEN, n, start=position, batch=2, seed=position)
            assert_same(await session.step(position, x), local_out(span, x, cache, position, prompts=prompts))
            assert_same(await plain.step(position, x), local_out(span, x, plain_cache, position))
            position += n
        await session.close()
        await plain.close()
        return await info(node, ticket)

    c = run(swarm, go).counters
    assert c.steps == 8 and c.sessions_closed == 2 and c.errors == 0


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


# ---- priority: session steps go between the blocks of a backward ---------------------------------
def test_a_session_step_runs_between_the_blocks_of_a_long_backward(serve, model_dir):
    """Blocks 0:4. Backward A is held inside its first gradient chunk (block 3, by a hook on the
    server's layer); meanwhile backward B queues its first chunk and a decode step arrives. Once A's
    chunk ends, the step runs next, ahead of B's earlier-queued chunk (counted as a jump) and before
    A's remaining blocks: it waited for one block of one backward, not for two backwards. All
    results equal local. Deterministic: the order is read from the layers' calls, not from timing."""
    swarm = serve(span=(0, 4))
    local = load_span(model_dir, 0, 4)[0]
    server = swarm.servers[0]
    compute = server.compute
    layers = server.server.backend.span.layers
    calls: list[tuple[str, int]] = []
    entered, release = threading.Event(), threading.Event()

    def record(index: int):
        def hook(module, args, kwargs):
            mode = "step" if torch.is_inference_mode_enabled() else "grad" if torch.is_grad_enabled() else "no_grad"
            calls.append((mode, index))
            if mode == "grad" and index == 3 and not entered.is_set():
                entered.set()
                assert release.wait(10), "the test never released backward A"

        return hook

    hooks = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    a_inputs, b_inputs = padded_inputs(seed=20), padded_inputs(seed=21)
    a_grad, b_grad = (torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(s)) for s in (22, 23))

    async def until(condition, what: str) -> None:
        for _ in range(2000):
            if condition():
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{what} did not happen within 10 s")

    async def go(node, ticket):
        session = await Session.open(node, ticket, max_length=8)
        prefill = inputs(HIDDEN, 4, seed=24)
        await session.step(0, prefill)
        loop = asyncio.get_running_loop()
        try:
            a = loop.create_task(backward((node, ticket), [*a_inputs, a_grad]))
            await until(entered.is_set, "backward A's first gradient chunk")
            b = loop.create_task(backward((node, ticket), [*b_inputs, b_grad]))
            await until(lambda: compute.queued(Priority.TRAINING) == 1, "backward B's first chunk queued")
            x = inputs(HIDDEN, 1, start=4, seed=25)
            step = loop.create_task(session.result(await session.send_step(4, x)))
            await until(lambda: compute.queued(Priority.INFERENCE) == 1, "the step queued")
            released_at = len(calls)
        finally:
            release.set()
        (_, out), a_grads, b_grads = await asyncio.gather(step, a, b)
        await session.close()
        return prefill, x, out, a_grads, b_grads, released_at, await info(node, ticket)

    try:
        prefill, x, out, a_grads, b_grads, released_at, reply = run(swarm, go)
    finally:
        for hook in hooks:
            hook.remove()
    cache = local.allocate_cache(1, 8)
    local_out(local, prefill, cache, 0)
    assert_same(out, local_out(local, x, cache, 4))
    assert_grad_close(a_grads[0], local_grads(local, a_inputs, a_grad)[0])
    assert_grad_close(b_grads[0], local_grads(local, b_inputs, b_grad)[0])
    assert calls[released_at : released_at + 4] == [("step", i) for i in range(4)]  # next after A's chunk
    assert ("grad", 2) in calls[released_at + 4 :]  # A's next block came after the step
    c = reply.counters
    assert c.inference_ahead_of_training == 1  # the step over B's chunk
    assert c.training_chunks == 2 * chunks(4) and c.backward_requests == 2 and c.steps == 2


# ---- LoRA adapters -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapted_span(model_dir, adapter_dir):
    """Local blocks 1:3 with the adapter under the name ``tuned``."""
    span = load_span(model_dir, *SPAN)[0]
    adapters = SpanAdapters(span)
    adapters.add("tuned", read_adapter(adapter_dir, load_config(model_dir), *SPAN))
    return span, adapters


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


def test_metrics_count_backwards_and_the_compute_thread_by_class(serve):
    """The Prometheus exporter's view of one forward and one backward (12 tokens each)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from shoal.server.metrics import ServerCollector

    swarm = serve()
    tensors = padded_inputs(seed=50)

    async def go(node, ticket):
        await forward(node, ticket, tensors)
        await backward((node, ticket), [*tensors, torch.ones(2, 6, HIDDEN)])

    run(swarm, go)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(lambda: swarm.servers[0].server))
    text = generate_latest(registry).decode()
    for sample in (
        "shoal_backward_requests_total 1.0",
        'shoal_tokens_served_total{kind="backward"} 12.0',
        'shoal_tokens_served_total{kind="forward"} 12.0',
        'shoal_compute_tasks_total{class="forward"} 1.0',
        f'shoal_compute_tasks_total{{class="training"}} {float(chunks(2))}',
        'shoal_compute_queue_jumps_total{class="inference",over="training"} 0.0',
    ):
        assert sample in text, (sample, text)


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "falcon", "falcon_alibi", "mixtral"])
def test_backward_equals_local_autograd_in_other_families(tmp_path, family):
    """Blocks 0:4, a padded batch of 30 tokens (past the sliding windows), deep prompts of 4
    positions shared by the batch: both gradients equal local autograd of the whole span."""
    model_dir = tiny_checkpoint(tmp_path / family, family, seed=2)
    local = load_span(model_dir, 0, 4)[0]
    tensors = padded_inputs(n=30, seed=60)
    prompts = random_prompts(4, 1, 4, seed=61)
    grad_output = torch.randn(2, 30, HIDDEN, generator=torch.Generator().manual_seed(62))
    expected = local_grads(local, tensors, grad_output, prompts)
    with InProcessSwarm(model_dir, [BlockRange(0, 4)]) as swarm:
        grads = run(
            swarm, lambda node, ticket: backward((node, ticket), [*tensors, prompts, grad_output], prompts=True)
        )
    for got, want in zip(grads, expected, strict=True):
        assert_grad_close(got, want)
