"""The protocols shoal peers speak, and the messages of each (shared by client and server).

``shoal/blocks/1`` — one request per stream, except sessions:

    info     -> result meta {model, num_blocks, start, end, fingerprints, dtype, hidden_size,
                             version, free_cache_tokens, counters}
    forward  [hidden, position_ids, attention_mask?] -> result [hidden]        (stateless)
    open     meta {max_length, batch_size} -> result meta {session}
      then on the same stream, any number of:
    step     meta {position} [hidden, position_ids, attention_mask?] -> result [hidden]
    close    -> result (the stream ends; a vanished client also frees the session)

Errors come back as ``error`` messages with a code (``bad_request``, ``busy``, ``not_found``,
``wire``, ``internal``); a request-level error leaves a session usable.
"""

from shoal.transport import Protocol

BLOCKS = Protocol("blocks", 1)

__all__ = ["BLOCKS"]
