"""Is a response's thinking block well formed?

Reasoning models write `<think> reasoning </think> answer`. When a recipe requires thinking, a
response whose tags are missing, unbalanced, nested, repeated or out of order is malformed: the
answer cannot be told apart from the reasoning.

Covered: exact tags `<tag>` / `</tag>` (default "think"); a well-formed response is optional
whitespace, one opening tag, the reasoning (no tags), one closing tag, then the answer (no tags).
Chat templates that put the opening tag into the prompt (DeepSeek-R1, Qwen3 thinking models) are
covered by `opening_tag_in_prompt=True`: the response then holds exactly one closing tag and no
opening tag.

Not covered: the content of the reasoning or the answer (an empty block is well formed), and tag
spellings other than the exact ones (`<Think>`, `< think >` are plain text, not tags).
"""

from __future__ import annotations

import re

__all__ = ["MALFORMED_REASONS", "check_thinking_format", "validate_tag"]

# Every reason check_thinking_format can give, for metrics and tests.
MALFORMED_REASONS = (
    "missing_tags",  # Neither tag.
    "missing_open",  # A closing tag but no opening one.
    "missing_close",  # An opening tag never closed.
    "close_before_open",  # A closing tag before the first opening tag.
    "nested",  # A second opening tag before the first block closed.
    "extra_tags",  # Any tag after the first block closed (a second block, a stray close).
    "text_before_open",  # Something other than whitespace before the opening tag.
    "unexpected_open",  # An opening tag in the response when the prompt holds it.
)

_TAG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def validate_tag(tag: str) -> None:
    """Raises ValueError unless `tag` is a plain tag name such as "think"."""
    if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
        raise ValueError(
            f"tag must be a plain tag name (letters, digits, '_', '-'; e.g. think), got {tag!r}"
        )


def check_thinking_format(
    text: str, tag: str = "think", opening_tag_in_prompt: bool = False
) -> str | None:
    """Returns None when `text` has a well-formed thinking block, else one of MALFORMED_REASONS."""
    validate_tag(tag)
    opening, closing = f"<{tag}>", f"</{tag}>"
    # Tag tokens in order of appearance: True for an opening tag, False for a closing one.
    pattern = re.escape(opening) + "|" + re.escape(closing)
    tokens = [(m.group(0) == opening, m.start()) for m in re.finditer(pattern, text)]
    kinds = [is_open for is_open, _ in tokens]

    if opening_tag_in_prompt:
        if any(kinds):
            return "unexpected_open"
        if not kinds:
            return "missing_close"
        return None if len(kinds) == 1 else "extra_tags"

    if not kinds:
        return "missing_tags"
    if not kinds[0]:
        return "missing_open" if not any(kinds) else "close_before_open"
    if len(kinds) == 1:
        return "missing_close"
    if kinds[1]:
        return "nested"
    if len(kinds) > 2:
        return "extra_tags"
    if text[: tokens[0][1]].strip():
        return "text_before_open"
    return None
