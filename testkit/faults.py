"""What a faulty server does wrong, and its own record of every time it did.

Each fault is a small frozen msgspec struct, so a list of them travels as JSON to a server process
(``python -m testkit.faulty_server ... --faults JSON``, see :func:`fault_flags`) as easily as it is
given to an in-process one (:func:`testkit.faulty.make_faulty`). Faults compose: a server may delay,
drop and corrupt at once; output corruptions apply in the order given.

Steps are counted per session, from 0, in the order the server runs them; stateless ``forward``
requests are counted in a sequence of their own (``session`` None). Positions are the session's
cache positions (``past_length + i``), not ``position_ids`` (which left padding shifts).

The record is the server's own account (what it altered, where): a test compares it with what the
client saw, so a seam that silently does nothing, or does more than it says, fails.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec

CRASH_EXIT_CODE = 17  # a faulty server process that crashes on purpose exits with this


class When(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Which steps a fault hits: ``first_step``, ``first_step + every``, ... up to ``last_step``,
    each with ``probability`` (seeded draws, one per such step). ``from_position``: output
    corruptions leave earlier positions of a step untouched; the other faults hit whole steps that
    reach it (some new position >= ``from_position``)."""

    first_step: int = 0
    every: int = 1
    last_step: int | None = None
    from_position: int = 0
    probability: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.first_step < 0 or self.every < 1 or self.from_position < 0:
            raise ValueError(f"need first_step >= 0, every >= 1, from_position >= 0: {self}")
        if self.last_step is not None and self.last_step < self.first_step:
            raise ValueError(f"last_step {self.last_step} < first_step {self.first_step}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")

    def selects(self, step: int, positions: tuple[int, int]) -> bool:
        """Whether ``step`` (covering cache positions ``[start, end)``) is one this fault may hit,
        before the probability draw."""
        if step < self.first_step or (self.last_step is not None and step > self.last_step):
            return False
        return (step - self.first_step) % self.every == 0 and positions[1] > self.from_position


ALWAYS = When()


class _Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, tag_field="fault"):
    """Base of every fault; ``fault`` (the tag) names it in JSON and in the record."""


class ReplyDelay(_Fault, frozen=True, tag="reply_delay"):
    """Wait ``seconds`` before sending every reply on the blocks protocol (a slow server)."""

    seconds: float


class DropReply(_Fault, frozen=True, tag="drop_reply"):
    """Never send the reply of the steps ``when`` selects (the step still runs: the cache moves on)."""

    when: When = ALWAYS


class Malformed(_Fault, frozen=True, tag="malformed"):
    """Answer the steps ``when`` selects with a frame of garbage instead of the reply: a well-sized
    header frame whose bytes are no message (the step still runs: the cache moves on)."""

    when: When = ALWAYS
    seed: int = 0


class Crash(_Fault, frozen=True, tag="crash"):
    """Die when a session reaches step ``step``, before running it: a server process exits with
    :data:`CRASH_EXIT_CODE`; an in-process server closes its node (every connection drops)."""

    step: int


class Noise(_Fault, frozen=True, tag="noise"):
    """Add Gaussian noise of norm ``relative * ||output||`` (over the positions hit)."""

    relative: float
    seed: int = 0
    when: When = ALWAYS


class Zeros(_Fault, frozen=True, tag="zeros"):
    """Answer zeros."""

    when: When = ALWAYS


class Identity(_Fault, frozen=True, tag="identity"):
    """Answer the step's input hidden states unchanged (no block ran, as far as the client sees)."""

    when: When = ALWAYS


class SkipBlock(_Fault, frozen=True, tag="skip_block"):
    """Run the span without block ``block`` (global index); its cache is not written either."""

    block: int
    when: When = ALWAYS


class OtherWeights(_Fault, frozen=True, tag="other_weights"):
    """Run block ``block`` (global index) with a perturbed copy of its weights: every floating
    tensor gets Gaussian noise of norm ``relative * ||tensor||`` (seeded; see
    :func:`testkit.faulty.perturbed_copy`)."""

    block: int
    relative: float = 0.5
    seed: int = 0
    when: When = ALWAYS


