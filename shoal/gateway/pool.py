"""The gateway's loaded models: each loaded on first use, the least recently used evicted to stay
under a memory budget (``shoal api --client-memory``), and none evicted while a request uses it.

A model's client part (tokenizer, embeddings, final norm, LM head) is what the gateway holds; its
size is estimated from the config before it loads (:func:`client_bytes`), so the pool can make room
first. A model bigger than the whole budget still loads once nothing else is held: a gateway can
always serve one model at a time. When the models in use leave no room, the request is refused
with a 503 (``model_memory_busy``) rather than waiting: it can be retried when one finishes.
A request past a model's own limit of requests in flight (``shoal api --max-concurrency-per-model``)
is refused with a 429 (``model_busy``): one busy model does not take every generation slot.

Thread-safe: loading runs outside the lock (other models keep serving), and two first requests
for one model load it once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from shoal.gateway.engine import GatewayError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CLIENT_MEMORY", "ModelPool", "client_bytes"]

DEFAULT_CLIENT_MEMORY = 8 << 30  # bytes: a few small models' heads at once, or one large one's

T = TypeVar("T")


def client_bytes(config, dtype_bytes: int = 4) -> int:
    """What a model's client part takes: embeddings, the LM head unless tied to them, the final norm."""
    vocab, hidden = int(config.vocab_size), int(config.hidden_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return (vocab * hidden * (1 if tied else 2) + hidden) * dtype_bytes


@dataclass
class _Held(Generic[T]):
    value: T
    size: int
    in_flight: int = 0


def _busy(name: str, limit: int) -> GatewayError:
    return GatewayError(
        429,
        f"model {name} has {limit} requests in flight, its limit on this gateway "
        "(--max-concurrency-per-model): retry when one finishes",
        "requests",
        param="model",
        code="model_busy",
    )


class ModelPool(Generic[T]):
    """``load(name)`` makes a model, ``size(name)`` says its bytes beforehand, ``close(value)``
    frees it; at most ``budget`` bytes are held (see the module docstring)."""

    def __init__(
        self,
        load: Callable[[str], T],
        size: Callable[[str], int],
        budget: int,
        close: Callable[[T], None] = lambda value: value.close(),
    ):
        if budget <= 0:
            raise ValueError(f"the memory budget must be positive, not {budget}")
        self._load, self._size, self._close, self.budget = load, size, close, budget
        self._lock = threading.Lock()
        self._held: OrderedDict[str, _Held[T]] = OrderedDict()  # least recently used first
        self._loading: dict[str, tuple[Future, int]] = {}  # name -> (done when loaded, its size)
        self.evictions = 0

    # ---- what is held ----------------------------------------------------------------------------
    def loaded(self) -> list[str]:
        """The loaded models, least recently used first."""
        with self._lock:
            return list(self._held)

    def in_flight(self, name: str) -> int:
        with self._lock:
            held = self._held.get(name)
            return held.in_flight if held is not None else 0

    def used(self) -> int:
        """Bytes held and being loaded."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return sum(h.size for h in self._held.values()) + sum(size for _, size in self._loading.values())

    def peek(self, name: str) -> T | None:
        """The model if it is loaded (not counted as a use)."""
        with self._lock:
            held = self._held.get(name)
            return held.value if held is not None else None

    # ---- leases ------------------------------------------------------------------------------------
    @contextmanager
    def lease(self, name: str) -> Iterator[T]:
        """The model ``name``, loaded if need be, held (never evicted) until the block ends."""
        value = self.acquire(name)
        try:
            yield value
        finally:
            self.release(name)

    def acquire(self, name: str, limit: int | None = None) -> T:
        """The model ``name`` with one more request in flight: pair with :meth:`release`. Raises
        (429) when ``limit`` requests of it are in flight already."""
        size: int | None = None
        while True:
            with self._lock:
                held = self._held.get(name)
                if held is not None:
                    if limit is not None and held.in_flight >= limit:
                        raise _busy(name, limit)
                    held.in_flight += 1
                    self._held.move_to_end(name)
                    return held.value
                loading = self._loading.get(name)
                if loading is None and size is not None:
                    evicted = self._make_room(name, size)
                    future: Future = Future()
                    self._loading[name] = (future, size)
                    break
            if loading is not None:
                loading[0].result()  # the other request's load: then take it as loaded (or raise its error)
            else:
                size = self._size(name)  # outside the lock: it may read a config file
        for value in evicted:
            self._close_quietly(value)
        try:
            value = self._load(name)
        except BaseException as exc:
            with self._lock:
                del self._loading[name]
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, no "never retrieved" warning
            raise
        with self._lock:
            del self._loading[name]
            self._held[name] = _Held(value, size, in_flight=1)
        future.set_result(None)
        return value

    def release(self, name: str) -> None:
        with self._lock:
            held = self._held.get(name)
            if held is None or held.in_flight <= 0:
                raise RuntimeError(f"model {name} released more often than acquired")
            held.in_flight -= 1

    def _make_room(self, name: str, size: int) -> list[T]:
        """Evict idle models, least recently used first, until ``size`` more bytes fit (called with
        the lock held); the evicted models, to close outside it. Raises (503) when the models in use
        leave no room."""
        idle = [other for other, held in self._held.items() if held.in_flight == 0]  # least recent first
        left = self._used() - sum(self._held[other].size for other in idle)
        if left + size > self.budget and (len(idle) < len(self._held) or self._loading):
            busy = ", ".join([*(o for o in self._held if o not in idle), *self._loading])
            raise GatewayError(
                503,
                f"model {name} needs {size / 2**20:.1f} MiB of the gateway's memory budget "
                f"({self.budget / 2**20:.1f} MiB, --client-memory) and the models serving requests now "
                f"({busy}) leave too little: retry when they finish",
                "server_error",
                param="model",
                code="model_memory_busy",
            )
        evicted = []
        for other in idle:
            if self._used() + size <= self.budget:
                break
            evicted.append(self._held.pop(other).value)
            self.evictions += 1
            log.info("evicted model %s (least recently used) to load %s", other, name)
        return evicted

    def _close_quietly(self, value: T) -> None:
        try:
            self._close(value)
        except Exception:  # an evicted model's client that fails to close: nothing left to do about it
            log.exception("closing an evicted model failed")

    def close(self) -> None:
        """Close every loaded model (at exit)."""
        with self._lock:
            values = [h.value for h in self._held.values()]
            self._held.clear()
        for value in values:
            self._close_quietly(value)
