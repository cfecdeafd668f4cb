"""Keep CPython's cyclic garbage collector off the latency path of a shoal process.

Importing torch and transformers leaves some 400,000 objects that live as long as the process.
A full (generation 2) collection walks all of them: measured here at 20-135 ms, during which the
event loop stands still, so a server stalls a step or a client a request at a random moment.
:func:`freeze_startup_heap` moves everything alive at that point into the collector's permanent
generation (``gc.freeze``), so later full collections walk only what was allocated since.

Frozen objects are still freed by reference counting; only a reference cycle among them would
never be collected, which for import-time objects (modules, classes, functions) is the point.

Freezing is a decision about the whole process, so only process entry points make it, once their
heavy imports are done: ``shoal serve``, ``shoal api``/``dashboard``, ``shoal chat``, ``shoal demo``
and the benchmarks. Libraries (the transport, the client) never do; a program embedding the client
may call :func:`freeze_startup_heap` itself after building its model.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_startup_heap() -> bool:
    """Collect once, then freeze what survives (once per process). Returns whether it froze now."""
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True
