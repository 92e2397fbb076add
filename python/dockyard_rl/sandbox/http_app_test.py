"""Tests of the executor's HTTP API over real HTTP on 127.0.0.1 (an ephemeral port).

The scoring function is injected (the executor's documented seam), so these tests pin down the
HTTP layer itself: every status code, idempotency, the bearer token, health. The metrics it serves
are metrics_test.py's; retries and shutdown task_executor_test.py's; scoring real repositories
server_load_test.py's.
"""

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from dockyard_rl.sandbox.http_app import create_app
from dockyard_rl.sandbox.task import TaskStatus
from dockyard_rl.sandbox.task_executor import TaskExecutor
from dockyard_rl.sandbox.testing_executor import (
    body,
    make_config,
    score,
    serve_and,
    verdict_for,
    wait_done,
)

TOKEN = "s3cret-token-0123456789"


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


@pytest.mark.parametrize(
    "payload, field",
    [
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
    ],
)
def test_malformed_submissions_are_400_naming_the_field(tmp_path, payload, field):
    async def scenario(http, server):
        async with http.post(
            f"{server.url}/task/submit", data=payload, headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, await response.json(), server.executor.all_records()

    status, data, records = serve_and(make_config(tmp_path), score, scenario)
    assert status == 400
    assert data["field"] == field and data["error"].startswith(f"{field}: ")
    assert records == []


def test_oversized_patch_is_413(tmp_path):
    config = make_config(tmp_path, max_patch_bytes=1000)

    async def scenario(http, server):
        results = []
        for data in (
            body("big", patch="+" * 1001),
            body("big-test", test_patch="+" * 1001),
            body("ok", patch="+" * 1000),
        ):
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
        for name, headers in (
            ("missing", {}),
            ("wrong", {"Authorization": "Bearer nope"}),
            ("scheme", {"Authorization": TOKEN}),
            ("right", {"Authorization": f"Bearer {TOKEN}"}),
        ):
            async with http.post(
                f"{server.url}/task/submit", json=body(f"auth-{name}"), headers=headers
            ) as response:
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


def test_surrogates_in_a_patch_are_400(tmp_path):
    config = make_config(tmp_path)

    async def scenario(http, server):
        raw = json.dumps(body(patch="diff --git a/x b/x\n+\ud800\n"))
        async with http.post(
            f"{server.url}/task/submit", data=raw, headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, await response.json()

    status, data = serve_and(config, score, scenario)
    assert status == 400 and data["field"] == "patch" and "Unicode" in data["error"]


def test_healthz_stays_responsive_while_heavy_patches_are_parsed(tmp_path):
    # Host-side patch parsing runs in worker threads and is linear, so the event loop
    # keeps answering. Target 0.5 s; asserted with room for a loaded test machine.
    from dockyard_rl.sandbox import apply, protected_paths, screening
    from dockyard_rl.sandbox.testing_patches import adversarial_patches

    patches = list(adversarial_patches(1 << 20).values())
    config = make_config(tmp_path, num_workers=2, max_patch_bytes=4 << 20)

    def parse_then_score(spec, work_root):  # the pipeline's host-side parsing of the patch
        screening.screen_patch(spec.patch)
        protected_paths.check_integrity(spec.patch, ["tests/t.py"], lambda path: None)
        apply.binary_hunks(spec.patch)
        return verdict_for(spec)

    async def scenario(http, server):
        ids = []
        for index, patch in enumerate(patches):
            async with http.post(
                f"{server.url}/task/submit", json=body(task_id=f"heavy-{index}", patch=patch)
            ) as response:
                assert response.status == 202
                ids.append((await response.json())["task_id"])
        latencies = []
        while True:
            start = time.monotonic()
            async with http.get(f"{server.url}/healthz") as response:
                assert response.status == 200
                health = await response.json()
            latencies.append(time.monotonic() - start)
            if health["queue_depth"] == 0 and health["running"] == 0:
                break
            await asyncio.sleep(0.02)
        for task_id in ids:
            assert (await wait_done(http, server.url, task_id))["status"] == "finished"
        return latencies

    latencies = serve_and(config, parse_then_score, scenario)
    print(f"/healthz while scoring: {len(latencies)} polls, max {max(latencies):.3f} s")
    assert len(latencies) >= 2 and max(latencies) < 2.0
