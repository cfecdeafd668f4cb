"""Subcommands ``shoal api``, ``shoal dashboard`` and ``shoal chat``: parse, build options, run.

Kept import-light: torch, transformers, FastAPI and uvicorn are imported by the command, not here.
"""

from __future__ import annotations

import argparse
import os

from shoal.cli.args import (
    ANNOUNCE_HELP,
    CODECS,
    NETWORK_PROFILES,
    add_limit_flags,
    announce_address,
    block_range,
    join_ticket,
    memory_size,
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
    probability,
    transport_config,
)
from shoal.cli.swarm import add_member_flags, member_settings

DEFAULT_CLIENT_MEMORY = 8 << 30  # as shoal.gateway.pool's (not imported here: it imports torch)

#: What ``--verify`` takes (``from_pretrained(verify=...)`` checks that the client runs it). Its
#: default is ClientConfig's, applied by leaving the flag out of the config (spelled only in help).
VERIFY_CHOICES = ("off", "audit", "redundant")


def _client_network(parser: argparse.ArgumentParser, *, several: bool = True) -> None:
    """The swarm connection's flags; ``several``: ``--join`` is repeatable (a client routes over the
    servers of every ticket; a dashboard shows one swarm)."""
    group = parser.add_argument_group("swarm connection")
    if several:
        group.add_argument(
            "--join",
            action="append",
            required=True,
            metavar="TICKET",
            help="ticket of a swarm member or of a standalone server (repeatable: the servers of every "
            "ticket are routed over together)",
        )
    else:
        group.add_argument("--join", required=True, metavar="TICKET", help="ticket of any member of the swarm")
    group.add_argument(
        "--network",
        choices=NETWORK_PROFILES,
        default="local",
        help="local: direct addresses only (LAN, loopback); internet: iroh relays and address lookup",
    )
    group.add_argument("--bind", default="0.0.0.0:0", metavar="ADDR:PORT", help="UDP address of the iroh endpoint")
    group.add_argument("--connect-timeout", type=positive_float, default=5.0, help="seconds to reach a peer")
    group.add_argument("--request-timeout", type=positive_float, default=60.0, help="seconds for one request or step")
    add_limit_flags(parser, "node")  # its endpoint answers any peer too


def _compression(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compression",
        choices=CODECS,
        default=CODECS[0],
        help="how hidden states travel to and from each server that supports it: raw float32 (exact), bf16 or "
        "fp16 (half the bytes), q8 (8-bit blocks of 64 values: about a quarter)",
    )


def add_speculation(parser: argparse.ArgumentParser) -> None:
    """``--draft MODEL`` or ``--prompt-lookup N`` (at most one): speculative decoding."""
    group = parser.add_argument_group("speculative decoding (greedy answers stay the same tokens)")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--draft",
        metavar="DRAFT_MODEL",
        help="a small model run locally that drafts tokens the swarm verifies several at a time: a directory, "
        "known model name or Hub id (another tokenizer works too)",
    )
    choice.add_argument(
        "--prompt-lookup",
        type=positive_int,
        metavar="N",
        help="draft up to N tokens a round by continuing n-grams found in the prompt (no model needed)",
    )


def add_verification(parser: argparse.ArgumentParser) -> None:
    """``--verify MODE``, ``--audit-every K`` and ``--require-verified``: check the untrusted servers' answers."""
    group = parser.add_argument_group("verification of the servers")
    group.add_argument(
        "--verify",
        choices=VERIFY_CHOICES,
        help="audit (the default): a second server recomputes every hop each K positions, a third settles a "
        "dispute, a liar is banned and the answer regenerated from its first wrong token; text is shown only "
        "once audited. redundant: every step also runs on a disjoint second chain. off: answers from untrusted "
        "servers are not checked. Blocks no second server serves alike are reported unverified",
    )
    group.add_argument(
        "--audit-every",
        type=positive_int,
        metavar="K",
        help="positions between audits of a hop with --verify audit (default: 16); redundant checks every step",
    )
    group.add_argument(
        "--require-verified",
        action="store_true",
        help="fail an answer rather than generate it with blocks no other server can check (not with --verify off)",
    )


