"""shoal: run large language models across machines that belong to different people."""

from __future__ import annotations

import logging

# A library logs; the application decides where that goes (the ``shoal`` command configures it):
# without this, Python's last-resort handler would print shoal's warnings on a user's stderr.
logging.getLogger("shoal").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["AutoDistributedModelForCausalLM", "DistributedModelForCausalLM", "__version__"]


def __getattr__(name: str):
    # The client pulls in transformers; import it only when asked for (servers and tools stay light).
    if name in ("AutoDistributedModelForCausalLM", "DistributedModelForCausalLM"):
        from shoal import client

        return getattr(client, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