class StaleCache(_Fault, frozen=True, tag="stale_cache"):
    """Run the steps on a throwaway copy of the session's cache: the session's length moves on but
    the new positions' keys and values are never written (later steps attend to stale slots)."""

    when: When = ALWAYS


class Equivocate(_Fault, frozen=True, tag="equivocate"):
    """Push the next server of a chain the output plus noise of norm ``relative * ||output||``,
    while the client gets the honest output."""

    relative: float
    seed: int = 0
    when: When = ALWAYS


Fault = (
    ReplyDelay
    | DropReply
    | Malformed
    | Crash
    | Noise
    | Zeros
    | Identity
    | SkipBlock
    | OtherWeights
    | StaleCache
    | Equivocate
)
OUTPUT_FAULTS = (Noise, Zeros, Identity)
BLOCK_FAULTS = (SkipBlock, OtherWeights)

_FAULTS_DECODER = msgspec.json.Decoder(list[Fault])


def fault_name(fault: Fault) -> str:
    """The fault's tag (``"noise"``...): its name in JSON and in the record."""
    return type(fault).__struct_config__.tag


def encode_faults(faults: Sequence[Fault]) -> str:
    return msgspec.json.encode(list(faults)).decode()


def decode_faults(text: str) -> list[Fault]:
    """Faults from their JSON list; a wrong or unknown field raises ValueError naming it."""
    try:
        return _FAULTS_DECODER.decode(text)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--faults: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"--faults is not JSON: {exc}") from None


def fault_flags(*faults: Fault, record: str | Path | None = None) -> tuple[str, ...]:
    """Flags for :mod:`testkit.faulty_server` (``record``: where it appends its record as JSON lines)."""
    flags = ("--faults", encode_faults(faults))
    return flags if record is None else (*flags, "--fault-record", str(record))


def faulty_server_args(args: Sequence[str]) -> list[str]:
    """``python`` arguments of ``shoal serve`` (``-m shoal.cli.main serve ...``) turned into the same
    server under :mod:`testkit.faulty_server` when they carry ``--faults``; unchanged otherwise."""
    args = list(args)
    if "--faults" not in args:
        return args
    prefix = ["-m", "shoal.cli.main", "serve"]
    if args[:3] != prefix:
        raise ValueError(f"expected {' '.join(prefix)} ..., got {args[:3]}")
    return ["-m", "testkit.faulty_server", *args[3:]]


# ---- the record ---------------------------------------------------------------------------------
class Alteration(msgspec.Struct, frozen=True, kw_only=True):
    """One thing a faulty server did on purpose."""

    fault: str  # the fault's tag, e.g. "noise"
    step: int | None  # the session's step (or the forward's number); None: a reply that carried no output
    session: int | None = None  # sessions numbered 0, 1, ... in the order of their first step; None: a forward
    positions: tuple[int, int] | None = None  # cache positions [start, end) altered
    blocks: tuple[int, int] | None = None  # blocks [start, end) whose computation was altered
    size: float | None = None  # measured ||altered - honest|| / ||honest|| where an output changed
    detail: str = ""  # what was done, in words


_LINE_DECODER = msgspec.json.Decoder(Alteration)


class FaultRecord:
    """Every alteration a faulty server made, in order. Written from the event loop and the compute
    thread; with ``sink``, each entry is also appended there as one JSON line as it happens (a server
    process's record survives its crash)."""

    def __init__(self, sink: str | Path | None = None):
        self._entries: list[Alteration] = []
        self._lock = threading.Lock()
        self._sink = None if sink is None else open(sink, "a", buffering=1)  # noqa: SIM115 (lives with the server)

    def add(self, entry: Alteration) -> None:
        with self._lock:
            self._entries.append(entry)
            if self._sink is not None:
                self._sink.write(msgspec.json.encode(entry).decode() + "\n")
                self._sink.flush()

    def entries(self, fault: str | None = None) -> list[Alteration]:
        with self._lock:
            return [e for e in self._entries if fault is None or e.fault == fault]

    def steps(self, fault: str) -> list[int | None]:
        return [e.step for e in self.entries(fault)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @staticmethod
    def read(path: str | Path) -> list[Alteration]:
        """The entries a server process appended to ``path``."""
        lines = Path(path).read_text().splitlines()
        return [_LINE_DECODER.decode(line) for line in lines if line.strip()]
