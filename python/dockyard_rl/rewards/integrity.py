"""Held-out test files: does a patch touch any of them?

A task's held-out tests (the files of its gold test patch) decide the reward, so a patch that
edits them is reward hacking. The sandbox restores those files from the base commit before it
runs the tests; the reward side also zeroes such a sample, so the policy is never paid for trying.

Covered:
- `normalize_repo_path`: one spelling per repository path: surrounding whitespace, git's C-style
  quoting ("tests/t\\303\\251st.py"), leading "/", "./" segments, duplicate slashes, "x/../"
  segments and trailing slashes are removed.
- `held_out_violations`: which held-out files a list of touched paths hits. Either list may hold
  paths as diff headers spell them: a path also matches with its first component removed when
  that is "a" or "b" (git's default prefixes), so "a/tests/x.py", "./tests//x.py" and
  "tests/x.py" are one file. This errs towards flagging: in a repository with a top-level "a/"
  folder, "a/tests/x.py" also matches a held-out "tests/x.py".
- `files_touched_by_patch`: the repository paths a unified/git diff touches when applied with
  `-p1` (as the sandbox does), whatever its prefixes ("i/", "w/", "foo/" are stripped like "a/"):
  old and new names from "---"/"+++" pairs, "diff --git" headers (mode-only and binary changes),
  and rename/copy lines. It over-approximates (both names of a renamed file, and a removed
  line "-- x" directly above an added line "++ y" reads as a header pair), which can only add
  violations, never hide one.

Not covered: context diffs ("*** file") and "Index:" lines (GNU patch only), patches that reach a
held-out file through a symlink the same patch creates (git apply refuses to write through it),
and case-insensitive or Unicode-normalising file systems (the sandbox's is neither).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

__all__ = ["files_touched_by_patch", "held_out_violations", "normalize_repo_path"]

# git's default diff prefixes; other prefixes only come from real diffs (files_touched_by_patch).
_DIFF_PREFIXES = ("a/", "b/")
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def normalize_repo_path(path: str) -> str:
    """Returns `path` as a plain relative repository path ("" for an empty or root path).

    Raises:
        ValueError: `path` is not a str, or is a malformed quoted path.
    """
    if not isinstance(path, str):
        raise ValueError(f"path must be a str, got {type(path).__name__} {path!r}")
    path = path.strip()
    if len(path) >= 2 and path[0] == '"' and path[-1] == '"':
        path = _unquote_c_style(path)
    # Leading slashes: a path inside the repository, written as if the repository were "/".
    path = posixpath.normpath(path.lstrip("/")) if path.lstrip("/") else ""
    return "" if path == "." else path


def held_out_violations(
    touched_files: Iterable[str], held_out_files: Iterable[str]
) -> tuple[str, ...]:
    """Returns the held-out files that any of `touched_files` hits: as spelled in
    `held_out_files`, normalised, sorted, without duplicates."""
    touched_aliases: set[str] = set()
    for path in touched_files:
        touched_aliases |= _aliases(path)
    violated = {
        normalize_repo_path(path)
        for path in held_out_files
        if _aliases(path) & touched_aliases
    }
    return tuple(sorted(violated))


def files_touched_by_patch(patch_text: str) -> tuple[str, ...]:
    """Returns the sorted repository paths `patch_text` touches when applied with -p1.

    Raises:
        ValueError: `patch_text` is not a str.
    """
    if not isinstance(patch_text, str):
        raise ValueError(f"patch_text must be a str, got {type(patch_text).__name__}")
    lines = patch_text.splitlines()
    touched: set[str] = set()
    for i, line in enumerate(lines):
        if line.startswith("diff --git "):
            touched.update(_git_header_paths(line[len("diff --git "):]))
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            # These already are repository paths, without a prefix.
            touched.add(normalize_repo_path(line.split(" ", 2)[2]))
        # Hunk content lines start with " ", "+", "-" or "\", so "--- x" alone may be a removed
        # line "-- x"; a file header is a "---" line directly followed by a "+++" line.
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            touched.add(_strip_first_component(_header_path(line[4:])))
            touched.add(_strip_first_component(_header_path(lines[i + 1][4:])))
    touched.discard("")
    return tuple(sorted(touched))


def _aliases(path: str) -> set[str]:
    normalized = normalize_repo_path(path)
    if not normalized:
        return set()
    aliases = {normalized}
    if normalized.startswith(_DIFF_PREFIXES) and len(normalized) > 2:
        aliases.add(normalized[2:])
    return aliases


def _header_path(text: str) -> str:
    """The path of a "---"/"+++" line's remainder: quoted, or up to a tab (then a timestamp)."""
    text = text.rstrip("\r\n")
    if text.startswith('"'):
        end = _closing_quote(text)
        return _unquote_c_style(text[: end + 1]) if end > 0 else text
    return text.split("\t", 1)[0].rstrip()


def _git_header_paths(rest: str) -> set[str]:
    """Paths of a "diff --git <old> <new>" header, as git apply -p1 reads them."""
    rest = rest.rstrip()
    if rest.startswith('"'):
        end = _closing_quote(rest)
        if end < 0:
            return set()
        old = _unquote_c_style(rest[: end + 1])
        new = _header_path(rest[end + 1 :].lstrip())
        return {_strip_first_component(old), _strip_first_component(new)}
    if rest.endswith('"'):
        start = rest.rfind(' "')
        if start < 0:
            return set()
        new = _unquote_c_style(rest[start + 1 :])
        return {_strip_first_component(rest[:start]), _strip_first_component(new)}
    # Unquoted names may hold spaces: like git, take the split whose two sides name the same
    # file after the prefix; headers of renames (two names) are covered by the rename lines.
    for match in re.finditer(" ", rest):
        old, new = rest[: match.start()], rest[match.end() :]
        if _strip_first_component(old) == _strip_first_component(new):
            return {_strip_first_component(old)}
    return set()


def _strip_first_component(path: str) -> str:
    """What `git apply -p1` makes of a header path: the part after the first slash(es)."""
    raw = path.strip()
    if len(raw) >= 2 and raw[0] == '"' and raw[-1] == '"':
        raw = _unquote_c_style(raw)
    if raw == "/dev/null":  # The old side of a new file, or the new side of a deletion.
        return ""
    _, slash, after = raw.partition("/")
    return normalize_repo_path(after if slash else raw)


def _closing_quote(text: str) -> int:
    """Index of the quote closing the C-quoted string that opens `text`, or -1."""
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return -1


def _unquote_c_style(quoted: str) -> str:
    """Decodes git's quoting: "\\t", "\\"", "\\\\", and octal bytes ("\\303\\251" = "é")."""
    body = quoted[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out += char.encode("utf-8")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError(f"malformed quoted path {quoted!r}: ends with a lone backslash")
        escape = body[i + 1]
        if escape in _C_ESCAPES:
            out.append(_C_ESCAPES[escape])
            i += 2
        elif re.fullmatch(r"[0-3][0-7]{2}", body[i + 1 : i + 4]):
            out.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            raise ValueError(f"malformed quoted path {quoted!r}: unknown escape \\{escape}")
    return out.decode("utf-8", errors="surrogateescape")
