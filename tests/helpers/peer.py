"""A shoal peer in its own process, for tests that cross process boundaries.

    python -m tests.helpers.peer [--key-file PATH] [--max-message BYTES] [--announce-addr IP:PORT]
        [--ping TICKET]

Prints ``ticket: <TICKET>`` once serving (after a ping to ``--ping``'s peer answered, when given,
as a server joins a swarm before it is ready), then serves the meta protocol (hello, ping echo)
until its standard input closes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shoal.transport import META, Node, Ticket, TransportConfig, load_or_create_identity
from shoal.wire import Limits, Message
from shoal.wire.schema import Ping


async def serve(args: argparse.Namespace) -> None:
    key = load_or_create_identity(args.key_file) if args.key_file else None
    config = TransportConfig(
        bind_addr="127.0.0.1:0", limits=Limits(max_message_bytes=args.max_message), announce_addrs=tuple(args.announce)
    )
    node = await Node.start(config, secret_key=key)
    if args.ping:
        await node.request(Ticket.parse(args.ping), META, Message("ping", 1, Ping()), timeout=20.0)
    print(f"ticket: {node.ticket()}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await node.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--key-file")
    parser.add_argument("--max-message", type=int, default=64 << 20)
    parser.add_argument("--announce-addr", dest="announce", action="append", default=[])
    parser.add_argument("--ping", help="a peer's ticket to ping before ready")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
