"""Executor throughput: tasks/minute at 1 vs 2 workers, and cached mirror vs a fresh clone per task.

    tools/bazel run //tests/benchmarks:sandbox_benchmark [-- --num-tasks 8 --num-commits 200]

Generates a git repository shaped like a small real project: a package with a few hundred
pytest tests (`--num-test-files` x `--tests-per-file`), `--num-commits` commits of history with
`--history-mib` of incompressible data spread over them (what a clone has to transfer), a bug, its
gold patch and a test_patch adding the FAIL_TO_PASS tests. Every task scores the gold patch and
runs the whole suite (PASS_TO_PASS = every existing test), through the real service: HTTP on
127.0.0.1, the async client, the real pipeline under bubblewrap.

Rows (each against the first, measured in the same run):
- cached mirror, 1 worker: the production path; the mirror is cloned once before timing.
- cached mirror, 2 workers: the same tasks with two workers.
- no integrity layers, 1 worker: the same checkout, apply and bubblewrap, but pytest runs
  directly on the host's worktree (no tree audit, no screening, no copy into the tmpfs, no
  runner: no audit hook, runner-object checks, streamed records or canaries) and its report is
  read from a file: what the hardening of the reward costs per task.
- fresh clone, 1 worker: every task gets a new, empty work root, so the pipeline clones the
  repository from scratch (what a cache-less executor would do).

Not a test: nothing is asserted beyond every verdict being `resolved` (a wrong figure from a
broken run would be worse than none).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from dockyard_rl.sandbox import apply as apply_lib
from dockyard_rl.sandbox import cleanup, evidence, grading, isolation, pipeline, repo_cache, runner
from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task import TaskSpec, TaskStatus, TestOutcome, Verdict
from dockyard_rl.sandbox.task_executor import pipeline_score_fn

_GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@localhost",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@localhost",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
}

_BUGGY = "def triangle(n):\n    return n * (n - 1) // 2\n"
_FIXED = "def triangle(n):\n    return n * (n + 1) // 2\n"


def _git(cwd: pathlib.Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=_GIT_ENV, check=True, capture_output=True, text=True
    ).stdout


def make_repo(
    path: pathlib.Path,
    *,
    num_test_files: int,
    tests_per_file: int,
    num_commits: int,
    history_mib: float,
    seed: int,
) -> dict:
    """Builds the benchmark repository; returns the fields of its task (without the patch)."""
    rng = random.Random(seed)
    path.mkdir(parents=True)
    _git(path, "init", "--quiet", "--initial-branch=main")
    (path / "shapes").mkdir()
    (path / "tests").mkdir()
    (path / "data").mkdir()
    (path / "shapes" / "__init__.py").write_text("")
    (path / "shapes" / "numbers.py").write_text(
        '"""Figurate numbers."""\n\n\ndef square(n):\n    return n * n\n\n\n' + _BUGGY
    )
    pass_to_pass = []
    for file_index in range(num_test_files):
        (path / "tests" / f"test_square_{file_index:02d}.py").write_text(
            "import pytest\n\nfrom shapes.numbers import square\n\n\n"
            f"@pytest.mark.parametrize('n', range({file_index * tests_per_file}, "
            f"{(file_index + 1) * tests_per_file}))\n"
            "def test_square(n):\n    assert square(n) == n ** 2\n"
        )
        pass_to_pass += [
            f"tests/test_square_{file_index:02d}.py::test_square[{n}]"
            for n in range(file_index * tests_per_file, (file_index + 1) * tests_per_file)
        ]
    _git(path, "add", "-A")
    _git(path, "commit", "--quiet", "-m", "initial")
    # History: each commit rewrites one data file with fresh random bytes, so every version is a
    # new blob the clone must transfer (random data does not delta-compress).
    blob_bytes = int(history_mib * (1 << 20) / max(1, num_commits))
    for commit_index in range(num_commits):
        (path / "data" / f"blob_{commit_index % 8}.bin").write_bytes(rng.randbytes(blob_bytes))
        _git(path, "add", "-A")
        _git(path, "commit", "--quiet", "-m", f"data {commit_index}")
    base_commit = _git(path, "rev-parse", "HEAD").strip()
    (path / "shapes" / "numbers.py").write_text(
        (path / "shapes" / "numbers.py").read_text().replace(_BUGGY, _FIXED)
    )
    (path / "tests" / "test_triangle.py").write_text(
        "import pytest\n\nfrom shapes.numbers import triangle\n\n\n"
        "@pytest.mark.parametrize('n, expected', [(1, 1), (2, 3), (4, 10)])\n"
        "def test_triangle(n, expected):\n    assert triangle(n) == expected\n"
    )
    _git(path, "add", "-A")
    _git(path, "commit", "--quiet", "-m", "fix triangle")
    fix_commit = _git(path, "rev-parse", "HEAD").strip()
    return {
        "repo": str(path),
        "base_commit": base_commit,
        "gold_patch": _git(path, "diff", base_commit, fix_commit, "--", "shapes"),
        "test_patch": _git(path, "diff", base_commit, fix_commit, "--", "tests"),
        "fail_to_pass": tuple(
            f"tests/test_triangle.py::test_triangle[{n}-{e}]" for n, e in ((1, 1), (2, 3), (4, 10))
        ),
        "pass_to_pass": tuple(pass_to_pass),
    }


def make_spec(task: dict, task_id: str) -> TaskSpec:
    # The whole suite, not only the files test_patch touches: PASS_TO_PASS spans every file.
    return TaskSpec(
        instance_id="bench__shapes-1",
        repo=task["repo"],
        base_commit=task["base_commit"],
        patch=task["gold_patch"],
        test_patch=task["test_patch"],
        fail_to_pass=task["fail_to_pass"],
        pass_to_pass=task["pass_to_pass"],
        test_command=f"{sys.executable} -m pytest -p no:cacheprovider -q tests",
        timeout_s=600,
        task_id=task_id,
    )


def fresh_clone_score_fn(config: ExecutorConfig, scratch: pathlib.Path):
    """The real pipeline, but with a new empty work root per task: every task clones anew."""
    score = pipeline_score_fn(config.pipeline)

    def fresh_clone_score(spec, work_root):
        fresh_root = pathlib.Path(tempfile.mkdtemp(prefix="fresh-", dir=scratch))
        try:
            return score(spec, fresh_root)
        finally:
            shutil.rmtree(fresh_root, ignore_errors=True)

    return fresh_clone_score


def unhardened_score_fn(config: ExecutorConfig):
    """The pipeline's steps without the integrity layers (module docstring, third row)."""

    def score(spec: TaskSpec, work_root: pathlib.Path) -> Verdict:
        start = time.monotonic()
        task_dir = pathlib.Path(tempfile.mkdtemp(prefix="task-", dir=work_root))
        try:
            worktree, scratch = task_dir / "repo", task_dir / "scratch"
            scratch.mkdir()
            cache = repo_cache.RepoCache(config.pipeline.cache_path(pathlib.Path(work_root)))
            cache.checkout(spec.repo, spec.base_commit, worktree)
            checkout_s = time.monotonic() - start
            applied = apply_lib.apply_patch(worktree, spec.patch, scratch)
            (scratch / "test.patch").write_text(spec.test_patch)
            apply_lib.git(worktree, "apply", str(scratch / "test.patch"))
            report = scratch / "junit.xml"
            tests_start = time.monotonic()
            args = (
                runner.pytest_arguments(spec.test_command)
                or pipeline.test_files_of(spec.test_patch)[1]
            )
            result = isolation.run_sandboxed(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    f"--junitxml={report}",
                    "-o",
                    "junit_family=xunit1",
                    *args,
                ],
                writable_dirs=[worktree, scratch],
                limits=config.pipeline.limits(None),
                cwd=worktree,
                readonly_paths=runner.interpreter_paths(),
                env={
                    "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
                    "HOME": "/tmp",
                    "LANG": "C.UTF-8",
                },
            )
            tests_s = time.monotonic() - tests_start
            junit = evidence.JUnitStream(64 << 20, 1_000_000)
            junit(report.read_bytes())
            junit.finish()
            outcomes = {
                test_id: junit.outcomes.get(grading.junit_key(test_id), TestOutcome.MISSING)
                for test_id in (*spec.fail_to_pass, *spec.pass_to_pass)
            }
            resolved = result.exit_code == 0 and set(outcomes.values()) == {TestOutcome.PASSED}
            return Verdict(
                resolved=resolved,
                reward=float(resolved),
                fail_to_pass={t: outcomes[t] for t in spec.fail_to_pass},
                pass_to_pass={t: outcomes[t] for t in spec.pass_to_pass},
                apply_method=applied.method,
                integrity_violation=(),
                test_exit_code=result.exit_code,
                timed_out=result.timed_out,
                timings_s={
                    "checkout": checkout_s,
                    "tests": tests_s,
                    "total": time.monotonic() - start,
                },
                log_tail=result.output,
            )
        finally:
            cleanup.remove_tree(task_dir)

    return score


