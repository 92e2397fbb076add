"""The base commit's files: reading them (`git_file_reader`) and diffing edits of them.

`git_file_reader(repo_path, commit)` is the `ReadFile` the formats that edit files read
(SEARCH/REPLACE, FUNCTION); `safe_path` refuses paths that could leave the repository;
`file_diff(path, old, new)` writes the git-style diff those formats return.

Not covered: binary files (contents are decoded as UTF-8 with replacement), renames and mode
changes.
"""

from __future__ import annotations

import difflib
import functools
import subprocess
from collections.abc import Callable

from dockyard_rl.data.patch_formats.interfaces import ReadFile


def safe_path(path: str) -> bool:
    """Whether `path` is relative to the repository root and stays inside it."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "\\" not in path


def git_file_reader(repo_path: str, commit: str) -> ReadFile:
    """A `read_file` over a local git repository at `commit`; None when the path is not a file
    there (`git cat-file blob`). Contents are decoded as UTF-8 with replacement. Each path is
    read once per reader: every sample of a prompt parses against the same files."""

    @functools.cache
    def read_file(path: str) -> str | None:
        if not safe_path(path):
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


def git_dir_lister(repo_path: str, commit: str) -> Callable[[str], list[str] | None]:
    """`list_dir(path)` over a local git repository at `commit`: the names in directory `path`
    ("." the root), a directory's with a trailing "/", a symbolic link's with "@" (as an agent's
    session lists a checkout), in git's order; None when `path` is not a directory there."""

    @functools.cache
    def list_dir(path: str) -> list[str] | None:
        if path not in (".", "") and not safe_path(path):
            return None
        tree = commit if path in (".", "") else f"{commit}:{path}"
        result = subprocess.run(
            ["git", "ls-tree", "-z", tree if ":" in tree else f"{tree}^{{tree}}"],
            cwd=repo_path,
            capture_output=True,
            check=False,
        )
        if result.returncode != 0:
            return None
        names = []
        for entry in result.stdout.decode("utf-8", errors="replace").split("\0"):
            if not entry:
                continue
            meta, name = entry.split("\t", 1)
            mode, kind = meta.split()[:2]
            names.append(f"{name}/" if kind == "tree" else f"{name}@" if mode == "120000" else name)
        return names

    return list_dir


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
