"""The task executor's HTTP API: `create_app(executor)`, an aiohttp app in front of a
`TaskExecutor` (task_executor.py); server.py binds it to a socket.

    POST /task/submit   SWE-bench instance fields + the agent's patch -> {"task_id", "status"}
                        202 accepted (new task) | 200 already known (same task_id, same spec)
                        400 malformed JSON / missing or bad field (the body names it)
                        401 missing or wrong bearer token (only when an auth token is configured)
                        409 task_id already used for a different spec
                        413 body, patch or test_patch larger than max_patch_bytes
                        429 queue full (Retry-After header)   503 shutting down
    GET  /task/{id}     the task record: status (queued | running | finished | infra_error),
                        verdict (null until finished), last infrastructure error, attempts,
                        timestamps. 404 for an unknown id; 401 as above.
    GET  /healthz       {"status": "ok", ...} 200; 503 when no worker thread is alive.
    GET  /metrics       Prometheus text format (prometheus_client; the metrics are listed in
                        metrics.py). No auth: it reveals counts, not tasks.

Multi-turn agent sessions (sessions.py; docs/sandbox.md "Sessions"), authenticated like /task/*:
    POST   /session/open      task fields as in /task/submit (no patch; the test_patch is never
                              applied) + optional session_id -> {"session_id", "budget",
                              "idle_timeout_s", ...}: 201 opened | 200 same id and spec again
                              | 400 bad field | 409 id open for another spec | 413 body too
                              large | 429 max_sessions open (Retry-After) | 503 shutting down
                              or the checkout failed (Retry-After)
    POST   /session/{id}/call {"tool": str, "args": object} -> 200 CallResult (a bad tool call is
                              ok:false, never a 4xx) | 400 body not an object, tool not a string
                              | 404 unknown, closed or expired session
    GET    /session/{id}/diff {"patch": the tree's diff against base_commit} | 404 | 413 larger
                              than max_patch_bytes
    GET    /session/{id}      {"session_id", "turns_used", "budget", "idle_s", "age_s", ...}
    DELETE /session/{id}      {"closed": true} | 404

Every error body is JSON {"error": "<message>", "field": "<field or null>"}.

Submissions are checked before anything is stored: the body's size, the fields
(`TaskSpec.from_request`), the patch sizes, the pipeline's own checks of repo, base_commit,
test_patch, test_command and test_harness (`check_scorable`), and the task_id's alphabet.

Responsiveness: no handler parses a patch or grades on the event loop: `check_scorable` and the
store run in threads, scoring in the executor's worker threads. What remains on the loop is
linear C work on the body (json.loads, one encode per patch for its size). Host-side patch
parsing and grading are linear (protected_paths.py, screening.py, evidence.py), so a worker thread
never holds the GIL for long: /healthz answers within milliseconds while tasks are scored
(http_app_test measures it with adversarial patches).

Security scope: this module authenticates callers (optional bearer token, compared in constant
time) and bounds what they may send (body and patch sizes, queue depth, a task_id alphabet that is
safe in paths); server.py binds 127.0.0.1 unless told otherwise (config.py refuses a non-loopback
host without a token). Isolation of the code under test is the pipeline's job (bubblewrap,
rlimits), not this one's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import re
import uuid

from aiohttp import web

from dockyard_rl.sandbox import pipeline, repo_cache, runner, sessions, swebench_harness
from dockyard_rl.sandbox.metrics import EXPOSITION_CONTENT_TYPE
from dockyard_rl.sandbox.store import QueueFullError, TaskConflictError
from dockyard_rl.sandbox.task import TaskSpec, TaskStatus, TaskValidationError
from dockyard_rl.sandbox.task_executor import ShuttingDownError, TaskExecutor

# Client task ids end up in log lines and may name directories: keep them to a safe alphabet.
_TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Submissions carry two patches plus small fields (ids, test lists, commands); this is the room
# allowed for everything but the patches before the body itself is refused with 413.
_BODY_OVERHEAD_BYTES = 1 << 20


def check_scorable(spec: TaskSpec) -> None:
    """The pipeline's own checks of repo, base_commit, test_patch, test_command and test_harness,
    run at submission so that a task that could never be scored is a 400 now rather than an
    infra_error later.

    Raises TaskValidationError naming the field. A local repo path must exist on this machine.
    """
    for field, check in (
        ("repo", lambda: repo_cache.normalize_repo(spec.repo)),
        ("base_commit", lambda: repo_cache.validate_commit(spec.base_commit)),
        ("test_patch", lambda: pipeline.test_files_of(spec.test_patch)),
        ("test_command", lambda: runner.pytest_arguments(spec.test_command)),
        (
            "test_harness",
            lambda: spec.test_harness and swebench_harness.parse_harness(spec.test_harness),
        ),
    ):
        try:
            check()
        except ValueError as error:
            message = str(error)
            if message.startswith(f"{field}: "):
                message = message[len(field) + 2 :]
            raise TaskValidationError(field, message) from None


def _error(
    status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": message, "field": field}, status=status, headers=headers)


def create_app(executor: TaskExecutor) -> web.Application:
    """The aiohttp application serving the routes in the module docstring."""
    config = executor.config
    expected_auth = (
        f"Bearer {config.auth_token}".encode() if config.auth_token is not None else None
    )
    max_body_bytes = 2 * config.max_patch_bytes + _BODY_OVERHEAD_BYTES

    def unauthorized(request: web.Request) -> web.Response | None:
        if expected_auth is None:
            return None
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected_auth):
            return None
        executor.note_rejected("unauthorized")
        return _error(
            401,
            "missing or wrong bearer token: send `Authorization: Bearer <token>`",
            "Authorization",
            headers={"WWW-Authenticate": 'Bearer realm="executor"'},
        )

    async def submit(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            executor.note_rejected("too_large")
            return _error(
                413,
                f"request body exceeds {max_body_bytes} bytes "
                f"(max_patch_bytes = {config.max_patch_bytes} per patch)",
                "body",
            )
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            executor.note_rejected("invalid")
            return _error(400, f"body: not valid JSON ({error})", "body")
        try:
            spec = TaskSpec.from_request(body)
        except TaskValidationError as error:
            executor.note_rejected("invalid")
            return _error(400, str(error), error.field)
        for name in ("patch", "test_patch"):
            try:
                num_bytes = len(getattr(spec, name).encode())
            except UnicodeEncodeError as error:
                # JSON's "\ud800" escapes decode to lone surrogates, which no file can hold.
                executor.note_rejected("invalid")
                return _error(400, f"{name}: not valid Unicode text ({error.reason})", name)
            if num_bytes > config.max_patch_bytes:
                executor.note_rejected("too_large")
                return _error(
                    413,
                    f"{name}: {num_bytes} bytes exceeds max_patch_bytes = {config.max_patch_bytes}",
                    name,
                )
        try:
            # A thread: parsing a large test_patch and resolving a local path take a while.
            await asyncio.to_thread(check_scorable, spec)
        except TaskValidationError as error:
            executor.note_rejected("invalid")
            return _error(400, str(error), error.field)
        if spec.task_id is None:
            spec = dataclasses.replace(spec, task_id=uuid.uuid4().hex)
        elif not _TASK_ID_RE.match(spec.task_id):
            executor.note_rejected("invalid")
            return _error(
                400,
                f"task_id: must match {_TASK_ID_RE.pattern} (letters, digits, "
                f"'.', '_', '-'; at most 128), got {spec.task_id[:200]!r}",
                "task_id",
            )
        try:
            # A thread: the store commits with fsync, which must not stall the event loop.
            record, created = await asyncio.to_thread(executor.submit, spec)
        except TaskConflictError as error:
            executor.note_rejected("conflict")
            return _error(409, str(error), "task_id")
        except QueueFullError as error:
            executor.note_rejected("queue_full")
            return _error(
                429,
                f"queue full: {error}; retry later",
                None,
                headers={"Retry-After": str(config.retry_after_s)},
            )
        except ShuttingDownError as error:
            return _error(503, str(error), None, headers={"Retry-After": str(config.retry_after_s)})
        return web.json_response(
            {"task_id": record.task_id, "status": record.status.value},
            status=202 if created else 200,
        )

    async def get_task(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        task_id = request.match_info["task_id"]
        record = await asyncio.to_thread(executor.get, task_id)
        if record is None:
            return _error(404, f"unknown task id {task_id[:200]!r}", "task_id")
        return web.json_response(record.to_dict())

    async def healthz(request: web.Request) -> web.Response:
        counts = await asyncio.to_thread(executor.counts)
        num_alive = executor.num_workers_alive
        return web.json_response(
            {
                "status": "ok" if num_alive > 0 else "no_workers",
                "workers": config.num_workers,
                "workers_alive": num_alive,
                "queue_depth": counts[TaskStatus.QUEUED],
                "running": counts[TaskStatus.RUNNING],
            },
            status=200 if num_alive > 0 else 503,
        )

    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.to_thread(executor.metrics_exposition)
        # Passed as a header: aiohttp's content_type argument refuses a charset parameter.
        return web.Response(body=body, headers={"Content-Type": EXPOSITION_CONTENT_TYPE})

    # -- sessions (sessions.py): the manager's own thread pool does the work, off the loop --

    manager = executor.sessions

    async def json_object(request: web.Request) -> dict | web.Response:
        """The request's JSON object body, or the error response to send instead."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds {max_body_bytes} bytes", "body")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            return _error(400, f"body: not valid JSON ({error})", "body")
        if not isinstance(body, dict):
            return _error(400, "body: must be a JSON object", "body")
        return body

    def session_not_found(error: sessions.SessionNotFoundError) -> web.Response:
        return _error(404, str(error), "session_id")

    async def open_session(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        body = await json_object(request)
        if isinstance(body, web.Response):
            return body
        try:
            spec, session_id = sessions.parse_open_request(body)
            if len(spec.test_patch.encode("utf-8", "surrogatepass")) > config.max_patch_bytes:
                return _error(
                    413,
                    f"test_patch: larger than max_patch_bytes = {config.max_patch_bytes}",
                    "test_patch",
                )
            # In the manager's pool: the checks (a local repo path, the test_patch) and the
            # checkout take a while.
            info, created = await manager.in_pool(manager.open, spec, session_id)
        except TaskValidationError as error:
            return _error(400, str(error), error.field)
        except sessions.SessionConflictError as error:
            return _error(409, str(error), "session_id")
        except sessions.TooManySessionsError as error:
            return _error(429, str(error), None, headers={"Retry-After": str(config.retry_after_s)})
        except (sessions.SessionsShuttingDownError, pipeline.InfrastructureError) as error:
            return _error(503, str(error), None, headers={"Retry-After": str(config.retry_after_s)})
        except ValueError as error:
            return _error(400, str(error), None)
        return web.json_response(info, status=201 if created else 200)

    async def call_tool(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        body = await json_object(request)
        if isinstance(body, web.Response):
            return body
        tool = body.get("tool")
        if not isinstance(tool, str):
            return _error(400, f"tool: must be a string naming a tool, got {tool!r:.100}", "tool")
        try:
            result = await manager.call_async(
                request.match_info["session_id"], tool, body.get("args")
            )
        except sessions.SessionNotFoundError as error:
            return session_not_found(error)
        return web.json_response(result.to_dict())

    async def session_diff(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        try:
            patch = await manager.in_pool(manager.diff, request.match_info["session_id"])
        except sessions.SessionNotFoundError as error:
            return session_not_found(error)
        except sessions.DiffTooLargeError as error:
            return _error(413, str(error), "patch")
        except pipeline.InfrastructureError as error:
            return _error(503, str(error), None, headers={"Retry-After": str(config.retry_after_s)})
        return web.json_response({"patch": patch})

    async def session_info(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        try:
            return web.json_response(manager.info(request.match_info["session_id"]))
        except sessions.SessionNotFoundError as error:
            return session_not_found(error)

    async def close_session(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        try:
            await manager.in_pool(manager.close, request.match_info["session_id"])
        except sessions.SessionNotFoundError as error:
            return session_not_found(error)
        return web.json_response({"closed": True})

    app = web.Application(client_max_size=max_body_bytes)
    app.add_routes(
        [
            web.post("/task/submit", submit),
            web.get("/task/{task_id}", get_task),
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
            web.post("/session/open", open_session),
            web.post("/session/{session_id}/call", call_tool),
            web.get("/session/{session_id}/diff", session_diff),
            web.get("/session/{session_id}", session_info),
            web.delete("/session/{session_id}", close_session),
        ]
    )
    return app
