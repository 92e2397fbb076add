"""What the reward-integrity layers cost per task: `pipeline.score_task` with and without them,
on the same tasks, alternating, in one run.

    tools/bazel run //tests/benchmarks:integrity_overhead_benchmark [-- --repeats 7]

The layers measured (docs/sandbox.md, "Test code protected while the tests run"): the read-only
mounts of the test files, their digests and the runner's verification of the test code (at
import, around each test, after the run), the runner's up-front imports and pinned bytecode
cache, and the AST capability screen of the changed files. "Without" turns exactly these off (by
replacing the three functions that provide them, in this process only); everything else of
scoring (checkout, integrity, apply, tree audit, sandbox, grading) runs in both. Tasks: the toy
repository's gold and wrong patches (3 test files), and a repository whose whole 20-file suite
is the task's tests (1,000 tests, all 20 files protected and verified). Prints the median
seconds per task and the ratio with/without (the issue's target: at most 1.3x).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from dockyard_rl.sandbox import capability_screen, pipeline, runner
from dockyard_rl.sandbox.pipeline import PipelineConfig
from dockyard_rl.sandbox.task import TaskSpec
from dockyard_rl.sandbox.testing_repos import make_toy_repo

_NUM_FILES, _TESTS_PER_FILE = 20, 50


def _git(cwd: pathlib.Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True
    ).stdout


def wide_task(root: pathlib.Path) -> TaskSpec:
    """A repository with 20 test files of 50 tests each; the gold patch fixes `cube` and the
    test patch adds its test to every file, so every file is protected and verified."""
    root.mkdir(parents=True)
    _git(root, "init", "--quiet", "--initial-branch=main")
    (root / "shapes").mkdir()
    (root / "tests").mkdir()
    (root / "shapes" / "__init__.py").write_text("")
    (root / "shapes" / "numbers.py").write_text(
        "def square(n):\n    return n * n\n\n\ndef cube(n):\n    return n * n\n"
    )
    for index in range(_NUM_FILES):
        (root / "tests" / f"test_shapes_{index:02d}.py").write_text(
            "import pytest\n\nfrom shapes.numbers import cube, square\n\n\n"
            f"@pytest.mark.parametrize('n', range({_TESTS_PER_FILE}))\n"
            "def test_square(n):\n    assert square(n) == n ** 2\n"
        )
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=b", "-c", "user.email=b@b", "commit", "--quiet", "-m", "base")
    base = _git(root, "rev-parse", "HEAD").strip()
    (root / "shapes" / "numbers.py").write_text(
        "def square(n):\n    return n * n\n\n\ndef cube(n):\n    return n * n * n\n"
    )
    fail_to_pass = []
    for index in range(_NUM_FILES):
        path = root / "tests" / f"test_shapes_{index:02d}.py"
        path.write_text(path.read_text() + "\n\ndef test_cube():\n    assert cube(3) == 27\n")
        fail_to_pass.append(f"tests/test_shapes_{index:02d}.py::test_cube")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=b", "-c", "user.email=b@b", "commit", "--quiet", "-m", "fix")
    fix = _git(root, "rev-parse", "HEAD").strip()
    return TaskSpec(
        instance_id="bench__shapes-wide",
        repo=str(root),
        base_commit=base,
        patch=_git(root, "diff", base, fix, "--", "shapes"),
        test_patch=_git(root, "diff", base, fix, "--", "tests"),
        fail_to_pass=tuple(fail_to_pass),
        pass_to_pass=tuple(
            f"tests/test_shapes_{i:02d}.py::test_square[{n}]"
            for i in range(_NUM_FILES)
            for n in range(_TESTS_PER_FILE)
        ),
        timeout_s=600,
    )


class LayersOff:
    """Within the `with` block, scoring runs without the layers this benchmark measures."""

    def __enter__(self):
        self.saved = (
            runner.protected_test_files,
            runner.run_pytest,
            capability_screen.screen_tree,
        )
        runner.protected_test_files = lambda worktree, files: ([], {})
        runner.run_pytest = functools.partial(self.saved[1], protect_test_code=False)
        capability_screen.screen_tree = lambda *args, **kwargs: ()
        return self

    def __exit__(self, *exc):
        (
            runner.protected_test_files,
            runner.run_pytest,
            capability_screen.screen_tree,
        ) = self.saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="scorings per task and setting")
    args = parser.parse_args(argv)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="integrity-bench-"))
    toy = make_toy_repo(scratch / "toy")
    tasks = {
        "toy gold": toy.spec(toy.gold_patch),
        "toy wrong": toy.spec(toy.wrong_patch),
        "wide gold (1,020 tests)": wide_task(scratch / "wide"),
    }
    config = PipelineConfig(timeout_s=600)
    work_root = scratch / "work"
    rows = []
    for name, spec in tasks.items():
        pipeline.score_task(spec, config, work_root)  # warm: mirror, page cache
        seconds: dict[bool, list[float]] = {True: [], False: []}
        resolved: dict[bool, set[bool]] = {True: set(), False: set()}
        for _ in range(args.repeats):
            for layers in (True, False):
                start = time.perf_counter()
                if layers:
                    verdict = pipeline.score_task(spec, config, work_root)
                else:
                    with LayersOff():
                        verdict = pipeline.score_task(spec, config, work_root)
                seconds[layers].append(time.perf_counter() - start)
                resolved[layers].add(verdict.resolved)
        if resolved[True] != resolved[False]:
            print(f"{name}: verdicts differ with and without the layers: {resolved}")
            return 1
        with_s, without_s = statistics.median(seconds[True]), statistics.median(seconds[False])
        rows.append((name, without_s, with_s, with_s / without_s))
    print(f"{'task':<26} {'without (s)':>12} {'with (s)':>10} {'ratio':>7}")
    for name, without_s, with_s, ratio in rows:
        print(f"{name:<26} {without_s:>12.3f} {with_s:>10.3f} {ratio:>6.2f}x")
    print(f"median of {args.repeats} scorings each, alternating; python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
