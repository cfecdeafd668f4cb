"""Training through a server (issue 20, the server side): ``backward``, deep prompts on forwards and
sessions and training at the compute thread's lowest priority (here), bad requests
(``test_bad_requests.py``) and LoRA adapters (``test_adapters.py``).

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

import pytest
import torch

from shoal.checkpoints import load_span
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.server.backend import row_groups
from shoal.server.scheduler import Priority
from testkit.tiny import tiny_checkpoint
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)
from tests.helpers.servers import Session, inputs
from tests.server.training.bench import (
    HIDDEN,
    SPAN,
    assert_grad_close,
    assert_same,
    backward,
    chunks,
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
