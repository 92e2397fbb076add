"""Turning a model's output into a unified diff: the output formats and their failures.

Formats (`PatchFormat`):
- DIFF: a unified diff, in ```diff / ```patch fences (several fences are concatenated) or as raw
  text starting at the first `diff --git` or `--- ` line. It must parse with `unidiff`; the diff is
  re-serialised from the parse, which drops prose after a hunk. Paths without the `a/` / `b/`
  prefixes get them, so `git apply` (-p1) finds the files.
- SEARCH_REPLACE: edit blocks, each naming a file on the line before it:

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
  file that does not exist yet.
- FUNCTION: whole functions in ```python blocks, each replacing the function of that name in the
  files the prompt showed (function_rewrite.py).

A leading `<think>...</think>` block (or, when the chat template opened it, text up to the
first `</think>`) is stripped first and returned as `thinking`.

Failures are returned, never raised: `ParsedPatch.invalid_reason` is an `InvalidReason` (for the
invalid-action penalty) and `detail` says what was wrong, naming the block when there is one.

The reverse, `gold_answer(patch, format, read_file)`, writes a diff as a model would answer in a
format (gold answers for tests and the supervised warm start).

Not covered: binary patches, renames and mode changes in SEARCH/REPLACE (diffs may carry them
through), fuzzy SEARCH matching (whitespace must match exactly), a SEARCH on a last line that has
no trailing newline, and checking that a DIFF applies (the executor's apply chain does that).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import re
import subprocess
from collections.abc import Callable, Sequence

import unidiff

ReadFile = Callable[[str], "str | None"]


def git_file_reader(repo_path: str, commit: str) -> ReadFile:
    """A `read_file` over a local git repository at `commit`; None when the path is not a file
    there (`git cat-file blob`). Contents are decoded as UTF-8 with replacement. Each path is
    read once per reader: every sample of a prompt parses against the same files."""

    @functools.cache
    def read_file(path: str) -> str | None:
        if not _safe_path(path):
            return None
        result = subprocess.run(
            ["git", "cat-file", "blob", f"{commit}:{path}"],
            cwd=repo_path,
            capture_output=True,
            check=False,
        )
        if result.returncode != 0:
            return None
        return result.stdout.decode("utf-8", errors="replace")

    return read_file


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


# ``` fences: the language tag is optional; the body runs to the next line that is only ```.
_FENCE = re.compile(r"^```[ \t]*([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_DIFF_START = re.compile(r"^(diff --git |--- )", re.MULTILINE)


def _looks_like_diff(text: str) -> bool:
    return bool(re.search(r"^--- .*\n\+\+\+ ", text, re.MULTILINE))


def _diff_candidate(text: str) -> str | None:
    fenced = [
        body
        for lang, body in _FENCE.findall(text)
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


def extract_diff(output: str) -> ParsedPatch:
    """The DIFF format: finds and validates the unified diff in `output`."""
    thinking, rest, ok = strip_think(output)
    if not ok:
        return invalid(
            InvalidReason.UNTERMINATED_THINK,
            "<think> was opened and never closed; no answer followed",
            thinking,
        )
    candidate = _diff_candidate(rest)
    if candidate is None:
        return invalid(
            InvalidReason.NO_PATCH,
            "no unified diff (no '--- '/'+++ ' file header) in the output",
            thinking,
        )
    try:
        patch_set = unidiff.PatchSet(candidate)
    except (unidiff.UnidiffParseError, ValueError, IndexError) as error:
        # Model text is arbitrary: any parse failure is the model's, reported, never raised.
        return invalid(InvalidReason.UNPARSABLE_DIFF, f"the diff does not parse: {error}", thinking)
    if len(patch_set) == 0 or not any(len(f) for f in patch_set):
        return invalid(InvalidReason.UNPARSABLE_DIFF, "the diff has no hunks", thinking)
    for patched in patch_set:
        # unidiff keeps the header paths as written; git apply -p1 strips one component.
        patched.source_file = _with_prefix(patched.source_file, "a/")
        patched.target_file = _with_prefix(patched.target_file, "b/")
    text = str(patch_set)
    if not text.endswith("\n"):
        text += "\n"
    files = tuple(dict.fromkeys(f.path for f in patch_set))
    return ParsedPatch(patch=text, invalid_reason=None, thinking=thinking, files=files)


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
    """The file path: the nearest non-empty line above the SEARCH marker that is not a fence."""
    for line in reversed(lines[:marker_index]):
        candidate = line.strip()
        if not candidate or candidate.startswith("```"):
            continue
        # Tolerate markdown decoration around the path (`path`, **path**, "File: path").
        candidate = candidate.strip("`*# ")
        if candidate.lower().startswith("file:"):
            candidate = candidate[len("file:") :].strip()
        return candidate or None
    return None


def parse_edit_blocks(text: str) -> tuple[list[EditBlock], str | None]:
    """Splits `text` into edit blocks. Returns (blocks, error); error names the bad block."""
    lines = text.splitlines(keepends=True)
    blocks: list[EditBlock] = []
    i = 0
    while i < len(lines):
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


def _safe_path(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "\\" not in path


def file_diff(path: str, old: str | None, new: str) -> str:
    """A git-style diff of one file; old None means a new file."""
    old_lines = [] if old is None else old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    fromfile = "/dev/null" if old is None else f"a/{path}"
    body = []
    for line in difflib.unified_diff(
        old_lines, new_lines, fromfile=fromfile, tofile=f"b/{path}", n=3
    ):
        if line.endswith("\n"):
            body.append(line)
        else:  # the file's last line has no newline: git's marker keeps that exact
            body.append(line + "\n\\ No newline at end of file\n")
    header = f"diff --git a/{path} b/{path}\n"
    if old is None:
        header += "new file mode 100644\n"
    return header + "".join(body)


def search_replace_to_diff(output: str, read_file: ReadFile) -> ParsedPatch:
    """The SEARCH_REPLACE format: applies the blocks to `read_file`'s contents, returns a diff."""
    thinking, rest, ok = strip_think(output)
    if not ok:
        return invalid(
            InvalidReason.UNTERMINATED_THINK,
            "<think> was opened and never closed; no answer followed",
            thinking,
        )
    blocks, error = parse_edit_blocks(rest)
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
        if not _safe_path(block.path):
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
    return ParsedPatch(patch=patch, invalid_reason=None, thinking=thinking, files=tuple(changed))


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
    try:
        patch_format = PatchFormat(patch_format)
    except ValueError:
        raise ValueError(
            f"patch format {patch_format!r} is unknown; valid: {[f.value for f in PatchFormat]}"
        ) from None
    if patch_format is PatchFormat.DIFF:
        return extract_diff(output)
    if read_file is None:
        raise ValueError(
            f"the {patch_format.value} format needs read_file (base_commit file contents)"
        )
    if patch_format is PatchFormat.FUNCTION:
        # Imported here: function_rewrite builds on this module's helpers.
        from dockyard_rl.data.function_rewrite import function_rewrite_to_diff

        return function_rewrite_to_diff(output, read_file, files)
    return search_replace_to_diff(output, read_file)


