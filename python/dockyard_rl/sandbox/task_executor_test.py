"""Tests of the task executor's worker pool: retries of infrastructure errors only, what the
scorer is given, and graceful shutdown (re-queueing a task running past the grace; a restart
finishing it). Driven over real HTTP on 127.0.0.1 or directly; the scoring function is injected.
"""

import dataclasses
import threading
import time

import pytest

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.store import TaskStore
from dockyard_rl.sandbox.task import TaskSpec, TaskStatus
from dockyard_rl.sandbox.task_executor import ShuttingDownError, TaskExecutor
from dockyard_rl.sandbox.testing_executor import (
    GOLD,
    body,
    make_config,
    score,
    serve_and,
    verdict_for,
    wait_done,
)


def test_only_infrastructure_errors_are_retried(tmp_path):
    calls = {}
    lock = threading.Lock()

    def scorer(spec, work_root):
        with lock:
            calls[spec.task_id] = calls.get(spec.task_id, 0) + 1
            num_calls = calls[spec.task_id]
        if spec.task_id == "infra-twice" and num_calls <= 2:
            raise pipeline.InfrastructureError(f"bwrap failed to start ({num_calls})")
        if spec.task_id == "infra-always":
            raise pipeline.InfrastructureError("git clone: repository not found")
        if spec.task_id == "bug":
            raise KeyError("a bug in scoring")
        if spec.task_id == "invalid":
            raise ValueError("test_patch: does not apply at base_commit abc1234")
        return verdict_for(spec)

    config = make_config(tmp_path, max_infra_attempts=3)

    async def scenario(http, server):
        ids = {
            "infra-twice": GOLD,
            "infra-always": GOLD,
            "bug": GOLD,
            "invalid": GOLD,
            "tests-fail": "",
        }
        for task_id, patch in ids.items():
            async with http.post(
                f"{server.url}/task/submit", json=body(task_id, patch=patch)
            ) as response:
                assert response.status == 202
        return {task_id: await wait_done(http, server.url, task_id) for task_id in ids}

    results = serve_and(config, scorer, scenario)
    assert results["infra-twice"]["status"] == "finished"
    assert results["infra-twice"]["attempts"] == 3 and calls["infra-twice"] == 3
    assert results["infra-twice"]["verdict"]["resolved"] is True
    assert "bwrap failed to start (2)" in results["infra-twice"]["error"]  # last error kept
    assert results["infra-always"]["status"] == "infra_error"
    assert calls["infra-always"] == 3 and "repository not found" in results["infra-always"]["error"]
    assert results["bug"]["status"] == "infra_error" and calls["bug"] == 1
    assert results["bug"]["error"].startswith("internal error: KeyError")
    # The pipeline's ValueError = a task that can never be scored: reported once, not retried.
    assert results["invalid"]["status"] == "infra_error" and calls["invalid"] == 1
    assert results["invalid"]["error"] == (
        "invalid task: test_patch: does not apply at base_commit abc1234"
    )
    # A patch whose tests fail is a verdict: scored once, never retried.
    assert results["tests-fail"]["status"] == "finished" and calls["tests-fail"] == 1
    assert results["tests-fail"]["verdict"]["resolved"] is False


def test_scorer_gets_the_stored_spec_and_the_work_root(tmp_path):
    seen = []

    def scorer(spec, work_root):
        seen.append((spec, work_root))
        return verdict_for(spec)

    config = make_config(tmp_path)

    async def scenario(http, server):
        for task_id, extra in (("default", {}), ("own", {"timeout_s": 5})):
            async with http.post(f"{server.url}/task/submit", json=body(task_id, **extra)):
                pass
            await wait_done(http, server.url, task_id)

    serve_and(config, scorer, scenario)
    assert [(spec.task_id, spec.timeout_s, root) for spec, root in seen] == [
        ("default", None, config.work_path),
        ("own", 5.0, config.work_path),
    ]
    # None: the pipeline applies its own default (config.pipeline.timeout_s).
    assert seen[0][0] == TaskSpec.from_request(body("default"))


def test_shutdown_requeues_a_task_running_past_the_grace_and_restart_finishes_it(tmp_path):
    release = threading.Event()

    def slow_score(spec, work_root):
        release.wait(timeout=30)
        return verdict_for(spec)

    config = make_config(tmp_path, num_workers=1, shutdown_grace_s=0.2)
    executor = TaskExecutor(config, slow_score)
    executor.start()
    spec = TaskSpec.from_request(body("slow"))
    executor.submit(spec)
    executor.submit(dataclasses.replace(spec, task_id="behind"))
    while executor.counts()[TaskStatus.RUNNING] != 1:
        time.sleep(0.01)
    executor.stop()
    with pytest.raises(ShuttingDownError):
        executor.submit(dataclasses.replace(spec, task_id="late"))
    release.set()

    store = TaskStore(config.db_file)
    slow = store.get("slow")
    assert slow.status is TaskStatus.QUEUED and slow.attempts == 0  # the attempt was given back
    assert store.get("behind").status is TaskStatus.QUEUED
    store.close()

    restarted = TaskExecutor(config, score)
    report = restarted.start()
    assert report.requeued == ("slow", "behind")
    deadline = time.monotonic() + 10
    while restarted.counts()[TaskStatus.FINISHED] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert restarted.get("slow").verdict.resolved and restarted.get("slow").attempts == 1
    restarted.stop()
    restarted.stop()  # safe to repeat


def test_shutdown_starts_no_queued_task_and_lets_the_running_one_finish(tmp_path):
    scored = []

    def short_score(spec, work_root):
        time.sleep(0.3)
        scored.append(spec.task_id)
        return verdict_for(spec)

    config = make_config(tmp_path, num_workers=1, shutdown_grace_s=10.0)
    executor = TaskExecutor(config, short_score)
    executor.start()
    spec = TaskSpec.from_request(body("running"))
    for task_id in ("running", "queued-1", "queued-2"):
        executor.submit(dataclasses.replace(spec, task_id=task_id))
    while executor.counts()[TaskStatus.RUNNING] != 1:
        time.sleep(0.01)
    started = time.monotonic()
    executor.stop()
    assert time.monotonic() - started < 5.0  # did not run the queued tasks within the grace
    assert scored == ["running"]
    store = TaskStore(config.db_file)
    assert store.get("running").status is TaskStatus.FINISHED
    assert [store.get(t).status for t in ("queued-1", "queued-2")] == [TaskStatus.QUEUED] * 2
    store.close()
