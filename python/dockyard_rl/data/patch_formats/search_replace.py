"""The SEARCH_REPLACE output format: edit blocks, each naming a file on the line before it.

      calc/ops.py
      <<<<<<< SEARCH
      def mul(a, b):
          return a + b
      =======
      def mul(a, b):
          return a * b
      >>>>>>> REPLACE

Blocks are applied in order to the file contents at base_commit (given by a `read_file(path)
-> str | None` callable), each SEARCH text must occur exactly once in the current contents, and
the result is written as a git-style unified diff made with difflib. An empty SEARCH creates a
file that does not exist yet. `diff_to_search_replace` is the reverse (gold answers).

Cost: an output holds at most `_MAX_EDIT_BLOCKS` blocks (each searches the whole file); the
rest is linear in the output's length.

Not covered: renames and mode changes, fuzzy SEARCH matching (whitespace must match exactly),
and a SEARCH on a last line that has no trailing newline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import unidiff

from dockyard_rl.data.patch_formats.base_files import file_diff, safe_path
from dockyard_rl.data.patch_formats.interfaces import (
    InvalidReason,
    OutputFormat,
    ParsedPatch,
    PatchFormat,
    ReadFile,
    invalid,
)


@dataclasses.dataclass(frozen=True)
class EditBlock:
    path: str
    search: str
    replace: str
    index: int  # 1-based position among the output's blocks, for messages


_SEARCH = "<<<<<<< SEARCH"
_DIVIDER = "======="
_REPLACE = ">>>>>>> REPLACE"


def _block_path(lines: list[str], marker_index: int) -> str | None:
    """The file path: the nearest non-empty line above the SEARCH marker that is not a fence.

    Walked back by index (a slice of the lines above would copy them all, for every block:
    quadratic in an output of many small blocks). The walk stops at the first other line, so
    over all blocks it visits each line about once."""
    for index in range(marker_index - 1, -1, -1):
        candidate = lines[index].strip()
        if not candidate or candidate.startswith("```"):
            continue
        # Tolerate markdown decoration around the path (`path`, **path**, "File: path").
        candidate = candidate.strip("`*# ")
        if candidate.lower().startswith("file:"):
            candidate = candidate[len("file:") :].strip()
        return candidate or None
    return None


# Each block searches the whole current file (`str.count`), which grows with every block's
# REPLACE text: without a cap, an output of many small blocks costs quadratic time (4 s for a
# crafted 1 MiB output). No real answer comes near it.
_MAX_EDIT_BLOCKS = 256


def parse_edit_blocks(text: str) -> tuple[list[EditBlock], str | None]:
    """Splits `text` into edit blocks. Returns (blocks, error); error names the bad block (or
    says there are more than `_MAX_EDIT_BLOCKS`)."""
    lines = text.splitlines(keepends=True)
    blocks: list[EditBlock] = []
    i = 0
    while i < len(lines):
        if len(blocks) > _MAX_EDIT_BLOCKS:
            return blocks, f"more than {_MAX_EDIT_BLOCKS} edit blocks; give fewer, larger ones"
        if lines[i].strip() != _SEARCH:
            if lines[i].strip() in (_DIVIDER, _REPLACE):
                return (
                    blocks,
                    f"block {len(blocks) + 1}: {lines[i].strip()!r} before any {_SEARCH!r}",
                )
            i += 1
            continue
        number = len(blocks) + 1
        path = _block_path(lines, i)
        if path is None:
            return blocks, f"block {number}: no file path on the line before {_SEARCH!r}"
        search: list[str] = []
        replace: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != _DIVIDER:
            if lines[j].strip() in (_SEARCH, _REPLACE):
                return blocks, f"block {number} ({path}): {lines[j].strip()!r} before {_DIVIDER!r}"
            search.append(lines[j])
            j += 1
        if j == len(lines):
            return blocks, f"block {number} ({path}): no {_DIVIDER!r} line"
        j += 1
        while j < len(lines) and lines[j].strip() != _REPLACE:
            if lines[j].strip() in (_SEARCH, _DIVIDER):
                return blocks, f"block {number} ({path}): {lines[j].strip()!r} before {_REPLACE!r}"
            replace.append(lines[j])
            j += 1
        if j == len(lines):
            return blocks, f"block {number} ({path}): no {_REPLACE!r} line"
        blocks.append(
            EditBlock(path=path, search="".join(search), replace="".join(replace), index=number)
        )
        i = j + 1
    return blocks, None


class SearchReplaceFormat(OutputFormat):
    """The SEARCH_REPLACE format (module docstring); it reads the base commit's files."""

    patch_format = PatchFormat.SEARCH_REPLACE
    reads_base_files = True

    def parse_answer(
        self,
        answer: str,
        thinking: str | None,
        read_file: ReadFile | None,
        files: Sequence[str],
    ) -> ParsedPatch:
        assert read_file is not None  # OutputFormat.parse checks it
        blocks, error = parse_edit_blocks(answer)
        if error is not None:
            return invalid(InvalidReason.MALFORMED_BLOCK, error, thinking)
        if not blocks:
            return invalid(
                InvalidReason.NO_PATCH,
                f"no {_SEARCH!r} ... {_REPLACE!r} edit block in the output",
                thinking,
            )
        originals: dict[str, str | None] = {}
        current: dict[str, str] = {}
        for block in blocks:
            where = f"block {block.index} ({block.path})"
            if not safe_path(block.path):
                return invalid(
                    InvalidReason.UNKNOWN_FILE,
                    f"{where}: the path must be relative to the repository root, without '..'",
                    thinking,
                )
            if block.path not in current:
                original = read_file(block.path)
                originals[block.path] = original
                if original is None:
                    if block.search.strip():
                        return invalid(
                            InvalidReason.UNKNOWN_FILE,
                            f"{where}: no such file at the "
                            "base commit (an empty SEARCH creates a new file)",
                            thinking,
                        )
                    current[block.path] = block.replace
                    continue
                current[block.path] = original
            content = current[block.path]
            if not block.search.strip():
                return invalid(
                    InvalidReason.MALFORMED_BLOCK,
                    f"{where}: empty SEARCH on an existing file; quote the lines to replace",
                    thinking,
                )
            count = content.count(block.search)
            if count == 0:
                return invalid(
                    InvalidReason.SEARCH_NOT_FOUND,
                    f"{where}: the SEARCH text does not "
                    "occur in the file (it must match exactly, whitespace included)",
                    thinking,
                )
            if count > 1:
                return invalid(
                    InvalidReason.AMBIGUOUS_SEARCH,
                    f"{where}: the SEARCH text occurs "
                    f"{count} times; include more lines so it is unique",
                    thinking,
                )
            current[block.path] = content.replace(block.search, block.replace, 1)
        changed = [path for path in current if current[path] != originals[path]]
        if not changed:
            return invalid(
                InvalidReason.NO_CHANGE, "the edit blocks leave every file unchanged", thinking
            )
        patch = "".join(file_diff(path, originals[path], current[path]) for path in changed)
        return ParsedPatch(
            patch=patch, invalid_reason=None, thinking=thinking, files=tuple(changed)
        )

    def gold_answer(self, patch: str, read_file: ReadFile) -> str:
        return diff_to_search_replace(patch, read_file)


