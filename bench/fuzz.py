"""Fuzz a live ``shoal serve`` process (issue #32: no peer can exhaust a node).

    scripts/isolated python -m bench.fuzz [--frames 100000] [--seconds 600] [--seed 0] [--concurrency 8]
        [--data-timeout 2]

A tiny random model's first block is served by a ``shoal serve`` child; one peer sends it
``--frames`` frames from ``--concurrency`` workers (or for ``--seconds``, whichever ends first):
valid requests, mutated headers, sizes, kinds, codecs and orders, every metadata field mutated,
random bytes, truncated streams, half-sent messages and oversized declared sizes, sessions misused
(:mod:`testkit.fuzzing`). Prints one JSON object:

- ``frames``, ``seconds``, ``frames_per_second``: what was sent, in how long;
- ``crashes``: 1 if the server died or stopped answering, else 0;
- ``rss_growth_mb``: the server's resident memory after the fuzz less before it (read after a
  warm-up of honest sessions), and ``rss_peak_growth_mb`` the highest reading during it;
- ``serves_after``: 1 if an honest session (and forwards) from a new peer after the fuzz returns
  exactly the tensors it returned before;
- ``errors``: the server's answers by wire reason or error code (``closed``: a stream it ended
  without a reply, ``reset``: one it stopped reading while we sent);
- ``valid_served``, ``cases`` (cases run by kind), ``problems`` (cases answered otherwise than they
  must be; ``problem_samples``), ``tracebacks`` logged and ``server_exit``, ``data_timeout`` used.
"""

from __future__ import annotations

import argparse
import json

from testkit.fuzzing import FuzzConfig, run_campaign


def main() -> None:
    defaults = FuzzConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=defaults.frames, help="frames to send (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="time budget (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="workers (default: %(default)s)")
    parser.add_argument(
        "--data-timeout",
        type=float,
        default=defaults.data_timeout,
        help="the server's --data-timeout, where it has the flag (default: %(default)s)",
    )
    args = parser.parse_args()
    config = FuzzConfig(args.frames, args.seconds, args.seed, args.concurrency, args.data_timeout)
    print(json.dumps(run_campaign(config)), flush=True)


if __name__ == "__main__":
    main()
