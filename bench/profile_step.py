"""Where one decode step's time goes: client -> server 1 -> server 2 -> client, from timestamps.

    scripts/isolated python -m bench.profile_step [--model smollm2] [--server-threads 1]
                                                   [--new-tokens 64] [--runs 3] [--push]

Two servers (halves of the blocks) run as ``python -m bench.profile_step --serve ARGS`` (``shoal
serve`` with timing hooks patched in: shoal's code is not changed); the client is this process.
Every process stamps ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for the whole machine), so
segments across processes line up. The k-th session step of the client is the k-th step of each
server (one session at a time), which is how records are matched.

Per decode token (medians over the decode steps of all runs after a warm-up), in milliseconds,
with client-driven hops (the default here; ``--push`` for the chain shoal runs by default, whose
segments :func:`push_hops` describes):
  gen_loop      transformers' generate between two forwards (logits processors, argmax, stopping)
  client_pre    DistributedModelForCausalLM.forward before the blocks (embedding, mask, casts)
  handoff_in    generate's thread -> the client event loop thread
  hop{i}.send   client: encode + write the step message (iroh FFI)
  hop{i}.wire_out   client write done -> server has decoded the message (transport + server read)
  hop{i}.server_pre  decoded -> compute starts on the executor thread (checks + thread handoff)
  hop{i}.compute     the span's forward on the server (torch)
  hop{i}.server_post compute done -> reply send starts (thread handoff back, reply message)
  hop{i}.back        reply send starts -> client has decoded the reply (server encode + write,
                     transport, client read)
  hop{i}.client_gap  client: reply decoded -> next hop's send starts
  hop{i}.server_send_call  (overlaps ``back``) how long the server's awaited write takes to return
  hop{i}.rtt_minus_compute everything of the hop but the server's torch compute
  handoff_out   client loop thread -> generate's thread again
  client_post   after the blocks: cast back, final norm + LM head, bookkeeping
Also: the same half-spans computed in-process (no network) at 1 and 2 threads, the client head
alone, and the plain transformers model's per-token time, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ENV_OUT = "SHOAL_PROFILE_OUT"
SERVE_ENTRY = ("-m", "bench.profile_step", "--serve")  # then ``serve ...``: an instrumented shoal serve


# ---- instrumented server -------------------------------------------------------------------------


def serve_instrumented(argv: list[str]) -> int:
    """``shoal serve`` with hooks; writes its step records to $SHOAL_PROFILE_OUT at exit.

    With $SHOAL_PROFILE_ONE_TORCH_THREAD=1, everything the server runs off its event loop (loading
    with ``asyncio.to_thread`` and the compute executor) runs on one and the same thread: libgomp
    keeps a thread pool per thread that starts a parallel region, and once its threads outnumber the
    CPUs it stops spinning at barriers (every parallel region then pays futex wake-ups)."""
    from shoal.server import backend, handler
    from shoal.transport import node

    if os.environ.get("SHOAL_PROFILE_ONE_TORCH_THREAD") == "1":
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-torch")

        async def to_thread(fn, /, *args, **kwargs):
            return await asyncio.get_running_loop().run_in_executor(torch_thread, lambda: fn(*args, **kwargs))

        asyncio.to_thread = to_thread
        backend_init = backend.SpanBackend.__init__

        def __init__(self, *args, **kwargs):
            backend_init(self, *args, **kwargs)
            self._executor.shutdown(wait=False)
            self._executor = torch_thread

        backend.SpanBackend.__init__ = __init__

    records: list[dict] = []
    state: dict = {"recv": None, "current": None}
    now = time.perf_counter

    recv_message = node.MessageStream._recv_message

    async def _recv_message(self):
        message = await recv_message(self)
        state["recv"] = now()
        return message

    step = handler.BlockServer._step

    async def _step(self, session, message):
        record = {"recv_end": state["recv"], "step_start": now()}
        state["current"] = record
        out = await step(self, session, message)
        record["step_end"] = now()
        records.append(record)
        return out

    compute = backend.SpanBackend._compute

    def _compute(self, *args, **kwargs):
        record = state["current"]
        start = now()
        out = compute(self, *args, **kwargs)
        if record is not None:
            record["compute_start"], record["compute_end"] = start, now()
        return out

    send = node.MessageStream.send

    async def _send(self, message):
        record = state["current"]
        start = now()
        await send(self, message)
        if record is not None and "step_end" in record and "send_start" not in record:
            record["send_start"], record["send_end"] = start, now()
            state["current"] = None

    node.MessageStream._recv_message = _recv_message
    handler.BlockServer._step = _step
    backend.SpanBackend._compute = _compute
    node.MessageStream.send = _send

    from shoal.cli.main import build_parser

    args = build_parser().parse_args(argv)  # as shoal.cli.main.main, which os._exit()s before atexit
    try:
        code = args.func(args)
    finally:
        if os.environ.get(ENV_OUT):
            Path(os.environ[ENV_OUT]).write_text(json.dumps(records))
    sys.stdout.flush()
    os._exit(code)  # skip the slow iroh runtime teardown, as shoal's CLI does


# ---- client side ---------------------------------------------------------------------------------


class ClientHooks:
    """Timestamps in this process: forward, session step (both threads) and each hop's send/recv."""

    def __init__(self) -> None:
        from shoal.client import model, remote
        from shoal.transport import node

        self.forwards: list[tuple[float, float]] = []
        self.steps: list[dict] = []
        now = time.perf_counter
        hooks = self

        forward = model.DistributedModelForCausalLM.forward

        def _forward(self, *args, **kwargs):
            start = now()
            out = forward(self, *args, **kwargs)
            hooks.forwards.append((start, now()))
            return out

        step = remote.RemoteSession.step

        def _step(self, *args, **kwargs):
            record = {"s_start": now(), "hops": []}
            hooks.current = record
            out = step(self, *args, **kwargs)
            record["s_end"] = now()
            hooks.steps.append(record)
            return out

        loop_step = remote.RemoteSession._step

        async def _loop_step(self, *args, **kwargs):
            hooks.current["l_start"] = now()
            out = await loop_step(self, *args, **kwargs)
            hooks.current["l_end"] = now()
            return out

        send = node.MessageStream.send

        async def _send(self, message):
            start = now()
            await send(self, message)
            record = getattr(hooks, "current", None)
            if record is not None and message.kind == "step":
                record["hops"].append({"send_start": start, "send_end": now()})

        recv_message = node.MessageStream._recv_message

        async def _recv_message(self):
            message = await recv_message(self)
            record = getattr(hooks, "current", None)
            if record is not None and record["hops"]:
                hop = record["hops"][-1]
                hop.setdefault("recv_end", now())  # the first reply (client-driven: the only one)
                hop["last_recv_end"] = now()  # with push: the last server's reply
            return message

        model.DistributedModelForCausalLM.forward = _forward
        remote.RemoteSession.step = _step
        remote.RemoteSession._step = _loop_step
        node.MessageStream.send = _send
        node.MessageStream._recv_message = _recv_message


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3) if values else float("nan")