def _codec(name: str):
    from shoal.wire import Codec

    return Codec(name)


def _client_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the client ``shoal api`` and ``shoal chat`` run, read by :func:`_client_settings`."""
    parser.add_argument("--num-threads", type=positive_int, help="torch threads (embeddings, LM head)")
    _compression(parser)
    add_speculation(parser)
    add_verification(parser)
    _client_network(parser)
    add_member_flags(parser)
    parser.add_argument(
        "--route-wait",
        type=non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="when no live server is left for some blocks mid-answer, wait this long for one to join before "
        "the answer fails (0: fail at once)",
    )


def _client_settings(args: argparse.Namespace) -> dict:
    """What ``shoal api`` and ``shoal chat`` set alike, from their shared flags: the tickets, the
    client's :class:`~shoal.client.config.ClientConfig` (connection, codec, verification), threads
    and speculation."""
    from shoal.client.config import ClientConfig

    join = tuple(join_ticket(text) for text in args.join)
    verify = {"verify": args.verify} if args.verify is not None else {}  # unset: ClientConfig's default
    client = ClientConfig(
        transport=transport_config(args, args.bind),
        compression=_codec(args.compression),
        **verify,
        audit_every=args.audit_every,
        require_verified=args.require_verified,
        route_wait=args.route_wait,
        **member_settings(args),
    )  # checked when made: a mode this client cannot run is a usage error before anything starts
    return dict(
        join=join,
        client=client,
        num_threads=args.num_threads,
        draft=args.draft,
        prompt_lookup=args.prompt_lookup,
    )


def _http(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port_number, default=8000, help="HTTP port (0: any free one)")
    parser.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="also answer requests whose Host header is NAME (repeatable; '*': any). Answered by default: "
        "localhost, 127.0.0.1, ::1, the --host address, this machine's name and any IP address; others get "
        "421 (against DNS rebinding)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let web pages of ORIGIN (e.g. https://app.example:8443) read the answers through CORS "
        "(repeatable; default: no origin)",
    )


def _http_options(args: argparse.Namespace) -> dict:
    """The GatewayOptions of the flags :func:`_http` adds."""
    return dict(
        host=args.host,
        port=args.port,
        allowed_hosts=tuple(args.allowed_host or ()),
        cors_origins=tuple(args.cors_origin or ()),
    )


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("SHOAL_API_KEY") or None


def cmd_api(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from shoal.gateway.serve import GatewayOptions, serve_gateway

    if args.announce_addr and args.serve_blocks is None:
        from shoal.errors import UsageError

        raise UsageError("--announce-addr goes with --serve-blocks (the gateway's client is only dialled out of)")
    settings = _client_settings(args)
    if args.serve_blocks is not None:  # the gateway as a peer: its client hosts the span
        if args.model is None:
            from shoal.errors import UsageError

            raise UsageError("--serve-blocks serves blocks of one model: name it (shoal api MODEL --serve-blocks ...)")
        settings["client"] = replace(settings["client"], local_blocks=args.serve_blocks)
    options = GatewayOptions(
        model=args.model,
        every_model=args.model is None,
        models_dirs=tuple(Path(folder).expanduser() for folder in args.models_dir or ()),
        client_memory=args.client_memory or DEFAULT_CLIENT_MEMORY,
        api_key=_api_key(args),
        **_http_options(args),
        max_concurrency=args.max_concurrency,
        max_concurrency_per_model=args.max_concurrency_per_model,
        default_max_tokens=args.max_tokens,
        **settings,
    )
    return serve_gateway(options)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from shoal.client.config import ClientConfig
    from shoal.errors import UsageError
    from shoal.gateway.serve import GatewayOptions, serve_gateway

    ticket = join_ticket(args.join)
    if not ticket.swarm_id:
        raise UsageError(
            "this ticket names no swarm: it was printed by a server started without --new-swarm or --join; "
            "the dashboard shows a swarm's table: use the ticket of a swarm member"
        )
    options = GatewayOptions(
        join=(ticket,),
        api_key=_api_key(args),
        client=ClientConfig(transport=transport_config(args, args.bind), **member_settings(args)),
        **_http_options(args),
    )
    return serve_gateway(options)


def cmd_chat(args: argparse.Namespace) -> int:
    from shoal.cli.chat import ChatOptions, run_chat

    options = ChatOptions(
        model=args.model,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        **_client_settings(args),
    )
    return run_chat(options)


def add_commands(sub) -> None:
    """Register ``api``, ``dashboard`` and ``chat`` on the ``shoal`` subparsers ``sub``."""
    model_help = "the model's local directory, known name (smollm2) or Hub id, as the swarm's servers name it"
    api = sub.add_parser("api", help="OpenAI-compatible HTTP API (and dashboard) over a swarm")
    api.add_argument(
        "model",
        nargs="?",
        help=f"{model_help}; none: every model the joined swarms list, routed by each request's model",
    )
    api.add_argument(
        "--models-dir",
        action="append",
        metavar="DIR",
        help="with no model named: load a model the swarms call NAME from DIR/NAME when it exists (repeatable; "
        "else NAME is a known model or Hub id)",
    )
    api.add_argument(
        "--client-memory",
        type=memory_size,
        metavar="SIZE",
        help="memory for the models' client parts (embeddings, LM head) held at once; the least recently used "
        "idle model is evicted to load another (default: 8GiB)",
    )
    _http(api)
    api.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 and on the dashboard's ?ticket= (another swarm) "
        "(default: $SHOAL_API_KEY; none)",
    )
    api.add_argument("--max-concurrency", type=positive_int, default=16, help="generations running at once")
    api.add_argument(
        "--max-concurrency-per-model",
        type=positive_int,
        default=None,
        help="requests of one model in flight at once; past it, 429 (default: none of its own)",
    )
    api.add_argument("--max-tokens", type=positive_int, default=512, help="answer length when a request names none")
    api.add_argument(
        "--serve-blocks",
        type=block_range,
        metavar="START:END",
        help="also serve these blocks in the gateway's process, as `shoal serve` would: announced to the swarm "
        "for every peer, reached by the gateway's own requests without a network hop",
    )
    api.add_argument("--announce-addr", action="append", type=announce_address, metavar="IP:PORT",
                     help=f"with --serve-blocks: {ANNOUNCE_HELP} (the span's endpoint, bound at --bind)")  # fmt: skip
    _client_flags(api)
    api.set_defaults(func=cmd_api)

    dashboard = sub.add_parser("dashboard", help="live web page of a swarm: models, block coverage, servers")
    _http(dashboard)
    dashboard.add_argument(
        "--api-key",
        help="let a caller with 'Authorization: Bearer KEY' show another swarm (?ticket=), which the gateway "
        "dials for it (default: $SHOAL_API_KEY; none: only this swarm)",
    )
    _client_network(dashboard, several=False)
    add_member_flags(dashboard)
    dashboard.set_defaults(func=cmd_dashboard)

    chat = sub.add_parser("chat", help="chat in the terminal with a model served by a swarm (one session)")
    chat.add_argument("model", help=model_help)
    chat.add_argument("--system", help="system message opening the conversation")
    chat.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens per answer at most")
    chat.add_argument(
        "--max-length",
        type=positive_int,
        help="positions of the whole conversation (default: min(context, 2048))",
    )
    chat.add_argument("--temperature", type=non_negative_float, default=0.0, help="sampling temperature; 0: greedy")
    chat.add_argument(
        "--top-p", type=probability, default=1.0, help="sample from the smallest set of tokens holding this probability"
    )
    chat.add_argument("--seed", type=int, help="seed of the sampling (default: random)")
    _client_flags(chat)
    chat.set_defaults(func=cmd_chat)
