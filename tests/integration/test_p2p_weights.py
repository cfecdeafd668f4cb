"""A server joins a swarm with no model files on disk: it fetches exactly its span's tensors (and
the config and tokenizer) from the swarm's members in verified chunks, and serves them.

Two servers hold the tiny checkpoint and give it (each announces ``weights``; the first's model
record carries the manifest's digest). The checks: the fetched tensors equal the source byte for
byte and the new server serves the same tokens; a giver that tampers with a chunk is caught by the
chunk's digest, banned, and the chunk fetched again from the other; a fetch cut halfway resumes from
its partial directory, fetching only what it lacks (counts asserted), and a chunk damaged on disk
meanwhile is fetched again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from shoal.checkpoints import load_tensors, model_fingerprints, model_name, swarm_weights_dir
from shoal.checkpoints.loading import weight_map
from shoal.checkpoints.manifest import cached_manifest, manifest_digest, safetensors_layout
from shoal.errors import ModelNotFoundError
from shoal.ids import BlockRange
from shoal.launch import InProcessSwarm, LocalSwarm, ServerProcess
from shoal.launch.process import serve_args
from shoal.server.builder import swarm_id_of
from shoal.server.config import ServerConfig
from shoal.server.preflight import check_server
from shoal.swarm.records import State
from shoal.swarm.swarmid import model_digest, new_swarm_id, parse_swarm_id
from shoal.weights.fetch import STREAMS_PER_GIVER, WeightsError
from shoal.weights.join import fetch_weights
from shoal.weights.partial import JOURNAL, MANIFEST, PARTIAL
from shoal.wire import error_message
from testkit.tampering import tamper
from testkit.tiny import char_tokenizer, tiny_checkpoint
from tests.helpers.inprocess import wait_until

pytestmark = pytest.mark.timeout(120)
CHUNK = 64 << 10  # the smallest a manifest allows: most of the tiny model's tensors take several
SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
SPAN = BlockRange(1, 3)
PROMPT = "the swarm carries its weights"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("p2p") / "tiny", "qwen2", 11, tokenizer=char_tokenizer(), **SHAPE)


@pytest.fixture
def swarm(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))  # the new server's disk: no weights
    pin = founders_pin(model_dir)
    with InProcessSwarm(model_dir, [], swarm=new_swarm_id(pin), weights_chunk=CHUNK) as swarm:
        givers = [swarm.add(BlockRange(0, 2)), swarm.add(BlockRange(2, 4))]

        def ready() -> bool:
            tables = [g.presence.service.table for g in givers]
            return all(
                (t.model("tiny") or None) is not None and t.model("tiny").manifest
                and sum(r.state is State.ONLINE and "weights" in r.capabilities for r in t.servers("tiny")) == 2
                for t in tables
            )  # fmt: skip

        wait_until(ready, 60.0, what="both givers online and the manifest in every table")
        yield swarm


def founders_pin(model_dir) -> str:
    """The pin a founder of the tiny model's swarm makes: its fingerprints and its chunk manifest."""
    fps = [bytes.fromhex(f) for f in model_fingerprints(model_dir)]
    return model_digest(
        model_name(str(model_dir)), len(fps), fps, manifest_digest(cached_manifest(model_dir, "tiny", CHUNK)[1])
    )


def test_a_new_swarm_pins_its_founders_manifest_with_the_fingerprints(model_dir):
    config = ServerConfig(model=str(model_dir), blocks=BlockRange(0, 4), new_swarm=True, weights_chunk=CHUNK)
    pin = parse_swarm_id(swarm_id_of(config, check_server(config))).pin
    fps = [bytes.fromhex(f) for f in model_fingerprints(model_dir)]
    assert pin == founders_pin(model_dir) != model_digest("tiny", len(fps), fps)


def fetch(swarm: InProcessSwarm, span: BlockRange = SPAN, **kwargs):
    return swarm.runtime.run(
        fetch_weights(swarm.start_node, swarm.transport, tuple(swarm.tickets()), "tiny", span, **kwargs), timeout=60
    )


def span_chunks(model_dir, span: BlockRange) -> int:
    manifest, _ = cached_manifest(model_dir, "tiny", CHUNK)
    return sum(len(manifest.items[i].chunks) for i in manifest.span_items(span.start, span.end))


