"""What client tests over an in-process swarm (:class:`shoal.launch.InProcessSwarm`) compare with, and
wait for: the plain ``transformers`` blocks, and server state that settles on the swarm's loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedModel


@torch.no_grad()
def blocks_output(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """What all decoder blocks of the ``transformers`` causal LM ``model`` make of ``hidden``
    ``[batch, tokens, hidden]`` at positions ``0..tokens-1`` (no padding): the last block's output,
    before the final norm (what a chain of servers over every block answers)."""
    captured: list[Tensor] = []

    def keep(module, args, output) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)

    hook = model.model.layers[-1].register_forward_hook(keep)
    try:
        model.model(inputs_embeds=hidden)
    finally:
        hook.remove()
    return captured[-1]


def wait_until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``condition`` (state changed on another thread, e.g. a server freeing a session whose
    stream was reset) until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.005)


@pytest.fixture
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if shoal logged an error (a handler that failed, a pushed step that crashed),
    as a server process's traceback on stderr would. Servers in this process log through the same
    loggers; import this fixture into a module and mark it ``usefixtures``."""
    caplog.set_level(logging.WARNING, logger="shoal")
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("shoal")]
    assert not errors, "shoal logged errors:\n" + "\n".join(r.getMessage() for r in errors)
