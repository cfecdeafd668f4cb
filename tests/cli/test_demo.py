"""``shoal demo`` as the README's first command runs it, and how it tells a cut answer."""

from __future__ import annotations

import pytest

from shoal.cli.demo import DemoOptions, spans_text, was_cut
from shoal.ids import BlockRange
from tests.cli.test_errors import shoal


def test_cut_at_the_limit_without_an_end_token():
    assert was_cut([5, 6, 7], 3, eos_token_id=2)
    assert was_cut([5, 6, 7], 3, eos_token_id=None)


def test_not_cut_when_the_answer_ended():
    assert not was_cut([5, 6, 2], 3, eos_token_id=2)  # ended exactly at the limit
    assert not was_cut([5, 2], 3, eos_token_id=[2, 9])
    assert not was_cut([5, 6], 3, eos_token_id=2)  # stopped early (e.g. a stop string)


def test_spans_read_as_half_open_block_ranges():
    assert spans_text([BlockRange(0, 10), BlockRange(10, 20), BlockRange(20, 30)]) == "blocks [0:10), [10:20), [20:30)"


def test_the_default_limit_fits_a_short_answer():
    assert DemoOptions(prompt="hi").max_new_tokens >= 128


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_answers_and_says_nothing_was_cut(smollm2_dir):
    outcome = shoal("demo", "--servers", "2", timeout=200)
    assert outcome.status == 0, outcome.stderr
    assert "assistant: The capital of France is Paris." in outcome.stdout
    assert "route: " in outcome.stdout and "tokens/s" in outcome.stdout
    assert "cut" not in outcome.stdout
    assert "starting 2 servers for smollm2 on loopback: blocks [0:15), [15:30)" in outcome.stderr.splitlines()
    assert "BlockRange(" not in outcome.stderr + outcome.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_says_when_the_answer_was_cut(smollm2_dir):
    outcome = shoal("demo", "--servers", "2", "--max-new-tokens", "3", timeout=200)
    assert outcome.status == 0, outcome.stderr
    assert "(the answer was cut at the limit of 3 new tokens: raise it with --max-new-tokens N)" in outcome.stdout