async def run_row(
    name: str,
    task: dict,
    work_dir: pathlib.Path,
    num_workers: int,
    num_tasks: int,
    fresh_clone: bool,
    hardened: bool = True,
) -> dict:
    config = ExecutorConfig(port=0, num_workers=num_workers, work_dir=str(work_dir))
    score_fn = None if hardened else unhardened_score_fn(config)
    if fresh_clone:
        scratch = work_dir / "fresh"
        scratch.mkdir(parents=True, exist_ok=True)
        score_fn = fresh_clone_score_fn(config, scratch)
    async with running_server(config, score_fn) as server:
        async with ExecutorClient(server.url, seed=0) as client:
            if not fresh_clone:  # warm the mirror cache outside the timed part
                warm = await client.score(make_spec(task, f"{name}-warm"), poll_interval_s=0.1)
                assert warm.status is TaskStatus.FINISHED and warm.verdict.resolved, warm
            started = time.monotonic()
            ids = await asyncio.gather(
                *(client.submit(make_spec(task, f"{name}-{index}")) for index in range(num_tasks))
            )
            results = await asyncio.gather(
                *(client.wait(task_id, poll_interval_s=0.1) for task_id in ids)
            )
            elapsed_s = time.monotonic() - started
    for result in results:
        if result.status is not TaskStatus.FINISHED or not result.verdict.resolved:
            raise RuntimeError(f"{name}: task {result.task_id} not resolved: {result}")
    timings = [result.verdict.timings_s for result in results]
    return {
        "name": name,
        "workers": num_workers,
        "tasks": num_tasks,
        "elapsed_s": elapsed_s,
        "tasks_per_min": 60.0 * num_tasks / elapsed_s,
        "checkout_s": statistics.mean(t["checkout"] for t in timings),
        "tests_s": statistics.mean(t["tests"] for t in timings),
        "task_s": statistics.mean(t["total"] for t in timings),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tasks", type=int, default=8, help="timed tasks per row")
    parser.add_argument("--num-test-files", type=int, default=10)
    parser.add_argument("--tests-per-file", type=int, default=30)
    parser.add_argument("--num-commits", type=int, default=200)
    parser.add_argument(
        "--history-mib",
        type=float,
        default=32.0,
        help="incompressible data spread over the history",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    root = pathlib.Path(tempfile.mkdtemp(prefix="sandbox-benchmark-"))
    try:
        started = time.monotonic()
        task = make_repo(
            root / "repo",
            num_test_files=args.num_test_files,
            tests_per_file=args.tests_per_file,
            num_commits=args.num_commits,
            history_mib=args.history_mib,
            seed=args.seed,
        )
        repo_mib = sum(
            f.stat().st_size for f in (root / "repo" / ".git").rglob("*") if f.is_file()
        ) / (1 << 20)
        print(
            f"repository: {len(task['pass_to_pass']) + len(task['fail_to_pass'])} tests, "
            f"{args.num_commits + 2} commits, .git {repo_mib:.1f} MiB "
            f"(built in {time.monotonic() - started:.1f} s)",
            flush=True,
        )
        rows = []
        for name, num_workers, fresh_clone, hardened in (
            ("cached mirror", 1, False, True),
            ("cached mirror", 2, False, True),
            ("no integrity", 1, False, False),
            ("fresh clone", 1, True, True),
        ):
            work_dir = root / f"work-{len(rows)}"
            rows.append(
                asyncio.run(
                    run_row(
                        name.replace(" ", "-"),
                        task,
                        work_dir,
                        num_workers,
                        args.num_tasks,
                        fresh_clone,
                        hardened,
                    )
                )
            )
            rows[-1]["name"] = name
            print(f"  done: {name}, {num_workers} worker(s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    baseline = rows[0]["tasks_per_min"]
    header = (
        f"{'path':<15} {'workers':>7} {'tasks':>5} {'elapsed s':>9} {'tasks/min':>9} "
        f"{'vs row 1':>8} {'s/task':>7} {'checkout s':>10} {'tests s':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['name']:<15} {row['workers']:>7} {row['tasks']:>5} {row['elapsed_s']:>9.1f} "
            f"{row['tasks_per_min']:>9.1f} {row['tasks_per_min'] / baseline:>7.2f}x "
            f"{row['task_s']:>7.2f} {row['checkout_s']:>10.3f} {row['tests_s']:>8.2f}"
        )
    hardened, plain = rows[0]["task_s"], rows[2]["task_s"]
    print(
        f"integrity layers: {hardened:.2f} s/task vs {plain:.2f} s/task without "
        f"({hardened / plain:.2f}x); {rows[1]['tasks_per_min']:.1f} tasks/min at 2 workers"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
