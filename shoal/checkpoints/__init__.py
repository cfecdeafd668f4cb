"""Checkpoints: find model files, read only a party's tensors, fingerprint blocks, write per-block shards."""

from shoal.checkpoints.fetch import (
    KNOWN_MODELS,
    fetch_model,
    is_fetched,
    model_cache_dir,
    model_source,
    resolve_model,
    swarm_weights_dir,
)
from shoal.checkpoints.loading import (
    CheckpointError,
    block_fingerprint,
    load_client_head,
    load_config,
    load_span,
    load_tensors,
    model_fingerprints,
    model_name,
    span_fingerprints,
    span_tensor_filter,
    weight_map,
)
from shoal.checkpoints.sharding import save_sharded

__all__ = [
    "KNOWN_MODELS",
    "CheckpointError",
    "block_fingerprint",
    "fetch_model",
    "is_fetched",
    "load_client_head",
    "load_config",
    "load_span",
    "load_tensors",
    "model_cache_dir",
    "model_fingerprints",
    "model_name",
    "model_source",
    "resolve_model",
    "save_sharded",
    "span_fingerprints",
    "span_tensor_filter",
    "swarm_weights_dir",
    "weight_map",
]
