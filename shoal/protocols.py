"""The protocols shoal peers speak, and the messages of each (shared by client and server).

Every message's metadata is a typed struct of :mod:`shoal.wire.schema` (named below).

``shoal/blocks/2`` — one request per stream, except sessions:

    info     Empty -> result InfoReply {span: SpanInfo, free_cache_tokens, draining, counters}
    forward  Empty [hidden, position_ids, attention_mask?] -> result [hidden]        (stateless)
    open     OpenRequest {max_length, batch_size} -> result OpenReply {session, token, max_length}
      then on the same stream, any number of:
    step     StepRequest {session, position, push} [hidden, position_ids, attention_mask?]
             -> result StepReply {position, pushed, draining} [hidden]
    close    Empty -> result (the stream ends; a vanished client also frees the session)
    migrate  MigrateRequest {session, position, step, to: PushHop}           (capability ``migrate``)
             -> result (once the replacement took the pages)
then, server to server, on a stream of its own:
    pages    PagesRequest {session, token, position, step, model, blocks, weights, dtype, adapter?,
             prompts} [keys, values, states u8] -> result; the replacement also answers the
             session's client, under ``step``: result MigratedReply {position, state}
             (:mod:`shoal.server.migrate`)

``push`` (capability ``push``): the rest of the chain, as :class:`~shoal.wire.schema.PushHop`
entries ``[ticket, session, token]``. The server sends its output on to the first of them as a
``push`` message (PushRequest {session, token, position, step, push}, on a stream of its own to that
server; tensors [hidden, position_ids, attention_mask?]), then answers its client (``pushed`` says
whether the hand-off went out). The receiving server checks the token, runs the step and answers on
the session's own stream with the id ``step``. ``draining``: the server is leaving; the client should
move this span before its next step. A client asks for a push only when both servers announced the
``push`` capability.

Errors come back as ``error`` messages (ErrorReply {code, message, reason}) with a code
(``bad_request``, ``busy``, ``not_found``, ``unavailable`` (draining), ``wire``, ``internal``); a
request-level error, malformed metadata included, leaves a session usable.

``shoal/weights/1`` — a model's weights, peer to peer (:mod:`shoal.weights`), asked of servers whose
record announces the ``weights`` capability; any number of requests per stream:

    manifest  ManifestRequest {model} -> result Empty [manifest u8]
    held      HeldRequest {manifest} -> result Empty [a u8 per item of the manifest, 1: held here]
    chunk     ChunkRequest {manifest, item, chunk} -> result Empty [chunk u8]

The asker checks the manifest against the BLAKE3 digest in the swarm's signed model record, and
every chunk against the manifest's digest of it, and asks a giver only for the items it holds (a
server that fetched its span gives that span). Errors: ``not_found`` (another model or manifest, an
item not held), ``busy`` (the giver is at its rate).
"""

from shoal.transport import Protocol

BLOCKS = Protocol("blocks", 2)
WEIGHTS = Protocol("weights", 1)

__all__ = ["BLOCKS", "WEIGHTS"]