def test_a_server_with_no_files_fetches_its_span_from_two_peers_and_serves_it(swarm, model_dir):
    report = fetch(swarm)
    assert report.fetched == span_chunks(model_dir, SPAN) and report.resumed == report.rejected == 0
    assert len(report.by_giver) == 2, report.by_giver  # both givers gave
    root = swarm_weights_dir("tiny")
    wanted = lambda n: n.startswith(("model.layers.1.", "model.layers.2."))  # noqa: E731
    fetched, source = load_tensors(root, wanted), load_tensors(model_dir, wanted)
    assert sorted(fetched) == sorted(source) and len(fetched) > 0
    for name, tensor in fetched.items():
        assert tensor.dtype == source[name].dtype and torch.equal(
            tensor.view(torch.uint8), source[name].view(torch.uint8)
        )
    with safe_open(root / "blocks-1-3.safetensors", "pt") as f:  # exactly its span: no other block, no head
        assert all(wanted(n) for n in f.keys())  # noqa: SIM118
    assert (root / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    assert (root / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()

    swarm.add(SPAN, model="tiny")  # the name only: resolved to the fetched files
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = reference.generate(**_inputs(model_dir), max_new_tokens=8, do_sample=False)
    for local in swarm.servers[:2]:
        swarm.kill(local)  # the fetched server must carry blocks 1:3: only 0:1 and 3:4 come from others
    swarm.add(BlockRange(0, 1))
    swarm.add(BlockRange(3, 4))
    model = swarm.connect()
    got = model.generate(**_inputs(model_dir), max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_a_server_that_fetched_its_span_gives_it_on_and_is_asked_for_nothing_else(swarm, model_dir, tmp_path,
                                                                                   monkeypatch):  # fmt: skip
    fetch(swarm)
    joined = swarm.add(SPAN, model="tiny")  # serves the fetched files, and gives them
    assert joined.gate.giver is not None and joined.presence.announcement.gives_weights
    for local in swarm.servers[:2]:
        swarm.drain(local)  # the givers of the whole checkpoint leave: only the fetched span is left
    wait_until(lambda: [r.peer for r in joined.presence.service.table.servers("tiny") if r.state is State.ONLINE]
               == [joined.node.id], 30.0, what="the whole checkpoint's givers gone from the table")  # fmt: skip

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "another"))  # a second newcomer, its disk empty too
    report = fetch(swarm)
    assert set(report.by_giver) == {joined.node.id} and report.fetched == span_chunks(model_dir, SPAN)
    wanted = lambda n: n.startswith(("model.layers.1.", "model.layers.2."))  # noqa: E731
    fetched, source = load_tensors(swarm_weights_dir("tiny"), wanted), load_tensors(model_dir, wanted)
    assert sorted(fetched) == sorted(source)
    assert all(torch.equal(fetched[n].view(torch.uint8), t.view(torch.uint8)) for n, t in source.items())
    with pytest.raises(WeightsError, match="could not be fetched"):  # block 0: nobody left holds it
        fetch(swarm, BlockRange(0, 2))
    assert joined.gate.giver.lacked == 0  # it said what it holds: never asked for a chunk it lacks


def test_a_giver_that_cannot_say_what_it_holds_is_still_asked_for_chunks(swarm, model_dir):
    mute = swarm.servers[0].gate.giver
    answer = mute._answer

    async def no_held(request):
        if request.kind == "held":  # as a giver from before the request: it cannot answer it
            return error_message(request.id, "bad_request", "'held' is not a weights request"), None
        return await answer(request)

    mute._answer = no_held
    report = fetch(swarm)
    assert len(report.by_giver) == 2 and report.fetched == span_chunks(model_dir, SPAN)


def test_a_client_with_no_files_fetches_its_embeddings_and_head_and_generates(swarm, model_dir):
    from shoal.client import AutoDistributedModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = reference.generate(**_inputs(model_dir), max_new_tokens=8, do_sample=False)
    with AutoDistributedModelForCausalLM.from_pretrained(
        "tiny", swarm.tickets(), transport=swarm.transport, start_node=swarm.start_node
    ) as model:  # the name only: nothing of it on this disk
        got = model.generate(**_inputs(model_dir), max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)
    root = swarm_weights_dir("tiny")
    with safe_open(root / "client.safetensors", "pt") as f:  # the client's part: no block's tensor
        names = set(f.keys())
    assert names and not any(n.startswith("model.layers.") for n in names)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    source = load_tensors(model_dir, names.__contains__)
    fetched = load_tensors(root, names.__contains__)
    assert all(torch.equal(fetched[n].view(torch.uint8), t.view(torch.uint8)) for n, t in source.items())

    # Another model of the same name left its embeddings here (same size, other bytes) and no manifest
    # of this swarm: they are checked chunk by chunk, found wrong, fetched again, not kept by size.
    start, header = safetensors_layout(root / "client.safetensors")
    with open(root / "client.safetensors", "r+b") as f:
        f.seek(start + header["model.embed_tokens.weight"]["data_offsets"][0])
        f.write(b"\x7f" * 64)  # (the row starts with zeros: padding)
    (root / MANIFEST).unlink()
    with AutoDistributedModelForCausalLM.from_pretrained(
        "tiny", swarm.tickets(), transport=swarm.transport, start_node=swarm.start_node
    ) as model:
        assert torch.equal(model.generate(**_inputs(model_dir), max_new_tokens=8, do_sample=False), expected)
    assert weight_map(root)["model.embed_tokens.weight"] == "client-2.safetensors"
    assert weight_map(root)["lm_head.weight"] == "client.safetensors"  # checked and kept: not fetched again


def test_two_fetches_of_a_clients_part_at_once_do_not_collide(swarm):
    """A gateway's first requests for a model come at once: their fetches take turns, and the second
    finds the part whole."""
    from shoal.client.auto import fetch_client_part
    from shoal.client.config import ClientConfig

    config = ClientConfig(transport=swarm.transport)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(fetch_client_part, "tiny", swarm.tickets(), config, swarm.start_node) for _ in range(2)]
        assert [run.result(timeout=60) for run in runs] == [None, None]
    root = swarm_weights_dir("tiny")
    assert sorted(p.name for p in root.glob("*.safetensors")) == ["client.safetensors"]
    assert not (root / PARTIAL).exists()


