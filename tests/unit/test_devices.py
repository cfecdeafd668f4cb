"""A device torch here cannot use is refused when a server or client config is made, in one line
that names it as the user wrote it, instead of torch's ``AssertionError`` deep in weight loading."""

from __future__ import annotations

import pytest
import torch

from shoal.client.config import ClientConfig
from shoal.devices import check_device
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cpu_only_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch as a CPU-only wheel reports itself, on this machine or one with a GPU."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.usefixtures("cpu_only_torch")
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("cuda", "--device cuda: this torch has no CUDA (a CPU-only build); use --device cpu, or install a CUDA build"),
        (
            "cuda:1",
            "--device cuda:1: this torch has no CUDA (a CPU-only build); use --device cpu, or install a CUDA build",
        ),
        ("mps", "--device mps: this torch has no MPS (Apple-silicon GPUs); use --device cpu"),
        ("gpu", "--device gpu: not a device torch knows (cpu, cuda, cuda:1, mps ...)"),
        ("meta", "--device meta: torch cannot run a model on meta devices; use --device cpu"),
    ],
)
def test_a_device_this_torch_lacks_is_one_usage_error(name: str, message: str):
    with pytest.raises(UsageError) as refused:
        check_device(name)
    assert str(refused.value) == message


@pytest.mark.usefixtures("one_gpu")
def test_a_gpu_index_past_the_last_gpu_names_the_ones_there():
    assert check_device("cuda:0") == "cuda:0"
    with pytest.raises(UsageError) as refused:
        check_device("cuda:3")
    assert str(refused.value) == "--device cuda:3: this machine has 1 CUDA device (cuda:0)"


def test_cuda_built_but_no_gpu_visible(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError) as refused:
        check_device("cuda")
    assert str(refused.value) == (
        "--device cuda: torch sees no CUDA device here (no driver, or CUDA_VISIBLE_DEVICES hides them); "
        "use --device cpu"
    )


def test_the_cpu_is_always_there():
    assert [check_device(name) for name in ("cpu", "cpu:0")] == ["cpu", "cpu:0"]


@pytest.mark.usefixtures("cpu_only_torch")
def test_server_and_client_configs_refuse_it_as_their_users_spell_it():
    with pytest.raises(UsageError, match=r"^--device cuda: this torch has no CUDA \(a CPU-only build\)"):
        ServerConfig(model="m", blocks=BlockRange(0, 1), device="cuda")
    with pytest.raises(UsageError) as refused:
        ClientConfig(device="cuda")  # what from_pretrained(device="cuda") builds first, before any load
    assert str(refused.value) == (
        "device='cuda': this torch has no CUDA (a CPU-only build); use device='cpu', or install a CUDA build"
    )
