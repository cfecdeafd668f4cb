"""The protocols shoal peers speak, and the messages of each (shared by client and server).

``shoal/blocks/1`` — one request per stream, except sessions:

    info     -> result meta {model, num_blocks, start, end, fingerprints, dtype, hidden_size,
                             version, free_cache_tokens, counters}
    forward  [hidden, position_ids, attention_mask?] -> result [hidden]        (stateless)
    open     meta {max_length, batch_size} -> result meta {session, token, max_length}
      then on the same stream, any number of:
    step     meta {session, position, push?} [hidden, position_ids, attention_mask?]
             -> result meta {position, pushed?, draining?} [hidden]
    close    -> result (the stream ends; a vanished client also frees the session)

``push``: the rest of the chain, ``[[ticket, session, token], ...]``. The server sends its output
on to the first of them as a ``push`` message (on a stream of its own to that server; meta
{session, token, position, step, push}, tensors [hidden, position_ids, attention_mask?]), then
answers its client (``pushed`` says whether the hand-off went out). The receiving server checks the
token, runs the step and answers on the session's own stream with the id ``step``. ``draining``: the
server is leaving; the client should move this span before its next step.

Errors come back as ``error`` messages with a code (``bad_request``, ``busy``, ``not_found``,
``unavailable`` (draining), ``wire``, ``internal``); a request-level error leaves a session usable.
"""

from shoal.transport import Protocol

BLOCKS = Protocol("blocks", 1)

__all__ = ["BLOCKS"]
