"""Tests of the async executor client against real local HTTP servers on 127.0.0.1.

A small scripted aiohttp server answers 429 / 503 / slow / 400 first, to exercise retries,
Retry-After, timeouts and idempotent resubmission; the real executor service (with an injected
scoring function) checks submit / get / wait / score end to end.
"""

import asyncio
import os
import socket
import threading
import time

import pytest
from aiohttp import web

from dockyard_rl.sandbox.client import (
    ExecutorClient,
    ExecutorRequestError,
    ExecutorUnavailableError,
)
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task import ApplyMethod, TaskSpec, TaskStatus, TestOutcome, Verdict

SPEC = TaskSpec.from_request(
    {
        "instance_id": "demo__demo-1",
        "repo": os.path.dirname(os.path.abspath(__file__)),
        "base_commit": "abc1234",
        "patch": "diff --git a/x b/x\n",
        "test_patch": (
            "diff --git a/t.py b/t.py\n--- a/t.py\n+++ b/t.py\n@@ -1 +1,2 @@\n x = 1\n+y = 2\n"
        ),
        "FAIL_TO_PASS": ["t.py::test_a"],
        "PASS_TO_PASS": [],
    }
)


class ScriptedServer:
    """Answers /task/submit with the scripted responses in order, then 202; records each body
    and the client port of each request (one port = one pooled connection)."""

    def __init__(self, script):
        self.script = list(script)
        self.bodies = []
        self.peer_ports = []
        self.request_times = []

    async def submit(self, request):
        self.bodies.append(await request.json())
        self.peer_ports.append(request.transport.get_extra_info("peername")[1])
        self.request_times.append(time.monotonic())
        if self.script:
            action = self.script.pop(0)
            if action[0] == "sleep":
                await asyncio.sleep(action[1])
            else:
                status, headers = action
                return web.json_response(
                    {"error": f"scripted {status}", "field": "patch"},
                    status=status,
                    headers=headers,
                )
        return web.json_response(
            {"task_id": self.bodies[-1]["task_id"], "status": "queued"}, status=202
        )

    async def run(self, scenario):
        app = web.Application()
        app.add_routes([web.post("/task/submit", self.submit)])
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            return await scenario(f"http://{host}:{port}")
        finally:
            await runner.cleanup()


def fast_client(url, **kwargs):
    values = dict(backoff_base_s=0.01, backoff_max_s=0.05, seed=0)
    values.update(kwargs)
    return ExecutorClient(url, **values)


def test_retries_429_honouring_retry_after_and_5xx_with_the_same_task_id():
    server = ScriptedServer([(429, {"Retry-After": "0.3"}), (503, {}), (502, {})])

    async def scenario(url):
        async with fast_client(url, max_attempts=4, backoff_max_s=1.0) as client:
            return await client.submit(SPEC)

    task_id = asyncio.run(server.run(scenario))
    assert len(server.bodies) == 4
    # The id was fixed before the first try, so every retry names the same task.
    assert {body["task_id"] for body in server.bodies} == {task_id}
    assert len(task_id) == 32
    # Retry-After (0.3 s) is a floor on the first delay; the jittered backoff alone is <= 0.01 s.
    assert server.request_times[1] - server.request_times[0] >= 0.3
    # One pooled connection served every attempt.
    assert len(set(server.peer_ports)) == 1


def test_client_supplied_task_id_is_kept():
    server = ScriptedServer([(503, {})])

    async def scenario(url):
        async with fast_client(url) as client:
            return await client.submit({**SPEC.to_dict(), "task_id": "mine-1"})

    assert asyncio.run(server.run(scenario)) == "mine-1"
    assert [body["task_id"] for body in server.bodies] == ["mine-1", "mine-1"]


def test_request_timeout_is_retried():
    server = ScriptedServer([("sleep", 2.0)])

    async def scenario(url):
        async with fast_client(url, request_timeout_s=0.3) as client:
            return await client.submit(SPEC)

    started = time.monotonic()
    asyncio.run(server.run(scenario))
    assert len(server.bodies) == 2 and time.monotonic() - started < 2.0


def test_client_errors_are_not_retried():
    server = ScriptedServer([(400, {})])

    async def scenario(url):
        async with fast_client(url) as client:
            with pytest.raises(ExecutorRequestError) as caught:
                await client.submit(SPEC)
            return caught.value

    error = asyncio.run(server.run(scenario))
    assert error.status == 400 and error.field == "patch" and "scripted 400" in str(error)
    assert len(server.bodies) == 1


def test_gives_up_after_max_attempts():
    server = ScriptedServer([(503, {})] * 10)

    async def scenario(url):
        async with fast_client(url, max_attempts=3) as client:
            with pytest.raises(ExecutorUnavailableError, match="failed 3 time.*HTTP 503"):
                await client.submit(SPEC)

    asyncio.run(server.run(scenario))
    assert len(server.bodies) == 3


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as sock:  # a port that nothing listens on once the socket closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario():
        async with fast_client(f"http://127.0.0.1:{port}", max_attempts=3) as client:
            with pytest.raises(ExecutorUnavailableError, match="failed 3 time.*Connect"):
                await client.get("anything")

    asyncio.run(scenario())


