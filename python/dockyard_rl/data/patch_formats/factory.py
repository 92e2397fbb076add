"""Choosing an output format by name: `output_format`, and the two calls every caller makes.

`parse_model_output(output, patch_format, read_file, files)` parses a model's output in the
recipe's format; `gold_answer(patch, patch_format, read_file)` writes a diff as a model would
answer in it. Both take the format as a `PatchFormat` or its string value (the recipe's
`data.patch_format`).

Not covered: the formats themselves (diff.py, search_replace.py, function_rewrite.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from dockyard_rl.data.patch_formats.diff import DiffFormat
from dockyard_rl.data.patch_formats.function_rewrite import FunctionFormat
from dockyard_rl.data.patch_formats.interfaces import (
    OutputFormat,
    ParsedPatch,
    PatchFormat,
    ReadFile,
)
from dockyard_rl.data.patch_formats.search_replace import SearchReplaceFormat

_FORMATS: dict[PatchFormat, OutputFormat] = {
    format_.patch_format: format_
    for format_ in (DiffFormat(), SearchReplaceFormat(), FunctionFormat())
}
assert set(_FORMATS) == set(PatchFormat), "every PatchFormat needs its OutputFormat"


def output_format(patch_format: PatchFormat | str) -> OutputFormat:
    """The format named `patch_format`; ValueError naming the valid ones when it is unknown."""
    try:
        return _FORMATS[PatchFormat(patch_format)]
    except ValueError:
        raise ValueError(
            f"patch format {patch_format!r} is unknown; valid: {[f.value for f in PatchFormat]}"
        ) from None


def parse_model_output(
    output: str,
    patch_format: PatchFormat | str,
    read_file: ReadFile | None = None,
    files: Sequence[str] = (),
) -> ParsedPatch:
    """Dispatches on the format. SEARCH_REPLACE and FUNCTION need `read_file` (base_commit
    contents); FUNCTION also `files`, the paths whose functions may be rewritten (those shown).

    Raises ValueError only for caller errors (unknown format, missing read_file), never for
    anything the model wrote."""
    return output_format(patch_format).parse(output, read_file, files)


def gold_answer(patch: str, patch_format: PatchFormat | str, read_file: ReadFile) -> str:
    """A unified diff written as a model would answer in `patch_format` (a ```diff block,
    SEARCH/REPLACE blocks, or the rewritten functions): gold answers for tests, few-shot examples
    and supervised warm starts. Raises ValueError when the format cannot express the diff."""
    return _FORMATS[PatchFormat(patch_format)].gold_answer(patch, read_file)
