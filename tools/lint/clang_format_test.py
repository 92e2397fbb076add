"""C++ and CUDA format: clang-format with the repository's .clang-format, over every tracked
.cc/.h/.cu/.cuh file."""

from tools.lint import workspace_files

ROOT = workspace_files.workspace_root(".clang-format")


def test_clang_format():
    files = workspace_files.source_files(ROOT, workspace_files.CPP_SOURCES)
    assert files, f"no C++ sources under {ROOT}"
    workspace_files.check(
        [
            workspace_files.tool_path("CLANG_FORMAT"),
            "--dry-run",
            "--Werror",
            "--style=file",
            *files,
        ],
        cwd=ROOT,
        fix=workspace_files.FIX_COMMAND,
    )
