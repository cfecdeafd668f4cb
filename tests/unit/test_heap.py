"""Freezing the startup heap is the process's decision: starting a node does not do it; the entry
point's call freezes the import graph, once."""

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
    async with await Node.start(TransportConfig(bind_addr="127.0.0.1:0")):
        assert gc.get_freeze_count() == 0, "a transport must not freeze the process's heap"
asyncio.run(main())
assert heap.freeze_startup_heap()
frozen = gc.get_freeze_count()
assert frozen > 100_000, frozen  # torch's import graph, at least
assert not heap.freeze_startup_heap() and gc.get_freeze_count() == frozen, "froze twice"
print("ok", frozen)
"""


def test_nodes_leave_the_heap_alone_and_the_entry_point_freezes_it_once():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