def breakdown(hooks: ClientHooks, servers: list[list[dict]], decode_steps: set[int], push: bool = False) -> dict:
    """Medians of each segment over the step indices in ``decode_steps``: the client's own segments
    (see the module docstring), with the hops' segments of :func:`driven_hops` or :func:`push_hops`."""
    segments: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        segments.setdefault(name, []).append(value)

    hops = push_hops if push else driven_hops
    forwards = hooks.forwards
    for k in sorted(decode_steps):
        c = hooks.steps[k]
        f_start, f_end = forwards[k]
        if k + 1 < len(forwards) and k + 1 in decode_steps:
            add("token_total", forwards[k + 1][0] - f_start)
            add("gen_loop", forwards[k + 1][0] - f_end)
        add("client_pre", c["s_start"] - f_start)
        add("handoff_in", c["l_start"] - c["s_start"])
        hops(add, c, [s[k] for s in servers])
        add("handoff_out", c["s_end"] - c["l_end"])
        add("client_post", f_end - c["s_end"])
    return {name: median_ms(values) for name, values in segments.items()}


def driven_hops(add: Callable[[str, float], None], c: dict, servers: list[dict]) -> None:
    """Client-driven: the client sends each hop its step and waits for its reply."""
    for i, (hop, srv) in enumerate(zip(c["hops"], servers, strict=True)):
        p = f"hop{i}."
        add(p + "send", hop["send_end"] - hop["send_start"])
        add(p + "wire_out", srv["recv_end"] - hop["send_end"])
        add(p + "server_pre", srv["compute_start"] - srv["recv_end"])
        add(p + "compute", srv["compute_end"] - srv["compute_start"])
        add(p + "server_post", srv["send_start"] - srv["compute_end"])
        add(p + "back", hop["recv_end"] - srv["send_start"])
        add(p + "server_send_call", srv["send_end"] - srv["send_start"])
        nxt = c["hops"][i + 1]["send_start"] if i + 1 < len(c["hops"]) else c["l_end"]
        add(p + "client_gap", nxt - hop["recv_end"])
        compute = srv["compute_end"] - srv["compute_start"]
        add(p + "rtt_minus_compute", hop["recv_end"] - hop["send_start"] - compute)


