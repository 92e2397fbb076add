"""Applies every fixer the lint tests check for, in place, over the working tree.

    tools/bazel run //tools/lint:fix

ruff (safe lint fixes, then formatting), clang-format and buildifier, with the repository's own
settings (ruff.toml, .clang-format, the buildifier warnings of workspace_files.py). What a fixer
cannot fix (e.g. a too-long string, a type error) is left for you: run
`tools/bazel test //tools/lint/...` afterwards to see it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from tools.lint import workspace_files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ruff", type=pathlib.Path, required=True)
    parser.add_argument("--clang-format", type=pathlib.Path, required=True)
    parser.add_argument("--buildifier", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    if "BUILD_WORKSPACE_DIRECTORY" not in os.environ:
        parser.error("run me with `tools/bazel run //tools/lint:fix` (I edit the working tree)")
    root = pathlib.Path(os.environ["BUILD_WORKSPACE_DIRECTORY"])
    ruff, clang_format, buildifier = (
        path.absolute() for path in (args.ruff, args.clang_format, args.buildifier)
    )
    steps = [
        [ruff, "check", "--fix", "--config", root / "ruff.toml", "."],
        [ruff, "format", "--config", root / "ruff.toml", "."],
        [
            clang_format,
            "-i",
            "--style=file",
            *workspace_files.source_files(root, workspace_files.CPP_SOURCES),
        ],
        [
            buildifier,
            "-lint=fix",
            f"-warnings={workspace_files.BUILDIFIER_WARNINGS}",
            *workspace_files.source_files(root, workspace_files.STARLARK_SOURCES),
        ],
    ]
    failed = 0
    for step in steps:
        print("+", " ".join(str(part) for part in step[:3]), "...", flush=True)
        failed |= subprocess.run([str(part) for part in step], cwd=root).returncode != 0
    if failed:
        print("Some problems need a hand: see above.", file=sys.stderr)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
