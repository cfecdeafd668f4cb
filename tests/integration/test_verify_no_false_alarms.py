"""No false alarms: honest replicas that compute differently pass 500+ audited steps each, never disagreeing.

The model is a random llama of :mod:`testkit.tiny` large enough for real kernels (hidden 256, MLP
512, 4 blocks, 4 query / 2 kv heads of dimension 64). Honest replicas differ in:

- **threads** (fp32): audit mode (``verify="audit"``, ``audit_every=1``) over spans ``[0:2]`` and
  ``[2:4]``, each served by a 1-thread and a 2-thread server; the chain is steered through the
  1-thread ones (:func:`~tests.helpers.byzantine.steer_through`, asserted), so the only replica
  left to audit each hop is the 2-thread one. 3 prompts x :data:`NEW_TOKENS` tokens: 600+ audits of
  each hop, one position each, under the fp32 tolerance;
- **dtype** (bf16): the same with every server (``dtype`` bfloat16, 1 and 2 threads) and the client
  in bfloat16, under the bf16 tolerance;
- **batch**: the audit path cannot put an auditor's row into another batch (each session computes
  alone), so this one is at the span level: the whole loaded span (:func:`shoal.checkpoints.load_span`)
  decodes a row of :data:`DECODE_STEPS` steps once alone (batch 1, no mask) and once as row 0 of a
  batch of 3 whose other rows are other, left-padded prompts; every step's outputs are compared
  with :func:`~shoal.verify.compare.first_disagreement` under the tolerance an audit would use
  (:func:`~shoal.verify.compare.tolerance_of`), in fp32 and in bf16.

Every case asserts zero disagreements (and no ban, settlement, rollback or unverified block on the
audit path), and, stricter than ``audit_every=1`` itself (whose one-position comparisons never pair
positions for the bf16 ``sustained`` rule), that each whole sequence compared in one call agrees
too. The audit cases read what the audits compared by wrapping the auditors' comparison
(:func:`spy_on_audits`, test-side only) and assert that it saw every audit and the calibrated tolerance.
One more span-level case is what audits at the default ``audit_every`` (8) compare: a hop's one
position a step against its auditor's 8 in one step.

Largest honest discrepancy seen (``-s`` prints it), as a fraction of the tolerance (single
positions against ``relative``; the smaller of two consecutive positions, at worst, against bf16's
``sustained``), measured on this machine (2 shared cores, torch CPU, fp32 tolerance then 5e-5, bf16 0.13 / 0.035):

- threads fp32 (1200 audits, 1266 positions): 8.4e-7, 0.017 of the tolerance;
- threads bf16 (1200 audits): 0: bitwise equal on this CPU;
- batch fp32 (alone vs row 0 of 3, 512 positions): 3.2e-5, 0.64 of the tolerance: the thinnest margin;
- batch bf16: 0: bitwise equal on this CPU (so the bf16 tolerance is exercised by the chunks case);
- chunks of 8 bf16: 0.033, 0.25 of ``relative``, pairs 0.50 of ``sustained``;
- chunks of 8 fp32: 7.2e-5, 1.44x that tolerance over 4 blocks (through 2 blocks, as the audit cases'
  hops, 0.47-0.70): a false alarm, which is why the fp32 tolerance is now 3e-4 (0.24 of it).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor

from shoal.checkpoints import load_span
from shoal.client.verification import auditors
from shoal.client.verification.auditors import Audits
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.launch.inprocess import LocalServer
from shoal.verify.compare import Tolerance, discrepancy, first_disagreement, tolerance_for, tolerance_of
from shoal.wire import Codec
from testkit.tiny import char_tokenizer, tiny_checkpoint, tiny_model
from tests.helpers.byzantine import connect_over, peer_of, steer_through

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

#: Big enough for the matmul and attention kernels to split work as on a real model (hidden >= 256).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)  # fmt: skip
MODEL_SEED = 11
LOW, HIGH = BlockRange(0, 2), BlockRange(2, 4)
PROMPT_LENGTH = 12
PROMPT_SEEDS = (300, 301, 302)
NEW_TOKENS = 200
#: Audits each hop must pass (the issue's bar), and the decode steps of the span-level batch case.
MIN_AUDITS = 500
DECODE_STEPS = 500
#: The tokens of the span-level cases' row; the batch case's other two rows: their prompt lengths
#: (left-padded to PROMPT_LENGTH) and token seeds.
ROW_SEED = 500
OTHER_ROWS = ((7, 401), (4, 402))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("no-false-alarms"), "llama", MODEL_SEED,
                           tokenizer=char_tokenizer(), **SHAPE)  # fmt: skip


@pytest.fixture(scope="module")
def swarm(model_dir):
    with InProcessSwarm(model_dir, []) as swarm:
        yield swarm


def prompt_of(seed: int, length: int = PROMPT_LENGTH) -> Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


# ---- what the audits compared ------------------------------------------------------------------

_AUDITING: contextvars.ContextVar[BlockRange | None] = contextvars.ContextVar("auditing", default=None)


@dataclass
class Compared:
    """Per hop's blocks, the sessions audited: per session, ``(recorded, auditor's)`` outputs per
    audit in order (a session starts at position 0); and every tolerance the audits used."""

    sessions: dict[BlockRange, list[list[tuple[Tensor, Tensor]]]] = field(default_factory=dict)
    tolerances: set[Tolerance] = field(default_factory=set)

    def add(self, blocks: BlockRange, start: int, recorded: Tensor, out: Tensor, tolerance: Tolerance) -> None:
        sessions = self.sessions.setdefault(blocks, [])
        if start == 0 or not sessions:
            sessions.append([])
        sessions[-1].append((recorded.clone(), out.clone()))
        self.tolerances.add(tolerance)

    def audits(self, blocks: BlockRange) -> int:
        return sum(len(session) for session in self.sessions.get(blocks, []))

    def whole(self, blocks: BlockRange) -> list[tuple[Tensor, Tensor]]:
        """Each session's recorded and audited outputs over all its positions, ``[B, n, H]`` each."""
        return [tuple(torch.cat(part, dim=1) for part in zip(*session, strict=True))
                for session in self.sessions.get(blocks, [])]  # fmt: skip