def push_hops(add: Callable[[str, float], None], c: dict, servers: list[dict]) -> None:
    """Push: the client sends to server 0, each server pushes its output to the next, the last one
    answers the client. ``s{i}.wire_in``: the sender's write returned -> server i has decoded the
    message (transport, receiver wake-ups, parse); ``s{i}.pre``/``post``: event loop <-> compute
    thread and the step's own checks; ``s{i}.send_call``: the awaited write of its push (or, for the
    last, its reply); ``wire_back``: the last server's write returned -> the client has decoded the
    reply. ``between_stages``: the client's session step, call to return, less the servers' compute
    (transport and thread hand-offs on the critical path)."""
    hop = c["hops"][0]
    add("client_send_call", hop["send_end"] - hop["send_start"])
    sent = hop["send_end"]
    for i, srv in enumerate(servers):
        p = f"s{i}."
        add(p + "wire_in", srv["recv_end"] - sent)
        add(p + "pre", srv["compute_start"] - srv["recv_end"])
        add(p + "compute", srv["compute_end"] - srv["compute_start"])
        add(p + "post", srv["send_start"] - srv["compute_end"])
        add(p + "send_call", srv["send_end"] - srv["send_start"])
        sent = srv["send_end"]
    add("wire_back", hop["last_recv_end"] - sent)
    add("client_gap", c["l_end"] - hop["last_recv_end"])
    computes = sum(srv["compute_end"] - srv["compute_start"] for srv in servers)
    add("between_stages", c["s_end"] - c["s_start"] - computes)


