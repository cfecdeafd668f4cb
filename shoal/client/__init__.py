"""The client: embeddings, final norm and LM head here; blocks on the swarm."""

from shoal.quantization.libraries import quiet_imports

with quiet_imports():  # transformers imports torchao when installed, which warns about a CPU build of torch
    from shoal.client.auto import AutoDistributedModelForCausalLM
    from shoal.client.config import ClientConfig
    from shoal.client.generation.cache import SessionCache
    from shoal.client.model import DistributedModelForCausalLM
    from shoal.client.remote import RemoteSequence, RemoteSession

__all__ = [
    "AutoDistributedModelForCausalLM",
    "ClientConfig",
    "DistributedModelForCausalLM",
    "RemoteSequence",
    "RemoteSession",
    "SessionCache",
]
