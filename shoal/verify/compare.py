"""Whether two servers' outputs of the same blocks on the same inputs agree, within what honest replicas differ by.

Two honest servers never return bit-identical hidden states: thread count, batch composition, the attention
kernel and cached decode versus one-pass prefill all change the order of floating-point sums, and bf16
rounds differently after each. :func:`discrepancy` measures, per position, the larger of two views of a
row ``e`` (expected) against ``g`` (got), both relative, so the same tolerance holds for a layer-0 output
of norm ~1 and a late block's output with outlier channels of magnitude ~90 or an attention-sink row of
norm ~26000:

- the *elementwise* view: the RMS over hidden of ``|e - g| / max(|e|, |g|, rms)``, where ``rms`` is the
  row's RMS. Honest rounding error is proportional to each value's own magnitude, so an outlier channel's
  large absolute error counts for what it is relative to that channel (measured on SmolLM2 in bf16: one
  channel of magnitude ~99 off by 7.5 made the plain relative L2 0.063, this view 0.031); diffuse
  corruption (Gaussian noise of relative size r) still reads 0.76 r to 1 r (0.84 r typically at hidden
  size 64, 0.96 r at 576). Each value counts at most 2, so this view alone under-weights a corruption
  of a few channels;
- *a quarter of the relative L2*, ``||e - g|| / (4 max(||e||, ||g||))``, which catches exactly that (one
  channel blown up reads about 0.25, whatever the hidden size), weighted down because one outlier
  channel's honest error dominates it.

Both are symmetric in the two arguments, so settling a dispute does not depend on who is called
"expected". A row whose RMS is below :data:`FLOOR_FRACTION` of the call's median row RMS is measured
against that floor, so a near-zero row's rounding noise is not a disagreement.

bf16 needs two levels (:class:`Tolerance`): honest bf16 replicas differ by about 0.01 at most positions
but by up to 0.065 at an isolated one (measured on tiny random models: a near-tie somewhere in the span
resolved differently), while noise of relative size 5e-2 reads 0.038-0.05 at *every* position it hits.
A position therefore disagrees when it exceeds ``relative`` (above every honest spike), or when it and
the next position of the same row both exceed ``sustained`` (above every honest pair). So in bf16 a
corruption confined to one position must be larger (about ``relative / 0.84``) to be seen, and one that
starts at the last compared position is seen at the next comparison's first position, unless it exceeds
``relative``.

Two more rules in bf16 catch the lies those two let through (issue #34: noise of 0.11 on every *other*
position never makes a pair, and a push of half the row's norm into 4 channels reads only 0.115):

- the *window* rule: a position beyond ``sustained`` disagrees when at least ``window_count`` of the
  ``window`` positions of its row from it on (itself included; fewer at the end of a comparison) are
  beyond ``sustained`` too. It reports the first position beyond ``sustained`` of the first such window,
  at or before the first corrupted position there, and sees only what one comparison holds (a judge
  compares the disputed step alone, :func:`shoal.verify.evidence.finding`). A count, not a mean: an
  honest replica's error drifts up over a stretch (SmolLM2 15:30, bf16: 8 positions in a row at
  0.02-0.027, a mean that noise of 5e-2 on alternate positions, 4 of 8 at ~0.045 and 4 at 0, does not
  exceed) but stays below ``sustained`` apart from isolated spikes, while such noise is beyond it at 4
  of every 8 positions;
- the *channel* view (:func:`channel_discrepancy`): the :data:`CHANNEL_RANK`-th largest ``|e - g|`` over
  hidden, in units of the row's RMS (floored as above), beyond ``channels``. Honest bf16 error is spread
  over every channel in proportion to each value (an outlier channel's error is one or two channels), so
  the 4th largest stays small (0.18 at most measured), while a push of ``f ||e||`` split over 4 channels
  reads about ``f sqrt(hidden) / 2`` there (1.6-1.8 at hidden 64 and f 0.5, 5.3 at 576): a few channels
  are this view's whole target, which the two RMS views dilute by the hidden size. It is per position,
  so one pushed position suffices.

The constants of :func:`tolerance_for` come from ``python -m bench.calibrate_verify`` (its docstring
says what it measures; the README gives the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.verify.receipts import known_compute
from shoal.wire.codecs import Codec

__all__ = [
    "Tolerance", "channel_discrepancy", "discrepancy", "first_disagreement", "row_discrepancy", "tolerance_for",
    "tolerance_of", "window_counts",
]  # fmt: skip

#: A row whose norm is below this fraction of the call's median row norm is compared against that floor
#: instead of its own norm (its honest rounding noise comes from the larger values it was computed from).
FLOOR_FRACTION = 1e-2
#: The weight of the relative L2 view against the elementwise one (see the module docstring).
L2_WEIGHT = 0.25
#: The channel view reads the this-th largest channel difference (see the module docstring).
CHANNEL_RANK = 4


@dataclass(frozen=True)
class Tolerance:
    """How far two honest outputs may be apart, in :func:`discrepancy`'s units: any position beyond
    ``relative`` disagrees; with ``sustained``, so do two consecutive positions of a row both beyond it."""

    relative: float
    sustained: float | None = None
    #: with ``sustained``: how many of ``window`` consecutive positions beyond it disagree (None: no window rule)
    window_count: int | None = None
    window: int = 8
    #: the channel view's level (:func:`channel_discrepancy`; None: not used)
    channels: float | None = None

    def __post_init__(self) -> None:
        if not self.relative > 0:
            raise ValueError(f"tolerance must be positive, got {self.relative}")
        if self.sustained is not None and not 0 < self.sustained <= self.relative:
            raise ValueError(f"sustained tolerance must be in (0, relative], got {self.sustained}")
        if self.window_count is not None and (self.sustained is None or not 2 <= self.window_count <= self.window):
            raise ValueError(f"window count must be in [2, window] with a sustained level, got {self.window_count}")
        if self.channels is not None and not self.channels > 0:
            raise ValueError(f"channel level must be positive, got {self.channels}")


# Calibrated by bench/calibrate_verify.py on CPU: honest replicas differing in torch threads (1 vs 2, in
# process and in a fresh child), batch (alone vs in a left-padded batch of 3), cached decode (1 or 8 at a
# time) vs one-pass prefill, and sdpa's backend; tiny llama/qwen2/gemma3/mistral and SmolLM2-135M (spans
# 0:15, 15:30); up to 300 positions. fp32: honest at most 1.4e-5 there, but 7.2e-5 on a 4-block span of a
# random llama with large weights (hidden 256) decoding one position a step against chunks of 8, what an
# auditor at audit_every=8 does (tests/integration/test_verify_no_false_alarms.py); so 3e-4 (4.2x that)
# catches noise of 5e-4 anywhere (within the bar of 1e-3, and of 10x the largest honest). bf16: honest
# spikes up to 0.048 (0.065 in a wider sweep), pairs up to 0.025; 0.13 and 0.035
# catch noise of 5e-2 on two consecutive positions and of 0.18 on one. Across attention kernels (eager,
# sdpa's math backend) bf16 replicas differ by up to 0.18 (pairs 0.09): they are not honest replicas here.
# bf16's window rule and channel view (bench/calibrate_window.py --quick: tiny llama and SmolLM2 0:15, 15:30,
# 240 honest pairs, 1,120 positions per variant of which 1,008 extra; and the whole set above but the child
# process and the kernel variants, 912 pairs, 70,560 positions): honest pairs have at most 1 position
# beyond 0.035 in any 8 and a channel view of at most 0.18; noise of 5e-2 on alternate positions puts 4 of
# 8 beyond it, a push of 0.5x the row norm into 4 channels reads at least 1.63 (hidden 64; 5.3 at 576):
# 3 of 8, and 1.0.
# Keys: (dtype, device type).
_CALIBRATED: dict[tuple[torch.dtype, str], Tolerance] = {
    (torch.float32, "cpu"): Tolerance(3e-4),
    (torch.bfloat16, "cpu"): Tolerance(0.13, sustained=0.035, window_count=3, window=8, channels=1.0),
}
#: Devices not calibrated here reuse the CPU constants times this margin (their kernels differ from the
#: CPU's; fp32 also assumes TF32 stays off, torch's default for matmuls).
_UNCALIBRATED_DEVICE_MARGIN = 2.0
#: float16 (not calibrated) has 3 more mantissa bits than bfloat16: an eighth of its error, kept at a quarter.
_FLOAT16_OF_BFLOAT16 = 0.25


def _scaled(tolerance: Tolerance, factor: float) -> Tolerance:
    def times(level: float | None) -> float | None:
        return None if level is None else level * factor

    return Tolerance(tolerance.relative * factor, times(tolerance.sustained), tolerance.window_count,
                     tolerance.window, times(tolerance.channels))  # fmt: skip


def tolerance_for(dtype: torch.dtype, device: str | torch.device = "cpu") -> Tolerance:
    """The calibrated tolerance for outputs computed in ``dtype`` on ``device`` ("cpu", "cuda:0", ...)."""
    kind = torch.device(device).type
    if dtype == torch.float16:
        return _scaled(tolerance_for(torch.bfloat16, kind), _FLOAT16_OF_BFLOAT16)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"no calibrated tolerance for {dtype}: outputs are float32, bfloat16 or float16")
    if (dtype, kind) in _CALIBRATED:
        return _CALIBRATED[dtype, kind]
    return _scaled(_CALIBRATED[dtype, "cpu"], _UNCALIBRATED_DEVICE_MARGIN)


#: How coarse each float dtype's rounding is (the coarsest of a comparison's dtypes sets its tolerance).
_COARSENESS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: The float dtypes by name (as a server's info and a receipt's ``compute`` say them; anything else: not known).
#: dtype names as servers' info says them, and as receipts sign them (shoal.verify.receipts.compute_label)
_FLOAT_NAMED = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}  # fmt: skip
#: Codecs that round the hidden states they carry (to about bfloat16).
LOSSY_CODECS = frozenset({Codec.BF16, Codec.FP16, Codec.Q8})


def tolerance_of(
    wire: torch.dtype, computed: str | None, codec: Codec, device: str | torch.device = "cpu", *,
    other: str | None = None,
) -> Tolerance:  # fmt: skip
    """How far honest outputs may differ: hidden states travelling as ``wire``, computed in
    ``computed`` (a dtype name, as a server's info says; None: not known), sent as ``codec``, on
    ``device``; ``other``: how the other side computed, as a receipt signs it ("bf16/cuda", see
    :func:`shoal.verify.receipts.compute_label`; None or "": not known). The coarsest rounding
    counts (a lossy codec rounds to about bfloat16); when ``other`` names another device type
    (a label of :data:`~shoal.verify.receipts.COMPUTE_LABELS`) than ``device``'s, kernels differ too: the
    tolerance is at least the uncalibrated-device one (the CPU constants times
    :data:`_UNCALIBRATED_DEVICE_MARGIN`); an unknown one or dtype loosens nothing (judges reject such
    evidence as forged, :mod:`shoal.verify.evidence`). ``compute`` is self-declared: a liar claiming
    bf16 in an fp32 swarm is judged at the bf16 tolerance (clients that know a server's dtype refuse
    such receipts). Here, not in the client: a server judging evidence (:mod:`shoal.server.judge`)
    uses the very same rule."""
    other_dtype, _, other_device = (other or "").partition("/")
    dtypes = [wire if wire in _COARSENESS else torch.float32]
    dtypes += [_FLOAT_NAMED[name] for name in (computed, other_dtype) if name in _FLOAT_NAMED]
    if codec in LOSSY_CODECS:
        dtypes.append(torch.bfloat16)
    coarsest = max(dtypes, key=_COARSENESS.__getitem__)
    tolerance = tolerance_for(coarsest, device)
    if known_compute(other or "") and other_device != torch.device(device).type:
        across = _scaled(tolerance_for(coarsest, "cpu"), _UNCALIBRATED_DEVICE_MARGIN)
        if across.relative > tolerance.relative:
            return across
    return tolerance


def _check_shapes(expected: Tensor, got: Tensor, mask: Tensor | None) -> None:
    if expected.dim() != 3 or expected.shape != got.shape:
        raise ValueError(
            f"need two [batch, n, hidden] tensors of one shape, got {tuple(expected.shape)} and {tuple(got.shape)}"
        )
    if mask is not None and tuple(mask.shape) != tuple(expected.shape[:2]):
        raise ValueError(f"mask must be [batch, n] = {tuple(expected.shape[:2])}, got {tuple(mask.shape)}")


def row_discrepancy(expected: Tensor, got: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-row, per-position relative discrepancy ``[batch, n]`` (float32; see the module docstring). A
    value that is NaN or infinite in one tensor and not the same in the other makes its position ``inf``;
    masked positions (``mask`` False: padding) are 0."""
    _check_shapes(expected, got, mask)
    a, b = expected.detach().float(), got.detach().to(expected.device).float()
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    same_nonfinite = ~finite_a & ~finite_b & ((a == b) | (torch.isnan(a) & torch.isnan(b)))
    broken = ((finite_a != finite_b) | (~finite_a & ~finite_b & ~same_nonfinite)).any(dim=-1)  # [batch, n]
    a, b = torch.where(finite_a, a, 0.0), torch.where(finite_b, b, 0.0)
    diff = a - b
    real = torch.ones_like(broken) if mask is None else mask.to(device=a.device, dtype=torch.bool)
    row_scale = _floored_rms(a, b, real)
    element_scale = torch.maximum(torch.maximum(a.abs(), b.abs()), row_scale.unsqueeze(-1))
    elementwise = (diff / element_scale).pow(2).mean(-1).sqrt()
    relative_l2 = diff.pow(2).mean(-1).sqrt() / row_scale  # ||diff|| / max(||a||, ||b||), floored
    relative = torch.maximum(elementwise, relative_l2 * L2_WEIGHT)
    relative = torch.where(broken, torch.inf, relative)
    return torch.where(real, relative, 0.0)


def discrepancy(expected: Tensor, got: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-position relative discrepancy ``[n]`` (float32) of two ``[batch, n, hidden]`` outputs: the largest
    over unmasked rows of :func:`row_discrepancy` (0 where every row is masked)."""
    per_row = row_discrepancy(expected, got, mask)
    return per_row.amax(dim=0) if per_row.shape[0] else per_row.new_zeros(per_row.shape[1])


def _floored_rms(a: Tensor, b: Tensor, real: Tensor) -> Tensor:
    """Each row's RMS (the larger of the two), floored at :data:`FLOOR_FRACTION` of the median over ``real``."""
    row_rms = torch.maximum(a.pow(2).mean(-1), b.pow(2).mean(-1)).sqrt()  # [batch, n]
    typical = row_rms[real].median() if real.any() else row_rms.new_zeros(())
    return torch.clamp(torch.maximum(row_rms, typical * FLOOR_FRACTION), min=torch.finfo(torch.float32).tiny)


def channel_discrepancy(expected: Tensor, got: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-row, per-position channel view ``[batch, n]`` (float32): the :data:`CHANNEL_RANK`-th largest
    ``|e - g|`` over hidden, over the row's RMS (floored as in :func:`row_discrepancy`); non-finite values
    count 0 (:func:`row_discrepancy` flags them), masked positions are 0."""
    _check_shapes(expected, got, mask)
    a, b = expected.detach().float(), got.detach().to(expected.device).float()
    a, b = torch.nan_to_num(a, 0.0, 0.0, 0.0), torch.nan_to_num(b, 0.0, 0.0, 0.0)
    real = torch.ones(a.shape[:2], dtype=torch.bool, device=a.device) if mask is None else mask.to(a.device, torch.bool)
    rank = min(CHANNEL_RANK, a.shape[-1])
    kth = (a - b).abs().topk(rank, dim=-1).values[..., -1]
    return torch.where(real, kth / _floored_rms(a, b, real), 0.0)


def window_counts(per_row: Tensor, level: float, window: int) -> Tensor:
    """``[batch, n]``: how many of the ``window`` positions from each one on (fewer at the end) are beyond ``level``."""
    over = (per_row > level).float()
    return torch.nn.functional.pad(over, (0, window - 1)).unfold(1, window, 1).sum(-1)


def first_disagreement(expected: Tensor, got: Tensor, tolerance: Tolerance, mask: Tensor | None = None) -> int | None:
    """The first position (0..n-1) where some unmasked row of ``got`` disagrees with ``expected`` beyond
    ``tolerance`` (see :class:`Tolerance` and the module docstring), or None when they agree everywhere.
    Clients' audits and servers' judges both decide with this function."""
    per_row = row_discrepancy(expected, got, mask)
    beyond = per_row > tolerance.relative
    if tolerance.sustained is not None:
        over = per_row > tolerance.sustained
        beyond[:, :-1] |= over[:, :-1] & over[:, 1:]
    if tolerance.window_count is not None:
        assert tolerance.sustained is not None  # Tolerance checks it
        counts = window_counts(per_row, tolerance.sustained, tolerance.window)
        beyond |= (per_row > tolerance.sustained) & (counts >= tolerance.window_count)
    if tolerance.channels is not None:
        beyond |= channel_discrepancy(expected, got, mask) > tolerance.channels
    flagged = beyond.any(dim=0).nonzero()
    return int(flagged[0, 0]) if flagged.numel() else None
