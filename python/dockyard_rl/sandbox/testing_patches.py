"""Patches for testing the host-side patch parsers' cost (the patch is the agent's, so every
parse must be linear in it): an ordinary patch and adversarial ones of a given size.

Each adversarial shape targets a way a parser can be superlinear: a header line whose regex
backtracks (long runs of blanks before the end, repeated separators " and ", "://", "\\303"
escapes), many tiny hunks or lines (per-line overhead), a header line with many spaces (a split
tried at every space), many pyproject.toml names (one re-parse or base-file read each), a huge
line number, and binary sections whose hunks are read ahead.
"""

from __future__ import annotations

_HEADER = "diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"


def _fill(prefix: str, unit: str, suffix: str, num_bytes: int) -> str:
    count = max(1, (num_bytes - len(prefix) - len(suffix)) // len(unit))
    return prefix + unit * count + suffix


def ordinary_patch(num_bytes: int) -> str:
    """A well-formed patch of about `num_bytes`: many files with a few ordinary hunks each."""
    parts = []
    size = index = 0
    while size < num_bytes:
        path = f"pkg/module_{index}.py"
        part = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n" + "".join(
            f"@@ -{10 * h + 1},3 +{10 * h + 1},3 @@ def function_{h}(value):\n"
            f"     total = value * {h}\n-    return total\n+    return total + 1\n"
            f"     # end of function_{h}\n"
            for h in range(8)
        )
        parts.append(part)
        size += len(part)
        index += 1
    return "".join(parts)


def adversarial_patches(num_bytes: int) -> dict[str, str]:
    """Shape name -> a patch of about `num_bytes` (module docstring)."""
    n = num_bytes
    return {
        "blanks_in_file_header": _fill("--- a", " ", "x\n+++ b/x\n", n),
        "blanks_in_index_line": _fill("Index: a", " ", "x\n", n),
        "blanks_in_rename_line": _fill("rename from a", " ", "x\n", n),
        "repeated_and_in_binary_line": _fill("Binary files ", " and", "\n", n),
        "repeated_uri_in_git_header": _fill("diff --git ", "://", "\n", n),
        "spaces_in_git_header": _fill("diff --git ", "a ", "\n", n),
        "escapes_in_quoted_name": _fill('diff --git "a/', "\\303", '" "b/x"\n', n),
        "unterminated_quotes": _fill("--- ", '"\\', "\n", n),
        "tiny_hunks": _fill(_HEADER, "@@ -1 +1 @@\n-a\n+b\n", "", n),
        "tiny_added_lines": _fill(_HEADER + f"@@ -0,0 +1,{n // 2} @@\n", "+\n", "", n),
        "long_added_line": _fill(_HEADER + "@@ -0,0 +1 @@\n+", "x_pytest ", "\n", n),
        "many_pyproject_names": "".join(f"Index: d{i}/pyproject.toml\n" for i in range(n // 28)),
        "many_pyproject_files": _fill(
            "",
            "--- a/pyproject.toml\n+++ b/pyproject.toml\n@@ -1 +1 @@\n-a\n+b\n",
            "",
            n,
        ),
        "huge_line_number": _fill(_HEADER + "@@ -1," + "9" * 5000 + " +1 @@\n", "+x\n", "", n),
        "many_binary_sections": _fill(
            "diff --git a/b.bin b/b.bin\n", "GIT binary patch\ndelta 10\nzcmV?d00001\n\n", "", n
        ),
        "many_file_sections": _fill(
            "", "diff --git a/x b/x\nnew file mode 100644\n--- /dev/null\n+++ b/x\n", "", n
        ),
    }
