"""Tests of the executor service over real HTTP on 127.0.0.1 (an ephemeral port).

The scoring function is injected (the service's documented seam), so these tests pin down the
service itself: every status code, idempotency, the bearer token, retries of infrastructure errors
only, metrics (parsed with prometheus_client), graceful shutdown. Scoring real repositories is
covered by service_load_test.py.
"""

import asyncio
import dataclasses
import json
import os
import threading
import time

import aiohttp
import prometheus_client
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.service import (ShuttingDownError, TaskExecutor, create_app,
                                         running_server)
from dockyard_rl.sandbox.store import TaskStore
from dockyard_rl.sandbox.task import (ApplyMethod, FailureKind, TaskSpec, TaskStatus,
                                      TestOutcome, Verdict)

TOKEN = "s3cret-token-0123456789"
GOLD = "diff --git a/gold b/gold\n"
# Submissions are checked the way the pipeline will check them: the repo must exist here, the
# commit must look like one and the test patch must be a diff. The injected scorer uses none.
REPO = os.path.dirname(os.path.abspath(__file__))
TEST_PATCH = ("diff --git a/tests/t.py b/tests/t.py\n--- a/tests/t.py\n+++ b/tests/t.py\n"
              "@@ -1 +1,2 @@\n x = 1\n+y = 2\n")


def body(task_id=None, patch=GOLD, **overrides):
    data = {"instance_id": "demo__demo-1", "repo": REPO, "base_commit": "abc1234",
            "patch": patch, "test_patch": TEST_PATCH,
            "FAIL_TO_PASS": ["tests/t.py::test_new"], "PASS_TO_PASS": ["tests/t.py::test_old"]}
    if task_id is not None:
        data["task_id"] = task_id
    data.update(overrides)
    return data


def verdict_for(spec: TaskSpec) -> Verdict:
    """Resolved exactly when the patch is GOLD: enough to tell tasks' verdicts apart."""
    resolved = spec.patch == GOLD
    outcome = TestOutcome.PASSED if resolved else TestOutcome.FAILED
    return Verdict(resolved=resolved, reward=float(resolved),
                   fail_to_pass={t: outcome for t in spec.fail_to_pass},
                   pass_to_pass={t: TestOutcome.PASSED for t in spec.pass_to_pass},
                   apply_method=ApplyMethod.GIT_APPLY if spec.patch else ApplyMethod.EMPTY,
                   integrity_violation=(), test_exit_code=0 if resolved else 1, timed_out=False,
                   timings_s={"total": 0.01}, log_tail="")


def score(spec, work_root):
    return verdict_for(spec)


def make_config(tmp_path, **overrides) -> ExecutorConfig:
    values = dict(host="127.0.0.1", port=0, num_workers=2, work_dir=str(tmp_path / "work"),
                  retry_backoff_s=0.0, shutdown_grace_s=5.0)
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


def test_submit_then_get_returns_the_verdict(tmp_path):
    async def scenario(http, server):
        async with http.post(f"{server.url}/task/submit", json=body("gold-1")) as response:
            assert response.status == 202
            assert await response.json() == {"task_id": "gold-1", "status": "queued"}
        async with http.post(f"{server.url}/task/submit", json=body(patch="")) as response:
            assert response.status == 202
            generated = (await response.json())["task_id"]
        gold = await wait_done(http, server.url, "gold-1")
        empty = await wait_done(http, server.url, generated)
        return gold, empty, generated

    gold, empty, generated = serve_and(make_config(tmp_path), score, scenario)
    assert len(generated) == 32  # a uuid4 hex when the client sends no task_id
    assert gold["status"] == "finished" and gold["attempts"] == 1 and gold["error"] is None
    assert gold["instance_id"] == "demo__demo-1"
    assert gold["verdict"]["resolved"] is True and gold["verdict"]["reward"] == 1.0
    assert gold["verdict"]["fail_to_pass"] == {"tests/t.py::test_new": "passed"}
    assert gold["finished_at"] >= gold["started_at"] >= gold["submitted_at"]
    assert empty["verdict"]["resolved"] is False and empty["verdict"]["apply_method"] == "empty"


def test_idempotent_resubmission_and_conflict(tmp_path):
    async def scenario(http, server):
        statuses = []
        for data in (body("same"), body("same"), body("same", patch="")):
            async with http.post(f"{server.url}/task/submit", json=data) as response:
                statuses.append((response.status, await response.json()))
        await wait_done(http, server.url, "same")
        # Resubmitting after it finished still answers the same task, not a new run.
        async with http.post(f"{server.url}/task/submit", json=body("same")) as response:
            statuses.append((response.status, await response.json()))
        return statuses, server.executor.all_records()

    statuses, records = serve_and(make_config(tmp_path), score, scenario)
    assert statuses[0][0] == 202 and statuses[1][0] == 200
    assert statuses[1][1]["task_id"] == "same"
    assert statuses[2][0] == 409 and statuses[2][1]["field"] == "task_id"
    assert statuses[3] == (200, {"task_id": "same", "status": "finished"})
    assert [r.task_id for r in records] == ["same"] and records[0].attempts == 1


