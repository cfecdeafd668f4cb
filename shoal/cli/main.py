"""``shoal``: serve model blocks, fetch models, run the local demo swarm.

Subcommands build a config object and hand it to the role's own module; no logic lives here.
Importing this module changes nothing and loads no torch: :func:`main`, the process entry point,
first sets shoal's OpenMP defaults (:mod:`shoal.omp`), which must happen before torch loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.transport import TransportConfig

# the network profiles' names (shoal.transport.NetworkProfile), spelled here so that building the
# parser does not import the transport (and with it torch) before main() set the OpenMP defaults
NETWORK_PROFILES = ("local", "internet")


def _transport(args: argparse.Namespace) -> TransportConfig:
    from shoal.transport import Deadlines, NetworkProfile, TransportConfig

    return TransportConfig(
        profile=NetworkProfile(args.network),
        bind_addr=f"{args.host}:{args.port}",
        deadlines=Deadlines(connect=args.connect_timeout, request=args.request_timeout),
    )


def _add_network(parser: argparse.ArgumentParser, port_help: str = "UDP port (0: any free one)") -> None:
    group = parser.add_argument_group("network")
    group.add_argument(
        "--network",
        choices=NETWORK_PROFILES,
        default="local",
        help="local: direct addresses only (LAN, loopback); internet: iroh relays and address lookup",
    )
    group.add_argument("--host", default="0.0.0.0", help="address to bind")
    group.add_argument("--port", type=int, default=0, help=port_help)
    group.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to reach a peer")
    group.add_argument("--request-timeout", type=float, default=60.0, help="seconds for one request or step")


def cmd_serve(args: argparse.Namespace) -> int:
    from shoal.heap import freeze_startup_heap
    from shoal.server.app import serve
    from shoal.server.config import ServerConfig, parse_blocks, parse_dtype
    from shoal.swarm.gossip import GossipConfig
    from shoal.transport import Ticket
    from shoal.transport.loop import run as run_loop

    try:
        config = ServerConfig(
            model=args.model,
            blocks=parse_blocks(args.blocks) if args.blocks else None,
            dtype=parse_dtype(args.dtype),
            device=args.device,
            cache_tokens=args.cache_tokens,
            max_sessions_per_peer=args.max_sessions_per_peer,
            session_idle_timeout=args.session_timeout,
            identity_file=Path(args.identity) if args.identity else None,
            ticket_file=Path(args.ticket_file) if args.ticket_file else None,
            num_threads=args.num_threads,
            transport=_transport(args),
            new_swarm=args.new_swarm,
            join=tuple(Ticket.parse(t) for t in args.join),
            throughput=args.throughput,
            num_blocks=args.num_blocks,
            rebalance=not args.no_rebalance,
            balance_period=args.balance_period,
            drain_timeout=args.drain_timeout,
            gossip=GossipConfig(period=args.gossip_period, refresh=args.refresh_period, expiry=args.expiry),
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
    except ValueError as exc:
        print(f"shoal serve: error: {exc}", file=sys.stderr)
        return 2
    freeze_startup_heap()  # a long-lived process, after its heavy imports (see shoal.heap)
    run_loop(serve(config, on_ready=lambda ticket: print(f"ticket: {ticket}", flush=True)))
    return 0


def cmd_swarm_status(args: argparse.Namespace) -> int:
    from shoal.swarm.status import render, swarm_status, to_json
    from shoal.transport import Ticket
    from shoal.transport.loop import run as run_loop

    status = run_loop(swarm_status(Ticket.parse(args.join), _transport(args)))
    print(to_json(status) if args.json else render(status))
    return 0


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from shoal.checkpoints import fetch_model

    print(fetch_model(args.name, progress=not args.quiet))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from shoal.demo import DemoOptions, run_demo

    return run_demo(DemoOptions(prompt=args.prompt, servers=args.servers, max_new_tokens=args.max_new_tokens))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal", description="Serve model blocks, fetch models, run a local demo swarm."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="host a span of a model's blocks")
    serve.add_argument("model", help="local Hugging Face directory, known model name (smollm2) or Hub id")
    serve.add_argument("--blocks", help="START:END, half-open (e.g. 0:10); omit it to be placed automatically")
    serve.add_argument("--num-blocks", type=int, help="blocks to host when placed automatically (default: what fits)")
    serve.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    serve.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    serve.add_argument("--cache-tokens", type=int, default=8192, help="KV cache budget per block, in tokens")
    serve.add_argument("--max-sessions-per-peer", type=int, default=16)
    serve.add_argument("--session-timeout", type=float, default=300.0, help="idle seconds before a session is freed")
    serve.add_argument("--identity", help="key file for a stable peer id (created if missing, mode 0600)")
    serve.add_argument("--ticket-file", help="also write the ticket to this file")
    serve.add_argument("--num-threads", type=int, help="torch threads for compute")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this TCP port (0: any free one)")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    swarm = serve.add_argument_group("swarm")
    swarm.add_argument("--new-swarm", action="store_true", help="create a swarm; the printed ticket joins it")
    swarm.add_argument("--join", action="append", default=[], metavar="TICKET", help="join the swarm of this peer")
    swarm.add_argument("--throughput", type=float, help="tokens/s per block to announce (default: measure, cached)")
    swarm.add_argument("--balance-period", type=float, default=120.0, help="seconds between placement re-checks")
    swarm.add_argument("--no-rebalance", action="store_true", help="placed automatically: never move")
    swarm.add_argument("--drain-timeout", type=float, default=5.0, help="seconds sessions get to move on at exit")
    swarm.add_argument("--gossip-period", type=float, default=5.0, help="seconds between gossip rounds")
    swarm.add_argument("--refresh-period", type=float, default=60.0, help="seconds between record refreshes")
    swarm.add_argument("--expiry", type=float, default=180.0, help="seconds a record stays valid")
    _add_network(serve)
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="obtain model weights").add_subparsers(dest="models_command", required=True)
    fetch = models.add_parser("fetch", help="fetch a known model and convert it once to safetensors; prints its path")
    fetch.add_argument("name", help="known model name, e.g. smollm2")
    fetch.add_argument("-q", "--quiet", action="store_true")
    fetch.set_defaults(func=cmd_models_fetch)

    swarm_cmd = sub.add_parser("swarm", help="inspect a swarm").add_subparsers(dest="swarm_command", required=True)
    status = swarm_cmd.add_parser("status", help="models, block coverage and servers of a swarm")
    status.add_argument("--join", required=True, metavar="TICKET", help="ticket of any swarm member")
    status.add_argument("--json", action="store_true")
    _add_network(status)
    status.set_defaults(func=cmd_swarm_status, host="127.0.0.1")

    demo = sub.add_parser("demo", help="a local swarm of servers on loopback answering a chat prompt")
    demo.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    demo.add_argument("--servers", type=int, default=3)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)

    from shoal.gateway.cli import add_commands  # api, dashboard, chat

    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shoal.omp import apply_defaults

    apply_defaults()  # before any subcommand imports torch
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    # Everything is closed and flushed by now. Skip interpreter teardown: dropping iroh's Rust
    # runtime there takes seconds, which every stop of a server would pay.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
