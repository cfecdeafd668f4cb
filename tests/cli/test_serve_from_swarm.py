"""Which ``shoal serve MODEL --join`` fetches its span from the swarm's members: a name with no files
here, never a directory, a GGUF file, a Hub id, or a known model already fetched."""

from __future__ import annotations

from shoal.cli.main import build_parser
from shoal.weights.join import fetches_from_swarm


def test_only_a_name_with_no_files_here_is_fetched_from_the_swarm(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))  # no known model fetched here
    (tmp_path / "local").mkdir()
    assert fetches_from_swarm("tiny")
    assert fetches_from_swarm("smollm2")  # known, but not fetched here: the swarm gives it, else its package
    assert not fetches_from_swarm(str(tmp_path / "local"))
    assert not fetches_from_swarm("Qwen/Qwen2.5-0.5B")  # a Hub id keeps the Hub
    assert not fetches_from_swarm(str(tmp_path / "model.gguf"))
    fetched = tmp_path / "home" / "models" / "smollm2"
    fetched.mkdir(parents=True)
    (fetched / ".shoal-complete.json").write_text("{}")
    assert not fetches_from_swarm("smollm2")


def test_give_rate_is_a_serve_flag_and_zero_gives_nothing():
    args = build_parser().parse_args(["serve", "tiny", "--blocks", "0:2", "--join", "t", "--give-rate", "0"])
    assert args.give_rate == 0
    assert build_parser().parse_args(["serve", "tiny", "--blocks", "0:2"]).give_rate == 256.0
