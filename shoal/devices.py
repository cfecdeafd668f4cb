"""Whether torch here can place tensors on a device a user named, checked before anything loads.

Without this check, ``--device cuda`` on a CPU-only torch fails deep in weight loading with torch's
``AssertionError: Torch not compiled with CUDA enabled``, after the model was fetched and read. The
server (``shoal serve --device``, :class:`~shoal.server.config.ServerConfig`) and the client
(``from_pretrained(device=...)``, :class:`~shoal.client.config.ClientConfig`) both check here, so the
refusal is one :class:`~shoal.errors.UsageError` whose message says what to do instead.
"""

from __future__ import annotations

import torch

from shoal.errors import UsageError

__all__ = ["check_device"]


def _spell(option: str, value: str) -> str:
    """How the user wrote it: ``--device cuda`` on the command line, ``device='cuda'`` in Python."""
    return f"{option} {value}" if option.startswith("--") else f"{option}={value!r}"


def _count(kind: str, count: int) -> str:
    """``2 CUDA devices (cuda:0 to cuda:1)``: the names that do exist."""
    names = f"{kind}:0" if count == 1 else f"{kind}:0 to {kind}:{count - 1}"
    return f"{count} {kind.upper()} device{'s' if count != 1 else ''} ({names})"


def check_device(name: str, option: str = "--device") -> str:
    """``name`` when torch here can run on that device; else a :class:`UsageError` that names it as
    ``option`` spells it, says why not, and offers the CPU."""
    asked, instead = _spell(option, name), f"use {_spell(option, 'cpu')}"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"{asked}: not a device torch knows (cpu, cuda, cuda:1, mps ...)") from None
    kind = device.type
    if kind == "cpu":
        return name
    if kind == "cuda" and not torch.backends.cuda.is_built():
        raise UsageError(f"{asked}: this torch has no CUDA (a CPU-only build); {instead}, or install a CUDA build")
    if kind == "mps":
        if not torch.backends.mps.is_built():
            raise UsageError(f"{asked}: this torch has no MPS (Apple-silicon GPUs); {instead}")
        available = torch.backends.mps.is_available
    else:
        available = getattr(getattr(torch, kind, None), "is_available", None)
    if available is None:
        raise UsageError(f"{asked}: torch cannot run a model on {kind} devices; {instead}")
    if not available():
        hint = " (no driver, or CUDA_VISIBLE_DEVICES hides them)" if kind == "cuda" else ""
        raise UsageError(f"{asked}: torch sees no {kind.upper()} device here{hint}; {instead}")
    count = getattr(getattr(torch, kind, None), "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise UsageError(f"{asked}: this machine has {_count(kind, count())}")
    return name
