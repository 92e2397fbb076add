"""Async client of the task executor service (its HTTP API: http_app.py).

    async with ExecutorClient("http://127.0.0.1:9090") as client:
        result = await client.score(spec)          # submit + wait
        if result.status is TaskStatus.FINISHED:
            reward = result.verdict.reward

Covered: one pooled aiohttp session per client (connections reused across requests), a timeout
per request, retries with exponential backoff and full jitter on 429 (honouring Retry-After),
5xx, connection errors and request timeouts, and idempotent resubmission: every submission
carries a task_id (generated when the spec has none), so a retried POST whose first try did reach
the server returns the same task instead of creating a second one.
Not covered: load balancing over several executors (the caller picks the URL), and cancelling a
task on the server (the API has no cancel).

Sessions (multi-turn agents; the executor's /session/* routes, sandbox/sessions.py):
`open_session` -> session id (idempotent: the id is fixed before the first try), `call_tool` ->
`ToolResult` (a bad tool call is `ok=False` with the reason in `error`, not an exception),
`session_diff` -> the tree's patch, `close_session` (a session already gone is not an error).

Errors: `ExecutorRequestError` for answers that retrying cannot fix (400, 401, 404, 409, 413),
`ExecutorUnavailableError` when retries are exhausted, `TimeoutError` when `wait` runs out of time,
`ExecutorProtocolError` when an answer is not what the API says (not a JSON object, a task record
or verdict with missing or mistyped fields): a clear error naming the path, never a KeyError or
TypeError from deep inside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp

from dockyard_rl.sandbox.task import TaskSpec, TaskStatus, Verdict

logger = logging.getLogger(__name__)

_TERMINAL = (TaskStatus.FINISHED, TaskStatus.INFRA_ERROR)


class ExecutorRequestError(Exception):
    """The executor refused the request in a way retrying cannot fix."""

    def __init__(self, status: int, message: str, field: str | None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.field = field


class ExecutorProtocolError(Exception):
    """The executor answered with something the API does not allow (a malformed body)."""


class ExecutorUnavailableError(Exception):
    """Every attempt failed with a retryable error (429, 5xx, connection error, timeout)."""


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """What `GET /task/{id}` says about a task."""

    task_id: str
    status: TaskStatus
    verdict: Verdict | None  # set when status is FINISHED
    error: str | None  # infrastructure error (final when status is INFRA_ERROR)
    attempts: int

    @classmethod
    def from_dict(cls, data: Any) -> TaskResult:
        """Raises ExecutorProtocolError for a body that is not a task record."""
        if not isinstance(data, Mapping):
            raise ExecutorProtocolError(f"task record: not a JSON object: {_short(data)}")
        task_id, error, attempts = data.get("task_id"), data.get("error"), data.get("attempts", 0)
        if not isinstance(task_id, str):
            raise ExecutorProtocolError(f"task record: task_id is not a string: {_short(task_id)}")
        if error is not None and not isinstance(error, str):
            raise ExecutorProtocolError(f"task record: error is not a string: {_short(error)}")
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise ExecutorProtocolError(f"task record: attempts not an integer: {_short(attempts)}")
        try:
            status = TaskStatus(data.get("status"))
        except (ValueError, TypeError):
            raise ExecutorProtocolError(
                f"task record: unknown status {_short(data.get('status'))}"
            ) from None
        verdict = None
        if data.get("verdict") is not None:
            try:
                verdict = Verdict.from_dict(data["verdict"])
            except Exception as error:  # noqa: BLE001 - whatever a malformed verdict raises
                raise ExecutorProtocolError(
                    f"task {task_id}: malformed verdict ({type(error).__name__}: "
                    f"{str(error)[:200]})"
                ) from None
        return cls(task_id=task_id, status=status, verdict=verdict, error=error, attempts=attempts)

    @property
    def done(self) -> bool:
        return self.status in _TERMINAL


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One session tool call's answer (POST /session/{id}/call): `output` is the observation,
    `error` says what was wrong when `ok` is False; `exhausted` once a budget is spent; `budget`
    has turns_left, wall_s_left, cpu_s_left, output_bytes_left."""

    ok: bool
    output: str
    error: str | None
    truncated: bool
    elapsed_s: float
    exhausted: bool
    budget: dict[str, float]

    @classmethod
    def from_dict(cls, data: Any) -> ToolResult:
        """Raises ExecutorProtocolError for a body that is not a tool call's answer."""
        if not isinstance(data, Mapping):
            raise ExecutorProtocolError(f"tool result: not a JSON object: {_short(data)}")
        checks = {
            "ok": lambda v: isinstance(v, bool),
            "output": lambda v: isinstance(v, str),
            "error": lambda v: v is None or isinstance(v, str),
            "truncated": lambda v: isinstance(v, bool),
            "elapsed_s": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "exhausted": lambda v: isinstance(v, bool),
            "budget": lambda v: (
                isinstance(v, Mapping)
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values())
            ),
        }
        for name, check in checks.items():
            if name not in data or not check(data[name]):
                raise ExecutorProtocolError(
                    f"tool result: {name} missing or mistyped: {_short(data.get(name))}"
                )
        return cls(
            ok=data["ok"],
            output=data["output"],
            error=data["error"],
            truncated=data["truncated"],
            elapsed_s=float(data["elapsed_s"]),
            exhausted=data["exhausted"],
            budget={str(k): float(v) for k, v in data["budget"].items()},
        )


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after_s: float | None = None):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class ExecutorClient:
    """See the module docstring. Use as an async context manager, or call `close()`."""

    def __init__(
        self,
        base_url: str,
        *,
        auth_token: str | None = None,
        request_timeout_s: float = 30.0,
        max_attempts: int = 6,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        max_connections: int = 64,
        seed: int | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: must start with http:// or https://, got {base_url!r}")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1 (1 = no retries), got {max_attempts}")
        if not 0 <= backoff_base_s <= backoff_max_s:
            raise ValueError(
                f"backoff_base_s, backoff_max_s: need 0 <= base <= max, got "
                f"{backoff_base_s}, {backoff_max_s}"
            )
        if max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {max_connections}")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._max_attempts = max_attempts
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._max_connections = max_connections
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ExecutorClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        # Created lazily: a ClientSession must be made inside the event loop that uses it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections), headers=self._headers
            )
        return self._session

    # -- API ------------------------------------------------------------------------------------

    async def submit(self, spec: TaskSpec | Mapping[str, Any]) -> str:
        """Submits a task; returns its task id. Resubmitting the same spec is idempotent.

        `spec` is a TaskSpec or a raw SWE-bench-style mapping (sent as is, plus a task_id).
        """
        if isinstance(spec, TaskSpec):
            body = spec.to_dict()
        else:
            body = dict(spec)
        if not body.get("task_id"):
            # Fixed before the first try, so that every retry names the same task.
            body["task_id"] = uuid.uuid4().hex
        data = await self._request("POST", "/task/submit", json_body=body)
        if not isinstance(data.get("task_id"), str):
            raise ExecutorProtocolError(f"submit: no task_id in the answer: {_short(data)}")
        return data["task_id"]

    async def get(self, task_id: str) -> TaskResult:
        return TaskResult.from_dict(await self._request("GET", f"/task/{task_id}"))

    async def wait(
        self, task_id: str, poll_interval_s: float = 1.0, timeout_s: float | None = None
    ) -> TaskResult:
        """Polls until the task is FINISHED or INFRA_ERROR; TimeoutError after `timeout_s`."""
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            result = await self.get(task_id)
            if result.done:
                return result
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"task {task_id} still {result.status.value} after {timeout_s} s"
                    )
                await asyncio.sleep(min(poll_interval_s, remaining))
            else:
                await asyncio.sleep(poll_interval_s)

    async def score(
        self,
        spec: TaskSpec | Mapping[str, Any],
        poll_interval_s: float = 1.0,
        timeout_s: float | None = None,
    ) -> TaskResult:
        """submit + wait."""
        task_id = await self.submit(spec)
        return await self.wait(task_id, poll_interval_s=poll_interval_s, timeout_s=timeout_s)

    async def healthz(self) -> dict[str, Any]:
        return await self._request("GET", "/healthz")

    # -- sessions -------------------------------------------------------------------------------

    async def open_session(
        self, spec: TaskSpec | Mapping[str, Any], session_id: str | None = None
    ) -> str:
        """Opens a session on the task (its patch is never sent); returns the session id.
        Retrying is idempotent: the id is fixed before the first try (generated when None)."""
        body = spec.to_dict() if isinstance(spec, TaskSpec) else dict(spec)
        for name in ("patch", "task_id"):
            body.pop(name, None)
        body["session_id"] = session_id or uuid.uuid4().hex
        data = await self._request("POST", "/session/open", json_body=body)
        if not isinstance(data.get("session_id"), str):
            raise ExecutorProtocolError(
                f"open_session: no session_id in the answer: {_short(data)}"
            )
        return data["session_id"]

    async def call_tool(self, session_id: str, tool: str, args: Mapping[str, Any]) -> ToolResult:
        """Runs one tool call in the session. A 5xx or lost connection is retried like every
        request: a call that reached the executor before the connection broke runs twice then
        (the session's budget counts both)."""
        data = await self._request(
            "POST",
            f"/session/{session_id}/call",
            json_body={"tool": tool, "args": dict(args) if isinstance(args, Mapping) else args},
        )
        return ToolResult.from_dict(data)

    async def session_diff(self, session_id: str) -> str:
        """The session tree's unified diff against base_commit (score it as a task's patch)."""
        data = await self._request("GET", f"/session/{session_id}/diff")
        if not isinstance(data.get("patch"), str):
            raise ExecutorProtocolError(f"session_diff: no patch in the answer: {_short(data)}")
        return data["patch"]

    async def close_session(self, session_id: str) -> None:
        """Closes the session and frees its tree; a session already gone (404) is fine."""
        try:
            await self._request("DELETE", f"/session/{session_id}")
        except ExecutorRequestError as error:
            if error.status != 404:
                raise

    # -- transport ------------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, json_body: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        url = self.base_url + path
        last_reason = "no attempt made"
        for attempt in range(1, self._max_attempts + 1):
            try:
                return await self._request_once(method, url, json_body)
            except _Retryable as retryable:
                last_reason = str(retryable)
                if attempt == self._max_attempts:
                    break
                delay_s = self._backoff_s(attempt, retryable.retry_after_s)
                logger.info(
                    "%s %s: %s; retry %d/%d in %.2f s",
                    method,
                    path,
                    retryable,
                    attempt,
                    self._max_attempts - 1,
                    delay_s,
                )
                await asyncio.sleep(delay_s)
        raise ExecutorUnavailableError(
            f"{method} {url} failed {self._max_attempts} time(s); last: {last_reason}"
        )

    async def _request_once(
        self, method: str, url: str, json_body: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        session = self._get_session()
        try:
            async with session.request(
                method, url, json=json_body, timeout=self._timeout
            ) as response:
                text = await response.text()
                if response.status == 429 or response.status >= 500:
                    raise _Retryable(
                        f"HTTP {response.status}: {text[:200]}",
                        _parse_retry_after(response.headers.get("Retry-After")),
                    )
                try:
                    data = await response.json(content_type=None) if text else {}
                except (ValueError, RecursionError):
                    data = None
                if response.status >= 400:
                    body = data if isinstance(data, dict) else {}
                    message, field = body.get("error"), body.get("field")
                    raise ExecutorRequestError(
                        response.status,
                        message if isinstance(message, str) else text[:500],
                        field if isinstance(field, str) else None,
                    )
                if not isinstance(data, dict):
                    raise ExecutorProtocolError(
                        f"{method} {url}: HTTP {response.status} with a body that is not a "
                        f"JSON object: {text[:200]!r}"
                    )
                return data
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            raise _Retryable(f"{type(error).__name__}: {error}") from None
        except TimeoutError:
            raise _Retryable(f"no answer within {self._timeout.total} s") from None

    def _backoff_s(self, attempt: int, retry_after_s: float | None) -> float:
        """Full jitter (uniform in [0, base * 2**(attempt-1)], capped): clients that failed together
        do not retry together. A server's Retry-After is a floor: it knows when it has room."""
        ceiling = min(self._backoff_max_s, self._backoff_base_s * 2 ** (attempt - 1))
        delay_s = self._rng.uniform(0, ceiling)
        if retry_after_s is not None:
            delay_s = max(delay_s, min(retry_after_s, self._backoff_max_s))
        return delay_s


def _short(value: Any) -> str:
    return repr(value)[:200]


def _parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds; the HTTP-date form is not used by the executor and is ignored."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None  # NaN and inf are no delay
