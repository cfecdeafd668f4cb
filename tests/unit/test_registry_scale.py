"""The registry's sampled simulation (``bench/registry_scale.py``, what ``python -m bench.registry
--peers 10000`` runs): its message sizes are the real encodings, and at a size the full simulation
also runs its numbers agree with the full one's (same gossip config and seed).

Bounds (``CONFIG`` of ``test_gossip_sim``: 1 s rounds, 10 s refresh, 30 s expiry; 100 peers): a join
converges within 3 rounds and a leave within 1 in both; the sampled bytes ratio is within 25% of
the full one (measured: 2.24 against 1.96 at 100 peers, 1.44 against 1.48 at 1,000 with the
defaults; it counts offer batches as a busy peer sends them, so small swarms read high), and the
observers' real tables refuse no honest record.
"""

from __future__ import annotations

import pytest

from bench import registry_scale
from bench.registry import SimConfig, run
from bench.scale_sim import digest_payload, records_payload, sync_reply_payload, wanted_payload
from shoal.swarm.gossip import GossipConfig
from shoal.swarm.messages import OfferReply, OfferRequest, PushRequest, SyncReply, encode_payload

pytestmark = pytest.mark.timeout(120)

CONFIG = GossipConfig(period=1.0, refresh=10.0, expiry=30.0)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 255, 256, 4096, 4097])
def test_payload_sizes_are_the_encodings(n):
    assert digest_payload(n) == len(encode_payload(OfferRequest(digest=bytes(16 * n))))
    assert wanted_payload(n) == len(encode_payload(OfferReply(wanted=bytes(8 * n))))
    sizes = [n % 300 + 1] * (n % 40) + [70_000] * (n % 2)
    records = tuple(bytes(s) for s in sizes)
    assert records_payload(sizes) == len(encode_payload(PushRequest(records=records)))
    ids = n % 5
    assert sync_reply_payload(sizes, ids) == len(encode_payload(SyncReply(records=records, wanted=bytes(8 * ids))))


def test_sampled_simulation_agrees_with_the_full_one():
    config = SimConfig(peers=100, gossip=CONFIG, seed=0)
    full = run(config, window=20.0, trials=2)
    sampled = registry_scale.run(SimConfig(peers=100, gossip=CONFIG, seed=0), 20.0, 2, 8, 2.0, lambda *_: None)
    for out in (full, sampled):
        assert out["join_convergence_s"] <= 3 * CONFIG.period, out["join"]
        assert out["leave_convergence_s"] <= CONFIG.period, out["leave"]
        assert out["peak_rss_mb"] > 0
    assert abs(sampled["bytes_ratio"] / full["bytes_ratio"] - 1) <= 0.25, (sampled["bytes_ratio"], full["bytes_ratio"])
    assert sampled["sampling"]["refreshes_sampled"] >= 20
    tables = sampled["observer_tables"]
    assert tables["rejected"] == {} and tables["records"] == 100 + 2  # the servers, a joiner, the model
