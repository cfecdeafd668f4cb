"""The optional libraries behind the quantised formats (``pip install shoal[quant]``): which one each
format needs, importing it with a one-line error when it is missing, and their import-time noise.

Pure until asked: nothing here imports torch or a library at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

from shoal.errors import UsageError
from shoal.quantization.formats import Quantization

#: The package each format needs, and the modules of it that shoal uses.
LIBRARIES: dict[Quantization, tuple[str, tuple[str, ...]]] = {
    Quantization.INT8: (
        "torchao",
        ("torchao.quantization", "torchao.quantization.quantize_.workflows.int8.int8_tensor"),
    ),
    Quantization.NF4: ("bitsandbytes", ("bitsandbytes",)),
    Quantization.GGUF: ("gguf", ("gguf",)),
}

#: Loggers that warn when the libraries import about what a CPU build of torch lacks (torchao's
#: CUDA-only extensions, triton; bitsandbytes' optional kernel hub, and the hub client of its
#: ``kernels`` package, offline here) and about torch.compile
#: registrations: expected, not news. transformers imports torchao whenever it is installed, so
#: every shoal command would print them; the CLI and :func:`require_library` show errors only.
IMPORT_WARNING_LOGGERS = ("torchao", "bitsandbytes", "kernels", "torch.utils._pytree")


def quiet_import_warnings() -> None:
    """Show only errors from :data:`IMPORT_WARNING_LOGGERS` from now on (the CLI does this first)."""
    for name in IMPORT_WARNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Only errors from :data:`IMPORT_WARNING_LOGGERS` within (the client's imports: transformers
    imports torchao); their levels are restored after, so a library user's logging stays theirs."""
    loggers = [logging.getLogger(name) for name in IMPORT_WARNING_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.level, logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def require_library(quantization: Quantization) -> Quantization:
    """``quantization``, once its library imports; else a one-line :class:`UsageError`."""
    if quantization is Quantization.NONE:
        return quantization
    package, modules = LIBRARIES[quantization]
    try:
        with quiet_imports():
            for module in modules:
                importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"--quant {quantization} needs the {package} package ({exc}): pip install 'shoal[quant]'"
        ) from None
    return quantization
