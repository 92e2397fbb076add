"""BUILD, .bzl, WORKSPACE and MODULE.bazel format and lint: buildifier over every tracked Starlark
file, with the warnings of workspace_files.BUILDIFIER_WARNINGS."""

from tools.lint import workspace_files

ROOT = workspace_files.workspace_root("ruff.toml")


def test_buildifier():
    files = workspace_files.source_files(ROOT, workspace_files.STARLARK_SOURCES)
    assert files, f"no BUILD files under {ROOT}"
    workspace_files.check(
        [
            workspace_files.tool_path("BUILDIFIER"),
            "-mode=check",
            "-lint=warn",
            f"-warnings={workspace_files.BUILDIFIER_WARNINGS}",
            *files,
        ],
        cwd=ROOT,
        fix=workspace_files.FIX_COMMAND,
    )
