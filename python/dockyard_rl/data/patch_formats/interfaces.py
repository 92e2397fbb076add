"""What every output format shares: the result of a parse, its failures, and the base class.

`OutputFormat` is the seam: one subclass per way a model can write its patch (diff.py,
search_replace.py, function_rewrite.py), registered in factory.py. Its `parse(output, read_file,
files)` strips a leading `<think>...</think>` block (or, when the chat template opened it, the
text up to the first `</think>`), returned as `ParsedPatch.thinking`, and hands the rest to the
subclass's `parse_answer`. Its `gold_answer(patch, read_file)` writes a diff as a model would
answer in the format (gold answers for tests, few-shot examples and the supervised warm start).

Failures are returned, never raised: `ParsedPatch.invalid_reason` is an `InvalidReason` (for the
invalid-action penalty) and `detail` says what was wrong, naming the block when there is one.
`parse` raises ValueError only for a caller's error (a format that reads the base commit's files
called without `read_file`); `gold_answer` raises ValueError when the format cannot express the
diff.

Not covered: reading the base commit's files (base_files.py) and choosing a format by name
(factory.py).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import ClassVar

# The base commit's file at a repository path, or None when there is no such file.
ReadFile = Callable[[str], "str | None"]


class PatchFormat(str, enum.Enum):
    DIFF = "diff"
    SEARCH_REPLACE = "search_replace"
    FUNCTION = "function"  # whole functions rewritten (function_rewrite.py)


class InvalidReason(str, enum.Enum):
    NO_PATCH = "no_patch"  # nothing patch-like in the output (or only thinking)
    UNTERMINATED_THINK = "unterminated_think"  # <think> never closed: output was all thinking
    UNPARSABLE_DIFF = "unparsable_diff"  # diff text that unidiff rejects (bad hunk counts, ...)
    MALFORMED_BLOCK = "malformed_block"  # SEARCH/REPLACE markers missing, out of order, no path
    SEARCH_NOT_FOUND = "search_not_found"  # SEARCH text does not occur in the file
    AMBIGUOUS_SEARCH = "ambiguous_search"  # SEARCH text occurs more than once
    UNKNOWN_FILE = "unknown_file"  # the file does not exist at base_commit / unsafe path
    NO_CHANGE = "no_change"  # the blocks change nothing
    SYNTAX_ERROR = "syntax_error"  # FUNCTION: a code block is not valid Python
    UNKNOWN_FUNCTION = "unknown_function"  # FUNCTION: no shown file defines that name
    AMBIGUOUS_FUNCTION = "ambiguous_function"  # FUNCTION: the name is defined several times


@dataclasses.dataclass(frozen=True)
class ParsedPatch:
    """The patch extracted from one model output, or why there is none."""

    patch: str | None  # unified diff, ends with "\n"; None when invalid
    invalid_reason: InvalidReason | None  # None when valid
    detail: str = ""  # human-readable reason, naming the block if any
    thinking: str | None = None  # the stripped <think> text, if there was one
    files: tuple[str, ...] = ()  # paths the patch touches

    @property
    def valid(self) -> bool:
        return self.invalid_reason is None


def invalid(reason: InvalidReason, detail: str, thinking: str | None) -> ParsedPatch:
    return ParsedPatch(patch=None, invalid_reason=reason, detail=detail, thinking=thinking)


_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def strip_think(output: str) -> tuple[str | None, str, bool]:
    """Returns (thinking, rest, ok). `ok` is False when a <think> is opened and never closed.

    Handles both an explicit leading <think> and templates that open the block in the prompt
    (the output then starts inside it and only `</think>` appears)."""
    stripped = output.lstrip()
    if stripped.startswith(_THINK_OPEN):
        end = stripped.find(_THINK_CLOSE)
        if end < 0:
            return stripped[len(_THINK_OPEN) :], "", False
        return stripped[len(_THINK_OPEN) : end].strip(), stripped[end + len(_THINK_CLOSE) :], True
    end = output.find(_THINK_CLOSE)
    if end >= 0 and _THINK_OPEN not in output[:end]:
        return output[:end].strip(), output[end + len(_THINK_CLOSE) :], True
    return None, output, True


class OutputFormat(abc.ABC):
    """One way a model writes its patch (module docstring). Subclasses are stateless.

    `patch_format` names the format; `reads_base_files` says whether parsing needs `read_file`
    (the base commit's files)."""

    patch_format: ClassVar[PatchFormat]
    reads_base_files: ClassVar[bool]

    def parse(
        self, output: str, read_file: ReadFile | None = None, files: Sequence[str] = ()
    ) -> ParsedPatch:
        """The patch in `output`, or why there is none. `files` are the paths the prompt showed
        (the FUNCTION format rewrites functions only there)."""
        if self.reads_base_files and read_file is None:
            raise ValueError(
                f"the {self.patch_format.value} format needs read_file (base_commit file contents)"
            )
        thinking, answer, ok = strip_think(output)
        if not ok:
            return invalid(
                InvalidReason.UNTERMINATED_THINK,
                "<think> was opened and never closed; no answer followed",
                thinking,
            )
        return self.parse_answer(answer, thinking, read_file, files)

    @abc.abstractmethod
    def parse_answer(
        self,
        answer: str,
        thinking: str | None,
        read_file: ReadFile | None,
        files: Sequence[str],
    ) -> ParsedPatch:
        """The patch in `answer` (the output after its thinking); `thinking` goes into the
        result. `read_file` is not None when `reads_base_files`."""

    @abc.abstractmethod
    def gold_answer(self, patch: str, read_file: ReadFile) -> str:
        """`patch` (a unified diff) written as a model would answer in this format. Raises
        ValueError when the format cannot express it."""
