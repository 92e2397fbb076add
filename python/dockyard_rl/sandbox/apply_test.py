import pytest

from dockyard_rl.sandbox import apply, repo_cache
from dockyard_rl.sandbox.task import ApplyMethod
from dockyard_rl.sandbox.testing_repos import OPS_BASE, OPS_FIXED, make_toy_repo


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("apply") / "toy")


@pytest.fixture
def worktree(toy, tmp_path):
    cache = repo_cache.RepoCache(tmp_path / "cache")
    cache.checkout(str(toy.path), toy.base_commit, tmp_path / "repo")
    (tmp_path / "scratch").mkdir()
    return tmp_path / "repo"


def test_empty_patch(worktree, tmp_path):
    assert apply.apply_patch(worktree, "  \n", tmp_path / "scratch").method == ApplyMethod.EMPTY


def test_clean_patch_uses_git_apply(toy, worktree, tmp_path):
    result = apply.apply_patch(worktree, toy.gold_patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY
    assert (worktree / "calc" / "ops.py").read_text() == OPS_FIXED


def test_missing_final_newline_is_tolerated(toy, worktree, tmp_path):
    result = apply.apply_patch(worktree, toy.gold_patch.rstrip("\n"), tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY


def test_drifted_context_falls_back_to_patch_fuzz(toy, worktree, tmp_path):
    # Line numbers and a context line are off: git apply refuses, GNU patch's fuzz copes.
    drifted = ("diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
               "@@ -20,9 +20,9 @@\n"
               " def sub(a, b):\n     return a - b\n \n \n def mul(a, b):\n-    return a + b\n"
               "+    return a * b\n \n \n def clamp_changed_context(value, low, high):\n")
    result = apply.apply_patch(worktree, drifted, tmp_path / "scratch")
    assert result.method == ApplyMethod.PATCH_FUZZ, result.message
    assert (worktree / "calc" / "ops.py").read_text() == OPS_FIXED
    assert not list(worktree.rglob("*.orig")) and not list(worktree.rglob("*.rej"))


def test_three_way_merge_uses_the_index(toy, worktree, tmp_path):
    # A patch made against a slightly different version of the file: the index line names the
    # base blob, so --3way can merge where the plain apply cannot.
    from dockyard_rl.sandbox.testing_repos import git
    base_blob = git(worktree, "rev-parse", "HEAD:calc/ops.py").strip()
    fixed_and_renamed = OPS_FIXED.replace("Small arithmetic helpers.", "Arithmetic helpers.")
    patch = toy.patch_for({"calc/ops.py": fixed_and_renamed})
    # Change the worktree's HEAD next to the docstring: the patch's context no longer matches.
    (worktree / "calc" / "ops.py").write_text(OPS_BASE.replace("def add(a, b):",
                                                               "def add(a, b):  # sum"))
    git(worktree, "commit", "--quiet", "-am", "local change")
    assert base_blob in git(worktree, "cat-file", "--batch-all-objects", "--batch-check")
    result = apply.apply_patch(worktree, patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY_3WAY, result.message
    merged = (worktree / "calc" / "ops.py").read_text()
    assert "return a * b" in merged and "Arithmetic helpers." in merged and "# sum" in merged


def test_failure_is_reported_and_the_tree_is_reset(toy, worktree, tmp_path):
    (worktree / "stray.txt").write_text("left over")
    result = apply.apply_patch(worktree, toy.conflicting_patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.FAILED
    assert "git_apply" in result.message and "patch_fuzz" in result.message
    assert (worktree / "calc" / "ops.py").read_text() == OPS_BASE
    assert not (worktree / "stray.txt").exists()
    assert not list(worktree.rglob("*.rej"))


def test_half_applied_patch_does_not_leak_into_the_next_method(toy, worktree, tmp_path):
    # The first file applies, the second does not: git apply is atomic, GNU patch is not, and
    # the reset between tries must leave no trace of the partial attempt.
    partial = toy.gold_patch + toy.conflicting_patch.replace("calc/ops.py", "calc/__init__.py")
    result = apply.apply_patch(worktree, partial, tmp_path / "scratch")
    assert result.method == ApplyMethod.FAILED
    assert (worktree / "calc" / "ops.py").read_text() == OPS_BASE
