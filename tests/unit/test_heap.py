"""The first node of a process freezes its startup heap, once."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CHECK = """
import asyncio, gc
from shoal import heap
from shoal.transport import Node, TransportConfig
assert gc.get_freeze_count() == 0
async def main():
    node = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
    frozen = gc.get_freeze_count()
    second = await Node.start(TransportConfig(bind_addr="127.0.0.1:0"))
    assert gc.get_freeze_count() == frozen, "a second node must not freeze again"
    await node.close(); await second.close()
    return frozen
frozen = asyncio.run(main())
assert frozen > 100_000, frozen  # torch's import graph, at least
assert not heap.freeze_startup_heap()
print("ok", frozen)
"""


def test_first_node_freezes_the_import_graph_once():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