def with_changes(**changes):
    """A valid body with fields replaced (None deletes the field), as JSON bytes."""
    data = body("ok-id")
    for name, value in changes.items():
        if value is None:
            del data[name]
        else:
            data[name] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize("payload, field", [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    (b'{"instance_id": "x"}', "repo"),
    (with_changes(repo=None), "repo"),
    (with_changes(repo="ssh://git@example.com/x.git"), "repo"),  # a scheme the pipeline refuses
    (with_changes(repo="/no/such/repository"), "repo"),
    (with_changes(base_commit="HEAD~1"), "base_commit"),
    (with_changes(test_patch="not a diff at all"), "test_patch"),
    (with_changes(FAIL_TO_PASS="not a json list"), "FAIL_TO_PASS"),
    (with_changes(task_id="../../etc/passwd"), "task_id"),
    (with_changes(reward_mode="best_effort"), "reward_mode"),
    (with_changes(timeout_s=-1), "timeout_s"),
])
def test_malformed_submissions_are_400_naming_the_field(tmp_path, payload, field):
    async def scenario(http, server):
        async with http.post(f"{server.url}/task/submit", data=payload,
                             headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.json(), server.executor.all_records()

    status, data, records = serve_and(make_config(tmp_path), score, scenario)
    assert status == 400
    assert data["field"] == field and data["error"].startswith(f"{field}: ")
    assert records == []


def test_oversized_patch_is_413(tmp_path):
    config = make_config(tmp_path, max_patch_bytes=1000)

    async def scenario(http, server):
        results = []
        for data in (body("big", patch="+" * 1001), body("big-test", test_patch="+" * 1001),
                     body("ok", patch="+" * 1000)):
            async with http.post(f"{server.url}/task/submit", json=data) as response:
                results.append((response.status, await response.json()))
        # A body beyond twice the patch limit plus overhead is refused before parsing.
        async with http.post(f"{server.url}/task/submit", data=b"x" * (3 << 20)) as response:
            results.append((response.status, await response.json()))
        return results

    results = serve_and(config, score, scenario)
    assert results[0][0] == 413 and results[0][1]["field"] == "patch"
    assert "1001 bytes exceeds max_patch_bytes = 1000" in results[0][1]["error"]
    assert results[1][0] == 413 and results[1][1]["field"] == "test_patch"
    assert results[2][0] == 202
    assert results[3][0] == 413 and results[3][1]["field"] == "body"


def test_unknown_task_is_404(tmp_path):
    async def scenario(http, server):
        async with http.get(f"{server.url}/task/never-submitted") as response:
            return response.status, await response.json()

    status, data = serve_and(make_config(tmp_path), score, scenario)
    assert status == 404 and data["field"] == "task_id" and "never-submitted" in data["error"]


def test_queue_full_is_429_with_retry_after(tmp_path):
    release = threading.Event()

    def blocking_score(spec, work_root):
        assert release.wait(timeout=30)
        return verdict_for(spec)

    config = make_config(tmp_path, num_workers=1, max_queue=2, retry_after_s=7)

    async def scenario(http, server):
        async with http.post(f"{server.url}/task/submit", json=body("first")) as response:
            assert response.status == 202
        while server.executor.counts()[TaskStatus.RUNNING] != 1:  # the worker took it
            await asyncio.sleep(0.01)
        codes = []
        for task_id in ("q1", "q2", "q3"):
            async with http.post(f"{server.url}/task/submit", json=body(task_id)) as response:
                codes.append((response.status, response.headers.get("Retry-After")))
        # Resubmitting an accepted id while full is still answered: it needs no new room.
        async with http.post(f"{server.url}/task/submit", json=body("q1")) as response:
            codes.append((response.status, None))
        release.set()
        for task_id in ("first", "q1", "q2"):
            assert (await wait_done(http, server.url, task_id))["status"] == "finished"
        async with http.post(f"{server.url}/task/submit", json=body("q3")) as response:
            codes.append((response.status, None))
        return codes

    codes = serve_and(config, blocking_score, scenario)
    assert codes == [(202, None), (202, None), (429, "7"), (200, None), (202, None)]


def test_bearer_token(tmp_path):
    config = make_config(tmp_path, auth_token=TOKEN)

    async def scenario(http, server):
        results = {}
        for name, headers in (("missing", {}), ("wrong", {"Authorization": "Bearer nope"}),
                              ("scheme", {"Authorization": TOKEN}),
                              ("right", {"Authorization": f"Bearer {TOKEN}"})):
            async with http.post(f"{server.url}/task/submit", json=body(f"auth-{name}"),
                                 headers=headers) as response:
                results[name] = (response.status, response.headers.get("WWW-Authenticate"))
            async with http.get(f"{server.url}/task/auth-right", headers=headers) as response:
                results[f"get-{name}"] = response.status
        for path in ("/healthz", "/metrics"):
            async with http.get(server.url + path) as response:
                results[path] = response.status
        return results

    results = serve_and(config, score, scenario)
    for name in ("missing", "wrong", "scheme"):
        assert results[name] == (401, 'Bearer realm="executor"')
        assert results[f"get-{name}"] == 401
    assert results["right"][0] == 202 and results["get-right"] == 200
    assert results["/healthz"] == 200 and results["/metrics"] == 200


def test_healthz_and_metrics_parse(tmp_path):
    def flaky_once_score(spec, work_root):
        if spec.task_id == "flaky" and not (tmp_path / "flaked").exists():
            (tmp_path / "flaked").touch()
            raise pipeline.InfrastructureError("mirror fetch failed")
        if spec.task_id == "broken":
            raise pipeline.InfrastructureError("disk full")
        return verdict_for(spec)

    config = make_config(tmp_path, max_infra_attempts=2)

    async def scenario(http, server):
        async with http.get(f"{server.url}/healthz") as response:
            health = (response.status, await response.json())
        for task_id, patch in (("good", GOLD), ("bad", ""), ("flaky", GOLD), ("broken", GOLD)):
            async with http.post(f"{server.url}/task/submit",
                                 json=body(task_id, patch=patch)) as response:
                assert response.status == 202
        async with http.post(f"{server.url}/task/submit", data=b"{") as response:
            assert response.status == 400
        for task_id in ("good", "bad", "flaky", "broken"):
            await wait_done(http, server.url, task_id)
        return health, await scrape(http, server.url)

    health, (families, samples) = serve_and(config, flaky_once_score, scenario)
    assert health == (200, {"status": "ok", "workers": 2, "workers_alive": 2, "queue_depth": 0,
                            "running": 0})
    assert families["dockyard_executor_task_duration_seconds"].type == "histogram"
    assert samples[("dockyard_executor_queue_depth", ())] == 0
    assert samples[("dockyard_executor_running_tasks", ())] == 0
    completed = "dockyard_executor_tasks_completed_total"
    assert samples[(completed, (("outcome", "resolved"),))] == 2      # good, flaky
    assert samples[(completed, (("outcome", "unresolved"),))] == 1    # bad
    assert samples[(completed, (("outcome", "infra_error"),))] == 1   # broken
    assert samples[("dockyard_executor_task_retries_total", ())] == 2  # flaky once, broken once
    rejected = "dockyard_executor_submissions_rejected_total"
    assert samples[(rejected, (("reason", "invalid"),))] == 1
    assert samples[(rejected, (("reason", "queue_full"),))] == 0  # every reason, from 0
    assert samples[("dockyard_executor_task_duration_seconds_count", ())] == 4
    assert samples[("dockyard_executor_task_duration_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("dockyard_executor_workers", ())] == 2
    assert samples[("dockyard_executor_workers_alive", ())] == 2
    # No image_stats given: no image cache metrics.
    assert not [name for name in families if "image_cache" in name]


async def scrape(http, url):
    """GET /metrics parsed: ({family name: family}, {(sample name, sorted labels): value})."""
    async with http.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == prometheus_client.CONTENT_TYPE_LATEST
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in families.values() for sample in family.samples}
    return families, samples


def test_metrics_by_outcome_failure_kind_stage_and_image_cache(tmp_path):
    release = threading.Event()
    phases = {"checkout": 0.2, "apply": 0.02, "tests": 3.0, "total": 3.3}

    def scorer(spec, work_root):
        if spec.task_id == "infra":
            raise pipeline.InfrastructureError("bwrap failed to start")
        if spec.task_id == "blocker":
            assert release.wait(timeout=30)
        verdict = dataclasses.replace(verdict_for(spec), timings_s=dict(phases))
        if not verdict.resolved:
            verdict = dataclasses.replace(verdict, failure_kind=FailureKind.TESTS_FAILED,
                                          failure_detail="tests/t.py::test_new failed")
        return verdict

    # Changed between scrapes: the figures must be read at scrape time.
    image_figures = {"hits": 5, "misses": 2, "evictions": 1, "bytes": 3 << 30, "images": 2}
    config = make_config(tmp_path, num_workers=1, max_infra_attempts=1)

    async def scenario(http, server):
        async def submit(task_id, patch=GOLD):
            async with http.post(f"{server.url}/task/submit",
                                 json=body(task_id, patch=patch)) as response:
                assert response.status == 202

        # The one worker holds "blocker" while "waiting" stays in the queue.
        await submit("blocker")
        while server.executor.counts()[TaskStatus.RUNNING] != 1:
            await asyncio.sleep(0.01)
        await submit("waiting")
        busy = await scrape(http, server.url)
        release.set()
        await submit("unresolved", patch="")
        await submit("infra")
        for task_id in ("blocker", "waiting", "unresolved", "infra"):
            await wait_done(http, server.url, task_id)
        image_figures.update(hits=9, bytes=1 << 30, images=1)
        return busy, await scrape(http, server.url)

    (_, busy), (families, samples) = serve_and(config, scorer, scenario,
                                               image_stats=lambda: dict(image_figures))
    assert busy[("dockyard_executor_queue_depth", ())] == 1
    assert busy[("dockyard_executor_running_tasks", ())] == 1
    assert busy[("dockyard_executor_tasks", (("status", "queued"),))] == 1
    assert busy[("dockyard_executor_tasks", (("status", "running"),))] == 1
    assert busy[("dockyard_executor_image_cache_hits_total", ())] == 5

    assert samples[("dockyard_executor_queue_depth", ())] == 0
    assert samples[("dockyard_executor_running_tasks", ())] == 0
    assert samples[("dockyard_executor_tasks", (("status", "finished"),))] == 3
    assert samples[("dockyard_executor_tasks", (("status", "infra_error"),))] == 1
    completed = "dockyard_executor_tasks_completed_total"
    assert samples[(completed, (("outcome", "resolved"),))] == 2      # blocker, waiting
    assert samples[(completed, (("outcome", "unresolved"),))] == 1
    assert samples[(completed, (("outcome", "infra_error"),))] == 1
    verdicts = "dockyard_executor_verdicts_total"
    assert samples[(verdicts, (("failure_kind", "none"),))] == 2
    assert samples[(verdicts, (("failure_kind", "tests_failed"),))] == 1
    assert samples[(verdicts, (("failure_kind", "timeout"),))] == 0   # every kind, from 0
    assert samples[("dockyard_executor_task_duration_seconds_count", ())] == 4
    # One observation per phase of each of the three verdicts (an infra error has none).
    assert families["dockyard_executor_stage_duration_seconds"].type == "histogram"
    for phase, seconds in phases.items():
        labels = (("phase", phase),)
        assert samples[("dockyard_executor_stage_duration_seconds_count", labels)] == 3
        assert samples[("dockyard_executor_stage_duration_seconds_sum", labels)] == \
            pytest.approx(3 * seconds)
    assert samples[("dockyard_executor_stage_duration_seconds_bucket",
                    (("le", "0.25"), ("phase", "checkout")))] == 3
    assert samples[("dockyard_executor_stage_duration_seconds_bucket",
                    (("le", "2.5"), ("phase", "tests")))] == 0
    assert families["dockyard_executor_image_cache_hits"].type == "counter"
    assert families["dockyard_executor_image_cache_bytes"].type == "gauge"
    assert samples[("dockyard_executor_image_cache_hits_total", ())] == 9
    assert samples[("dockyard_executor_image_cache_misses_total", ())] == 2
    assert samples[("dockyard_executor_image_cache_evictions_total", ())] == 1
    assert samples[("dockyard_executor_image_cache_bytes", ())] == 1 << 30
    assert samples[("dockyard_executor_image_cache_images", ())] == 1


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
        ids = {"infra-twice": GOLD, "infra-always": GOLD, "bug": GOLD, "invalid": GOLD,
               "tests-fail": ""}
        for task_id, patch in ids.items():
            async with http.post(f"{server.url}/task/submit",
                                 json=body(task_id, patch=patch)) as response:
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
    assert results["invalid"]["error"] == ("invalid task: test_patch: does not apply at "
                                           "base_commit abc1234")
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
        ("default", None, config.work_path), ("own", 5.0, config.work_path)]
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


def test_healthz_is_503_without_live_workers(tmp_path):
    executor = TaskExecutor(make_config(tmp_path), score)  # never started: no worker threads

    async def main():
        runner = web.AppRunner(create_app(executor), handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://{host}:{port}/healthz") as response:
                    return response.status, await response.json()
        finally:
            await runner.cleanup()

    status, data = asyncio.run(main())
    executor.stop()
    assert status == 503 and data["status"] == "no_workers" and data["workers_alive"] == 0