def reference_compute(path: Path, new_tokens: int, threads_list: list[int]) -> dict:
    """The half spans and the client head, in-process, per decode step; plain transformers per token."""
    from transformers import AutoModelForCausalLM

    from bench.measure import CpuMeter, halves, run_once
    from shoal.checkpoints import load_config, load_tensors, span_tensor_filter
    from shoal.models import get_family

    config = load_config(path)
    family = get_family(config)
    head = family.build_client_head(
        config, load_tensors(path, family.client_tensor_names(config)), torch.float32, "cpu"
    )
    spans = [
        family.build_span(config, a, b, load_tensors(path, span_tensor_filter(config, a, b)), torch.float32, "cpu")
        for a, b in halves(config.num_hidden_layers)
    ]
    local = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(3, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))

    def timed(fn, n: int = 30) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return median_ms(times)

    out = {}
    saved = torch.get_num_threads()
    meter, deadline = CpuMeter(), time.monotonic() + 300
    for threads in threads_list:
        torch.set_num_threads(threads)
        meter.wait_quiet(0.15, deadline)
        start = meter.sample()
        row = {}
        with torch.inference_mode():
            for i, span in enumerate(spans):
                cache = span.allocate_cache(1, 64)
                span(torch.randn(1, 24, config.hidden_size), torch.arange(24)[None], None, cache=cache)
                x, pos = torch.randn(1, 1, config.hidden_size), torch.tensor([[24]])
                row[f"span{i}_step_ms"] = timed(
                    lambda span=span, x=x, pos=pos, cache=cache: span(x, pos, None, cache=cache, past_length=24)
                )
            token = torch.tensor([[5]])
            row["client_head_ms"] = timed(lambda token=token: head.logits(head.embed(token)))
        runs = [run_once(local, ids, new_tokens, 0)[0]["decode_tok_s"] for _ in range(3)]
        row["transformers_ms_per_token"] = round(1e3 / statistics.median(runs), 3)
        row["foreign_cpu"] = round(meter.foreign(start), 3)
        out[f"threads_{threads}"] = row
    torch.set_num_threads(saved)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_instrumented(argv[1:])
    from shoal.omp import child_environment

    env = child_environment()
    if env != os.environ:
        # run the client (and, by inheritance, the servers) with shoal's spin count (shoal.omp), as
        # shoal's processes do; libgomp read its environment when torch loaded, so start again
        os.execve(sys.executable, [sys.executable, "-m", "bench.profile_step", *argv], env)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--client-threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--omp-wait-policy", default="")
    parser.add_argument("--server-env", action="append", default=[], metavar="K=V", help="more server environment")
    parser.add_argument(
        "--one-torch-thread",
        action="store_true",
        help="servers load and compute on one thread (see serve_instrumented): tests the libgomp pool effect",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the in-process reference timings")
    parser.add_argument(
        "--push",
        action="store_true",
        help="servers push to the next server (shoal's default); else the client drives every hop",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.client_threads)

    import tempfile

    from bench.measure import CpuMeter, halves, run_once
    from bench.models import model_dir, prompt_ids
    from shoal import AutoDistributedModelForCausalLM
    from shoal.checkpoints import load_config
    from shoal.heap import freeze_startup_heap
    from shoal.launch import ServerProcess, serve_args, stop_all
    from shoal.transport import TransportConfig

    path = model_dir(args.model)
    config = load_config(path)
    tmp = Path(tempfile.mkdtemp(prefix="shoal-profile-"))
    servers = []
    for i, blocks in enumerate(halves(config.num_hidden_layers)):  # loading in parallel
        env = {ENV_OUT: str(tmp / f"server{i}.json"), "OMP_NUM_THREADS": str(args.server_threads)}  # over ours
        if args.omp_wait_policy:
            env["OMP_WAIT_POLICY"] = args.omp_wait_policy
        if args.one_torch_thread:
            env["SHOAL_PROFILE_ONE_TORCH_THREAD"] = "1"
        env.update(kv.split("=", 1) for kv in args.server_env)
        serve = serve_args(path, blocks, "--num-threads", str(args.server_threads), entry=SERVE_ENTRY)
        servers.append(ServerProcess(serve, ready_timeout=None, env=env, stdin=None))
    try:
        tickets = [server.wait_ready(600) for server in servers]
        hooks = ClientHooks()
        swarm = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), tickets, transport=TransportConfig(bind_addr="127.0.0.1:0"), push=args.push
        )
        freeze_startup_heap()  # as shoal's own long-lived processes do (see shoal.heap)
        ids = prompt_ids(args.model, path, config.vocab_size)
        run_once(swarm, ids, args.new_tokens, 0)  # warm-up
        first = len(hooks.steps)
        meter, deadline = CpuMeter(), time.monotonic() + 600
        runs = []
        for _ in range(args.runs):
            meter.wait_quiet(0.15, deadline)  # a quiet second first (the machine may be shared)
            runs.append(run_once(swarm, ids, args.new_tokens, 0, None, meter)[0])
        # decode steps: all but the prefill of each run
        decode = {first + r * args.new_tokens + j for r in range(args.runs) for j in range(1, args.new_tokens)}
        swarm.close()
    finally:
        stop_all(servers, 30)  # each writes its record as it exits
    records = [json.loads((tmp / f"server{i}.json").read_text()) for i in range(len(servers))]
    assert all(len(r) == len(hooks.steps) for r in records), [len(r) for r in records] + [len(hooks.steps)]
    result = {
        "model": args.model,
        "server_threads": args.server_threads,
        "client_threads": args.client_threads,
        "omp_wait_policy": args.omp_wait_policy or None,
        "servers_one_torch_thread": args.one_torch_thread,
        "server_env": args.server_env,
        "client_omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
        "swarm_decode_tok_s": [round(r["decode_tok_s"], 2) for r in runs],
        "foreign_cpu": [round(r["foreign_cpu"], 3) for r in runs],
        "push": args.push,
        "per_token_ms": breakdown(hooks, records, decode, args.push),
        "loadavg": os.getloadavg(),
    }
    if not args.no_reference:
        result["in_process_reference"] = reference_compute(path, args.new_tokens, sorted({1, args.client_threads}))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