def gold_answer(patch: str, patch_format: PatchFormat | str, read_file: ReadFile) -> str:
    """A unified diff written as a model would answer in `patch_format` (a ```diff block,
    SEARCH/REPLACE blocks, or the rewritten functions): gold answers for tests, few-shot examples
    and supervised warm starts. Raises ValueError when the format cannot express the diff."""
    patch_format = PatchFormat(patch_format)
    if patch_format is PatchFormat.DIFF:
        return f"```diff\n{patch}```\n"
    if patch_format is PatchFormat.SEARCH_REPLACE:
        return diff_to_search_replace(patch, read_file)
    from dockyard_rl.data.function_rewrite import diff_to_function_rewrite

    return diff_to_function_rewrite(patch, read_file)


def diff_to_search_replace(patch: str, read_file: ReadFile) -> str:
    """Expresses a unified diff as SEARCH/REPLACE blocks, one per hunk, each SEARCH holding the
    hunk's old lines (context included). Used to build gold answers in the SEARCH/REPLACE format
    for tests and few-shot examples. Raises ValueError if a hunk's old text is not unique in its
    file (widen the diff's context) or the file is missing."""
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
            old = "".join(line.value for line in hunk if not line.is_added)
            new = "".join(line.value for line in hunk if not line.is_removed)
            if content.count(old) != 1:
                raise ValueError(
                    f"{patched.path}: hunk {hunk.source_start} old text occurs "
                    f"{content.count(old)} times; it must be unique"
                )
            blocks.append(f"{patched.path}\n{_SEARCH}\n{old}{_DIVIDER}\n{new}{_REPLACE}\n")
    return "\n".join(blocks)
