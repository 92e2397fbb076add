"""Type checks of the public seams (interfaces, factories, configs; the list is mypy.ini's
`files`), strict, with the venv's packages for the types of what they import."""

import os
import sys

from tools.lint import workspace_files

ROOT = workspace_files.workspace_root("mypy.ini")


def test_mypy_strict_on_the_seams():
    mypy_site = workspace_files.tool_path("MYPY_MARKER").parents[1]  # site/mypy/__init__.py
    # mypy runs on this interpreter (the venv), so it resolves torch, ray, ... as the code does.
    env = {**os.environ, "PYTHONPATH": str(mypy_site)}
    cache = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "mypy_cache")
    workspace_files.check(
        [sys.executable, "-m", "mypy", "--config-file", ROOT / "mypy.ini", "--cache-dir", cache],
        cwd=ROOT,
        env=env,
        fix="mypy has no fixer; the report names file:line and the error",
    )