def test_the_gateway_serves_a_model_with_no_files_here(model_dir, tmp_path, monkeypatch):
    """``shoal api NAME --join TICKET``: the gateway sizes and loads the model's client part after
    fetching it from the swarm's members, as a client does (here over iroh nodes on loopback, which
    the gateway's client dials)."""
    from shoal.client.config import ClientConfig
    from shoal.gateway.serve import GatewayOptions, build_catalog
    from shoal.transport import Node

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = reference.generate(**_inputs(model_dir), max_new_tokens=6, do_sample=False)
    pinned = new_swarm_id(founders_pin(model_dir))
    with InProcessSwarm(
        model_dir, [BlockRange(0, 4)], swarm=pinned, weights_chunk=CHUNK, start_node=Node.start
    ) as swarm:
        table = swarm.servers[0].presence.service.table
        wait_until(lambda: (table.model("tiny") or None) is not None and table.model("tiny").manifest, 30.0,
                   what="the model record with its manifest")  # fmt: skip
        options = GatewayOptions(
            join=tuple(swarm.tickets()), model="tiny", client=ClientConfig(transport=swarm.transport)
        )
        catalog = build_catalog(options, None)
        try:
            with catalog.pool.lease("tiny") as engine:
                got = engine.model.generate(**_inputs(model_dir), max_new_tokens=6, do_sample=False)
        finally:
            catalog.pool.close()
    assert torch.equal(got, expected)
    assert (swarm_weights_dir("tiny") / "client.safetensors").is_file()


def test_a_client_fetches_nothing_by_a_manifest_the_swarm_id_does_not_pin(model_dir, tmp_path, monkeypatch):
    """No fingerprint covers a client's embeddings and head: in a swarm pinned before manifests were
    (the manifest is the first model record's), the client refuses, naming why."""
    from shoal.client import AutoDistributedModelForCausalLM

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    fps = [bytes.fromhex(f) for f in model_fingerprints(model_dir)]
    loose = new_swarm_id(model_digest("tiny", len(fps), fps))
    with InProcessSwarm(model_dir, [BlockRange(0, 4)], swarm=loose, weights_chunk=CHUNK) as swarm:
        table = swarm.servers[0].presence.service.table
        wait_until(lambda: (table.model("tiny") or None) is not None and table.model("tiny").manifest, 30.0,
                   what="the model record with its manifest")  # fmt: skip
        with pytest.raises(ModelNotFoundError, match="does not pin"):
            AutoDistributedModelForCausalLM.from_pretrained(
                "tiny", swarm.tickets(), transport=swarm.transport, start_node=swarm.start_node
            )
    assert not (swarm_weights_dir("tiny") / "client.safetensors").exists()


def _inputs(model_dir):
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(model_dir))(PROMPT, return_tensors="pt"))


def test_a_tampered_chunk_is_refused_its_giver_banned_and_the_chunk_fetched_from_the_other(swarm, model_dir):
    liar = swarm.servers[0]
    tamper(liar.gate.giver)  # every chunk it gives is damaged
    report = fetch(swarm)
    assert report.banned == {liar.node.id}
    # caught at its first chunks (one per stream it had in flight), then never asked again
    assert 1 <= report.rejected == liar.gate.giver.tampered <= STREAMS_PER_GIVER
    assert set(report.by_giver) == {swarm.servers[1].node.id}
    assert report.fetched == span_chunks(model_dir, SPAN)
    source = load_tensors(model_dir, lambda n: n.startswith("model.layers.1."))
    fetched = load_tensors(swarm_weights_dir("tiny"), lambda n: n.startswith("model.layers.1."))
    assert all(torch.equal(fetched[n].view(torch.uint8), t.view(torch.uint8)) for n, t in source.items())


