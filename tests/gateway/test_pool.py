"""The gateway's model pool without a network: models load on first use, the least recently used
idle one is evicted to stay under the budget, one with a request in flight never is, and a model
larger than the budget still loads alone. The "models" are plain records of what was loaded and
closed: the pool's policy is what is tested, not a model."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
from transformers import LlamaConfig

from shoal.gateway.engine import GatewayError
from shoal.gateway.pool import ModelPool, client_bytes

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20


@dataclass
class Loaded:
    name: str
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class Recorder:
    """Loads ``Loaded`` records of the sizes given, keeping every one it made (and how often)."""

    def __init__(self, sizes: dict[str, int], delay: float = 0.0):
        self.sizes, self.delay = sizes, delay
        self.made: list[Loaded] = []

    def load(self, name: str) -> Loaded:
        time.sleep(self.delay)
        if name == "broken":
            raise OSError("no such checkpoint")
        self.made.append(Loaded(name))
        return self.made[-1]

    def pool(self, budget: int) -> ModelPool[Loaded]:
        return ModelPool(self.load, self.sizes.__getitem__, budget)


def use(pool: ModelPool, name: str) -> Loaded:
    with pool.lease(name) as value:
        return value


def test_models_load_once_on_first_use():
    recorder = Recorder({"a": 3 * MIB, "b": 3 * MIB})
    pool = recorder.pool(10 * MIB)
    assert pool.loaded() == [] and pool.used() == 0
    first = use(pool, "a")
    assert use(pool, "a") is first
    use(pool, "b")
    assert [m.name for m in recorder.made] == ["a", "b"]
    assert pool.loaded() == ["a", "b"] and pool.used() == 6 * MIB


def test_the_least_recently_used_idle_model_is_evicted_to_make_room():
    recorder = Recorder({"a": 4 * MIB, "b": 4 * MIB, "c": 4 * MIB})
    pool = recorder.pool(10 * MIB)
    a, b = use(pool, "a"), use(pool, "b")
    use(pool, "a")  # a is now the more recently used: b goes first
    c = use(pool, "c")
    assert pool.loaded() == ["a", "c"]
    assert b.closed and not a.closed and not c.closed
    assert pool.evictions == 1 and pool.used() == 8 * MIB
    again = use(pool, "b")  # back on demand, a fresh load (a, now least recent, makes room)
    assert again is not b and pool.loaded() == ["c", "b"] and a.closed


def test_a_model_with_a_request_in_flight_is_never_evicted():
    recorder = Recorder({"a": 4 * MIB, "b": 4 * MIB, "c": 4 * MIB})
    pool = recorder.pool(10 * MIB)
    a = pool.acquire("a")  # in flight
    use(pool, "b")
    c = use(pool, "c")  # a is least recently used but busy: b goes
    assert pool.loaded() == ["a", "c"] and not a.closed and not c.closed
    assert pool.in_flight("a") == 1
    pool.release("a")
    assert pool.in_flight("a") == 0
    use(pool, "b")  # a idle now: evicted
    assert a.closed and pool.loaded() == ["c", "b"]


def test_no_room_beside_busy_models_is_a_503_and_evicts_nothing():
    recorder = Recorder({"a": 6 * MIB, "b": 2 * MIB, "c": 6 * MIB})
    pool = recorder.pool(10 * MIB)
    pool.acquire("a")
    b = use(pool, "b")
    with pytest.raises(GatewayError) as refused:
        pool.acquire("c")
    assert (refused.value.status, refused.value.code, refused.value.param) == (503, "model_memory_busy", "model")
    assert "a" in refused.value.message and "--client-memory" in refused.value.message
    assert pool.loaded() == ["a", "b"] and not b.closed  # nothing evicted for a load that cannot happen
    pool.release("a")
    use(pool, "c")  # a, idle now and least recently used, makes room; b stays
    assert pool.loaded() == ["b", "c"]


def test_a_model_larger_than_the_budget_loads_alone():
    recorder = Recorder({"small": 2 * MIB, "huge": 50 * MIB})
    pool = recorder.pool(10 * MIB)
    small = use(pool, "small")
    use(pool, "huge")
    assert pool.loaded() == ["huge"] and small.closed


def test_concurrent_first_requests_load_a_model_once():
    recorder = Recorder({"a": MIB}, delay=0.3)
    pool = recorder.pool(10 * MIB)
    got: list[Loaded] = []
    threads = [threading.Thread(target=lambda: got.append(use(pool, "a"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(recorder.made) == 1 and all(value is recorder.made[0] for value in got) and len(got) == 4
    assert pool.in_flight("a") == 0


def test_a_failed_load_holds_nothing_and_can_be_retried():
    recorder = Recorder({"broken": MIB})
    pool = recorder.pool(10 * MIB)
    with pytest.raises(OSError):
        pool.acquire("broken")
    assert pool.loaded() == [] and pool.used() == 0
    with pytest.raises(OSError):
        pool.acquire("broken")


def test_release_without_acquire_is_a_bug_said_so():
    pool = Recorder({"a": MIB}).pool(10 * MIB)
    with pytest.raises(RuntimeError):
        pool.release("a")


def test_close_closes_every_loaded_model():
    recorder = Recorder({"a": MIB, "b": MIB})
    pool = recorder.pool(10 * MIB)
    use(pool, "a"), use(pool, "b")
    pool.close()
    assert all(m.closed for m in recorder.made) and pool.loaded() == []


def test_client_bytes_counts_embeddings_head_and_norm():
    untied = LlamaConfig(vocab_size=1000, hidden_size=64, tie_word_embeddings=False)
    tied = LlamaConfig(vocab_size=1000, hidden_size=64, tie_word_embeddings=True)
    assert client_bytes(untied) == (2 * 1000 * 64 + 64) * 4
    assert client_bytes(tied, dtype_bytes=2) == (1000 * 64 + 64) * 2


def test_a_model_past_its_limit_is_refused_and_others_load():
    recorder = Recorder({"a": MIB, "b": MIB})
    pool = recorder.pool(10 * MIB)
    pool.acquire("a", limit=1)
    with pytest.raises(GatewayError) as refused:
        pool.acquire("a", limit=1)
    assert (refused.value.status, refused.value.code) == (429, "model_busy")
    assert pool.acquire("b", limit=1).name == "b"
    assert pool.in_flight("a") == pool.in_flight("b") == 1
    pool.release("a")
    assert pool.acquire("a", limit=1).name == "a"
