"""The client's settings: ``from_pretrained`` makes one frozen :class:`ClientConfig` of its
keywords, checked when made (before any model is loaded or node started), and the sequence, its
directory and its sessions run from that one object."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from shoal.client import AutoDistributedModelForCausalLM
from shoal.client.config import ClientConfig
from shoal.client.remote.pipeline import DEFAULT_PREFILL_CHUNK
from shoal.errors import UsageError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.quantization import Quantization
from shoal.routing import AdapterChoice
from shoal.wire import Codec
from testkit.tiny import save_checkpoint, tiny_model
from tests.helpers.inprocess import no_server_errors  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)


def test_the_config_has_a_field_for_every_setting_from_pretrained_takes():
    keywords = inspect.signature(AutoDistributedModelForCausalLM.from_pretrained).parameters
    settings = {name for name, p in keywords.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert settings - {"start_node"} == {f.name for f in dataclasses.fields(ClientConfig)}  # start_node: not a value


def test_from_pretrained_defaults_are_the_configs():
    """One source of truth: a keyword left out of from_pretrained means the config's default."""
    keywords = inspect.signature(AutoDistributedModelForCausalLM.from_pretrained).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(ClientConfig) if f.default is not dataclasses.MISSING}
    assert keywords["verify"].default == defaults["verify"] == "audit"
    assert keywords["audit_every"].default is defaults["audit_every"] is None


def test_the_config_is_frozen_with_from_pretrained_defaults():
    config = ClientConfig()
    assert (config.push, config.compression, config.refresh_period, config.routing_seed) == (True, Codec.RAW, 30, None)
    assert (config.min_quality, config.adapter, config.audit_every) == (Quantization.INT8, None, None)
    assert (config.verify, config.prefill_chunk) == ("audit", DEFAULT_PREFILL_CHUNK)  # audits are on by default
    assert (config.tuning_mode, config.pre_seq_len, config.dtype, config.device) == (None, 0, torch.float32, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.push = False  # type: ignore[misc]
    deadlines = config.transport.deadlines
    assert config.listing_timeout == deadlines.connect + 2.0 < deadlines.connect + deadlines.request
    assert config.route_wait == 10.0


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"verify": "paranoid"}, UsageError),
        ({"route_wait": -1.0}, UsageError),
        ({"verify": "audit", "audit_every": 0}, UsageError),
        ({"verify": "redundant", "audit_every": 8}, UsageError),  # redundant mode audits every step
        ({"prefill_chunk": -1}, ValueError),
        ({"pre_seq_len": 4}, UsageError),  # prompt positions without a tuning mode
    ],
)
def test_settings_are_checked_when_the_config_is_made(settings, error):
    with pytest.raises(error):
        ClientConfig(**settings)


@pytest.mark.parametrize(
    ("keywords", "error"),
    [
        ({"verify": "paranoid"}, UsageError),
        ({"route_wait": -1.0}, UsageError),
        ({"prefill_chunk": -1}, ValueError),
        ({"min_quality": "int3"}, UsageError),
        ({"compression": "zip"}, UsageError),
        ({"adapter": ""}, UsageError),
    ],
)
def test_from_pretrained_checks_its_keywords_before_loading_anything(tmp_path, keywords, error):
    missing = tmp_path / "no-such-model"  # reached only if the keywords passed
    with pytest.raises(error):
        AutoDistributedModelForCausalLM.from_pretrained(str(missing), initial_peers=[], **keywords)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_checkpoint(tiny_model("llama", seed=3), tmp_path_factory.mktemp("tiny-client-config"))


@pytest.mark.usefixtures("no_server_errors")
def test_from_pretrained_builds_one_config_that_sequence_directory_and_sessions_share(model_dir):
    with InProcessSwarm(model_dir, [BlockRange(0, 2), BlockRange(2, 4)]) as swarm:
        model = swarm.connect(
            push=False, compression="bf16", refresh_period=0, routing_seed=5, min_quality="nf4",
            verify="audit", audit_every=3, prefill_chunk=6,
        )  # fmt: skip
        sequence = model.blocks
        config = sequence.config
        assert isinstance(config, ClientConfig)
        assert sequence.directory.config is config  # passed whole, not rebuilt or relayed
        assert config == ClientConfig(
            transport=swarm.transport, push=False, compression=Codec.BF16, refresh_period=0, routing_seed=5,
            min_quality=Quantization.NF4, verify="audit", audit_every=3, prefill_chunk=6,
        )  # fmt: skip
        assert sequence.directory.min_quality is Quantization.NF4
        assert (model.verification.mode, model.verification.audit_every) == ("audit", 3)
        assert sequence.prefill_chunk == 6 and sequence.adapter is None and sequence.directory.adapter is None
        with model.inference_session(max_length=8):
            ids = torch.tensor([[1, 2, 3]])
            assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 5)
        assert [(s.start, s.end) for s in sequence.chain] == [(0, 2), (2, 4)]


def test_an_adapter_choice_reaches_the_directory_as_parsed():
    digest = "ab" * 32
    config = ClientConfig(adapter=AdapterChoice.parse(f"style@{digest}"))
    assert config.adapter == AdapterChoice("style", digest)


def test_require_verified_needs_a_mode_that_checks():
    assert ClientConfig(verify="audit", require_verified=True).require_verified
    with pytest.raises(UsageError, match="require_verified=True needs verify='audit' or 'redundant'"):
        ClientConfig(verify="off", require_verified=True)
