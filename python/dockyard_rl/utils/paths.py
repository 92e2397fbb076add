"""Paths given on the command line of `bazel run` targets.

`bazel run` starts a binary in its runfiles tree, so a relative path the user typed means nothing
there. `caller_path(path)` resolves it against the directory the user ran the command from:
DOCKYARD_CALLER_DIR (set by tools/bazel, which itself must cd to the workspace root), else
BUILD_WORKING_DIRECTORY (set by bazel run), else the current directory (a plain `python -m`).
"""

from __future__ import annotations

import os
import pathlib

_CALLER_DIR_VARIABLES = ("DOCKYARD_CALLER_DIR", "BUILD_WORKING_DIRECTORY")


def caller_path(path: str | os.PathLike) -> pathlib.Path:
    """`path` made absolute against the user's directory (module docstring), `~` expanded."""
    path = pathlib.Path(path).expanduser()
    if not path.is_absolute():
        for variable in _CALLER_DIR_VARIABLES:
            if os.environ.get(variable):
                return (pathlib.Path(os.environ[variable]) / path).resolve()
    return path.resolve()
