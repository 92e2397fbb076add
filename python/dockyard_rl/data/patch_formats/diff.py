"""The DIFF output format: a unified diff in the model's answer.

The diff is taken from ```diff / ```patch / ```udiff fences (several fences are concatenated;
a fence without a tag counts when it holds a `--- `/`+++ ` header), or else from the raw text
starting at the first `diff --git` or `--- ` line. It must parse with unidiff (read in linear time
by unidiff_linear.py, since the text is the model's); the diff is re-serialised from the parse,
which drops prose after a hunk. Paths without the `a/` / `b/` prefixes get them, so `git apply`
(-p1) finds the files.

Cost: every step is linear in the output's length: fences are found line by line, not by a
regular expression that rescans from every unclosed fence.

Not covered: checking that the diff applies (the executor's apply chain does that).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import unidiff

from dockyard_rl.data.patch_formats.interfaces import (
    InvalidReason,
    OutputFormat,
    ParsedPatch,
    PatchFormat,
    ReadFile,
    invalid,
)
from dockyard_rl.data.patch_formats.unidiff_linear import patched_files

# ``` fences: the language tag is optional; the body runs to the next line that is only ```.
# Found line by line (`_fenced_blocks`): the equivalent regular expression,
# r"^```[ \t]*([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$" (MULTILINE, DOTALL), rescans the rest of the
# output from every unclosed fence, quadratic in a crafted output (the output is the model's).
_FENCE_OPEN = re.compile(r"```[ \t]*([\w+-]*)[ \t]*")
_FENCE_CLOSE = re.compile(r"```[ \t]*")
_DIFF_START = re.compile(r"^(diff --git |--- )", re.MULTILINE)


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each closed ``` fence, in order, in one pass over the lines.

    An opening line needs a newline after it; its body ends at the next line that is only ```
    (blanks allowed). Once an opening fence has no closing line after it, no later one has:
    the scan stops there."""
    lines = text.split("\n")
    blocks = []
    i = 0
    while i < len(lines) - 1:
        opening = _FENCE_OPEN.fullmatch(lines[i]) if lines[i].startswith("```") else None
        if opening is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not (
            lines[j].startswith("```") and _FENCE_CLOSE.fullmatch(lines[j])
        ):
            j += 1
        if j == len(lines):
            break
        blocks.append((opening.group(1), "".join(line + "\n" for line in lines[i + 1 : j])))
        i = j + 1
    return blocks


def _looks_like_diff(text: str) -> bool:
    # Linear: ".*" stops at the line's end, and only a line start can begin a match.
    return bool(re.search(r"^--- .*\n\+\+\+ ", text, re.MULTILINE))


def _diff_candidate(text: str) -> str | None:
    fenced = [
        body
        for lang, body in _fenced_blocks(text)
        if lang.lower() in ("diff", "patch", "udiff") or (not lang and _looks_like_diff(body))
    ]
    if fenced:
        return "".join(body if body.endswith("\n") else body + "\n" for body in fenced)
    if not _looks_like_diff(text):
        return None
    start = _DIFF_START.search(text)
    assert start is not None  # _looks_like_diff found a "--- " line
    return text[start.start() :]


def _with_prefix(path: str, prefix: str) -> str:
    if path == "/dev/null" or path.startswith(prefix):
        return path
    return prefix + path


class DiffFormat(OutputFormat):
    """The DIFF format (module docstring); it needs no base files."""

    patch_format = PatchFormat.DIFF
    reads_base_files = False

    def parse_answer(
        self,
        answer: str,
        thinking: str | None,
        read_file: ReadFile | None,
        files: Sequence[str],
    ) -> ParsedPatch:
        candidate = _diff_candidate(answer)
        if candidate is None:
            return invalid(
                InvalidReason.NO_PATCH,
                "no unified diff (no '--- '/'+++ ' file header) in the output",
                thinking,
            )
        try:
            patch_set = patched_files(candidate)
        except (unidiff.UnidiffParseError, ValueError, IndexError) as error:
            # Model text is arbitrary: any parse failure is the model's, reported, never raised.
            return invalid(
                InvalidReason.UNPARSABLE_DIFF, f"the diff does not parse: {error}", thinking
            )
        if len(patch_set) == 0 or not any(len(f) for f in patch_set):
            return invalid(InvalidReason.UNPARSABLE_DIFF, "the diff has no hunks", thinking)
        for patched in patch_set:
            # unidiff keeps the header paths as written; git apply -p1 strips one component.
            patched.source_file = _with_prefix(patched.source_file, "a/")
            patched.target_file = _with_prefix(patched.target_file, "b/")
        text = "".join(str(patched) for patched in patch_set)
        if not text.endswith("\n"):
            text += "\n"
        touched = tuple(dict.fromkeys(f.path for f in patch_set))
        return ParsedPatch(patch=text, invalid_reason=None, thinking=thinking, files=touched)

    def gold_answer(self, patch: str, read_file: ReadFile) -> str:
        return f"```diff\n{patch}```\n"


def extract_diff(output: str) -> ParsedPatch:
    """The DIFF format: finds and validates the unified diff in `output`."""
    return DiffFormat().parse(output)
