"""What each sender may make a peer's registry take: a budget of records and of request bytes, and
the keys we asked it for (pure: a clock in, decisions out; :class:`~shoal.swarm.gossip.Gossiper`
applies them).

A sender is the peer at the other end of a request (the transport authenticates its id). Every
request it sends is charged its payload bytes first: past its byte budget the request is refused
whole (``rate_limited``), before anything in it is decoded. Records come in three ways:

* asked for: our reply to its offer or sync named their keys (:meth:`Quota.ask`, which grants at
  most the records left in its budget and takes them from it); its push of those is merged;
* unasked, in a push: at most ``max_unasked_per_push`` of one push (a leaving server pushes its
  offline record to every peer), each taken from the budget; the rest are dropped, and decoded
  (to find the asked ones among them) only while asks of the sender are open, each decode taken
  from its budget;
* in the reply to a request of ours (a sync): not charged, we asked; the table's caps still hold.

Budgets are token buckets (``sender_*_per_s`` sustained, ``sender_*_burst`` at once). A sender
past its budget is slowed, not banned: what it offers is asked again once the budget refills, and
its records reach us through other peers meanwhile (every record is offered by many).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from shoal.limits import RegistryLimits
from shoal.swarm.records import RecordError


class Bucket:
    """A token bucket: ``rate`` per second up to ``burst``, full at first."""

    __slots__ = ("burst", "rate", "tokens", "when")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.when = rate, burst, float(burst), now

    def level(self, now: float) -> float:
        if now > self.when:
            self.tokens = min(self.burst, self.tokens + (now - self.when) * self.rate)
            self.when = now
        return self.tokens

    def take(self, n: float, now: float) -> bool:
        if self.level(now) < n:
            return False
        self.tokens -= n
        return True

    def wait(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (inf if more than the burst)."""
        missing = n - self.level(now)
        return 0.0 if missing <= 0 else (missing / self.rate if n <= self.burst else float("inf"))


class Sender:
    """One sender's budgets and the keys (ids) we asked it for, with when each ask lapses."""

    __slots__ = ("asked", "bytes", "records")

    def __init__(self, limits: RegistryLimits, now: float):
        self.records = Bucket(limits.sender_records_per_s, limits.sender_records_burst, now)
        self.bytes = Bucket(limits.sender_bytes_per_s, limits.sender_bytes_burst, now)
        self.asked: dict[bytes, float] = {}


class Quota:
    """Every sender's budget and open asks, bounded (``max_senders``, ``max_asked``)."""

    def __init__(self, limits: RegistryLimits = RegistryLimits(), clock: Callable[[], float] = time.time):
        self.limits, self.clock = limits, clock
        self._senders: OrderedDict[str, Sender] = OrderedDict()  # least recently heard first
        self._asked = 0  # open asks of all senders

    def __len__(self) -> int:
        return len(self._senders)

    @property
    def asked(self) -> int:
        return self._asked

    def _sender(self, peer: str, now: float) -> Sender:
        sender = self._senders.get(peer)
        if sender is None:
            if len(self._senders) >= self.limits.max_senders:
                _, oldest = self._senders.popitem(last=False)
                self._asked -= len(oldest.asked)
            sender = self._senders[peer] = Sender(self.limits, now)
        else:
            self._senders.move_to_end(peer)
            self._lapse(sender, now)
        return sender

    def _lapse(self, sender: Sender, now: float) -> None:
        if sender.asked and min(sender.asked.values()) <= now:
            before = len(sender.asked)
            sender.asked = {kid: until for kid, until in sender.asked.items() if until > now}
            self._asked -= before - len(sender.asked)

    def charge(self, peer: str, nbytes: int) -> None:
        """A request of ``nbytes`` from ``peer``: :class:`RecordError` ``rate_limited`` if over its budget."""
        now = self.clock()
        bucket = self._sender(peer, now).bytes
        if not bucket.take(nbytes, now):
            wait = bucket.wait(nbytes, now)
            raise RecordError(
                "rate_limited",
                f"peer {peer[:10]} sent more than {self.limits.sender_bytes_per_s} bytes/s of gossip; "
                + (f"retry in {wait:.1f} s" if wait < float("inf") else f"{nbytes} bytes is over the burst"),
            )

    def ask(self, peer: str, kids: Iterable[bytes]) -> list[bytes]:
        """The ids of ``kids`` (in order) we may ask ``peer`` for now, noted as asked and taken from its
        record budget: those asked already and still open, and as many more as its budget and the
        room for open asks allow."""
        now = self.clock()
        sender = self._sender(peer, now)
        room = min(int(sender.records.level(now)), self._room(now))
        out, new = [], 0
        until = now + self.limits.ask_timeout
        for kid in kids:
            if kid in sender.asked:  # asked again (its offer came twice): still open, not charged again
                sender.asked[kid] = until
                out.append(kid)
            elif new < room:
                sender.asked[kid] = until
                out.append(kid)
                new += 1
        sender.records.take(new, now)
        self._asked += new
        return out

    def _room(self, now: float) -> int:
        """Asks that may open now. With none left, lapsed asks are swept, and if that frees none,
        the sender holding the most open asks loses them all (a sender that offers and never pushes
        must not starve the others; an honest sender's lost asks only make its push unasked)."""
        if self._asked >= self.limits.max_asked:
            for sender in self._senders.values():
                self._lapse(sender, now)
        while self._asked >= self.limits.max_asked:
            greediest = max(self._senders.values(), key=lambda s: len(s.asked))
            self._asked -= len(greediest.asked)
            greediest.asked = {}
        return self.limits.max_asked - self._asked

    def asked_of(self, peer: str, kid: bytes) -> bool:
        """Whether we asked ``peer`` for ``kid`` (an ask is answered once: it is closed)."""
        sender = self._senders.get(peer)
        if sender is None or sender.asked.pop(kid, None) is None:
            return False
        self._asked -= 1
        return True

    def open_asks(self, peer: str) -> int:
        """Keys asked of ``peer`` that it has not pushed yet."""
        sender = self._senders.get(peer)
        return 0 if sender is None else len(sender.asked)

    def unasked(self, peer: str) -> bool:
        """Whether ``peer``'s budget covers one record we did not ask for (then taken from it)."""
        now = self.clock()
        return self._sender(peer, now).records.take(1, now)


__all__ = ["Bucket", "Quota", "Sender"]
