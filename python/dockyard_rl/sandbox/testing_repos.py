"""A tiny, real SWE-style task for tests: a git repository with a bug, its fix and its tests.

    repo = make_toy_repo(tmp_path / "toy")     # ~0.1 s; a real git repository on disk
    spec = repo.spec(repo.gold_patch)          # a TaskSpec that scoring should resolve
    spec = repo.spec("")                       # ... and one it should not
    hostile = repo.patch_for({"calc/ops.py": "..."})   # any edit, as a unified diff vs base
    train, val = write_toy_tasks(tmp_path, train=["toy_a"], val=["toy_v"])  # tasks.jsonl files

The repository (package `calc`, tests in `tests/`):
- base commit ("introduce mul", `base_commit`): `calc/ops.py` has add, sub, mul and clamp;
  `mul` is buggy (it adds). `tests/test_ops.py` tests add, sub (parametrized, with spaces in the
  ids) and clamp; those are PASS_TO_PASS.
- fix commit (`fix_commit`, tagged `v1.0-fixed`, on branch `main`; "future history" a scored
  checkout must not be able to see): fixes `mul` (`gold_patch`) and adds tests
  (`test_patch`): `test_mul` in tests/test_ops.py and a new tests/test_mul_table.py with
  parametrized ids containing spaces. Those tests are FAIL_TO_PASS.
- `wrong_patch`: makes mul correct but breaks sub (F2P pass, some P2P fail).
- `conflicting_patch`: a well-formed diff whose context does not exist: no method applies it.

Used by the sandbox pipeline's tests and the executor service's tests; no mocks anywhere: the
tests score these tasks with real git, real pytest and real bubblewrap.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

from dockyard_rl.sandbox.task import RewardMode, TaskSpec

_GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "toy",
    "GIT_AUTHOR_EMAIL": "toy@localhost",
    "GIT_COMMITTER_NAME": "toy",
    "GIT_COMMITTER_EMAIL": "toy@localhost",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
}

OPS_BASE = '''\
"""Small arithmetic helpers."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a + b


def clamp(value, low, high):
    return max(low, min(high, value))
'''

OPS_FIXED = OPS_BASE.replace("def mul(a, b):\n    return a + b", "def mul(a, b):\n    return a * b")

OPS_WRONG = OPS_FIXED.replace(
    "def sub(a, b):\n    return a - b", "def sub(a, b):\n    return b - a"
)

TEST_OPS_BASE = """\
import pytest

from calc.ops import add, clamp, sub


def test_add():
    assert add(2, 3) == 5


@pytest.mark.parametrize("a, b, expected", [(5, 3, 2), (1, 1, 0)], ids=["five minus three",
                                                                       "one minus one"])
def test_sub(a, b, expected):
    assert sub(a, b) == expected


class TestClamp:
    def test_inside(self):
        assert clamp(5, 0, 10) == 5

    def test_outside(self):
        assert clamp(50, 0, 10) == 10
"""

TEST_OPS_FIXED = (
    TEST_OPS_BASE.replace(
        "from calc.ops import add, clamp, sub", "from calc.ops import add, clamp, mul, sub"
    )
    + """

def test_mul():
    assert mul(3, 4) == 12
"""
)

TEST_MUL_TABLE = """\
import pytest

from calc.ops import mul


@pytest.mark.parametrize("a, b", [(2, 3), (4, 5)], ids=["2 x 3", "4 x 5"])
def test_table(a, b):
    assert mul(a, b) == a * b
"""

FAIL_TO_PASS = (
    "tests/test_ops.py::test_mul",
    "tests/test_mul_table.py::test_table[2 x 3]",
    "tests/test_mul_table.py::test_table[4 x 5]",
)
PASS_TO_PASS = (
    "tests/test_ops.py::test_add",
    "tests/test_ops.py::test_sub[five minus three]",
    "tests/test_ops.py::test_sub[one minus one]",
    "tests/test_ops.py::TestClamp::test_inside",
    "tests/test_ops.py::TestClamp::test_outside",
)

CONFLICTING_PATCH = (
    '''\