def test_when_every_giver_tampers_the_fetch_fails_and_nothing_is_served(swarm):
    for local in swarm.servers:
        tamper(local.gate.giver)
    with pytest.raises(WeightsError, match="could not be fetched"):
        fetch(swarm)
    assert not (swarm_weights_dir("tiny") / "blocks-1-3.safetensors").exists()


def test_a_fetch_cut_halfway_resumes_and_fetches_only_what_it_lacks(swarm, model_dir):
    total = span_chunks(model_dir, SPAN)
    for local in swarm.servers:
        local.gate.giver.pace.rate = 40 * CHUNK  # slow: the fetch takes about a second
    journal = swarm_weights_dir("tiny") / PARTIAL / JOURNAL
    running = asyncio.run_coroutine_threadsafe(
        fetch_weights(swarm.start_node, swarm.transport, tuple(swarm.tickets()), "tiny", SPAN), swarm.runtime.loop
    )
    wait_until(lambda: journal.is_file() and len(journal.read_text().splitlines()) >= total // 2, 30.0,
               what="half the chunks in")  # fmt: skip
    running.cancel()  # the fetch is killed: its partial directory stays
    with pytest.raises(concurrent.futures.CancelledError):
        running.result(timeout=10)
    time.sleep(0.2)
    kept = len(journal.read_text().splitlines())
    assert total // 2 <= kept < total
    # one chunk written before the cut is damaged on disk meanwhile: the restart must find it out
    manifest, _ = cached_manifest(model_dir, "tiny", CHUNK)
    kept_chunks = [tuple(map(int, line.split())) for line in journal.read_text().splitlines()]
    item, chunk = next((i, c) for i, c in kept_chunks if manifest.items[i].dtype)  # a tensor's chunk
    damaged = next(p for p in (swarm_weights_dir("tiny") / PARTIAL).iterdir() if p.suffix == ".safetensors")
    start, header = safetensors_layout(damaged)
    with open(damaged, "r+b") as f:
        f.seek(start + header[manifest.items[item].name]["data_offsets"][0] + chunk * CHUNK)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    for local in swarm.servers:
        local.gate.giver.pace.rate = 1e9
    report = fetch(swarm)
    assert (report.resumed, report.discarded) == (kept - 1, 1)
    assert report.fetched == total - report.resumed  # the damaged chunk and those never fetched, no more
    source = load_tensors(model_dir, lambda n: n.startswith(("model.layers.1.", "model.layers.2.")))
    fetched = load_tensors(swarm_weights_dir("tiny"), lambda n: n.startswith(("model.layers.1.", "model.layers.2.")))
    assert all(torch.equal(fetched[n].view(torch.uint8), t.view(torch.uint8)) for n, t in source.items())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shoal_serve_killed_while_fetching_resumes_after_a_restart(model_dir, tmp_path):
    """``shoal serve tiny --blocks 1:3 --join TICKET`` with no files: SIGKILLed halfway through the
    fetch, then started again, it fetches only the chunks it lacks, and serves."""
    home = {"SHOAL_HOME": str(tmp_path / "home")}
    journal = tmp_path / "home" / "swarm-weights" / "tiny" / PARTIAL / JOURNAL
    slow = ["--give-rate", "0.25"]  # MB/s: the fetch takes seconds
    with LocalSwarm(model_dir, [(0, 2), (2, 4)], slow, swarm=True) as swarm:
        swarm.wait_converged()
        total = span_chunks_default(model_dir, SPAN)
        args = serve_args("tiny", SPAN, "--join", str(swarm.tickets[0]), "--throughput", "100")
        first = ServerProcess(args, ready_timeout=None, env=home)
        try:
            wait_until(lambda: journal.is_file() and len(journal.read_text().splitlines()) >= total // 2, 120.0,
                       what="half the chunks in")  # fmt: skip
        finally:
            first.kill()
        kept = len(journal.read_text().splitlines())
        assert kept < total, "the fetch finished before it was killed"
        second = ServerProcess(args, ready_timeout=120.0, env=home)
        try:
            line = next(line for line in second.output if "fetched blocks 1:3 of tiny" in line)
            fetched, resumed = (int(n) for n in re.search(r"(\d+) chunks, (\d+) kept from before", line).groups())
            assert resumed >= kept - 1 and fetched + resumed == total, line  # at most the chunk being written is lost
        finally:
            second.stop()


def span_chunks_default(model_dir, span: BlockRange) -> int:
    """Chunks of ``span`` in the manifest a server builds by default (4 MiB chunks)."""
    manifest, _ = cached_manifest(model_dir, "tiny")
    return sum(len(manifest.items[i].chunks) for i in manifest.span_items(span.start, span.end))
