"""Quantise a built block's weight matrices in place, and count what quantised weights cost.

Two libraries, one per format, chosen by measurement on CPU with torch 2.13 (a ``[1, 576] x
[576, 1536]`` decode matmul, one thread; fp32 takes 78 us at 4 bytes per weight):

* ``int8``: :class:`Int8Linear`, symmetric with one bf16 scale per output row, through torch's
  ``_weight_int8pack_mm`` on bf16 activations (1.002 bytes per weight; on ``[1, 896] x [896, 4864]``
  265 to 350 us against fp32's 630 to 750, relative error 0.4-0.5%). torchao's ``Int8Tensor`` (one fp32
  scale per row) dequantised the whole matrix on every fp32 call (1.9 ms there): int8 decoded at
  0.64x of fp32 on the Qwen span. It still holds the 3-D expert parameters of transformers' MoE
  layers, which then run transformers' eager experts loop (one expert's matrix at a time; grouped
  and batched matmuls have no kernel for it). bitsandbytes' LLM.int8 was slower (182 to 208 us on
  ``[1, 576] x [576, 1536]``) and twice as far off (0.9%: it quantises activations too).
* ``gguf``: a GGUF file's own codes (:mod:`shoal.quantization.gguf`), or, on a block made up
  without one (timing it), the weights rounded to Q4_1's grid.
* ``nf4``: bitsandbytes' ``Linear4bit`` (NormalFloat4, one scale per 64 weights; 0.53 bytes per
  weight once packed for its AVX512-bf16 kernel, 0.56 on CUDA; 77 to 90 us, relative error 9.4%),
  which has CPU and CUDA kernels. torchao's NF4Tensor is 60 times slower on CPU (4.6 ms), and
  torchao has no int4 kernel for CPU (its int4 weight-only configs leave the weights as they are).

Only weight matrices change: every ``nn.Linear``'s weight, and 3-D expert parameters. Norms,
biases, routers (not ``nn.Linear`` in transformers 5) and the KV cache stay in the serving dtype.
Both libraries are optional (``pip install shoal[quant]``); a format whose library is missing is a
:class:`~shoal.errors.UsageError` naming the package.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shoal.errors import UsageError
from shoal.quantization.formats import Quantization
from shoal.quantization.libraries import require_library

NF4_BLOCK = 64  # weights per nf4 scale
NF4_SCALE_BYTES = 4  # fp32 per block of 64 (bf16 once bitsandbytes packs them for its CPU kernel)
NF4_CPU_SCALE_BYTES = 2
NF4_STATE_BYTES = 64  # per matrix: the 16-value fp32 code
INT8_ROW_BYTES = 5  # torchao (experts): an fp32 scale and an int8 zero point (always 0) per output row
INT8_LINEAR_ROW_BYTES = 2  # Int8Linear: a bf16 scale per output row
QUANT_CHUNK = 1 << 18  # weights quantised at a time (bounds the full-precision temporaries)

Quantizer = Callable[[nn.Module], nn.Module]


def expert_parameters(block: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """(module, name, parameter) of every 3-D parameter of ``block``: MoE experts, one matrix each."""
    for module in block.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() == 3:
                yield module, name, parameter


def linear_layers(block: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every ``nn.Linear`` inside ``block``."""
    for parent in block.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, name, child


def check_quantizable(block: nn.Module, quantization: Quantization) -> None:
    """Refuse a format that cannot hold some weight of ``block`` (shapes suffice: a meta block will do)."""
    experts = [name for _, name, _ in expert_parameters(block)]
    if quantization is Quantization.GGUF and experts:
        raise UsageError(
            f"--quant gguf cannot hold MoE expert tensors yet ({', '.join(sorted(set(experts)))}); "
            "serve the dequantised checkpoint (--quant none) or --quant int8"
        )
    if quantization is Quantization.NF4 and experts:
        raise UsageError(
            f"--quant nf4 cannot hold MoE expert tensors ({', '.join(sorted(set(experts)))}: 3-D, and "
            "bitsandbytes quantises nn.Linear layers only); use --quant int8 for this model"
        )


