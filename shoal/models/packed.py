"""fp32 linear layers on a CPU through oneDNN's packed weight layout, for batched decode steps:
a batch of one-token steps then costs about what one step costs.

A decode step multiplies a few rows by every weight matrix of the span. ``nn.Linear`` calls MKL's
sgemm, which is quick for one row (a matrix-vector product, bound by reading the weights) but not
for a few: measured on an AMD EPYC (Zen 4, one thread), the linear layers of
8 blocks of the 270M llama take 34, 60, 60, 73 and 87 ms for 1, 2, 4, 8 and 16 rows. oneDNN, with
the weights reordered once into the blocked layout it computes from (sized for 16 rows), takes 35,
33, 32, 31 and 51 ms for the same: a batch of 8 costs what one row does.

Only a batch of one-token steps (``[rows >= packed_from, 1, H]``: what continuous batching makes
of decode steps, :mod:`shoal.server.batching`) takes that path. One row, a prefill, anything that records
gradients (a backward, training) and anything not fp32 on the CPU runs ``nn.Linear``'s own MKL
call on the plain weight, so a lone session computes exactly what transformers computes: oneDNN
sums in another order (its error against fp64 is about twice MKL's, still fp32 rounding), which
through SmolLM2's 30 blocks moves logits by ~4e-4, more than the 1e-4 the swarm's parity with
transformers is held to. Batched rows already differ from a lone one's by their GEMM's order.

Which is quicker for 2 or 3 rows depends on the CPU: on the Intel Xeon (AVX-512) this project
runs on now, the same layers take 28, 29, 54, 72 and 74 ms with MKL for 1, 2, 4, 8 and 16 rows,
and 35, 34, 41 and 52 ms packed for 2, 4, 8 and 16: MKL is quicker for 2 rows there, oneDNN from
4, as on the EPYC. So :func:`calibrate` times both for 2 and 3 rows over the span's layers when
they are packed, and the layers use their packed copy from the fewest rows where it was quicker
(:attr:`PackedLinear.packed_from`: 2, 3 or 4). Only those: a server times this while others load
beside it, and a measure spoilt by them then costs a few batches of 2 or 3 rows a little, never
every batch the packed copy (timing every size, two of four servers loading at once here once
chose never to use it).

The plain weight stays (and LoRA adapters, which wrap it, and the fingerprints use it), so the
linear weights take twice their memory: hence opt-in, ``shoal serve --packed-weights``, and
:func:`packed_bytes` for placement to count. The copy follows the weight: one changed in place is
packed again before its next use.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: rows oneDNN lays the weights out for (it computes any number of rows from them)
PACKED_FOR_ROWS = 16
#: batch sizes :func:`calibrate` times (from 4 rows on the packed copy is the quicker wherever measured)
CALIBRATION_ROWS = (2, 3)


def packing_available() -> bool:
    """Whether this torch build has oneDNN (with the packed-linear ops) for the CPU."""
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (the same weight and bias parameters) that computes no-grad fp32 CPU calls
    from a oneDNN copy of its weight."""

    packed: torch.Tensor
    packed_version: int  # the weight's version the copy was made from
    packed_from: int = 2  # batches of this many one-token rows or more use the packed copy (calibrate)

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls._holding(linear.weight, linear.bias)

    @classmethod
    def _holding(cls, weight: nn.Parameter, bias: nn.Parameter | None) -> PackedLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.weight, layer.bias = weight, bias
        layer.repack()
        return layer

    def repack(self) -> None:
        # not a buffer: state dicts, fingerprints and byte counts see the plain weight alone
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACKED_FOR_ROWS)
        self.packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one_token_batch = x.dim() == 3 and x.shape[1] == 1 and x.shape[0] >= self.packed_from
        if not one_token_batch or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return self.packed_call(x)

    def packed_call(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's product of ``x`` (fp32, CPU, no gradient) with the packed copy."""
        if self.weight._version != self.packed_version:
            self.repack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy of the parameters, packed anew (oneDNN's copy has no storage to copy)."""
        twin = self._holding(copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo))
        twin.packed_from = self.packed_from
        return twin


def _plain_fp32(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a quantised or adapted one) with fp32 weights."""
    return type(module) is nn.Linear and module.weight.dtype == torch.float32


def packable(module: nn.Module) -> bool:
    """A plain fp32 ``nn.Linear`` on the CPU."""
    return _plain_fp32(module) and module.weight.device.type == "cpu"


def pack_linears(module: nn.Module) -> int:
    """Swap every packable linear layer under ``module`` for a :class:`PackedLinear` of the same
    parameters; returns how many. A no-op where this torch has no oneDNN."""
    if not packing_available():
        return 0
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()]
    swapped = 0
    for parent, name, child in targets:
        if packable(child):
            setattr(parent, name, PackedLinear.of(child))
            swapped += 1
    return swapped


def calibrate(module: nn.Module, rows: Sequence[int] = CALIBRATION_ROWS, repeats: int = 3) -> int | None:
    """Time MKL's plain call and the packed copy for batches of each of ``rows`` one-token rows, each
    over every packed layer of ``module`` in turn (the weights as a step reads them: one layer alone
    would sit in cache), the two in turns and the quickest of ``repeats`` (other work on the machine
    slows both alike), and set every layer's :attr:`~PackedLinear.packed_from` to the fewest rows
    from which the packed copy was quicker at every size timed (one past them otherwise); returns
    it (None: nothing is packed). Tensor work: call it on the compute thread."""
    layers = [m for m in module.modules() if isinstance(m, PackedLinear)]
    if not layers:
        return None

    def seconds(inputs: list[torch.Tensor], packed: bool) -> float:
        started = time.perf_counter()
        for layer, x in zip(layers, inputs, strict=True):
            if packed:
                layer.packed_call(x)
            else:
                F.linear(x, layer.weight, layer.bias)
        return time.perf_counter() - started

    best = {(count, packed): float("inf") for count in rows for packed in (False, True)}
    with torch.inference_mode():
        for _ in range(repeats):
            for count in rows:
                inputs = [torch.zeros(count, 1, layer.in_features) for layer in layers]
                for packed in (False, True):
                    best[count, packed] = min(best[count, packed], seconds(inputs, packed))
    threshold = packed_threshold(rows, [best[count, True] < best[count, False] for count in rows])
    for layer in layers:
        layer.packed_from = threshold
    return threshold


def packed_threshold(rows: Sequence[int], quicker: Sequence[bool]) -> int:
    """The fewest of ``rows`` (ascending) from which the packed copy was ``quicker`` at every size
    timed; one past the last when it was not quicker at the last."""
    return next((count for i, count in enumerate(rows) if all(quicker[i:])), rows[-1] + 1)


def packed_bytes(module: nn.Module) -> int:
    """Bytes :func:`pack_linears` would add to ``module`` (a meta module will do): one more copy of
    each packable layer's weight."""
    planned = [m for m in module.modules() if _plain_fp32(m) and m.weight.device.type in ("cpu", "meta")]
    return sum(m.weight.numel() * 4 for m in planned)


__all__ = [
    "CALIBRATION_ROWS",
    "PACKED_FOR_ROWS",
    "PackedLinear",
    "calibrate",
    "pack_linears",
    "packable",
    "packed_bytes",
    "packed_threshold",
    "packing_available",
]