def spy_on_audits(monkeypatch: pytest.MonkeyPatch) -> Compared:
    """Record what every audit step compares (the hop's recorded outputs, the auditor's, the
    tolerance), by wrapping :meth:`Audits._audit` (which hop) and the comparison it calls; a
    settlement's comparisons (not inside an audit step) are not recorded. The audits run as they would."""
    compared = Compared()
    audit, compare = Audits._audit, auditors.first_disagreement

    async def recording_audit(self, index, track, *args, **kwargs):
        token = _AUDITING.set((track.hop.span.blocks, track.audited))
        try:
            return await audit(self, index, track, *args, **kwargs)
        finally:
            _AUDITING.reset(token)

    def recording_compare(expected, got, tolerance, mask=None):
        auditing = _AUDITING.get()
        if auditing is not None:
            assert mask is None, "the audited rows are unpadded: a mask here would need recording too"
            compared.add(*auditing, expected, got, tolerance)
        return compare(expected, got, tolerance, mask)

    monkeypatch.setattr(Audits, "_audit", recording_audit)
    monkeypatch.setattr(auditors, "first_disagreement", recording_compare)
    return compared


# ---- how close honest replicas came ---------------------------------------------------------


@dataclass(frozen=True)
class Margin:
    """The largest honest discrepancy as a fraction of the tolerance: any single position against
    ``relative``, and the worst pair of consecutive positions (the smaller of the two) against
    ``sustained`` (None: the tolerance has no sustained rule)."""

    single: float
    pair: float | None
    largest: float

    def __str__(self) -> str:
        pair = "" if self.pair is None else f", consecutive pair {self.pair:.3f} of sustained"
        return f"largest {self.largest:.2e} = {self.single:.3f} of relative{pair}"


def margin_of(sequences: list[Tensor], tolerance: Tolerance) -> Margin:
    """``sequences``: per-position discrepancies ``[n]`` of each compared sequence."""
    largest = max(float(d.max()) for d in sequences)
    pair = None
    if tolerance.sustained is not None:
        pair = max(float(torch.minimum(d[:-1], d[1:]).max()) for d in sequences if d.numel() > 1)
        pair /= tolerance.sustained
    return Margin(largest / tolerance.relative, pair, largest)


# ---- (a) threads, (c) dtype: the audit path -------------------------------------------------


#: The dtype every server (and the client) of each audit case computes in.
AUDIT_CASES = {"threads-fp32": torch.float32, "threads-bf16": torch.bfloat16}


