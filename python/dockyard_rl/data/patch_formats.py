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

Cost (issue 25, class 7): the output is the model's, so every parse here is linear in its length
and returns a result for any text. Fences are found line by line, not by a regular expression
that rescans from every unclosed fence; the diff is read by unidiff's own parse loop with its two
backtracking header expressions replaced by linear matchers (`_patched_files`, tested against
unidiff); SEARCH/REPLACE outputs hold at most 256 blocks (each searches the whole file). A 1 MiB
adversarial output parses in about a second: `bazel run //tests/benchmarks:patch_parse_benchmark
-- --trainer`.

Not covered: binary patches, renames and mode changes in SEARCH/REPLACE (diffs may carry them
through), fuzzy SEARCH matching (whitespace must match exactly), a SEARCH on a last line that has
no trailing newline, and checking that a DIFF applies (the executor's apply chain does that).
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import enum
import functools
import io
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence

import unidiff
from unidiff import constants as unidiff_constants
from unidiff.patch import Line, PatchInfo

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
# Found line by line (`_fenced_blocks`): the equivalent regular expression,
# r"^```[ \t]*([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$" (MULTILINE, DOTALL), rescans the rest of the
# output from every unclosed fence, quadratic in a crafted output (issue 25, class 7).
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


# --- unidiff's parser, in linear time ---------------------------------------------------------
# `unidiff.PatchSet` reads a patch with one regular expression per header kind; two of them
# backtrack on a crafted line (issue 25, class 7): the URI-like "diff --git" header
# `(.*://[^\t\n]+) (.*://[^\t\n]+)` and the "Binary files" line (lazy names around " and ",
# each with an optional timestamp), quadratic or worse: a 1 MiB line stalls the trainer for
# minutes. `_patched_files` is PatchSet's parse loop with those two matched by the linear
# functions below (the same groups: differential tests against the regular expressions), the
# linear ones kept, and unidiff's own classes holding the result, so that the re-serialised
# diff is byte for byte unidiff's.


def _positions(pattern: str, text: str) -> list[int]:
    """Sorted start positions of `pattern` (a lookahead of fixed width: one step per char)."""
    return [match.start() for match in re.finditer(pattern, text)]


def _first_at_or_after(positions: list[int], index: int, default: int) -> int:
    at = bisect.bisect_left(positions, index)
    return positions[at] if at < len(positions) else default


def _last_at_or_before(positions: list[int], index: int) -> int:
    at = bisect.bisect_right(positions, index)
    return positions[at - 1] if at else -1


def _uri_git_header(rest: str) -> tuple[str, str] | None:
    """unidiff's RE_DIFF_GIT_HEADER_URI_LIKE on "diff --git " + `rest`: (source, target).

    Its backtracking order, found directly: the target's `.*` is greedy, so it ends at the last
    "://" followed by a name character (q); the source takes the last "://" (p) for which a
    space lies between its name and q, and the last such space (j)."""
    rest = rest.partition("\n")[0]  # no part of the expression matches a newline
    uris = _positions(r"(?=://[^\t])", rest)
    if len(uris) < 2:
        return None
    tabs = _positions("\t", rest)
    spaces = _positions(" ", rest)
    last = uris[-1]
    for start in reversed(uris[:-1]):
        # The source's name runs from start + 3 up to a tab; the space after it is before q.
        high = min(_first_at_or_after(tabs, start + 3, len(rest)), last) - 1
        space = _last_at_or_before(spaces, high)
        if space >= start + 4:
            return rest[:space], rest[space + 1 : _first_at_or_after(tabs, last + 3, len(rest))]
    return None


# `[\s0-9:\+-]`, a timestamp's characters in RE_BINARY_DIFF (\s is str.isspace, as in `re`).
_TIMESTAMP_RUNS = re.compile(r"[\s0-9:\+-]+")


def _binary_diff_names(line: str) -> tuple[str, str | None] | None:
    """unidiff's RE_BINARY_DIFF on `line`: (source_filename, target_filename or None).

    The expression, `Binary files? SRC(\\tTS)?( and TGT(\\tTS)?)? (differ|has changed)` with
    lazy names that hold no tab, tried in its backtracking order: SRC grows one character at a
    time, and at each end the " and TGT" branch is tried (TGT as short as possible) before
    " differ" right there. Only the positions where an end (" differ", " has changed") or
    " and " starts can succeed, so only those are visited, each in logarithmic time."""
    if line.startswith("Binary files "):
        rest = line[len("Binary files ") :]
    elif line.startswith("Binary file "):
        rest = line[len("Binary file ") :]
    else:
        return None
    ends = _positions(r"(?= differ| has changed)", rest)
    ands = _positions(r"(?= and )", rest)
    tabs = _positions("\t", rest)
    runs = [(match.start(), match.end()) for match in _TIMESTAMP_RUNS.finditer(rest)]
    run_starts = [start for start, _ in runs]

    def timestamp_ends(tab: int) -> tuple[int, int]:
        # "\t" + timestamp from `tab`: the possible ends, [first, last] (empty when first > last).
        at = bisect.bisect_right(run_starts, tab + 1) - 1
        run_end = runs[at][1] if at >= 0 and runs[at][1] > tab + 1 else tab + 1
        return tab + 2, run_end

    def end_at(index: int) -> bool:
        return rest.startswith((" differ", " has changed"), index)

    def target_end(start: int) -> int | None:
        # TGT (lazy, no tab) from `start`, then an optional timestamp, then the end.
        tab = _first_at_or_after(tabs, start, len(rest))
        if tab == start:
            return None  # TGT holds one character at least
        end = _first_at_or_after(ends, start + 1, len(rest))
        if end < tab:
            return end
        if tab < len(rest):
            first, last = timestamp_ends(tab)
            if first <= last and _last_at_or_before(ends, last) >= first:
                return tab
        return None

    def after_source(index: int) -> tuple[str, str | None] | None:
        if rest.startswith(" and ", index):
            end = target_end(index + len(" and "))
            if end is not None:
                return "", rest[index + len(" and ") : end]
        return ("", None) if end_at(index) else None

    first_tab = _first_at_or_after(tabs, 0, len(rest))
    lo, hi = 1, first_tab - 1  # SRC ends before its first tab
    for index in sorted(
        set(ends[bisect.bisect_left(ends, lo) :] + ands[bisect.bisect_left(ands, lo) :])
    ):
        if index > hi:
            break
        found = after_source(index)
        if found is not None:
            return rest[:index], found[1]
    if first_tab < len(rest) and first_tab >= 1:
        first, last = timestamp_ends(first_tab)
        candidates = [i for i in ends + ands if first <= i <= last]
        for index in sorted(set(candidates), reverse=True):  # the timestamp is greedy
            found = after_source(index)
            if found is not None:
                return rest[:first_tab], found[1]
        found = after_source(first_tab)
        if found is not None:
            return rest[:first_tab], found[1]
    return None


def _git_header(line: str) -> tuple[str, str] | None:
    """(source, target) of a "diff --git" line as unidiff reads it, or None."""
    match = unidiff_constants.RE_DIFF_GIT_HEADER.match(line)
    if match is None and line.startswith("diff --git "):
        names = _uri_git_header(line[len("diff --git ") :])
        if names is not None:
            return names
        match = unidiff_constants.RE_DIFF_GIT_HEADER_NO_PREFIX.match(line)
    return None if match is None else (match.group("source"), match.group("target"))


def _parse_hunk(
    patched: unidiff.PatchedFile, header: str, lines: Iterator[tuple[int, str]]
) -> None:
    """unidiff's PatchedFile._parse_hunk: the hunk's lines, checked against its counts."""
    hunk = unidiff.Hunk(*unidiff_constants.RE_HUNK_HEADER.match(header).groups())
    source_line_no, target_line_no = hunk.source_start, hunk.target_start
    expected_source_end = source_line_no + hunk.source_length
    expected_target_end = target_line_no + hunk.target_length
    for number, line in lines:
        # RE_HUNK_BODY_LINE, then RE_HUNK_EMPTY_BODY_LINE, without a regular expression: this
        # runs once per line of the diff.
        kind = line[:1]
        if kind in ("-", "+", " ", "\\"):
            line_type, value = kind, line[1:]
        elif kind in ("\r", "\n"):
            line_type = unidiff_constants.LINE_TYPE_CONTEXT
            value = line[:2] if line[1:2] in ("\r", "\n") else line[:1]
        else:
            raise unidiff.UnidiffParseError(f"Hunk diff line expected: {line}")
        parsed = Line(value, line_type=line_type)
        if line_type == unidiff_constants.LINE_TYPE_ADDED:
            parsed.target_line_no = target_line_no
            target_line_no += 1
        elif line_type == unidiff_constants.LINE_TYPE_REMOVED:
            parsed.source_line_no = source_line_no
            source_line_no += 1
        elif line_type == unidiff_constants.LINE_TYPE_CONTEXT:
            parsed.target_line_no, parsed.source_line_no = target_line_no, source_line_no
            target_line_no += 1
            source_line_no += 1
        if source_line_no > expected_source_end or target_line_no > expected_target_end:
            raise unidiff.UnidiffParseError("Hunk is longer than expected")
        parsed.diff_line_no = number
        list.append(hunk, parsed)  # Hunk.append only formats the line first, unused
        if source_line_no == expected_source_end and target_line_no == expected_target_end:
            break
    if source_line_no < expected_source_end or target_line_no < expected_target_end:
        raise unidiff.UnidiffParseError("Hunk is shorter than expected")
    patched.append(hunk)


def _patched_files(text: str) -> list[unidiff.PatchedFile]:
    """`list(unidiff.PatchSet(text))` in time linear in `text` (section comment above).

    Raises what PatchSet raises on a malformed diff: UnidiffParseError, or ValueError for a line
    number of more than 4,300 digits."""
    files: list[unidiff.PatchedFile] = []
    current: unidiff.PatchedFile | None = None
    info: unidiff.PatchInfo | None = None
    source: str | None = None
    source_timestamp: str | None = None
    c = unidiff_constants
    lines = enumerate(io.StringIO(text), 1)  # split on "\n" only, as PatchSet reads a str
    for number, line in lines:
        names = _git_header(line)
        if names is not None:
            info = PatchInfo([line])
            source = names[0]  # as PatchSet: a later "+++" without "---" takes it
            current = unidiff.PatchedFile(info, names[0], names[1], None, None, diff_line_no=number)
            files.append(current)
            continue
        if match := c.RE_DIFF_GIT_NEW_FILE.match(line):
            if current is None or info is None:
                raise unidiff.UnidiffParseError(f"Unexpected new file found: {line}")
            current.source_file = c.DEV_NULL
            current.target_mode = match.group("mode")
            info.append(line)
            continue
        if match := c.RE_DIFF_GIT_DELETED_FILE.match(line):
            if current is None or info is None:
                raise unidiff.UnidiffParseError(f"Unexpected deleted file found: {line}")
            current.target_file = c.DEV_NULL
            current.source_mode = match.group("mode")
            info.append(line)
            continue
        if current is not None and info is not None:
            if match := c.RE_DIFF_GIT_OLD_MODE.match(line):
                current.source_mode = match.group("mode")
                info.append(line)
                continue
            if match := c.RE_DIFF_GIT_NEW_MODE.match(line):
                current.target_mode = match.group("mode")
                info.append(line)
                continue
            if match := c.RE_DIFF_GIT_INDEX.match(line):
                if current.source_mode is None:
                    current.source_mode = match.group("mode")
                if current.target_mode is None:
                    current.target_mode = match.group("mode")
                info.append(line)
                continue
        if match := c.RE_SOURCE_FILENAME.match(line):
            source, source_timestamp = match.group("filename"), match.group("timestamp")
            if current is not None and info is None:
                current = None
            elif current is not None:
                current.source_timestamp = source_timestamp
            continue
        if match := c.RE_TARGET_FILENAME.match(line):
            target, target_timestamp = match.group("filename"), match.group("timestamp")
            if current is not None and current.target_file != target:
                raise unidiff.UnidiffParseError(f"Target without source: {line}")
            if current is None:
                if source is None:
                    raise unidiff.UnidiffParseError(f"Target without source: {line}")
                current = unidiff.PatchedFile(
                    info, source, target, source_timestamp, target_timestamp, diff_line_no=number
                )
                files.append(current)
                info = source = source_timestamp = None
            else:
                current.target_timestamp = target_timestamp
            continue
        if c.RE_HUNK_HEADER.match(line):
            info = None
            if current is None:
                raise unidiff.UnidiffParseError(f"Unexpected hunk found: {line}")
            _parse_hunk(current, line, lines)
            continue
        if c.RE_NO_NEWLINE_MARKER.match(line):
            if current is None:
                raise unidiff.UnidiffParseError(f"Unexpected marker: {line}")
            if not current:
                raise unidiff.UnidiffParseError("Unexpected marker:" + c.LINE_VALUE_NO_NEWLINE)
            current[-1].append(
                Line(c.LINE_VALUE_NO_NEWLINE + "\n", line_type=c.LINE_TYPE_NO_NEWLINE)
            )
            continue
        if line == "\n" and current:
            current[-1].append(Line("\n", line_type=c.LINE_TYPE_EMPTY))
            continue
        if info is None:
            current = None
            info = PatchInfo()
        binary = _binary_diff_names(line)
        if binary is not None:
            source = binary[0]
            info.append(line)
            if current is not None:
                current.is_binary_file = True
            else:
                files.append(
                    unidiff.PatchedFile(
                        info,
                        binary[0],
                        binary[1] or binary[0],
                        is_binary_file=True,
                        diff_line_no=number,
                    )
                )
            info = current = None
            continue
        if line == "GIT binary patch\n":
            if current is None:
                raise unidiff.UnidiffParseError(f"Unexpected binary patch marker: {line}")
            current.is_binary_file = True
            info = current = None
            continue
        info.append(line)
    return files


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
        patch_set = _patched_files(candidate)
    except (unidiff.UnidiffParseError, ValueError, IndexError) as error:
        # Model text is arbitrary: any parse failure is the model's, reported, never raised.
        return invalid(InvalidReason.UNPARSABLE_DIFF, f"the diff does not parse: {error}", thinking)
    if len(patch_set) == 0 or not any(len(f) for f in patch_set):
        return invalid(InvalidReason.UNPARSABLE_DIFF, "the diff has no hunks", thinking)
    for patched in patch_set:
        # unidiff keeps the header paths as written; git apply -p1 strips one component.
        patched.source_file = _with_prefix(patched.source_file, "a/")
        patched.target_file = _with_prefix(patched.target_file, "b/")
    text = "".join(str(patched) for patched in patch_set)
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
# REPLACE text: without a cap, an output of many small blocks costs quadratic time (issue 25,
# class 7; 4 s for 1 MiB). No real answer comes near it.
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