diff --git a/calc/ops.py b/calc/ops.py
--- a/calc/ops.py
+++ b/calc/ops.py
@@ -1,3 +1,3 @@
-"""Helpers that never existed."""
+"""Helpers that never will."""
'''
    " \n"  # two context lines, blank in the file: a lone space each
    " \n"
)


TOY_PROBLEM = "calc.ops.mul(3, 4) returns 7 instead of 12: it adds its arguments."


def git(cwd: pathlib.Path, *args: str) -> str:
    """Runs git with a fixed identity and dates (deterministic commit ids); returns stdout."""
    return subprocess.run(
        ["git", *args], cwd=cwd, env=_GIT_ENV, check=True, capture_output=True, text=True
    ).stdout


def _write(root: pathlib.Path, files: Mapping[str, str | None]) -> None:
    for name, content in files.items():
        path = root / name
        if content is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)


@dataclasses.dataclass(frozen=True)
class ToyRepo:
    path: pathlib.Path
    base_commit: str
    fix_commit: str
    gold_patch: str
    test_patch: str
    wrong_patch: str
    conflicting_patch: str
    fail_to_pass: tuple[str, ...] = FAIL_TO_PASS
    pass_to_pass: tuple[str, ...] = PASS_TO_PASS

    def spec(
        self,
        patch: str,
        *,
        instance_id: str = "toy__calc-1",
        reward_mode: RewardMode = RewardMode.BINARY,
        timeout_s: float | None = None,
        test_command: str | None = None,
        task_id: str | None = None,
    ) -> TaskSpec:
        return TaskSpec(
            instance_id=instance_id,
            repo=str(self.path),
            base_commit=self.base_commit,
            patch=patch,
            test_patch=self.test_patch,
            fail_to_pass=self.fail_to_pass,
            pass_to_pass=self.pass_to_pass,
            test_command=test_command,
            timeout_s=timeout_s,
            reward_mode=reward_mode,
            task_id=task_id,
        )

    def dataset_row(self, instance_id: str, problem_statement: str = TOY_PROBLEM) -> dict:
        """This repository's task as a row of a tasks.jsonl (the SWE-bench columns)."""
        return {
            "instance_id": instance_id,
            "repo": str(self.path),
            "base_commit": self.base_commit,
            "patch": self.gold_patch,
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": list(self.fail_to_pass),
            "PASS_TO_PASS": list(self.pass_to_pass),
            "problem_statement": problem_statement,
            "version": "1.0",
        }

    def patch_for(self, files: Mapping[str, str | None]) -> str:
        """A git-style unified diff from base_commit to base_commit + `files` (path -> new
        content, None deletes)."""
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="toy-patch-"))
        try:
            git(scratch, "clone", "--quiet", str(self.path), "clone")
            clone = scratch / "clone"
            git(clone, "checkout", "--quiet", "--detach", self.base_commit)
            _write(clone, files)
            git(clone, "add", "-A")
            return git(clone, "diff", "--cached", "--binary", self.base_commit)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def make_toy_repo(path: pathlib.Path) -> ToyRepo:
    """Creates the repository described in the module docstring at `path` (must not exist)."""
    path.mkdir(parents=True)
    git(path, "init", "--quiet", "--initial-branch=main")
    _write(
        path,
        {
            "calc/__init__.py": "",
            "calc/ops.py": OPS_BASE.replace("\n\ndef mul(a, b):\n    return a + b\n", ""),
            "tests/test_ops.py": TEST_OPS_BASE,
        },
    )
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "initial")
    _write(path, {"calc/ops.py": OPS_BASE})
    git(path, "commit", "--quiet", "-am", "introduce mul")
    base_commit = git(path, "rev-parse", "HEAD").strip()
    _write(
        path,
        {
            "calc/ops.py": OPS_FIXED,
            "tests/test_ops.py": TEST_OPS_FIXED,
            "tests/test_mul_table.py": TEST_MUL_TABLE,
        },
    )
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "fix mul")
    fix_commit = git(path, "rev-parse", "HEAD").strip()
    git(path, "tag", "v1.0-fixed")
    gold_patch = git(path, "diff", base_commit, fix_commit, "--", "calc")
    test_patch = git(path, "diff", base_commit, fix_commit, "--", "tests")
    repo = ToyRepo(
        path=path,
        base_commit=base_commit,
        fix_commit=fix_commit,
        gold_patch=gold_patch,
        test_patch=test_patch,
        wrong_patch="",
        conflicting_patch=CONFLICTING_PATCH,
    )
    return dataclasses.replace(repo, wrong_patch=repo.patch_for({"calc/ops.py": OPS_WRONG}))


def toy_worktree(root: pathlib.Path) -> pathlib.Path:
    """A plain clone of a fresh toy repository at its base commit, at `root`/wt (the toy's own
    repository goes to `root`/toy): what the runner's tests run pytest on."""
    toy = make_toy_repo(root / "toy")
    tree = root / "wt"
    git(root, "clone", "--quiet", str(toy.path), str(tree))
    git(tree, "checkout", "--quiet", toy.base_commit)
    return tree


def write_toy_tasks(root: pathlib.Path, **splits: list[str]) -> list[pathlib.Path]:
    """One tasks.jsonl per split (`root/<split>.jsonl`, in the order given), one toy repository
    (its own git repo under `root/<split>/<name>`) per task name; instance ids `<name>__calc-1`."""
    paths = []
    for split, names in splits.items():
        rows = [make_toy_repo(root / split / name).dataset_row(f"{name}__calc-1") for name in names]
        path = root / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths
