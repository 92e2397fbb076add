"""Tests of dockyard_rl.rewards.held_out_tests: path spellings and held-out violations."""

import pytest

from dockyard_rl.rewards.held_out_tests import held_out_violations, normalize_repo_path


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
        ('"tests/say \\"hi\\".py"', 'tests/say "hi".py'),
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
