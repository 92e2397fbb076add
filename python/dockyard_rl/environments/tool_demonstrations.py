"""Multi-turn tool-use demonstrations made from gold patches, for the agent's warm start.

    renderer = ChatRenderer(tokenizer)
    demo = build_demonstration(instance, git_file_reader(repo, instance.base_commit), renderer,
                               user_message=task_prompt)          # Demonstration | Skipped
    demos, skipped = build_demonstrations(items, renderer)        # skipped: Counter of reasons

A demonstration is the episode an agent that knows the fix would play, in the tool format of
`environments/agent_tools.py`:
1. per file the gold patch modifies: `view` of the whole file when it fits one view (an agent
   that does not yet know where the bug is reads it), else of the ranges its hunks touch
   (VIEW_MARGIN lines around them, merged while a view stays within the tool's 200 lines); then
   one `replace` per hunk: `old` is the lines the hunk changes (its context lines left out), as
   they are in the file at that point, `new` their replacement. When `old` is not unique in the
   file (or empty: a pure insertion), it is widened by one line above and below at a time (at
   most MAX_WIDEN times) until it is; otherwise the task is skipped (`ambiguous_hunk`). Short
   calls matter: a small model repeats a long run of context (blank lines most of all) without
   end. A new file is one `write_file`.
2. `run_tests` without arguments (the task's test command);
3. `submit`.

Observations are what the session's tools answer (sandbox/sessions.py), computed here from the
base files and rendered by `render_observation`: `view_output` (numbered lines
"{n:>5}\\t{line}"), `replace_output` (the changed lines with two around them), `write_output`;
for `run_tests` a fixed placeholder, RUN_TESTS_OUTPUT: the tests are not run when demonstrations
are built, so a demonstration does not show pytest's real output. `submit` has no observation:
the episode ends. Views are split so none is over MAX_VIEW_BYTES (the session cuts long outputs).

Tokens come from the same `ChatRenderer` the rollouts use (prompt, each call as the model would
generate it, ending with the end-of-turn token, then `observation_ids`), so a warm start trains
on exactly the token sequences rollouts produce. `mask` is 1 on the assistant's tokens only: the
calls and the end-of-turn token that ends each of them.

Skipped tasks (a `Skipped` with a `SkipReason` and detail; `build_demonstrations` counts them):
a patch that does not parse, deletes, renames or changes only the mode of a file, is binary,
touches a file missing at the base commit, has a hunk that does not match the base file, or a
hunk whose text stays ambiguous, a line too long to view; and a demonstration longer than
`max_tokens`.

Not covered: exploring with `search`, failed attempts or test output in the demonstration (it
goes straight to the fix), and files with "\\r"-only line endings (lines split on "\\n").
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence

import unidiff
from unidiff.constants import LINE_TYPE_NO_NEWLINE

from dockyard_rl.data.patch_formats import ReadFile
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.environments.agent_tools import (
    MAX_VIEW_LINES,
    ChatRenderer,
    ToolCall,
    render_observation,
    render_tool_call,
)
from dockyard_rl.sandbox.sessions import directory_listing

__all__ = [
    "Demonstration",
    "SkipReason",
    "Skipped",
    "UnsupportedPatchError",
    "build_demonstration",
    "build_demonstrations",
    "demonstration_calls",
    "replace_output",
    "view_output",
    "write_output",
]

# Names in a directory of the base commit ("." the root), as `patch_formats.git_dir_lister` gives
# them; None for a path that is no directory.
ListDir = Callable[[str], "list[str] | None"]

VIEW_MARGIN = 3  # lines shown around the changed ranges
MAX_WIDEN = 20  # at most this many lines added above and below a hunk to make it unique
MAX_VIEW_BYTES = 8 * 1024  # a view's output, well under the session's cut (16 KiB by default)
RUN_TESTS_OUTPUT = "(tests ran)"


class SkipReason(str, enum.Enum):
    UNPARSABLE_PATCH = "unparsable_patch"
    UNSUPPORTED_CHANGE = "unsupported_change"  # delete, rename, mode-only, binary
    MISSING_FILE = "missing_file"
    HUNK_MISMATCH = "hunk_mismatch"
    AMBIGUOUS_HUNK = "ambiguous_hunk"
    TOO_LONG = "too_long"


@dataclasses.dataclass(frozen=True)
class Skipped:
    instance_id: str
    reason: SkipReason
    detail: str


class UnsupportedPatchError(ValueError):
    """The gold patch cannot be played with the tools; `reason` says why (counted), `detail`
    names the file and hunk."""

    def __init__(self, reason: SkipReason, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One episode. `token_ids` and `mask` have the same length; mask[i] is 1 where token i is
    the assistant's. `observations[i]` answers `calls[i]`; the last call (submit) has none."""

    instance_id: str
    token_ids: tuple[int, ...]
    mask: tuple[int, ...]
    calls: tuple[ToolCall, ...]
    observations: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Result:
    """An observed tool result (the fields `render_observation` reads)."""

    output: str
    ok: bool = True
    error: str | None = None
    truncated: bool = False
    exhausted: bool = False


