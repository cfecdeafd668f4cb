"""OpenMP settings for shoal's own processes (``shoal serve``, ``demo``, ``api``, ``chat``), set
before torch loads libgomp, which reads its environment once.

After every parallel region, libgomp (PyTorch's OpenMP runtime on Linux) lets each worker thread
busy-wait ``GOMP_SPINCOUNT`` iterations before it sleeps; the default, 300,000, is several
milliseconds here. A server's step ends with such a region, after which the server waits for the
network while its workers keep a core busy, the core that the next stage of the pipeline (another
server, or the client, on the same machine) needs. 20,000 iterations still cover the gaps between
regions inside a step. Measured with ``bench.generate`` (270M llama, 2 cores): see the note that
introduced this module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

SPIN_COUNT = "20000"
_USER_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set shoal's spin count unless the user chose a wait policy; returns whether it was set.
    Too late (and a no-op) once torch is imported."""
    if "torch" in sys.modules or _user_chose(environ):
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def child_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` for a process about to start (torch not yet loaded there), with shoal's
    spin count unless the user chose a wait policy."""
    env = dict(environ)
    if not _user_chose(env):
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return env


def _user_chose(environ: Mapping[str, str]) -> bool:
    return any(knob in environ for knob in _USER_KNOBS)
