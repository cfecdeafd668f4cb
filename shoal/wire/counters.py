"""A server's counters (``info``'s ``counters``; :mod:`shoal.wire.schema` re-exports them)."""

from __future__ import annotations

import msgspec


class ServerCounters(msgspec.Struct, kw_only=True):
    """What a server has done, readable through ``info`` (tests and dashboards use them)."""

    sessions_opened: int = 0
    sessions_closed: int = 0  # closed by the client
    sessions_abandoned: int = 0  # the client vanished mid-session (or broke its stream)
    sessions_timed_out: int = 0  # idle for longer than the timeout
    reservations_taken_back: int = 0  # unused KV reservations of unstepped or idle sessions, given to others
    sessions_active: int = 0
    sessions_rejected_busy: int = 0
    steps: int = 0
    positions_processed: int = 0
    positions_rolled_back: int = 0  # cached positions a step overwrote (rejected drafts, replays)
    forward_requests: int = 0
    forward_tokens: int = 0
    errors: int = 0
    pushes_sent: int = 0  # step outputs handed to the next server
    pushes_received: int = 0  # steps that arrived from the previous server
    pushes_failed: int = 0  # the next server could not be reached (the client falls back to its own hop)
    pushes_rejected: int = 0  # unknown session, wrong token, or a stale step
    sessions_drained: int = 0  # still open when a drain closed them
    step_seconds: float = 0.0  # compute time of all steps (metrics: latency = step_seconds / steps)
    backward_requests: int = 0  # backward passes served (needs TRAIN)
    backward_tokens: int = 0  # batch x tokens of those passes
    # tasks the compute thread ran, by priority class (shoal.server.scheduler): session steps and cache
    # allocations; stateless forwards; training chunks (a backward is one per block, or one for the span)
    inference_tasks: int = 0
    forward_tasks: int = 0
    training_chunks: int = 0
    # tasks taken before earlier-queued work of a lower class: how often priority let a session step
    # (or a forward) go first instead of waiting behind a forward or a training chunk
    inference_ahead_of_forward: int = 0
    inference_ahead_of_training: int = 0
    forward_ahead_of_training: int = 0
    # the KV page pool (shoal.models.kv): its pages, and those held by sessions or the prefix cache
    kv_pages_total: int = 0
    kv_pages_in_use: int = 0
    prefix_cache_pages: int = 0  # pages only the prefix cache holds (closed sessions' full pages)
    prefix_hit_tokens: int = 0  # positions a step adopted from the prefix cache instead of computing
    # continuous batching (shoal.server.batching): batched forwards run (a lone step is a batch of one),
    # the session steps (or prefill chunks) they carried, the most rows one took, times a waiting step
    # was left out of a batch that ran, the chunks run of steps cut in pieces, the batches that
    # waited (briefly) for sessions due back before they started, the groups the sessions run in now
    # (one batch each: as many as their chains keep busy, shoal.server.pacing) and how often that changed
    batches: int = 0
    batched_steps: int = 0
    batch_rows_max: int = 0
    steps_deferred: int = 0
    prefill_chunks: int = 0
    merge_waits: int = 0
    batch_groups: int = 1
    regroupings: int = 0
    # evidence of other servers' lies judged here (shoal.server.judge): received, confirmed (a verdict
    # signed and gossiped), rejected; and the rejections by reason (the EvidenceReply's tag)
    evidence_received: int = 0
    evidence_confirmed: int = 0
    evidence_rejected: int = 0
    evidence_malformed: int = 0
    evidence_not_judged: int = 0  # not this server's blocks or weights, too large, about itself, draining
    evidence_forged: int = 0
    evidence_replayed: int = 0
    evidence_framing: int = 0  # the accused was honest: its outputs recompute within tolerance
    # KV migration (shoal.server.migrate): sessions handed over, taken over, hand-offs failed (either side)
    sessions_migrated_out: int = 0
    sessions_migrated_in: int = 0
    migrations_failed: int = 0


__all__ = ["ServerCounters"]
