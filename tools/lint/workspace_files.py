"""The source tree that the lint tests check, found from inside Bazel's test sandbox.

The lint tests read the working tree itself instead of declared inputs: declaring every source file
of every package as test data would mean boilerplate in each BUILD file, which a new package could
forget, and an unchecked file would pass silently. So a test finds the workspace through the
runfile of a root config file (its symlink resolves into the source tree, which Bazel's sandbox
leaves readable) and lists the files git knows or would add (tracked, plus untracked files that
.gitignore does not exclude). The test targets are tagged `external`, so Bazel never answers with a
cached pass for a tree that has changed since.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence


def workspace_root(anchor: str = "ruff.toml") -> pathlib.Path:
    """The source tree's root: where the runfile `anchor` (a root-level file) really lives."""
    runfile = pathlib.Path(anchor)
    if not runfile.exists():
        raise FileNotFoundError(
            f"{anchor} is not in the test's runfiles: add //:{anchor} to its data"
        )
    return runfile.resolve().parent


def source_files(root: pathlib.Path, patterns: Sequence[str]) -> list[pathlib.Path]:
    """The files under `root` matching git pathspec `patterns` (e.g. "*.cc"), tracked or not
    ignored, sorted."""
    listed = subprocess.run(
        [
            "git",
            "-C",
            str(root),
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "-z",
            "--",
            *patterns,
        ],
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        raise RuntimeError(
            f"cannot list the sources of {root} with git (exit {listed.returncode}): "
            f"{listed.stderr.strip()}; the lint tests check a git checkout"
        )
    names = sorted(set(filter(None, listed.stdout.split("\0"))))
    # A file deleted in the working tree but not yet in the index is still "cached".
    return [root / name for name in names if (root / name).is_file()]


def tool_path(env_var: str) -> pathlib.Path:
    """A tool's runfile, named by an environment variable that the BUILD target sets."""
    value = os.environ.get(env_var)
    if not value:
        raise RuntimeError(
            f"${env_var} is not set: run this test through Bazel "
            "(tools/bazel test //tools/lint/...)"
        )
    return pathlib.Path(value).absolute()


def check(
    command: Sequence[str | os.PathLike[str]],
    *,
    cwd: pathlib.Path,
    fix: str,
    env: dict[str, str] | None = None,
) -> None:
    """Runs a checker; fails the test with its report and the command that fixes it."""
    run = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if run.returncode != 0:
        report = (run.stdout + run.stderr).strip()
        raise AssertionError(
            f"{report}\n\n{pathlib.Path(str(command[0])).name} found problems "
            f"(exit {run.returncode}). Fix: {fix}"
        )
    sys.stdout.write(run.stdout)


FIX_COMMAND = "tools/bazel run //tools/lint:fix"

# What each check covers, shared by the tests and by fix.py.
CPP_SOURCES = ["*.cc", "*.h", "*.cu", "*.cuh"]
STARLARK_SOURCES = [
    "BUILD",
    "*/BUILD",
    "BUILD.bazel",
    "*/BUILD.bazel",
    "*.bzl",
    "WORKSPACE",
    "MODULE.bazel",
]
# buildifier's native-* warnings are off: the offline build is Bazel 4.2.3, whose rules_cc and
# rules_java are local stand-ins that forward to the native rules (tools/bazel_stubs), so loading
# cc_library or py_test from rules_* would reach the same native rules by a longer way.
BUILDIFIER_WARNINGS = (
    "-native-cc-binary,-native-cc-library,-native-cc-test,-native-py,"
    "-native-sh-binary,-native-sh-test"
)
