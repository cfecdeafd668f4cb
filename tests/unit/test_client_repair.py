"""How ``generate`` and audit-mode repair talk (:mod:`shoal.client.verification.repair`): the model hands each
attempt's :class:`GenerationContext` over through its per-thread :class:`GenerationSlot`, and the
repair loop drives the session as an :class:`AuditedSession`. In-process blocks whose sessions
"audit" by script stand in for a swarm: a lie rolls the session back, and generation resumes from
the honest prefix with the context handed over, ending where an undisturbed run ends."""

from __future__ import annotations

import threading

import pytest
import torch

from shoal.client.blocks import AuditedSession
from shoal.client.local import LocalBlockSequence, LocalBlockSession
from shoal.client.model import DistributedModelForCausalLM
from shoal.client.verification.audit import LieDetected, Verification
from shoal.client.verification.repair import GenerationContext, GenerationSlot
from shoal.ids import BlockRange, PeerId
from shoal.models import get_family
from testkit.tiny import tiny_model

pytestmark = pytest.mark.timeout(120)

GREEDY = {"do_sample": False}


class ScriptedAuditSession(LocalBlockSession):
    """A local session in audit mode: every position is audited as it is computed, except that
    ``audit()`` reports one lie at ``lie_at`` the first time it is called past it."""

    def __init__(self, *args, lie_at: int | None, audits: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.lie_at, self.audits = lie_at, audits

    @property
    def audited_position(self) -> int:
        return self.position

    def audit(self) -> None:
        self.audits.append(self.position)
        if self.lie_at is not None and self.position > self.lie_at:
            position, self.lie_at = self.lie_at, None
            self.position = position  # rolled back, as a session that caught a liar is
            raise LieDetected(position, PeerId("liar"), BlockRange(0, 2))


class AuditedBlocks(LocalBlockSequence):
    def __init__(self, spans, lie_at: int | None = None):
        super().__init__(spans)
        self.verification = Verification("audit", 4)
        self.lie_at, self.audits = lie_at, []

    def open_session(self, batch_size, max_length, prompts=None, share=0) -> ScriptedAuditSession:
        caches = [span.allocate_cache(batch_size, max_length) for span in self.spans]
        return ScriptedAuditSession(self, caches, batch_size, max_length, lie_at=self.lie_at, audits=self.audits)


@pytest.fixture(scope="module")
def reference():
    return tiny_model("llama", seed=0)


def distributed(reference, lie_at: int | None = None) -> DistributedModelForCausalLM:
    config, state = reference.config, reference.state_dict()
    spans = LocalBlockSequence.from_state_dict(config, state, boundaries=(2,)).spans
    head = get_family(config).build_client_head(config, state, torch.float32, "cpu")
    return DistributedModelForCausalLM(config, head, AuditedBlocks(spans, lie_at))


def test_a_session_with_audits_is_an_audited_session_and_a_plain_one_is_not(reference):
    model = distributed(reference)
    assert isinstance(model.blocks.open_session(1, 4), AuditedSession)
    assert not isinstance(LocalBlockSequence(model.blocks.spans).open_session(1, 4), AuditedSession)


def test_the_slot_holds_one_context_per_thread():
    slot, mine = GenerationSlot(), GenerationContext(cache=None, generation_config=None, attention_mask=None)
    slot.hand_over(mine)
    seen: list = []

    def other() -> None:
        seen.append(slot.context)
        slot.hand_over(GenerationContext(cache=None, generation_config=None, attention_mask=torch.ones(1, 1)))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [None] and slot.context is mine


def test_generate_audits_the_session_once_it_ends(reference):
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    model = distributed(reference)
    out = model.generate(prompt, max_new_tokens=5, **GREEDY)
    torch.testing.assert_close(out, reference.generate(prompt, max_new_tokens=5, **GREEDY), rtol=0, atol=0)
    assert model.blocks.audits == [prompt.shape[1] + 4]  # the last token is never sent: 6 + 5 - 1 positions


def test_a_lie_found_by_the_final_audit_is_repaired_from_the_context_handed_over(reference):
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    model = distributed(reference, lie_at=8)
    out = model.generate(prompt, max_new_tokens=5, **GREEDY)
    torch.testing.assert_close(out, reference.generate(prompt, max_new_tokens=5, **GREEDY), rtol=0, atol=0)
    assert model.blocks.audits == [10, 10]  # the repaired attempt went on from position 8, then passed its audit
