"""`patch_similarity`: the changed lines of two unified diffs, compared."""

import pytest

from dockyard_rl.rewards.patch_similarity import changed_lines, patch_similarity


def _diff(path: str, removed: list[str], added: list[str], context: list[str] = ()) -> str:
    body = [f" {line}" for line in context]
    body += [f"-{line}" for line in removed] + [f"+{line}" for line in added]
    old, new = len(context) + len(removed), len(context) + len(added)
    header = f"--- a/{path}\n+++ b/{path}\n@@ -1,{old} +1,{new} @@\n"
    return header + "\n".join(body) + "\n"


GOLD = _diff("pkg/series.py", ["        total -= value"], ["        total += value"])


def test_the_same_edit_scores_one_whatever_context_either_diff_quotes():
    with_context = _diff(
        "pkg/series.py",
        ["        total -= value"],
        ["        total += value"],
        context=["    for value in values:"],
    )
    assert patch_similarity(with_context, GOLD) == 1.0
    assert changed_lines(with_context) == "-        total -= value\n+        total += value"


def test_nearer_edits_score_higher():
    wrong_token = _diff("pkg/series.py", ["        total -= value"], ["        total *= value"])
    rewrite = _diff(
        "pkg/series.py",
        [
            "def cumulative_sum(values):",
            "    result = []",
            "    total = 0",
            "    for value in values:",
            "        total -= value",
            "        result.append(total)",
            "    return result",
        ],
        ["def cumulative_sum(values):", "    return sum(values)"],
    )
    other_line = _diff("pkg/series.py", ["    result = []"], ["    result = list()"])
    near, far, elsewhere = (patch_similarity(p, GOLD) for p in (wrong_token, rewrite, other_line))
    assert 0.9 < near < 1.0
    assert near > far and near > elsewhere
    assert 0.0 < far < 0.5


@pytest.mark.parametrize(
    "patch", ["", "not a diff at all", "--- a/x\n+++ b/x\n@@ -1,1 +1,1 @@\n x\n"]
)
def test_a_patch_that_changes_nothing_or_does_not_parse_scores_zero(patch):
    assert patch_similarity(patch, GOLD) == 0.0
    assert patch_similarity(GOLD, patch) == 0.0


def test_files_are_compared_in_path_order():
    one = _diff("b.py", ["x = 1"], ["x = 2"]) + _diff("a.py", ["y = 1"], ["y = 2"])
    other = _diff("a.py", ["y = 1"], ["y = 2"]) + _diff("b.py", ["x = 1"], ["x = 2"])
    assert patch_similarity(one, other) == 1.0