def search_replace_to_diff(output: str, read_file: ReadFile) -> ParsedPatch:
    """The SEARCH_REPLACE format: applies the blocks to `read_file`'s contents, returns a diff."""
    return SearchReplaceFormat().parse(output, read_file)


def _narrowest_unique_block(hunk: unidiff.Hunk, content: str) -> tuple[str, str] | None:
    """(old, new) text of `hunk` cut to its changed lines plus the fewest context lines that
    make the old text occur exactly once in `content`; among cuts of the same size, the one
    with more lines above (a `def` line names the place better than the blank after it). A pure
    insertion keeps at least one context line to anchor it. None when even the whole hunk's old
    text is not unique."""
    lines = list(hunk)
    changed = [i for i, line in enumerate(lines) if line.is_added or line.is_removed]
    first, last = changed[0], changed[-1]
    most_above, most_below = first, len(lines) - 1 - last
    for extra in range(most_above + most_below + 1):
        for above in range(min(extra, most_above), -1, -1):
            below = extra - above
            if below > most_below:
                break
            window = lines[first - above : last + 1 + below]
            old = "".join(line.value for line in window if not line.is_added)
            if old.strip() and content.count(old) == 1:
                return old, "".join(line.value for line in window if not line.is_removed)
    return None


def diff_to_search_replace(patch: str, read_file: ReadFile) -> str:
    """Expresses a unified diff as SEARCH/REPLACE blocks, one per hunk. Each SEARCH holds the
    hunk's changed lines and only as much of its context as makes it unique in the file as the
    earlier blocks left it: a gold answer quotes what a model should quote (the line it changes),
    not the diff's three lines of context, which may lie outside the code a prompt shows. Used
    for warm-start answers, tests and few-shot examples. Raises ValueError if even the whole
    hunk's old text is not unique (widen the diff's context) or the file is missing."""
    blocks = []
    for patched in unidiff.PatchSet(patch):
        if patched.is_added_file:
            new = "".join(line.value for hunk in patched for line in hunk if not line.is_removed)
            blocks.append(f"{patched.path}\n{_SEARCH}\n{_DIVIDER}\n{new}{_REPLACE}\n")
            continue
        content = read_file(patched.path)
        if content is None:
            raise ValueError(f"{patched.path}: not in the repository; cannot build a SEARCH block")
        for hunk in patched:
            block = _narrowest_unique_block(hunk, content)
            if block is None:
                raise ValueError(
                    f"{patched.path}: hunk {hunk.source_start} old text is not unique in the "
                    "file, even with all its context"
                )
            old, new = block
            content = content.replace(old, new, 1)
            blocks.append(f"{patched.path}\n{_SEARCH}\n{old}{_DIVIDER}\n{new}{_REPLACE}\n")
    return "\n".join(blocks)
