"""What a server checks before it binds a port or reads a weight: the model (see
:mod:`shoal.checkpoints.check`), that the blocks asked for are inside it, and that its weights can
be quantised as asked. The model's config is read once, by :func:`check_model`, and travels on in
the :class:`CheckedServer` every later step is built from."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.checkpoints.check import CheckedModel, check_model
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.quantization import Quantization
from shoal.server.config import ServerConfig

__all__ = ["CheckedModel", "CheckedServer", "check_blocks", "check_model", "check_quantization", "check_server"]


@dataclass(frozen=True)
class CheckedServer:
    """A server's settings and the model they were checked against (its config read once)."""

    config: ServerConfig
    model: CheckedModel


def check_server(config: ServerConfig, model: CheckedModel | None = None) -> CheckedServer:
    """``config`` checked against its model (``model``: checked already, e.g. by the CLI; else
    checked here)."""
    if model is None:
        model = check_model(config.model)
    check_blocks(config.blocks, model)
    check_quantization(config.quant, model)
    return CheckedServer(config, model)


def check_blocks(blocks: BlockRange | None, model: CheckedModel) -> None:
    """Refuse a span that reaches past the model's last block."""
    if blocks is not None and blocks.end > model.num_blocks:
        raise UsageError(
            f"--blocks {blocks.start}:{blocks.end} is outside the model's {model.num_blocks} blocks "
            f"(choose START:END within 0:{model.num_blocks})"
        )


def check_quantization(quantization: Quantization, model: CheckedModel) -> Quantization:
    """Refuse a format whose library is missing, or that cannot hold the model's weights (nf4 and
    MoE expert tensors); from the config alone (every block, with the model's shapes, on the meta
    device: a MoE model may have dense blocks too)."""
    from shoal.quantization.libraries import require_library
    from shoal.quantization.weights import check_quantizable
    from shoal.server.throughput import meta_block

    require_library(quantization)
    if quantization is not Quantization.NONE:
        for index in range(model.num_blocks):
            check_quantizable(meta_block(model.hf_config, index), quantization)
    return quantization