def block_quantizer(quantization: Quantization) -> Quantizer:
    """What quantises one built block in place and returns it (the identity for ``none``); checks
    the library first."""
    require_library(quantization)
    if quantization is Quantization.INT8:
        return _int8_block
    if quantization is Quantization.NF4:
        return _nf4_block
    if quantization is Quantization.GGUF:
        return _int4_block
    return lambda block: block


@torch.no_grad()
def _int4_block(block: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` as an :class:`~shoal.quantization.gguf.Int4Linear` of its weight rounded
    to an asymmetric 4-bit grid per group of 32 (what Q4_1 stores). A GGUF server reads its codes
    from the file instead; this serves blocks made up without one: timing a block
    (:mod:`shoal.server.throughput`) and tests."""
    from shoal.quantization.gguf import GROUP, Int4Linear, int4_grid

    check_quantizable(block, Quantization.GGUF)
    for parent, name, layer in list(linear_layers(block)):
        if layer.in_features % GROUP == 0:
            setattr(parent, name, Int4Linear(int4_grid(layer.weight), layer.bias))
    return block


class Int8Linear(nn.Module):
    """A linear layer holding int8 weights and one bf16 scale per output row (symmetric; the scale
    rounded *up* to bf16 first, so the codes are exact for the scale held), run by torch's
    ``_weight_int8pack_mm`` on bf16 activations: 265 us for a ``[1, 896] x [896, 4864]`` matmul
    where fp32 takes 630 us (on fp32 activations the kernel takes 2.7 ms, and torchao's
    ``Int8Tensor`` dequantises the whole matrix on every call, 1.9 ms: why int8 decoded slower
    than fp32). The bias and the output stay in the server's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        qdata = torch.empty(weight.shape, dtype=torch.int8)
        scale = torch.empty(weight.shape[0], dtype=torch.bfloat16)
        step = max(1, QUANT_CHUNK // weight.shape[1])
        for i in range(0, weight.shape[0], step):  # a chunk at a time: bounded fp32 temporaries
            rows = weight[i : i + step].detach().float()
            s = _bf16_up(rows.abs().amax(dim=1).clamp_min(1e-12) / 127)
            qdata[i : i + step] = torch.round(rows / s.float()[:, None]).clamp(-127, 127).to(torch.int8)
            scale[i : i + step] = s
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qdata, self.scale)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def dequantized(self) -> torch.Tensor:
        return self.qdata.float() * self.scale.float()[:, None]


def _bf16_up(values: torch.Tensor) -> torch.Tensor:
    """``values`` (positive fp32) rounded up to bf16."""
    rounded = values.to(torch.bfloat16)
    low = rounded.float() < values
    return torch.where(low, torch.nextafter(rounded, torch.tensor(float("inf"), dtype=torch.bfloat16)), rounded)


@torch.no_grad()
def _int8_block(block: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` as an :class:`Int8Linear`, and every 3-D expert parameter as torchao's
    ``Int8Tensor`` (what its ``Int8WeightOnlyConfig`` makes of a weight: symmetric, one scale per
    output row; MoE experts run one matrix at a time, and torch's kernel takes 2-D weights only)."""
    for parent, name, layer in list(linear_layers(block)):
        setattr(parent, name, Int8Linear(layer.weight, layer.bias))
    experts = list(expert_parameters(block))
    for module, name, parameter in experts:
        setattr(module, name, nn.Parameter(int8_rows(parameter), requires_grad=False))
    for module in {id(m): m for m, _, _ in experts}.values():
        _eager_experts(module)
    return block


def int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[..., rows, in]`` as an ``Int8Tensor`` with one scale per row, quantised
    ``QUANT_CHUNK`` weights at a time: torchao's ``from_hp`` makes a few full-precision copies of its
    input, and the whole of a large matrix (or of a stack of experts) would add several of them to
    the peak while loading. Rows are quantised independently, so the result is the same."""
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    rows = weight.detach().reshape(-1, weight.shape[-1])  # [rows, in]
    qdata = torch.empty(rows.shape, dtype=torch.int8, device=weight.device)
    scale = zero_point = None
    step = max(1, QUANT_CHUNK // rows.shape[1])
    for i in range(0, rows.shape[0], step):
        part = Int8Tensor.from_hp(rows[i : i + step], granularity=PerRow())
        if scale is None:  # [rows, 1], in the dtypes torchao picks
            scale = torch.empty((rows.shape[0], 1), dtype=part.scale.dtype, device=weight.device)
            zero_point = torch.empty((rows.shape[0], 1), dtype=part.zero_point.dtype, device=weight.device)
        qdata[i : i + step] = part.qdata
        scale[i : i + step] = part.scale
        zero_point[i : i + step] = part.zero_point
    per_row = [*weight.shape[:-1], 1]
    block_size = [1] * (weight.dim() - 1) + [weight.shape[-1]]
    return Int8Tensor(
        qdata.reshape(weight.shape), scale.reshape(per_row), block_size, weight.dtype,
        zero_point=zero_point.reshape(per_row),
    )  # fmt: skip


def _eager_experts(module: nn.Module) -> None:
    """Have transformers run ``module``'s experts one matrix at a time (the only path a quantised
    3-D tensor supports), on a private copy of its config so the rest of the block is unchanged."""
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "_experts_implementation", "eager") != "eager":
        module.config = copy.copy(config)
        module.config._experts_implementation = "eager"


@torch.no_grad()
def _nf4_block(block: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` as bitsandbytes' ``Linear4bit`` holding NF4 weights."""
    import bitsandbytes as bnb

    check_quantizable(block, Quantization.NF4)
    for parent, name, layer in list(linear_layers(block)):
        quantized = bnb.nn.Linear4bit(
            layer.in_features, layer.out_features, bias=layer.bias is not None, compute_dtype=layer.weight.dtype,
            compress_statistics=False, quant_type="nf4", device="meta",
        )  # fmt: skip
        data, state = nf4_rows(layer.weight)
        quantized.weight = bnb.nn.Params4bit(
            data, requires_grad=False, quant_state=state, blocksize=NF4_BLOCK, compress_statistics=False,
            quant_type="nf4", bnb_quantized=True, module=quantized,
        )  # fmt: skip
        quantized.quant_state = state
        quantized.bias = layer.bias
        # the CPU kernel's packing needs whole 32-row tiles and whole scale blocks per row (else: dequantise)
        quantized.support_avx512bf16_for_cpu &= layer.out_features % 32 == 0 and layer.in_features % NF4_BLOCK == 0
        if quantized.support_avx512bf16_for_cpu and data.device.type == "cpu":
            _pack_for_cpu(quantized)
        setattr(parent, name, quantized.eval())
    return block


def _pack_for_cpu(layer) -> None:
    """Repack ``layer`` (bitsandbytes' ``Linear4bit``) for its AVX512-bf16 kernel now, as its first
    forward would. That repacking makes an int32 copy of every code (8 times the packed bytes) and
    new scales: done for the whole span at its first step, the freed temporaries stayed resident
    between the repacked tensors (glibc keeps them in its heap), and nf4 took 360 MB of unique
    memory for 190 MB of tensors on the Qwen span. Here, it happens block by block while loading,
    each block's temporaries handed back by :func:`~shoal.checkpoints.loading.release_freed_memory`."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    layer.weight.data, state = _convert_weight_packed_for_cpu(layer.weight.data, layer.weight.quant_state)
    layer.weight.quant_state = layer.quant_state = state


def nf4_rows(weight: torch.Tensor):
    """``weight`` ``[out, in]`` in bitsandbytes' NF4 (packed data, ``QuantState``), quantised about
    ``QUANT_CHUNK`` weights at a time where rows hold whole blocks of 64 (so the result is the
    same): its CPU path makes several fp32 copies of its input. Scales stay fp32, not double-
    quantised: that would save 0.05 bytes per weight on CUDA, and the CPU kernel unpacks them anyway."""
    import bitsandbytes as bnb

    rows = weight.detach()
    step = rows.shape[0]
    if rows.shape[1] % NF4_BLOCK == 0:
        step = max(1, QUANT_CHUNK // rows.shape[1])
    data, scales, state = [], [], None
    for i in range(0, rows.shape[0], step):
        part, state = bnb.functional.quantize_4bit(
            rows[i : i + step], blocksize=NF4_BLOCK, compress_statistics=False, quant_type="nf4"
        )
        data.append(part)
        scales.append(state.absmax)
    state.absmax, state.shape = torch.cat(scales), weight.shape
    return torch.cat(data), state


# ---- what weights cost -------------------------------------------------------------------------


def quantized_weight_bytes(shape: torch.Size | tuple[int, ...], quantization: Quantization, device: str = "cpu") -> int:
    """Bytes a weight matrix (or a stack of them) of ``shape`` takes quantised on ``device`` (nf4 on
    CPU: once its first step packed it for the kernel)."""
    numel, rows = _numel(shape), _numel(shape[:-1])
    if quantization is Quantization.INT8:  # Int8Linear: a bf16 scale per row; experts: torchao's
        return numel + rows * (INT8_LINEAR_ROW_BYTES if len(shape) == 2 else INT8_ROW_BYTES)
    if quantization is Quantization.GGUF:  # at most two int4 planes, a bf16 scale and zero per 32 each
        return numel + -(-numel // 32) * 8
    if quantization is Quantization.NF4:
        scale = NF4_CPU_SCALE_BYTES if device == "cpu" else NF4_SCALE_BYTES
        return (numel + 1) // 2 + -(-numel // NF4_BLOCK) * scale + NF4_STATE_BYTES
    raise ValueError(f"{quantization} is not a quantised format")


def planned_bytes(block: nn.Module, dtype: torch.dtype, quantization: Quantization, device: str = "cpu") -> int:
    """Bytes ``block`` will take on ``device`` (shapes suffice: a meta block will do) in ``dtype``, its
    weight matrices quantised as ``quantization`` says (and can: nf4 refuses expert tensors)."""
    size = torch.empty((), dtype=dtype).element_size()
    quantized: dict[int, torch.Size] = {}
    if quantization is not Quantization.NONE:
        check_quantizable(block, quantization)
        quantized = {id(layer.weight): layer.weight.shape for _, _, layer in linear_layers(block)}
        if quantization is not Quantization.NF4:
            quantized.update({id(p): p.shape for _, _, p in expert_parameters(block)})
    total = 0
    for tensor in [*block.parameters(), *block.buffers()]:
        shape = quantized.get(id(tensor))
        total += tensor.numel() * size if shape is None else quantized_weight_bytes(shape, quantization, device)
    return total


def held_bytes(module: nn.Module) -> int:
    """Bytes ``module``'s parameters and buffers hold as they are: a quantised tensor counts its
    packed data and scales, not the shape it stands for."""
    return sum(_tensor_bytes(t) for t in [*module.parameters(), *module.buffers()])


def _tensor_bytes(tensor: torch.Tensor) -> int:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):  # torchao: the inner tensors it is made of
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(inner) for name in names if (inner := getattr(tensor, name)) is not None)
    total = tensor.numel() * tensor.element_size()
    state = getattr(tensor, "quant_state", None)  # bitsandbytes: packed data here, scales beside it
    if state is not None:
        total += sum(_tensor_bytes(t) for t in _state_tensors(state))
    return total


def _state_tensors(state) -> Iterator[torch.Tensor]:
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif type(value) is type(state):  # the nested state of double-quantised scales
            yield from _state_tensors(value)


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
