"""The ``shoal`` command's argument parsing: a parser whose mistakes are one-line errors, and the
value types and choices its flags share.

Import-light: building the parser imports neither torch nor the transport (``shoal --help`` and a
usage mistake answer at once, and :func:`shoal.cli.main.main` sets the OpenMP defaults before torch
loads). Choices that live in those layers are spelled here; ``tests/cli/test_commands.py`` checks them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shoal.limits import Limits, RegistryLimits, flag_of, limit_fields

if TYPE_CHECKING:
    from shoal.ids import BlockRange
    from shoal.transport import Ticket, TransportConfig

#: shoal.transport.NetworkProfile's values
NETWORK_PROFILES = ("local", "internet")
#: shoal.wire.Codec's values, the first the default (raw float32)
CODECS = ("raw", "bf16", "fp16", "q8")
#: shoal.models.kv.DEFAULT_PAGE_SIZE
DEFAULT_PAGE_SIZE = 16


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help text, unless there is nothing to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        nothing = default in (None, False, argparse.SUPPRESS) or default == []
        if "%(default)" in text or nothing or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake raises :class:`~shoal.errors.UsageError` (reported as one line
    by :mod:`shoal.cli.failures`) instead of printing usage and exiting."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """A subcommand's mistake names the subcommand (``shoal serve: ...``); the top level's needs no
        name: the error line already starts ``shoal: error:``."""
        from shoal.errors import UsageError

        where = f"{self.prog}: " if " " in self.prog else ""
        raise UsageError(f"{where}{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # what argparse names in "invalid positive integer value"


def block_range(text: str) -> BlockRange:
    """``START:END``, half-open (``--serve-blocks``)."""
    from shoal.ids import BlockRange

    return BlockRange.parse(text)


block_range.__name__ = "START:END block range"


def memory_size(text: str) -> int:
    """Bytes of ``512MiB``, ``8GiB``, ``2G`` or a plain number of bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    number = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(number[-1:], 1)
    value = float(number[:-1] if scale != 1 else number) * scale
    if not value >= 1:
        raise ValueError(text)
    return int(value)


memory_size.__name__ = "memory size (e.g. 512MiB, 8GiB)"


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(text)
    return value


port_number.__name__ = "port (0-65535)"


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


positive_float.__name__ = "positive number"


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(text)
    return value


non_negative_float.__name__ = "non-negative number"


def record_lifetime(text: str) -> float:
    """Seconds a server's records live (``--expiry``): positive, and no longer than tables accept."""
    value = float(text)
    if not 0 < value <= RegistryLimits().max_announce_lifetime:
        raise ValueError(text)
    return value


record_lifetime.__name__ = f"lifetime in (0, {RegistryLimits().max_announce_lifetime:g}] seconds"


def probability(text: str) -> float:
    """A probability a sampler keeps (``--top-p``): above 0, at most 1, as the HTTP API takes it."""
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(text)
    return value


probability.__name__ = "probability in (0, 1]"


def announce_address(text: str) -> str:
    """An ``--announce-addr`` value: ``IP:PORT``, normalised (:func:`shoal.ids.socket_address`)."""
    from shoal.ids import socket_address

    try:
        return socket_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


ANNOUNCE_HELP = (
    "announce this address (IP:PORT; repeatable) in tickets and swarm records instead of the bound ones: "
    "a public address forwarded to --port, a proxy in front of this peer"
)


def add_limit_flags(parser: argparse.ArgumentParser, scope: str) -> None:
    """A flag for every limit of ``scope`` (:mod:`shoal.limits`: ``node`` or ``server``)."""
    group = parser.add_argument_group(f"limits ({'per peer and per node' if scope == 'node' else 'work and cache'})")
    for item in limit_fields(scope):
        kind = positive_int if isinstance(item.default, int) else positive_float
        metavar = "BYTES" if item.name.endswith("_bytes") else ("SECONDS" if kind is positive_float else "N")
        group.add_argument(flag_of(item.name), type=kind, default=item.default, metavar=metavar,
                           help=item.metadata["help"])  # fmt: skip


def limits_of(args: argparse.Namespace) -> Limits:
    """The limits a command's flags set (those it has no flag for keep their defaults); a
    combination :class:`Limits` refuses is a usage error."""
    from shoal.errors import UsageError

    given = {item.name: getattr(args, item.name) for item in limit_fields() if hasattr(args, item.name)}
    try:
        return Limits(**given)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def transport_config(args: argparse.Namespace, bind_addr: str) -> TransportConfig:
    """The endpoint settings of every command that joins a swarm (``--network``, the connect and
    request deadlines, the limits), bound to ``bind_addr``. Imports the transport only when called."""
    from shoal.transport import Deadlines, NetworkProfile, TransportConfig

    return TransportConfig(
        profile=NetworkProfile(args.network),
        bind_addr=bind_addr,
        deadlines=Deadlines(connect=args.connect_timeout, request=args.request_timeout),
        limits=limits_of(args),
        announce_addrs=tuple(getattr(args, "announce_addr", None) or ()),
    )


def join_ticket(text: str) -> Ticket:
    """A ``--join`` value, parsed (a damaged one raises :class:`~shoal.transport.ticket.TicketError`,
    reported as one line). Imports the transport only when called."""
    from shoal.transport import Ticket

    return Ticket.parse(text)