def honest_pairs(swarm: InProcessSwarm, dtype: torch.dtype) -> dict[BlockRange, tuple[LocalServer, LocalServer]]:
    """Per span, a 1-thread and a 2-thread server computing in ``dtype``."""
    return {span: (swarm.add(span, dtype=dtype, num_threads=1), swarm.add(span, dtype=dtype, num_threads=2))
            for span in (LOW, HIGH)}  # fmt: skip


@pytest.mark.parametrize("case", list(AUDIT_CASES))
def test_replicas_differing_in_threads_pass_500_audits_per_hop(swarm, monkeypatch, case):
    """1-thread hops, 2-thread auditors, ``audit_every=1``: 600 audits per hop, none disagrees."""
    dtype = AUDIT_CASES[case]
    pairs = honest_pairs(swarm, dtype)
    compared = spy_on_audits(monkeypatch)
    servers = [server for pair in pairs.values() for server in pair]
    chain = [pairs[LOW][0], pairs[HIGH][0]]
    with connect_over(swarm, servers, verify="audit", audit_every=1, dtype=dtype) as model:
        for seed in PROMPT_SEEDS:
            route = steer_through(model, chain)
            assert route == [peer_of(s) for s in chain], "the chain is not the 1-thread servers"
            got = model.generate(prompt_of(seed), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert got.shape == (1, PROMPT_LENGTH + NEW_TOKENS)
            assert model.verification.unverified_blocks == 0, model.verification
        verification = model.verification
    expected_tolerance = tolerance_for(dtype)
    assert compared.tolerances == {expected_tolerance}, compared.tolerances
    for blocks in (LOW, HIGH):
        assert len(compared.sessions[blocks]) == len(PROMPT_SEEDS), f"blocks {blocks}: sessions audited"
        assert compared.audits(blocks) >= MIN_AUDITS, f"blocks {blocks}: {compared.audits(blocks)} audits"
    assert verification.audits == sum(compared.audits(b) for b in (LOW, HIGH)), verification
    for blocks, (hop, auditor) in pairs.items():  # by the servers' own counts: the 2-thread ones audited
        assert auditor.server.counters.steps == compared.audits(blocks), (blocks, auditor.server.counters)
        assert hop.server.counters.steps >= compared.audits(blocks), (blocks, hop.server.counters)
    assert verification.audited_positions >= 2 * len(PROMPT_SEEDS) * (PROMPT_LENGTH + NEW_TOKENS - 1), verification
    counts = (verification.disagreements, verification.settled, verification.unsettled, verification.bans,
              verification.rollbacks)  # fmt: skip
    assert counts == (0, 0, 0, 0, 0), verification
    sequences = []
    for blocks in (LOW, HIGH):
        for recorded, audited in compared.whole(blocks):
            assert first_disagreement(recorded, audited, expected_tolerance) is None, f"blocks {blocks}, whole run"
            sequences.append(discrepancy(recorded, audited))
    margin = margin_of(sequences, expected_tolerance)
    print(f"\n{case}: {verification.audits} audits ({verification.audited_positions} positions), "
          f"tolerance {expected_tolerance}: {margin}")  # fmt: skip
    assert margin.single < 1 and (margin.pair is None or margin.pair < 1)


# ---- (b) batch composition: the span level ---------------------------------------------------


def decode(span, hidden: Tensor, mask: Tensor | None, prefill: int, chunk: int = 1) -> list[Tensor]:
    """Outputs of each step of one session on ``span``: ``prefill`` positions, then ``chunk`` at a
    time (1: as a hop decodes; K: as an auditor at ``audit_every=K`` catches up). ``hidden``
    ``[B, T, H]`` (the inputs of every position); ``mask`` ``[B, T]`` or None (nothing padded).
    Position ids as transformers' generate makes them (left padding counts no position)."""
    batch, total, _ = hidden.shape
    real = torch.ones(batch, total, dtype=torch.bool) if mask is None else mask
    positions = (real.long().cumsum(-1) - 1).masked_fill(~real, 1)
    cache = span.allocate_cache(batch, total)
    outputs, past = [], 0
    with torch.inference_mode():
        for end in [prefill, *range(prefill + chunk, total, chunk), total]:
            step_mask = None if mask is None else mask[:, :end]
            out = span(hidden[:, past:end].to(span.dtype), positions[:, past:end], step_mask, cache=cache,
                       past_length=past)  # fmt: skip
            outputs.append(out.float())
            past = end
    return outputs


def random_ids(seed: int, length: int = PROMPT_LENGTH + DECODE_STEPS) -> Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def embed() -> torch.nn.Embedding:
    """The checkpoint's embedding matrix (the same seed, the same weights): a span's inputs are token embeddings."""
    return tiny_model("llama", MODEL_SEED, **SHAPE).get_input_embeddings()


def embedded(embed: torch.nn.Embedding, ids: Tensor) -> Tensor:
    with torch.no_grad():
        return embed(ids).float()


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_alone_and_in_a_batch_of_3_agree_over_500_steps(model_dir, embed, dtype):
    """A prefill and 500 one-position steps of a row alone (no mask) and as row 0 of a padded batch
    of 3: every step agrees under the audit's tolerance, and the whole sequence in one call."""
    span, _ = load_span(model_dir, 0, 4, dtype=dtype)
    total = PROMPT_LENGTH + DECODE_STEPS
    ids, masks = [random_ids(ROW_SEED)], [torch.ones(1, total, dtype=torch.bool)]
    for length, seed in OTHER_ROWS:  # other tokens, shorter prompts left-padded with the pad token (0)
        other, pad = random_ids(seed), PROMPT_LENGTH - length
        other[:, :pad] = 0
        ids.append(other)
        masks.append(torch.arange(total)[None] >= pad)
    row, batch, batch_mask = embedded(embed, ids[0]), embedded(embed, torch.cat(ids)), torch.cat(masks)

    alone = decode(span, row, None, PROMPT_LENGTH)
    batched = decode(span, batch, batch_mask, PROMPT_LENGTH)
    tolerance = tolerance_of(torch.float32, name_of(dtype), Codec.RAW)
    assert tolerance == tolerance_for(dtype)
    assert len(alone) == len(batched) == 1 + DECODE_STEPS  # the prefill, then one position a step
    flagged = [step for step, (a, b) in enumerate(zip(alone, batched, strict=True))
               if first_disagreement(a, b[:1], tolerance) is not None]  # fmt: skip
    whole_alone, whole_batched = torch.cat(alone, dim=1), torch.cat(batched, dim=1)
    assert torch.isfinite(whole_batched).all()
    assert discrepancy(whole_alone, whole_batched[1:2]).min() > 0.5, "the other rows are not other inputs"
    per_position = discrepancy(whole_alone, whole_batched[:1])
    margin = margin_of([per_position], tolerance)
    print(f"\nbatch {name_of(dtype)}: {DECODE_STEPS} steps, {total} positions, tolerance {tolerance}: {margin}")
    assert flagged == [], f"steps that disagree: {flagged[:10]} ({margin})"
    assert first_disagreement(whole_alone, whole_batched[:1], tolerance) is None, margin


#: An auditor at the default ``audit_every`` catches up this many positions in one step.
AUDIT_CHUNK = 8


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16],
    ids=["fp32", "bf16"],
)  # fmt: skip
def test_an_auditors_chunks_of_8_agree_with_one_position_steps(model_dir, embed, dtype):
    """Not one of the issue's three cases, but what audits at the default ``audit_every`` (8)
    compare: a hop decodes one position a step, its auditor 8 in one step. Each window of 8 is
    compared as an audit compares it, and the whole sequence in one call."""
    span, _ = load_span(model_dir, 0, 4, dtype=dtype)
    row = embedded(embed, random_ids(ROW_SEED))
    single = torch.cat(decode(span, row, None, PROMPT_LENGTH), dim=1)
    chunks = decode(span, row, None, PROMPT_LENGTH, chunk=AUDIT_CHUNK)
    tolerance = tolerance_of(torch.float32, name_of(dtype), Codec.RAW)
    flagged, start = [], 0
    for chunk in chunks:
        end = start + chunk.shape[1]
        first = first_disagreement(single[:, start:end], chunk, tolerance)
        if first is not None:
            flagged.append(start + first)
        start = end
    whole = torch.cat(chunks, dim=1)
    margin = margin_of([discrepancy(single, whole)], tolerance)
    print(f"\nchunks of {AUDIT_CHUNK} {name_of(dtype)}: {whole.shape[1]} positions, tolerance {tolerance}: {margin}; "
          f"windows beyond it start at {flagged[:10]}")  # fmt: skip
    assert flagged == [], f"positions that disagree: {flagged[:10]} ({margin})"
    assert first_disagreement(single, whole, tolerance) is None, margin
