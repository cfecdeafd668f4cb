"""``shoal serve`` with faults applied, in a process of its own:

    python -m testkit.faulty_server MODEL --blocks A:B [any shoal serve flag...] --faults JSON [--fault-record PATH]

``--faults`` is a JSON list of :mod:`testkit.faults` faults (:func:`testkit.faults.fault_flags` writes
it); ``--fault-record`` appends the server's record there as JSON lines, as it happens (a crashed
server's record included). Everything else is the normal server: this entry point only swaps the
loader ``shoal serve`` builds its block server with for one that returns it made faulty.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from testkit.faults import FaultRecord, decode_faults


def faulty_loader(load: Callable, faults: list, record: FaultRecord) -> Callable:
    """``load`` (``shoal.server.builder.load_block_server``), returning its server made faulty."""
    from testkit.faulty import make_faulty

    def load_faulty(*args, **kwargs):
        return make_faulty(load(*args, **kwargs), faults, record, exit_on_crash=True)

    return load_faulty


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testkit.faulty_server", allow_abbrev=False, add_help=False)
    parser.add_argument("--faults", required=True, help="JSON list of testkit.faults faults")
    parser.add_argument("--fault-record", help="append the record here (JSON lines)")
    ours, serve_args = parser.parse_known_args(argv)
    try:
        faults = decode_faults(ours.faults)
    except ValueError as exc:
        print(f"testkit.faulty_server: error: {exc}", file=sys.stderr)
        return 2
    from shoal.cli.main import main as shoal_main
    from shoal.server import builder

    builder.load_block_server = faulty_loader(builder.load_block_server, faults, FaultRecord(ours.fault_record))
    return shoal_main(["serve", *serve_args])


if __name__ == "__main__":
    sys.exit(main())
