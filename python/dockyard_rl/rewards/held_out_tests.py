"""Held-out test files: does a patch touch any of them?

A task's held-out tests (the files of its gold test patch) decide the reward, so a patch that
edits them is reward hacking. The sandbox restores those files from the base commit before it
runs the tests; the reward side also zeroes such a sample, so the policy is never paid for trying.

Covered:
- `normalize_repo_path`: one spelling per repository path: surrounding whitespace, git's C-style
  quoting ("tests/t\\303\\251st.py", undone by the sandbox's `unquote_c_style`), leading "/",
  "./" segments, duplicate slashes, "x/../" segments and trailing slashes are removed.
- `held_out_violations`: which held-out files a list of touched paths hits. Either list may hold
  paths as diff headers spell them: a path also matches with its first component removed when
  that is "a" or "b" (git's default prefixes), so "a/tests/x.py", "./tests//x.py" and
  "tests/x.py" are one file. This errs towards flagging: in a repository with a top-level "a/"
  folder, "a/tests/x.py" also matches a held-out "tests/x.py".

Which files a patch touches is parsed in one place, the sandbox's
`sandbox.protected_paths.touched_paths` (the executor reports violations in its verdict); this
module compares path lists.

Not covered: case-insensitive or Unicode-normalising file systems (the sandbox's is neither).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from dockyard_rl.sandbox.protected_paths import unquote_c_style

__all__ = ["held_out_violations", "normalize_repo_path"]

# git's default diff prefixes.
_DIFF_PREFIXES = ("a/", "b/")


def normalize_repo_path(path: str) -> str:
    """Returns `path` as a plain relative repository path ("" for an empty or root path).

    Raises:
        ValueError: `path` is not a str, or is a malformed quoted path.
    """
    if not isinstance(path, str):
        raise ValueError(f"path must be a str, got {type(path).__name__} {path!r}")
    path = path.strip()
    if len(path) >= 2 and path[0] == '"' and path[-1] == '"':
        path = unquote_c_style(path)
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
        normalize_repo_path(path) for path in held_out_files if _aliases(path) & touched_aliases
    }
    return tuple(sorted(violated))


def _aliases(path: str) -> set[str]:
    normalized = normalize_repo_path(path)
    if not normalized:
        return set()
    aliases = {normalized}
    if normalized.startswith(_DIFF_PREFIXES) and len(normalized) > 2:
        aliases.add(normalized[2:])
    return aliases
