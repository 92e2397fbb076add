"""Test helpers for the executor service's tests (http_app_test, metrics_test,
task_executor_test, sessions_test, executor_restart_test): a valid submission body, an injected
scorer that tells the gold patch from the others, a config under the test's tmp_path, a live
server to run a scenario against, polling until a task ends, and the executor as a real process.
"""

import asyncio
import os
import pathlib
import select
import subprocess
import sys
import time

import aiohttp

from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task import ApplyMethod, TaskSpec, TestOutcome, Verdict

GOLD = "diff --git a/gold b/gold\n"
# Submissions are checked the way the pipeline will check them: the repo must exist here, the
# commit must look like one and the test patch must be a diff. The injected scorer uses none.
REPO = os.path.dirname(os.path.abspath(__file__))
TEST_PATCH = (
    "diff --git a/tests/t.py b/tests/t.py\n--- a/tests/t.py\n+++ b/tests/t.py\n"
    "@@ -1 +1,2 @@\n x = 1\n+y = 2\n"
)


def body(task_id=None, patch=GOLD, **overrides):
    data = {
        "instance_id": "demo__demo-1",
        "repo": REPO,
        "base_commit": "abc1234",
        "patch": patch,
        "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": ["tests/t.py::test_new"],
        "PASS_TO_PASS": ["tests/t.py::test_old"],
    }
    if task_id is not None:
        data["task_id"] = task_id
    data.update(overrides)
    return data


def verdict_for(spec: TaskSpec) -> Verdict:
    """Resolved exactly when the patch is GOLD: enough to tell tasks' verdicts apart."""
    resolved = spec.patch == GOLD
    outcome = TestOutcome.PASSED if resolved else TestOutcome.FAILED
    return Verdict(
        resolved=resolved,
        reward=float(resolved),
        fail_to_pass={t: outcome for t in spec.fail_to_pass},
        pass_to_pass={t: TestOutcome.PASSED for t in spec.pass_to_pass},
        apply_method=ApplyMethod.GIT_APPLY if spec.patch else ApplyMethod.EMPTY,
        integrity_violation=(),
        test_exit_code=0 if resolved else 1,
        timed_out=False,
        timings_s={"total": 0.01},
        log_tail="",
    )


def score(spec, work_root):
    return verdict_for(spec)


def make_config(tmp_path, **overrides) -> ExecutorConfig:
    values = dict(
        host="127.0.0.1",
        port=0,
        num_workers=2,
        work_dir=str(tmp_path / "work"),
        retry_backoff_s=0.0,
        shutdown_grace_s=5.0,
    )
    values.update(overrides)
    return ExecutorConfig(**values)


async def wait_done(http, url, task_id, headers=None, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(f"{url}/task/{task_id}", headers=headers) as response:
            assert response.status == 200
            data = await response.json()
        if data["status"] in ("finished", "infra_error"):
            return data
        assert time.monotonic() < deadline, f"task {task_id} still {data['status']}"
        await asyncio.sleep(0.02)


def serve_and(config, score_fn, scenario, image_stats=None):
    """Runs `scenario(http, server)` against a live server; returns what it returns."""

    async def main():
        async with running_server(config, score_fn, image_stats=image_stats) as server:
            async with aiohttp.ClientSession() as http:
                return await scenario(http, server)

    return asyncio.run(main())


def start_executor_process(
    work_dir: pathlib.Path, *extra_args: str
) -> tuple[subprocess.Popen, str]:
    """Starts `python -m dockyard_rl.sandbox.executor` (the Bazel binary's entry point) on a free
    port with one worker and `extra_args`; returns the process and its URL (from its stdout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("DOCKYARD_EXECUTOR_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "dockyard_rl.sandbox.executor", "--port", "0", "--workers", "1"]
        + ["--work-dir", str(work_dir), "--log-level", "WARNING", *extra_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if line.startswith("dockyard executor listening on "):
                return process, line.split()[-1]
            assert line, f"executor exited with {process.wait()} before listening"
    process.kill()
    raise AssertionError("executor did not report its address within 60 s")