def _lines(text: str) -> list[str]:
    """Lines with their "\\n" (the last one may lack it): split on "\\n" only, as diffs are."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _view_lines(text: str) -> list[str]:
    """Lines as the session's tools number them: split at "\n" only, a trailing newline ends
    the last line, a "\r" before the "\n" is not shown."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def view_output(path: str, content: str, start_line: int = 1, end_line: int | None = None) -> str:
    """What the session's `view` answers for a file holding `content`: "{n:>5}\t{line}" for
    lines start_line..end_line (inclusive, at most MAX_VIEW_LINES), a note when lines are left
    out, "(path is empty)" for an empty file. Raises ValueError where the session answers an
    error (start_line past the end, end_line before start_line)."""
    lines = _view_lines(content)
    if not lines:
        return f"({path} is empty)"
    if start_line > len(lines) or (end_line is not None and end_line < start_line):
        raise ValueError(f"lines {start_line}-{end_line} are not a range of {path}")
    last = min(
        len(lines),
        end_line if end_line is not None else len(lines),
        start_line + MAX_VIEW_LINES - 1,
    )
    shown = [f"{n:>5}\t{lines[n - 1]}" for n in range(start_line, last + 1)]
    if last < len(lines) and (end_line is None or last < end_line):
        shown.append(
            f"[showing lines {start_line}-{last} of {len(lines)}; at most {MAX_VIEW_LINES} at a "
            f"time: view again with start_line={last + 1}]"
        )
    return "\n".join(shown)


def replace_output(path: str, content: str, old: str, new: str) -> str:
    """What the session's `replace` answers after replacing the one `old` in `content`: the
    changed lines with two lines around them (at most 41 lines)."""
    at = content.find(old)
    assert at >= 0
    updated = content[:at] + new + content[at + len(old) :]
    lines = _view_lines(updated)
    first = content.count("\n", 0, at) + 1
    last = first + new.count("\n")
    low, high = max(1, first - 2), min(len(lines), last + 2, first + 40)
    snippet = "\n".join(f"{n:>5}\t{lines[n - 1]}" for n in range(low, high + 1))
    return f"replaced 1 occurrence in {path}; lines {low}-{high} now read:\n{snippet}"


def write_output(path: str, content: str) -> str:
    """What the session's `write_file` answers when it creates `path`."""
    num_bytes = len(content.encode("utf-8"))
    return f"created {path} ({len(_view_lines(content))} lines, {num_bytes} bytes)"


def _hunk_sides(hunk: unidiff.Hunk) -> tuple[list[str], list[str]]:
    """The hunk's old and new lines; a line followed by "\\ No newline at end of file" loses its
    newline on the side(s) it belongs to."""
    old: list[str] = []
    new: list[str] = []
    lines = list(hunk)
    for i, line in enumerate(lines):
        if line.line_type == LINE_TYPE_NO_NEWLINE:
            continue
        value = line.value
        if i + 1 < len(lines) and lines[i + 1].line_type == LINE_TYPE_NO_NEWLINE:
            value = value.removesuffix("\n")
        if not line.is_added:
            old.append(value)
        if not line.is_removed:
            new.append(value)
    return old, new


