"""Tests of dockyard_rl.rewards.thinking: one case per reason, both prompt conventions."""

import pytest

from dockyard_rl.rewards.thinking import MALFORMED_REASONS, check_thinking_format


@pytest.mark.parametrize(
    "text",
    [
        "<think>plan</think>answer",
        "\n  <think>\nplan\n</think>\n\nanswer",
        "<think></think>",  # Empty reasoning and answer are still well formed.
        "<think>a <Think> b < think > c</think> answer",  # Other spellings are plain text.
    ],
)
def test_well_formed(text):
    assert check_thinking_format(text) is None


@pytest.mark.parametrize(
    "text, reason",
    [
        ("just an answer", "missing_tags"),
        ("", "missing_tags"),
        ("plan</think>answer", "missing_open"),
        ("<think>plan, never closed", "missing_close"),
        ("</think><think>plan</think>", "close_before_open"),
        ("<think>a<think>b</think>c</think>", "nested"),
        ("<think>a</think>b<think>c</think>d", "extra_tags"),
        ("<think>a</think>b</think>", "extra_tags"),
        ("preamble <think>a</think>b", "text_before_open"),
    ],
)
def test_malformed(text, reason):
    assert reason in MALFORMED_REASONS
    assert check_thinking_format(text) == reason


@pytest.mark.parametrize(
    "text, reason",
    [
        ("plan</think>answer", None),
        ("plan and answer", "missing_close"),
        ("<think>plan</think>answer", "unexpected_open"),
        ("a</think>b</think>c", "extra_tags"),
    ],
)
def test_opening_tag_in_prompt(text, reason):
    assert check_thinking_format(text, opening_tag_in_prompt=True) == reason


def test_custom_tag():
    assert check_thinking_format("<reasoning>x</reasoning>y", tag="reasoning") is None
    assert check_thinking_format("<think>x</think>y", tag="reasoning") == "missing_tags"


@pytest.mark.parametrize("tag", ["", "<think>", "th ink", "1x", None])
def test_bad_tag(tag):
    with pytest.raises(ValueError, match="tag must be a plain tag name"):
        check_thinking_format("<think>x</think>", tag=tag)
