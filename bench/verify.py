"""What verification costs: decode speed with audits against none, on honest servers.

    scripts/isolated python -m bench.verify [--rounds 2] [--new-tokens 128] [--audit-every 4 8 16 32]

The ~270M random llama of ``bench.models`` (hidden 1024, 16 layers), 2 spans (blocks 0-7, 8-15)
x 3 replicas, one torch thread per server, all in this process (``shoal.launch.InProcessSwarm``, on
the in-memory network: the 2 cores here are shared by the six servers and the client). Clients
over the same servers: ``verify="off"``, the default (``from_pretrained`` with no ``verify``:
audit mode at :data:`~shoal.client.verification.audit.DEFAULT_AUDIT_EVERY`), ``verify="audit"``
with each ``audit_every`` of ``--audit-every`` (8 and 16 always), and ``verify="redundant"``
(every step also on a second chain of the other replicas, checked after each step); each
generates ``--new-tokens`` greedy tokens from a 64-token prompt, modes alternating in every
round. ``tok_s_*`` are medians over rounds; ``ratio_*`` are over ``off`` (``ratio_default``: the
default's). Every mode's tokens must equal (``tokens_equal``), and honest servers must never
disagree (``disagreements``).
``receipt_bytes_per_step``: a step reply's receipt as encoded on the wire (per hop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import msgspec
import torch

from bench.models import model_dir
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm
from shoal.verify.receipts import ReceiptSigner, adapter_tag, sign_receipt, weights_digest

SPANS = (BlockRange(0, 8), BlockRange(8, 16))
REPLICAS = 3
PROMPT_TOKENS = 64
REPORTED_K = (8, 16)  # audit_every values always measured (their keys are in every report)


def modes(audit_every: list[int]) -> dict[str, dict]:
    """Each measured mode's ``from_pretrained`` keywords, by report name (``default``: none given)."""
    ks = sorted({*REPORTED_K, *audit_every})
    audits = {f"audit_k{k}": {"verify": "audit", "audit_every": k} for k in ks}
    return {"off": {"verify": "off"}, "default": {}, **audits, "redundant": {"verify": "redundant"}}


def receipt_bytes(hidden_size: int, *, adapter: bool = False, compute: str = "f32/cpu") -> int:
    """The encoded size of one decode step's receipt (a 16-hex-digit session id, as servers issue), with
    a cache state, ``compute`` as a server signs it and, with ``adapter``, an adapter's digest."""
    signer = ReceiptSigner(bytes(range(32)))
    x = torch.randn(1, 1, hidden_size)
    receipt = sign_receipt(
        signer, weights=weights_digest(("ab" * 32,) * 8, "none"), start=8, end=16, session="0123456789abcdef",
        position=200, step=12345, inputs=[x, torch.tensor([[200]])], output=x,
        adapter=adapter_tag("cd" * 32) if adapter else b"", state=bytes(range(16)), compute=compute,
    )  # fmt: skip
    return len(msgspec.msgpack.encode(receipt))


def _plain(counters: dict) -> dict:
    """The counters a JSON report can hold (numbers and the mode; not the peers and spans)."""
    return {k: v for k, v in counters.items() if isinstance(v, (int, float, str))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every mode once")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per generation")
    parser.add_argument("--audit-every", type=int, nargs="*", default=[], metavar="K",
                        help="audit_every values measured besides 8 and 16")  # fmt: skip
    args = parser.parse_args(argv)
    measured = modes(args.audit_every)

    torch.set_num_threads(1)
    path = model_dir("llama270m")
    prompt = torch.randint(3, 32000, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {mode: [] for mode in measured}
    tokens: dict[str, list[torch.Tensor]] = {mode: [] for mode in measured}
    with InProcessSwarm(path, [span for span in SPANS for _ in range(REPLICAS)], num_threads=1) as swarm:
        clients = {mode: swarm.connect(refresh_period=0, **kwargs) for mode, kwargs in measured.items()}
        for model in clients.values():  # warm up each client's route and the servers
            model.generate(prompt, max_new_tokens=4, do_sample=False)
        for _ in range(args.rounds):
            for mode, model in clients.items():
                started = time.perf_counter()
                out = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False)  # fmt: skip
                times[mode].append(time.perf_counter() - started)
                tokens[mode].append(out[0, PROMPT_TOKENS:])
        audits = {mode: vars(model.verification).copy() for mode, model in clients.items()}
    tok_s = {mode: args.new_tokens / statistics.median(t) for mode, t in times.items()}
    reference = tokens["off"][0]
    result = {
        "model": "llama270m",
        "spans": [str(s) for s in SPANS],
        "replicas": REPLICAS,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens,
        "default": {"verify": audits["default"]["mode"], "audit_every": audits["default"]["audit_every"]},
        **{f"tok_s_{mode}": tok_s[mode] for mode in measured},
        **{f"ratio_{mode}": tok_s[mode] / tok_s["off"] for mode in measured if mode != "off"},
        "receipt_bytes_per_step": receipt_bytes(1024),
        "tokens_equal": all(torch.equal(t, reference) for runs in tokens.values() for t in runs),
        "disagreements": sum(a.get("disagreements", 0) for a in audits.values()),
        "verification": {mode: _plain(a) for mode, a in audits.items()},
        "seconds": times,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