def _common_head(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading items `a` and `b` share."""
    count = 0
    while count < min(len(a), len(b)) and a[count] == b[count]:
        count += 1
    return count


def _unique(content: str, text: str) -> bool:
    first = content.find(text)
    return bool(text) and first >= 0 and content.find(text, first + 1) < 0


def _view_ranges(patched: unidiff.PatchedFile, lines: Sequence[str]) -> list[tuple[int, int]]:
    """1-based inclusive line ranges covering the hunks' old lines with VIEW_MARGIN around them,
    merged while a range stays within MAX_VIEW_LINES, then split so that no view's output is
    over MAX_VIEW_BYTES (the session cuts longer outputs)."""
    ranges: list[tuple[int, int]] = []
    for hunk in patched:
        first = max(1, hunk.source_start - VIEW_MARGIN)
        last = min(len(lines), hunk.source_start + max(hunk.source_length, 1) - 1 + VIEW_MARGIN)
        last = max(first, min(last, first + MAX_VIEW_LINES - 1))
        if ranges and first <= ranges[-1][1] + 1 and last - ranges[-1][0] < MAX_VIEW_LINES:
            ranges[-1] = (ranges[-1][0], max(last, ranges[-1][1]))
        else:
            ranges.append((first, last))
    pieces: list[tuple[int, int]] = []
    for first, last in ranges:
        start, size = first, 0
        for n in range(first, last + 1):
            line_bytes = len(f"{n:>5}\t{lines[n - 1]}\n".encode())
            if line_bytes > MAX_VIEW_BYTES:
                raise UnsupportedPatchError(
                    SkipReason.TOO_LONG,
                    f"{patched.path}: line {n} is over {MAX_VIEW_BYTES} bytes; a view would be cut",
                )
            if size + line_bytes > MAX_VIEW_BYTES:
                pieces.append((start, n - 1))
                start, size = n, 0
            size += line_bytes
        pieces.append((start, last))
    return pieces


def _file_calls(patched: unidiff.PatchedFile, content: str) -> list[tuple[ToolCall, str]]:
    path = patched.path
    calls: list[tuple[ToolCall, str]] = []
    view_lines = _view_lines(content)
    whole = view_output(path, content) if view_lines else ""
    if view_lines and len(view_lines) <= MAX_VIEW_LINES and len(whole.encode()) <= MAX_VIEW_BYTES:
        # A file that fits one view is viewed whole: the agent reads the code before it knows
        # where the bug is, as it must when it plays the episode itself.
        calls.append((ToolCall("view", {"path": path}), whole))
    else:
        for first, last in _view_ranges(patched, view_lines) if view_lines else []:
            call = ToolCall("view", {"path": path, "start_line": first, "end_line": last})
            calls.append((call, view_output(path, content, first, last)))
    delta = 0  # lines added minus removed by the hunks already replaced
    for hunk in patched:
        old_lines, new_lines = _hunk_sides(hunk)
        lines = _lines(content)
        # unidiff's source_start is the first old line, or for a pure insertion the line after
        # which the new lines go.
        at = (hunk.source_start - 1 if hunk.source_length > 0 else hunk.source_start) + delta
        if lines[at : at + len(old_lines)] != old_lines:
            raise UnsupportedPatchError(
                SkipReason.HUNK_MISMATCH,
                f"{path}: hunk at line {hunk.source_start} does not match the base file",
            )
        # `old` starts as the lines the hunk changes, without its context lines (short calls:
        # a long run of context, blank lines most of all, is what a small model repeats
        # without end), and is widened only as far as it takes to be unique.
        same_head = _common_head(old_lines, new_lines)
        same_tail = _common_head(old_lines[same_head:][::-1], new_lines[same_head:][::-1])
        core_begin, core_end = at + same_head, at + len(old_lines) - same_tail
        new_core = new_lines[same_head : len(new_lines) - same_tail]
        begin, end = core_begin, core_end
        if begin == end:  # a pure insertion: anchor it on the line above (or below)
            begin, end = (begin - 1, end) if begin > 0 else (begin, end + 1)
        for _ in range(MAX_WIDEN + 1):
            old = "".join(lines[begin:end])
            if _unique(content, old):
                break
            begin, end = max(0, begin - 1), min(len(lines), end + 1)
        else:
            raise UnsupportedPatchError(
                SkipReason.AMBIGUOUS_HUNK,
                f"{path}: hunk at line {hunk.source_start} is not unique in the file even with "
                f"{MAX_WIDEN} more lines of context",
            )
        new = "".join(lines[begin:core_begin] + new_core + lines[core_end:end])
        call = ToolCall("replace", {"path": path, "old": old, "new": new})
        calls.append((call, replace_output(path, content, old, new)))
        content = content.replace(old, new, 1)
        delta += len(new_lines) - len(old_lines)
    return calls


def demonstration_calls(
    patch: str, read_file: ReadFile, list_dir: ListDir | None = None
) -> list[tuple[ToolCall, str | None]]:
    """The demonstration's calls, each with its observation text (None for submit). With
    `list_dir` (names in a directory of the base commit: `patch_formats.git_dir_lister`), the
    episode first finds the file: `view` of the root, then of each directory down to the first
    file the patch changes. Raises UnsupportedPatchError when the patch cannot be expressed with
    the tools."""
    try:
        patch_set = unidiff.PatchSet(patch)
    except unidiff.UnidiffParseError as error:
        raise UnsupportedPatchError(SkipReason.UNPARSABLE_PATCH, str(error)) from None
    if not len(patch_set):
        raise UnsupportedPatchError(SkipReason.UNPARSABLE_PATCH, "the patch changes no file")
    calls: list[tuple[ToolCall, str | None]] = []
    if list_dir is not None:
        calls.extend(_exploration_calls(patch_set[0].path, list_dir))
    for patched in patch_set:
        path = patched.path
        if (
            patched.is_removed_file
            or patched.is_rename
            or patched.is_binary_file
            or not len(patched)
        ):
            raise UnsupportedPatchError(
                SkipReason.UNSUPPORTED_CHANGE,
                f"{path}: deletes, renames, binary and mode-only changes have no tool",
            )
        if patched.is_added_file:
            content = "".join(line for hunk in patched for line in _hunk_sides(hunk)[1])
            call = ToolCall("write_file", {"path": path, "content": content})
            calls.append((call, write_output(path, content)))
            continue
        base = read_file(path)
        if base is None:
            raise UnsupportedPatchError(SkipReason.MISSING_FILE, f"{path}: not in the repository")
        calls.extend(_file_calls(patched, base))
    calls.append((ToolCall("run_tests", {}), RUN_TESTS_OUTPUT))
    calls.append((ToolCall("submit", {}), None))
    return calls


def _exploration_calls(path: str, list_dir: ListDir) -> list[tuple[ToolCall, str | None]]:
    """`view` of ".", then of each directory on the way to `path` ("a/b/c.py": ".", "a", "a/b"),
    answered as the session lists a directory."""
    parts = path.split("/")[:-1]
    calls: list[tuple[ToolCall, str | None]] = []
    for depth in range(len(parts) + 1):
        directory = "/".join(parts[:depth]) or "."
        names = list_dir(directory)
        if names is None:
            raise UnsupportedPatchError(
                SkipReason.MISSING_FILE, f"{directory}: not a directory of the repository"
            )
        calls.append((ToolCall("view", {"path": directory}), directory_listing(names, directory)))
    return calls


def _tokens(
    renderer: ChatRenderer, user_message: str, calls: Sequence[tuple[ToolCall, str | None]]
) -> tuple[list[int], list[int], list[str]]:
    """The episode's token ids, its assistant mask and the rendered observations."""
    token_ids = renderer.initial_prompt_ids(user_message)
    mask = [0] * len(token_ids)
    observations = []
    for call, output in calls:
        response = renderer.response_ids(render_tool_call(call))
        token_ids += response
        mask += [1] * len(response)
        if output is not None:
            observations.append(render_observation(_Result(output)))
            following = renderer.observation_ids(observations[-1], response)
            token_ids += following
            mask += [0] * len(following)
    return token_ids, mask, observations


def build_demonstration(
    instance: SweInstance,
    read_file: ReadFile,
    renderer: ChatRenderer,
    user_message: str,
    *,
    max_tokens: int | None = None,
    list_dir: ListDir | None = None,
) -> Demonstration | Skipped:
    """The demonstration of `instance`'s gold patch, or why there is none. `read_file` reads
    the base commit's files (`patch_formats.git_file_reader`); `user_message` is the task
    prompt exactly as the episode loop gives it, so the tokens match a rollout's."""
    try:
        calls = demonstration_calls(instance.patch, read_file, list_dir)
    except UnsupportedPatchError as skip:
        return Skipped(instance.instance_id, skip.reason, skip.detail)
    token_ids, mask, observations = _tokens(renderer, user_message, calls)
    if max_tokens is not None and len(token_ids) > max_tokens:
        return Skipped(
            instance.instance_id,
            SkipReason.TOO_LONG,
            f"{len(token_ids)} tokens, more than max_tokens={max_tokens}",
        )
    return Demonstration(
        instance_id=instance.instance_id,
        token_ids=tuple(token_ids),
        mask=tuple(mask),
        calls=tuple(call for call, _ in calls),
        observations=tuple(observations),
    )


def build_demonstrations(
    items: Iterable[tuple[SweInstance, ReadFile, str] | tuple[SweInstance, ReadFile, str, ListDir]],
    renderer: ChatRenderer,
    *,
    max_tokens: int | None = None,
) -> tuple[list[Demonstration], collections.Counter[str]]:
    """Demonstrations of (instance, read_file, user_message[, list_dir]) items, and the number of
    skipped tasks per `SkipReason` value."""
    demos: list[Demonstration] = []
    skipped: collections.Counter[str] = collections.Counter()
    for instance, read_file, user_message, *list_dir in items:
        result = build_demonstration(
            instance,
            read_file,
            renderer,
            user_message,
            max_tokens=max_tokens,
            list_dir=list_dir[0] if list_dir else None,
        )
        if isinstance(result, Skipped):
            skipped[result.reason.value] += 1
        else:
            demos.append(result)
    return demos, skipped