def test_backoff_is_jittered_capped_and_floored_by_retry_after():
    client = ExecutorClient("http://127.0.0.1:1", backoff_base_s=1.0, backoff_max_s=4.0, seed=3)
    delays = [client._backoff_s(attempt, None) for attempt in range(1, 8)]
    assert all(0 <= d <= min(4.0, 2 ** (a - 1)) for a, d in zip(range(1, 8), delays))
    assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule
    assert client._backoff_s(1, 2.5) >= 2.5
    assert client._backoff_s(1, 100.0) <= 4.0  # a huge Retry-After is capped


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(base_url="127.0.0.1:9090"), "base_url"),
        (dict(base_url="http://x", request_timeout_s=0), "request_timeout_s"),
        (dict(base_url="http://x", max_attempts=0), "max_attempts"),
        (dict(base_url="http://x", backoff_base_s=2, backoff_max_s=1), "backoff_base_s"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExecutorClient(**kwargs)


def test_score_against_the_real_service_with_a_token(tmp_path):
    token = "client-test-token-0123456789"

    def scorer(spec, work_root):
        return Verdict(
            resolved=True,
            reward=1.0,
            fail_to_pass={"t.py::test_a": TestOutcome.PASSED},
            pass_to_pass={},
            apply_method=ApplyMethod.GIT_APPLY,
            integrity_violation=(),
            test_exit_code=0,
            timed_out=False,
            timings_s={"total": 0.0},
            log_tail="ok",
        )

    config = ExecutorConfig(port=0, num_workers=1, work_dir=str(tmp_path), auth_token=token)

    async def scenario():
        async with running_server(config, scorer) as server:
            async with ExecutorClient(server.url, auth_token=token, seed=0) as client:
                result = await client.score(SPEC, poll_interval_s=0.02, timeout_s=10)
                again = await client.get(result.task_id)
                health = await client.healthz()
                with pytest.raises(ExecutorRequestError) as missing:
                    await client.get("no-such-task")
            async with ExecutorClient(server.url, auth_token="wrong-token-0123456789") as bad:
                with pytest.raises(ExecutorRequestError) as unauthorized:
                    await bad.submit(SPEC)
            return result, again, health, missing.value, unauthorized.value

    result, again, health, missing, unauthorized = asyncio.run(scenario())
    assert result.status is TaskStatus.FINISHED and result.done and result.attempts == 1
    assert result.verdict.resolved and result.verdict.log_tail == "ok"
    assert again == result
    assert health["status"] == "ok"
    assert missing.status == 404 and unauthorized.status == 401


def test_wait_times_out_on_a_task_that_never_finishes(tmp_path):
    release = threading.Event()

    def blocked(spec, work_root):
        release.wait(timeout=30)
        raise RuntimeError("released")

    config = ExecutorConfig(port=0, num_workers=1, work_dir=str(tmp_path), shutdown_grace_s=0)

    async def scenario():
        async with running_server(config, blocked) as server:
            async with ExecutorClient(server.url) as client:
                task_id = await client.submit(SPEC)
                with pytest.raises(TimeoutError, match=f"task {task_id} still"):
                    await client.wait(task_id, poll_interval_s=0.02, timeout_s=0.3)
            release.set()

    asyncio.run(scenario())


def test_hostile_task_records_raise_a_protocol_error():
    # The executor's answer is untrusted: a malformed one is a clear ExecutorProtocolError, nothing
    # else.
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from dockyard_rl.sandbox.client import ExecutorProtocolError, TaskResult

    values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=10)
        | st.sampled_from(["finished", "none", "tests_failed", "git_apply", "passed"]),
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=12), children, max_size=4)
        ),
        max_leaves=12,
    )
    verdict_keys = [
        "instance_id",
        "resolved",
        "reward",
        "apply_method",
        "failure_kind",
        "fail_to_pass",
        "pass_to_pass",
        "detail",
        "timings",
        "screening_flags",
    ]
    verdicts = st.fixed_dictionaries({}, optional={k: values for k in verdict_keys})
    records = st.fixed_dictionaries(
        {"task_id": st.text(max_size=5) | values, "status": st.sampled_from(["finished"]) | values},
        optional={"verdict": verdicts | values, "attempts": values, "error": values},
    )

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=records | values)
    def check(data):
        try:
            result = TaskResult.from_dict(data)
        except ExecutorProtocolError:
            return
        assert isinstance(result.task_id, str) and isinstance(result.attempts, int)

    check()
    with pytest.raises(ExecutorProtocolError, match="not a JSON object"):
        TaskResult.from_dict([1, 2])
    with pytest.raises(ExecutorProtocolError, match="malformed verdict"):
        TaskResult.from_dict({"task_id": "t", "status": "finished", "verdict": {"x": 1}})
