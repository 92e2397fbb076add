"""Python lint and format: ruff, configured by the repository's ruff.toml, over every Python file
that git tracks or would add (ruff reads .gitignore itself)."""

from tools.lint import workspace_files

ROOT = workspace_files.workspace_root("ruff.toml")


def _ruff(*args: str) -> None:
    ruff = workspace_files.tool_path("RUFF")
    # --no-cache: the tree is read-only from the test's sandbox.
    workspace_files.check(
        [ruff, *args, "--no-cache", "--config", ROOT / "ruff.toml", "."],
        cwd=ROOT,
        fix=workspace_files.FIX_COMMAND,
    )


def test_ruff_lint():
    _ruff("check", "--output-format", "concise")


def test_ruff_format():
    _ruff("format", "--check", "--diff")
