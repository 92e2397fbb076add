"""Tests of dockyard_rl.rewards.integrity: path spellings and patch parsing."""

import pytest

from dockyard_rl.rewards.integrity import (
    files_touched_by_patch,
    held_out_violations,
    normalize_repo_path,
)


@pytest.mark.parametrize(
    "path, expected",
    [
        ("tests/test_x.py", "tests/test_x.py"),
        ("  tests/test_x.py\n", "tests/test_x.py"),
        ("./tests/./test_x.py", "tests/test_x.py"),
        ("tests//unit///test_x.py", "tests/unit/test_x.py"),
        ("/tests/test_x.py", "tests/test_x.py"),
        ("//tests/test_x.py", "tests/test_x.py"),
        ("src/../tests/test_x.py", "tests/test_x.py"),
        ("tests/", "tests"),
        ('"tests/t\\303\\251st x.py"', "tests/tést x.py"),
        ('"tests/tab\\there.py"', "tests/tab\there.py"),
        ("", ""),
        ("./", ""),
        ("/", ""),
    ],
)
def test_normalize_repo_path(path, expected):
    assert normalize_repo_path(path) == expected


def test_normalize_rejects_bad_input():
    with pytest.raises(ValueError, match="must be a str"):
        normalize_repo_path(None)
    with pytest.raises(ValueError, match="unknown escape"):
        normalize_repo_path('"tests/\\q.py"')


@pytest.mark.parametrize(
    "touched",
    [
        "tests/test_x.py",
        "a/tests/test_x.py",
        "b/tests/test_x.py",
        "./tests/test_x.py",
        "tests//test_x.py",
        "a/./tests//test_x.py",
        "/tests/test_x.py",
        "src/../tests/test_x.py",
        '"tests/test_x.py"',
    ],
)
def test_violation_cannot_be_dodged_by_spelling(touched):
    held_out = ["tests/test_x.py", "tests/test_other.py"]
    assert held_out_violations(["src/lib.py", touched], held_out) == ("tests/test_x.py",)
    # Held-out files spelled as in diff headers match too (reported as given, normalised).
    assert held_out_violations([touched], ["b/tests//test_x.py"]) == ("b/tests/test_x.py",)


def test_no_violation():
    held_out = ["tests/test_x.py"]
    assert held_out_violations([], held_out) == ()
    assert held_out_violations(["src/x.py", "tests/test_x.py.orig", "tests/test_x"], held_out) == ()
    # Only one a/ or b/ prefix is a diff prefix; a deeper path is another file.
    assert held_out_violations(["pkg/tests/test_x.py", "a/b/tests/test_x.py"], held_out) == ()
    assert held_out_violations(["", "/"], held_out) == ()


def test_several_violations_sorted_and_unique():
    touched = ["b/tests/z.py", "a/tests/a.py", "tests/a.py"]
    assert held_out_violations(touched, ["./tests/z.py", "tests/a.py", "tests/m.py"]) == (
        "tests/a.py",
        "tests/z.py",
    )


PATCH = '''\
diff --git a/src/lib.py b/src/lib.py
index 1111111..2222222 100644
--- a/src/lib.py
+++ b/src/lib.py
@@ -1,3 +1,3 @@
 import os
--- removed sql comment
+++ added
 x = 1
diff --git w/tests/test_mode.py i/tests/test_mode.py
old mode 100644
new mode 100755
diff --git a/tests/old.py b/tests/new.py
similarity index 90%
rename from tests/old.py
rename to tests/new.py
diff --git "a/tests/t\\303\\251st.py" "b/tests/t\\303\\251st.py"
--- "a/tests/t\\303\\251st.py"
+++ "b/tests/t\\303\\251st.py"
@@ -1 +1 @@
-a
+b
diff --git a/docs/my file.txt b/docs/my file.txt
deleted file mode 100644
--- a/docs/my file.txt\t2024-01-01 00:00:00
+++ /dev/null
@@ -1 +0,0 @@
-gone
--- foo/conftest.py
+++ bar//conftest.py
@@ -0,0 +1 @@
+import os
'''


def test_files_touched_by_patch():
    assert files_touched_by_patch(PATCH) == (
        "added",  # From the hunk lines "--- removed sql comment" / "+++ added": over-approximation.
        "conftest.py",
        "docs/my file.txt",
        "removed sql comment",  # No slash, so -p1 has nothing to strip.
        "src/lib.py",
        "tests/new.py",
        "tests/old.py",
        "tests/test_mode.py",
        "tests/tést.py",
    )


def test_touched_by_patch_feeds_the_violation_check():
    touched = files_touched_by_patch(PATCH)
    held_out = ["tests/test_mode.py", "tests/tést.py", "tests/old.py", "tests/untouched.py"]
    assert held_out_violations(touched, held_out) == (
        "tests/old.py",
        "tests/test_mode.py",
        "tests/tést.py",
    )


def test_files_touched_by_patch_edge_cases():
    assert files_touched_by_patch("") == ()
    assert files_touched_by_patch("not a patch\n--- only a minus line\n") == ()
    new_file = "--- /dev/null\n+++ b/tests/new_test.py\n@@ -0,0 +1 @@\n+x\n"
    assert files_touched_by_patch(new_file) == ("tests/new_test.py",)
    with pytest.raises(ValueError, match="patch_text must be a str"):
        files_touched_by_patch(None)
