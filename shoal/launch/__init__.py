"""The one swarm harness: servers of a model on this machine for the demo, benchmarks and tests.

* :class:`LocalSwarm` / :class:`ServerProcess`: ``shoal serve`` child processes (where the process
  boundary is the point: SIGKILL, the CLI, gossip between processes, benchmarks).
* :class:`~shoal.launch.inprocess.InProcessSwarm`: the same servers inside this process, on an
  in-memory network (fast tests of the handler, sessions, push chain, recovery and routing).
"""

from __future__ import annotations

from shoal.launch.process import (
    ChildProcess,
    LocalSwarm,
    ServerProcess,
    even_spans,
    join_flags,
    serve_args,
    start_parallel,
    stop_all,
    wait_converged,
)

__all__ = [
    "ChildProcess",
    "InProcessSwarm",
    "LocalSwarm",
    "ServerProcess",
    "even_spans",
    "join_flags",
    "serve_args",
    "start_parallel",
    "stop_all",
    "wait_converged",
]


def __getattr__(name: str):
    # the in-process swarm pulls in the server and client (torch, transformers): only when asked for
    if name == "InProcessSwarm":
        from shoal.launch.inprocess import InProcessSwarm

        return InProcessSwarm
    raise AttributeError(f"module 'shoal.launch' has no attribute {name!r}")
