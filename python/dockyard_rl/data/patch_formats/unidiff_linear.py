"""unidiff's patch parser in linear time: `patched_files(text)` is `list(unidiff.PatchSet(text))`.

`unidiff.PatchSet` reads a patch with one regular expression per header kind; two of them
backtrack on a crafted line: the URI-like "diff --git" header `(.*://[^\t\n]+) (.*://[^\t\n]+)`
and the "Binary files" line (lazy names around " and ", each with an optional timestamp),
quadratic or worse: a 1 MiB line stalls the trainer for minutes, and the text parsed here is the
model's (the "superlinear parsing" class of the attack catalogue, docs/sandbox.md). `patched_files`
is PatchSet's parse loop with those two matched by the linear functions below (the same groups:
differential tests against the regular expressions), the linear ones kept, and unidiff's own
classes holding the result, so that the re-serialised diff is byte for byte unidiff's.

Not covered: anything PatchSet itself does not read (the result is unidiff's, errors included).
"""

from __future__ import annotations

import bisect
import io
import re
from collections.abc import Iterator

import unidiff
from unidiff import constants as unidiff_constants
from unidiff.patch import Line, PatchInfo


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


def patched_files(text: str) -> list[unidiff.PatchedFile]:
    """`list(unidiff.PatchSet(text))` in time linear in `text` (module docstring).

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
