"""Multi-turn agent sessions on the task executor: `SessionManager` keeps one working tree per
session, runs the agent's tool calls in it, and hands back the tree's diff for scoring.

    manager = SessionManager(SessionConfig(), pipeline_config, work_root, max_patch_bytes)
    manager.start()                                        # wipes what a previous run left
    info, created = manager.open(spec, "episode-17")      # spec: a TaskSpec (patch unused)
    result = manager.call("episode-17", "view", {"path": "calc/ops.py"})   # -> CallResult
    patch = manager.diff("episode-17")                    # scored later as a normal task
    manager.close("episode-17")
    manager.stop()

http_app.py serves it (`/session/...`, docs/sandbox.md "Sessions"); task_executor.py owns one.

The tree. `<work_root>/sessions/<id>-<random>/tree` is a checkout of base_commit from the
repository cache (repo_cache.py: one commit, no history, no future refs) WITHOUT the task's test
patch: the held-out tests stay hidden. Its git directory is moved out of the tree, to
`.../git`, before any tool runs, so nothing in the tree is git's. The diff (`diff`) runs git with
that git dir and the tree as work tree, on a copy of the index (the real one is never written),
hooks off, no external diff or textconv, no user or system configuration; `__pycache__`,
`.pytest_cache` and `*.pyc` are left out, new files are included. A diff larger than the
executor's `max_patch_bytes` is refused (`DiffTooLargeError`): it could not be submitted anyway.

Tools (the contract shared with environments/agent_tools.py; every argument is checked and every
problem is an `ok: false` result whose error says what is wrong and how to fix it, never an
exception): `view`, `search`, `replace`, `write_file` run here, on the host, and never follow a
symbolic link: every path component is opened relative to its parent with O_NOFOLLOW after an
lstat, so a link anywhere on the path (one in the repository itself, or one planted by any other
means) is refused by name. Absolute paths, `..`, the `.git` name, NUL bytes, text that is not
valid Unicode, over-long paths, non-string arguments, files larger than `MAX_FILE_BYTES`, binary
files (a NUL byte in the first 8 KiB) and regular expressions that run longer than
`SEARCH_TIME_S` (the `regex` module's timeout) are refused the same way.
`run_tests` runs pytest through the scoring pipeline's runner (runner.run_pytest: bubblewrap, no
network, the pipeline's rlimits, the task's image or per-repository environment when it has
one): the tree is bound read-only and copied into a size-capped tmpfs inside the sandbox, so the
tests see a writable repository but what they write is thrown away with the sandbox, and the
session's tree, its git dir and the rest of the host stay out of their reach. Only node ids and
paths are accepted (no leading `-`; the path part must name something inside the tree). The
output is the run's tail, cut to `max_tool_output_bytes`.

Budgets (SessionConfig), per session: turns (every call counts, a refused one too), wall clock
since open, test seconds (`cpu_s`: each run_tests run is charged the wall-clock seconds its
sandbox ran, an upper bound of a single-process run's CPU time: per-process CPU accounting is
not available from the sandbox; the run's RLIMIT_CPU and wall clock are capped at what is
left), and output bytes returned. Once any is spent the session is `exhausted`: calls answer
ok:false without running anything; the diff is still available. Sessions idle longer than
`idle_timeout_s` are closed by a reaper thread (then "expired"); at most `max_sessions` are
open at once (`TooManySessionsError`).

Concurrency: calls on one session run one at a time (an asyncio lock on the event loop, so
queued calls wait there, not in threads, plus a thread lock against the reaper and close);
different sessions run in parallel in the manager's own thread pool, off the event loop and
apart from the default executor that the task API uses.

What is trusted: nothing the agent sends or that runs in the sandbox. The session's outcome is
never a verdict: the verdict comes from scoring the final diff as a normal task
(pipeline.score_task, with every integrity check), so a session only ever produces a patch.
Not covered: per-process CPU accounting (see budgets); a session's tree survives only as long as
the executor process (a restart wipes every session, by design).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from dockyard_rl.sandbox import cleanup, images, isolation, pipeline, repo_cache, runner
from dockyard_rl.sandbox.task import TaskSpec, TaskValidationError
from dockyard_rl.utils.config import is_int, is_number, require

logger = logging.getLogger(__name__)

SESSIONS_DIR_NAME = "sessions"  # <work_root>/sessions/<id>-<random>: one directory per session
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the task ids' alphabet
TOOL_NAMES = ("view", "search", "replace", "write_file", "run_tests")

MAX_FILE_BYTES = 2 * 1024 * 1024  # largest file view/replace/search read, and write_file writes
MAX_VIEW_LINES = 200
MAX_SEARCH_RESULTS = 50
SEARCH_TIME_S = 2.0  # time budget of one regex search
_MAX_SEARCH_FILES = 20_000
_MAX_SEARCH_BYTES = 64 * 1024 * 1024
_MAX_SHOWN_LINE_CHARS = 400
_MAX_PATH_CHARS = 1024
_MAX_NAME_BYTES = 255
_MAX_PATTERN_CHARS = 1000
_MAX_TEST_IDS = 64
_MAX_TEST_ID_CHARS = 1000
_MAX_DIR_ENTRIES = 1000
_BINARY_SNIFF_BYTES = 8192
_SKIPPED_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache"})
# How many closed session ids are remembered, so that a late call hears "closed" or "expired".
_MAX_CLOSED_REMEMBERED = 10_000
_GIT_TIMEOUT_S = 300
# What run_tests passes pytest besides the agent's node ids: short tracebacks, the reasons of
# failures and errors in the summary.
_PYTEST_FLAGS = ("--tb=short", "-rfE")
# The fields of POST /session/open taken from the body (same names as /task/submit).
_OPEN_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "test_command",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "timeout_s",
    "image",
    "repo_path",
    "requirements",
    "test_harness",
)

_DIR_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_LIST_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in the tree must not hang (it is refused after fstat).
_FILE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_WRITE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """The executor's `sessions` section (ExecutorConfig.sessions)."""

    max_sessions: int = 32  # open at once; more answer 429
    idle_timeout_s: float = 600.0  # a session without a call for this long is closed
    max_turns: int = 64  # tool calls per session (refused ones count)
    max_wall_s: float = 3600.0  # since open
    max_cpu_s: float = 900.0  # seconds of run_tests sandboxes (module docstring, "Budgets")
    max_output_bytes: int = 1024 * 1024  # tool output returned over the session's life
    max_tool_output_bytes: int = 16 * 1024  # one call's output (run_tests keeps the tail)

    def __post_init__(self):
        for name in ("max_sessions", "max_turns", "max_output_bytes", "max_tool_output_bytes"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        for name in ("idle_timeout_s", "max_wall_s", "max_cpu_s"):
            value = getattr(self, name)
            require(
                is_number(value) and math.isfinite(value) and value > 0,
                name,
                f"must be a positive number of seconds, got {value!r}",
            )
        require(
            self.max_tool_output_bytes >= 1024,
            "max_tool_output_bytes",
            f"must be at least 1024 (a test run's summary must fit), got "
            f"{self.max_tool_output_bytes}",
        )


class SessionError(Exception):
    """Base of the errors the session API answers with an HTTP status."""


class SessionNotFoundError(SessionError):
    """No such session: never opened, closed, or expired (the message says which)."""


class SessionConflictError(SessionError):
    """The session id is in use for another task spec."""


class TooManySessionsError(SessionError):
    """`max_sessions` are open; retry later."""


class SessionsShuttingDownError(SessionError):
    """The executor is stopping; no new session is opened."""


class DiffTooLargeError(SessionError):
    """The tree's diff is larger than the executor accepts as a patch."""


class _ToolError(Exception):
    """A tool call the agent got wrong: its message is the observation (ok: false)."""


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One tool call's answer (POST /session/{id}/call's body)."""

    ok: bool
    output: str
    error: str | None
    truncated: bool
    elapsed_s: float
    exhausted: bool
    budget: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_open_request(body: Any) -> tuple[TaskSpec, str | None]:
    """POST /session/open's body -> (the session's task spec, the requested session id or None).

    The task fields are validated like a submission's (TaskSpec.from_request); the spec's patch
    is always empty (a session never sees one) and its test_patch is "" when none was sent.
    Other fields (problem_statement, patch, ...) are ignored. Raises TaskValidationError naming
    the field.
    """
    if not isinstance(body, dict):
        raise TaskValidationError("body", "must be a JSON object")
    session_id = body.get("session_id")
    if session_id is not None and (
        not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id)
    ):
        raise TaskValidationError(
            "session_id",
            f"must match {SESSION_ID_RE.pattern} (letters, digits, '.', '_', '-'; at most "
            f"128), got {str(session_id)[:200]!r}",
        )
    fields = {name: body[name] for name in _OPEN_FIELDS if name in body}
    test_patch = fields.get("test_patch")
    has_test_patch = isinstance(test_patch, str) and bool(test_patch.strip())
    request = {
        **fields,
        "patch": "",
        # from_request wants a test patch; a session may have none (then its default test run
        # is the whole suite).
        "test_patch": test_patch if has_test_patch or test_patch not in (None, "") else "-",
        "FAIL_TO_PASS": fields.get("FAIL_TO_PASS", []),
        "PASS_TO_PASS": fields.get("PASS_TO_PASS", []),
    }
    spec = TaskSpec.from_request(request)
    if not has_test_patch:
        spec = dataclasses.replace(spec, test_patch="")
    return spec, session_id


def check_openable(spec: TaskSpec) -> None:
    """The pipeline's submission checks that apply to a session (repo, base_commit, test_patch
    when given, test_command); a local repo path must exist here. Raises TaskValidationError."""
    checks: list[tuple[str, Callable[[], Any]]] = [
        ("repo", lambda: repo_cache.normalize_repo(spec.repo)),
        ("base_commit", lambda: repo_cache.validate_commit(spec.base_commit)),
        ("test_command", lambda: runner.pytest_arguments(spec.test_command)),
    ]
    if spec.test_patch:
        checks.append(("test_patch", lambda: pipeline.test_files_of(spec.test_patch)))
    for field, check in checks:
        try:
            check()
        except ValueError as error:
            raise TaskValidationError(field, str(error).removeprefix(f"{field}: ")) from None


def _spec_key(spec: TaskSpec) -> str:
    return json.dumps(dataclasses.replace(spec, task_id=None).to_dict(), sort_keys=True)


class _Session:
    def __init__(self, session_id: str, spec: TaskSpec, directory: pathlib.Path):
        self.id, self.spec, self.key = session_id, spec, _spec_key(spec)
        self.dir = directory
        self.tree = directory / "tree"
        self.git_dir = directory / "git"
        self.lock = threading.Lock()  # one call, diff or close at a time
        self.async_lock = asyncio.Lock()  # queued HTTP calls wait on the event loop
        self.ready = threading.Event()  # set once the checkout is done (or failed)
        self.open_error: BaseException | None = None
        self.closed = False
        self.opened_at = self.last_active = time.monotonic()
        self.turns_used = 0
        self.cpu_s_used = 0.0
        self.output_bytes_used = 0


class SessionManager:
    """Open sessions, their trees and their budgets (module docstring). Thread-safe.

    Call order: `start()` once, then open / call / diff / info / close from any thread (the
    `*_async` forms from the event loop), then `stop()` (safe to repeat).
    """

    def __init__(
        self,
        config: SessionConfig,
        pipeline_config: pipeline.PipelineConfig,
        work_root: pathlib.Path,
        max_patch_bytes: int,
    ):
        self.config = config
        self.pipeline_config = pipeline_config
        self.work_root = pathlib.Path(work_root).expanduser().resolve()
        self.sessions_dir = self.work_root / SESSIONS_DIR_NAME
        self.max_patch_bytes = max_patch_bytes
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._accepting = False
        self._stopping = threading.Event()
        self._reaper: threading.Thread | None = None
        # Our own pool: a call may run tests for minutes, and the event loop's default executor
        # serves the task API (its /healthz too). One thread per open session, plus a few for
        # opens, diffs and closes.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_sessions + 4, thread_name_prefix="session"
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Removes every session directory a previous executor left (sessions do not survive a
        restart), then starts the idle reaper."""
        assert self._reaper is None, "start() called twice"
        problem = cleanup.remove_tree(
            self.sessions_dir, trash_dir=cleanup.trash_path(self.work_root)
        )
        if problem:
            logger.error("leftover sessions directory: %s", problem)
        self.sessions_dir.mkdir(parents=True, exist_ok=True)
        self._accepting = True
        self._reaper = threading.Thread(target=self._reap_loop, name="session-reaper", daemon=True)
        self._reaper.start()

    def stop(self, grace_s: float = 30.0) -> None:
        """Closes every session (waiting up to `grace_s` for calls in progress) and stops."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._accepting = False
            sessions = list(self._sessions.values())
        if self._reaper is not None:
            self._reaper.join(timeout=5.0)
        deadline = time.monotonic() + grace_s
        for session in sessions:
            self._close(
                session, "closed: the executor shut down", max(0.0, deadline - time.monotonic())
            )
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- requests -------------------------------------------------------------------------------

    def open(self, spec: TaskSpec, session_id: str | None = None) -> tuple[dict[str, Any], bool]:
        """Opens a session on `spec` (its patch is ignored); returns (info, created). Opening an
        id again with the same spec returns the same session (created False).

        Raises SessionConflictError, TooManySessionsError, SessionsShuttingDownError,
        ValueError (a bad spec) and pipeline.InfrastructureError (the checkout failed)."""
        spec = dataclasses.replace(spec, patch="", task_id=None)
        check_openable(spec)  # a bad spec is a 400 before the id is looked at
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not SESSION_ID_RE.match(session_id):
            raise ValueError(f"session_id: must match {SESSION_ID_RE.pattern}, got {session_id!r}")
        with self._lock:
            if not self._accepting:
                raise SessionsShuttingDownError(
                    "the executor is shutting down; open the session on another executor or "
                    "retry after it restarts"
                )
            existing = self._sessions.get(session_id)
            if existing is None:
                if len(self._sessions) >= self.config.max_sessions:
                    raise TooManySessionsError(
                        f"{len(self._sessions)} sessions are open (sessions.max_sessions = "
                        f"{self.config.max_sessions}); close finished sessions or retry later"
                    )
                directory = self.sessions_dir / f"{session_id}-{secrets.token_hex(4)}"
                session = _Session(session_id, spec, directory)
                self._sessions[session_id] = session
                self._closed.pop(session_id, None)
        if existing is not None:
            if existing.key != _spec_key(spec):
                raise SessionConflictError(
                    f"session id {session_id!r} is already open for another task "
                    f"({existing.spec.instance_id}); use a new session id"
                )
            existing.ready.wait()
            if existing.open_error is not None:
                raise existing.open_error
            return self._info(existing), False
        try:
            self._prepare(session)
        except BaseException as error:
            with self._lock:
                self._sessions.pop(session_id, None)
            session.open_error = error
            session.ready.set()
            cleanup.remove_tree(session.dir, trash_dir=cleanup.trash_path(self.work_root))
            raise
        session.opened_at = session.last_active = time.monotonic()
        session.ready.set()
        logger.info("session %s opened for %s", session_id, spec.instance_id)
        return self._info(session), True

    def call(self, session_id: str, tool: str, args: Any) -> CallResult:
        """Runs one tool call (module docstring). Raises SessionNotFoundError only; everything
        about the call itself is in the result."""
        session = self._ready_session(session_id)
        with session.lock:
            if session.closed:
                raise SessionNotFoundError(self._not_found_message(session_id))
            start = time.monotonic()
            spent = self._spent(session)
            if spent:
                return self._result(
                    session,
                    start,
                    ok=False,
                    output="",
                    error=f"the session's {spent} budget is spent; no tool ran. Submit your "
                    f"patch now.",
                    truncated=False,
                    charge=False,
                )
            session.turns_used += 1
            try:
                output, truncated = self._run_tool(session, tool, args)
                ok, error = True, None
            except _ToolError as problem:
                output, truncated, ok, error = "", False, False, str(problem)
            except OSError as problem:  # e.g. a full disk, a name the file system refuses
                output, truncated, ok = "", False, False
                error = f"{tool}: the file system refused: {problem.strerror or problem}"
            except Exception as problem:  # a tool bug must still be an observation, not a 500
                logger.exception("session %s: tool %r raised", session_id, tool)
                output, truncated, ok = "", False, False
                error = f"internal error in the executor ({type(problem).__name__}); try again"
            return self._result(
                session, start, ok=ok, output=output, error=error, truncated=truncated
            )

    def diff(self, session_id: str) -> str:
        """The tree's unified diff against base_commit (module docstring). Raises
        SessionNotFoundError, DiffTooLargeError."""
        session = self._ready_session(session_id)
        with session.lock:
            if session.closed:
                raise SessionNotFoundError(self._not_found_message(session_id))
            patch = self._git_diff(session)
            session.last_active = time.monotonic()
            return patch

    def info(self, session_id: str) -> dict[str, Any]:
        """GET /session/{id}'s body (never waits for a call in progress)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed or not session.ready.is_set():
            raise SessionNotFoundError(self._not_found_message(session_id))
        return self._info(session)

    def close(self, session_id: str) -> None:
        """Closes the session and removes its tree (after a call in progress ends). Raises
        SessionNotFoundError when there is no such open session."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise SessionNotFoundError(self._not_found_message(session_id))
        session.ready.wait()
        self._close(session, "closed", None)

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- from the event loop ---------------------------------------------------------------------

    async def in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the manager's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def call_async(self, session_id: str, tool: str, args: Any) -> CallResult:
        """`call` from the event loop: calls queued on one session wait here, one at a time."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(self._not_found_message(session_id))
        async with session.async_lock:
            return await self.in_pool(self.call, session_id, tool, args)

    # -- internals ------------------------------------------------------------------------------

    def _ready_session(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(self._not_found_message(session_id))
        session.ready.wait()
        if session.open_error is not None:
            raise SessionNotFoundError(f"session {session_id!r} failed to open")
        return session

    def _not_found_message(self, session_id: str) -> str:
        with self._lock:
            reason = self._closed.get(session_id)
        shown = repr(session_id[:200])
        if reason is None:
            return f"unknown session id {shown}: open it with POST /session/open"
        return f"session {shown} is {reason}; open a new session"

    def _prepare(self, session: _Session) -> None:
        """The checkout (module docstring): tree at base_commit, git dir moved out of it."""
        session.dir.mkdir(parents=True)
        cache = repo_cache.RepoCache(self.pipeline_config.cache_path(self.work_root))
        try:
            cache.checkout(session.spec.repo, session.spec.base_commit, session.tree)
        except repo_cache.RepoCacheError as error:
            raise pipeline.InfrastructureError(str(error)) from error
        os.rename(session.tree / ".git", session.git_dir)

    def _close(self, session: _Session, reason: str, timeout_s: float | None) -> None:
        acquired = session.lock.acquire(timeout=-1 if timeout_s is None else timeout_s)
        try:
            with self._lock:
                if session.closed:
                    return
                session.closed = True
                if self._sessions.get(session.id) is session:
                    del self._sessions[session.id]
                self._closed[session.id] = reason
                while len(self._closed) > _MAX_CLOSED_REMEMBERED:
                    self._closed.popitem(last=False)
            if not acquired:
                # A call still running past the shutdown grace: its tree goes at the next start.
                logger.warning("session %s still busy at shutdown; its tree stays", session.id)
                return
            problem = cleanup.remove_tree(session.dir, trash_dir=cleanup.trash_path(self.work_root))
            if problem:
                logger.warning("session %s: %s", session.id, problem)
            logger.info("session %s %s", session.id, reason)
        finally:
            if acquired:
                session.lock.release()

    def _reap_loop(self) -> None:
        period_s = min(5.0, max(0.05, self.config.idle_timeout_s / 4))
        while not self._stopping.wait(period_s):
            now = time.monotonic()
            with self._lock:
                idle = [
                    s
                    for s in self._sessions.values()
                    if s.ready.is_set() and now - s.last_active > self.config.idle_timeout_s
                ]
            for session in idle:
                if not session.lock.acquire(blocking=False):
                    continue  # a call is running: not idle
                try:
                    still_idle = time.monotonic() - session.last_active > self.config.idle_timeout_s
                finally:
                    session.lock.release()
                if still_idle:
                    self._close(
                        session,
                        f"expired: idle for more than {self.config.idle_timeout_s:g} s "
                        f"(sessions.idle_timeout_s)",
                        None,
                    )

    # -- budgets --------------------------------------------------------------------------------

    def _budget(self, session: _Session) -> dict[str, float]:
        config = self.config
        return {
            "turns_left": max(0, config.max_turns - session.turns_used),
            "wall_s_left": max(0.0, config.max_wall_s - (time.monotonic() - session.opened_at)),
            "cpu_s_left": max(0.0, config.max_cpu_s - session.cpu_s_used),
            "output_bytes_left": max(0, config.max_output_bytes - session.output_bytes_used),
        }

    def _spent(self, session: _Session) -> str:
        """The name of a spent budget ("" when none is)."""
        budget = self._budget(session)
        for key, name in (
            ("turns_left", "turns"),
            ("wall_s_left", "wall-clock"),
            ("cpu_s_left", "test-time (cpu_s)"),
            ("output_bytes_left", "output"),
        ):
            if budget[key] <= 0:
                return name
        return ""

    def _info(self, session: _Session) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "session_id": session.id,
            "turns_used": session.turns_used,
            "budget": self._budget(session),
            "exhausted": bool(self._spent(session)),
            "idle_s": now - session.last_active,
            "age_s": now - session.opened_at,
            "idle_timeout_s": self.config.idle_timeout_s,
        }

    def _result(
        self,
        session: _Session,
        start: float,
        *,
        ok: bool,
        output: str,
        error: str | None,
        truncated: bool,
        charge: bool = True,
    ) -> CallResult:
        if charge:
            left = max(0, self.config.max_output_bytes - session.output_bytes_used)
            error_bytes = len(error.encode("utf-8", "replace")) if error else 0
            encoded = output.encode("utf-8", "replace")
            if len(encoded) + error_bytes > left:
                keep = max(0, left - error_bytes)
                output = encoded[:keep].decode("utf-8", "ignore")
                output += "\n[output cut: the session's output budget is spent]"
                truncated = True
                encoded = output.encode("utf-8", "replace")
            session.output_bytes_used += len(encoded) + error_bytes
        session.last_active = time.monotonic()
        return CallResult(
            ok=ok,
            output=output,
            error=error,
            truncated=truncated,
            elapsed_s=time.monotonic() - start,
            exhausted=bool(self._spent(session)),
            budget=self._budget(session),
        )

    # -- tools ----------------------------------------------------------------------------------

    def _run_tool(self, session: _Session, tool: Any, args: Any) -> tuple[str, bool]:
        if not isinstance(tool, str) or tool not in TOOL_NAMES:
            raise _ToolError(
                f"unknown tool {str(tool)[:100]!r}; the tools are {', '.join(TOOL_NAMES)} "
                f"(and submit, which ends the episode)"
            )
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise _ToolError(
                f"{tool}: the arguments must be a JSON object of named arguments, got "
                f"{type(args).__name__}"
            )
        allowed = _TOOL_ARGS[tool]
        unknown = sorted(str(name)[:50] for name in args if name not in allowed)
        if unknown:
            raise _ToolError(
                f"{tool}: unknown argument(s) {', '.join(map(repr, unknown))}; {tool} takes "
                f"{', '.join(allowed) if allowed else 'no arguments'}"
            )
        if tool == "run_tests":
            return self._run_tests(session, args.get("tests"))
        tree_fd = os.open(session.tree, _DIR_PATH_FLAGS)
        try:
            if tool == "view":
                output = _view(
                    tree_fd, args.get("path"), args.get("start_line", 1), args.get("end_line")
                )
            elif tool == "search":
                output = _search(
                    tree_fd, args.get("pattern"), args.get("path", "."), args.get("regex", False)
                )
            elif tool == "replace":
                output = _replace(tree_fd, args.get("path"), args.get("old"), args.get("new"))
            else:
                output = _write_file(tree_fd, args.get("path"), args.get("content"))
        finally:
            os.close(tree_fd)
        return _cut_head(output, self.config.max_tool_output_bytes)

    def _run_tests(self, session: _Session, tests: Any) -> tuple[str, bool]:
        spec = session.spec
        pytest_args = self._pytest_args(session, tests)
        config = self.pipeline_config
        budget = self._budget(session)
        base = config.limits(spec.timeout_s)
        # A run may use at most what is left of the session's time budgets.
        wall_s = max(1.0, min(base.wall_timeout_s, budget["cpu_s_left"], budget["wall_s_left"]))
        limits = dataclasses.replace(
            config.runner_limits(spec.timeout_s),
            sandbox=dataclasses.replace(
                base,
                wall_timeout_s=wall_s,
                cpu_s=max(1, min(base.cpu_s, math.ceil(budget["cpu_s_left"]))),
                max_output_bytes=2 * self.config.max_tool_output_bytes,
            ),
        )
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="runner-", dir=session.dir))
        try:
            with self._environment(spec) as (image, interpreter, repo_env):
                result, _ = runner.run_pytest(
                    pytest_args,
                    session.tree,
                    scratch,
                    limits,
                    canaries=False,
                    hidden_paths=[self.work_root, config.cache_path(self.work_root)],
                    image=image,
                    interpreter=interpreter,
                    worktree_dir=pathlib.Path(spec.repo_path)
                    if image is not None
                    else runner.SANDBOX_WORKTREE,
                    repo_env=repo_env,
                    protect_test_code=False,
                )
        except isolation.SandboxUnavailableError as error:
            raise _ToolError(
                f"run_tests: the executor's sandbox could not start ({error}); this is not your "
                f"doing: try again later"
            ) from None
        except images.ImageError as error:
            raise _ToolError(f"run_tests: the task's image cannot run the tests: {error}") from None
        finally:
            cleanup.remove_tree(scratch)
        session.cpu_s_used += result.wall_s
        if result.timed_out:
            footer = f"[run_tests: killed at the wall-clock limit of {wall_s:.0f} s]"
        elif result.exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
            footer = f"[run_tests: killed at the CPU-time limit of {limits.sandbox.cpu_s} s]"
        else:
            footer = f"[run_tests: pytest exit status {result.exit_code}; {result.wall_s:.1f} s]"
        # The runner's report path is noise to the agent (and random per run).
        output = "\n".join(
            line
            for line in result.output.rstrip("\n").split("\n")
            if "generated xml file: /.dockyard/" not in line
        )
        text, truncated = _cut_tail(output, self.config.max_tool_output_bytes - len(footer) - 1)
        # The sandbox keeps a head and a tail of larger outputs; the tail is what we show.
        omitted = result.num_output_bytes > limits.sandbox.max_output_bytes
        return f"{text}\n{footer}", truncated or omitted

    @contextlib.contextmanager
    def _environment(self, spec: TaskSpec):
        """(image, interpreter, repo_env) the task's tests run with, leased for one run, as the
        pipeline does (pipeline.score_task)."""
        if spec.requirements:
            with pipeline.repo_env_cache(self.pipeline_config, self.work_root).lease(
                spec.requirements
            ) as env:
                yield None, None, env.root
        elif spec.image is not None:
            try:
                lease = pipeline.image_cache(self.pipeline_config, self.work_root).lease(spec.image)
            except images.ImageUnavailableError as error:
                raise _ToolError(f"run_tests: the task's image is unavailable: {error}") from None
            with lease as image:
                yield image, runner.image_interpreter(image, spec.test_command), None
        else:
            yield None, None, None

    def _pytest_args(self, session: _Session, tests: Any) -> list[str]:
        spec = session.spec
        if tests is None:
            args = runner.pytest_arguments(spec.test_command)
            if args is not None:
                return args
            if spec.test_harness is not None:
                raise _ToolError(
                    "run_tests: this task's tests run through the SWE-bench harness, not a "
                    "pytest command; name the test files or node ids to run"
                )
            files = []
            if spec.test_patch:
                _, kept = pipeline.test_files_of(spec.test_patch)
                files = [path for path in kept if os.path.isfile(session.tree / path)]
            # Held-out test files that do not exist yet are not run; without any, the suite.
            return [*_PYTEST_FLAGS, *files]
        if not isinstance(tests, list) or not tests:
            raise _ToolError(
                "run_tests: `tests` must be a non-empty list of pytest node ids or paths "
                '(e.g. ["tests/test_x.py::test_name"]), or null for the task\'s test command'
            )
        if len(tests) > _MAX_TEST_IDS:
            raise _ToolError(f"run_tests: at most {_MAX_TEST_IDS} node ids per call")
        tree_fd = os.open(session.tree, _DIR_PATH_FLAGS)
        try:
            for test in tests:
                _check_test_id(tree_fd, test)
        finally:
            os.close(tree_fd)
        return [*_PYTEST_FLAGS, *tests]

    def _git_diff(self, session: _Session) -> str:
        index = session.dir / f"index-{secrets.token_hex(4)}"
        out = session.dir / f"diff-{secrets.token_hex(4)}"
        try:
            # A copy of the checkout's index: its stat data spares git re-hashing unchanged files.
            # copy2, not copyfile: git trusts an entry's stat data only when the file is older
            # than the index file ("racy git"); a copy with a fresh mtime made an edit within the
            # checkout's second, same size and inode (mul's `a + b` -> `a * b`), look unchanged,
            # and the diff came back empty.
            shutil.copy2(session.git_dir / "index", index)
            env = {**_GIT_ENV, "GIT_INDEX_FILE": str(index)}
            git = [
                "git",
                "--git-dir",
                str(session.git_dir),
                "--work-tree",
                str(session.tree),
                "-c",
                "core.hooksPath=/dev/null",
                "-c",
                "core.fsmonitor=false",
                "-c",
                "core.symlinks=true",
            ]
            _run(
                [
                    *git,
                    "add",
                    "--all",
                    "--",
                    ".",
                    ":(exclude,glob)**/__pycache__/**",
                    ":(exclude,glob)**/.pytest_cache/**",
                    ":(exclude,glob)**/*.pyc",
                ],
                env,
                session.tree,
            )
            with open(out, "wb") as sink:
                _run(
                    [
                        *git,
                        "diff",
                        "--cached",
                        "--binary",
                        "--no-color",
                        "--no-ext-diff",
                        "--no-textconv",
                        "HEAD",
                    ],
                    env,
                    session.tree,
                    stdout=sink,
                )
            size = out.stat().st_size
            if size > self.max_patch_bytes:
                raise DiffTooLargeError(
                    f"the session's diff is {size} bytes, more than the executor accepts as a "
                    f"patch (max_patch_bytes = {self.max_patch_bytes}); undo large edits "
                    f"(generated or data files) before submitting"
                )
            return out.read_text(encoding="utf-8", errors="surrogateescape")
        finally:
            for path in (index, out):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


_TOOL_ARGS = {
    "view": ("path", "start_line", "end_line"),
    "search": ("pattern", "path", "regex"),
    "replace": ("path", "old", "new"),
    "write_file": ("path", "content"),
    "run_tests": ("tests",),
}

_GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_OPTIONAL_LOCKS": "0",
}


def _run(argv: list[str], env: dict[str, str], cwd: pathlib.Path, stdout=None) -> None:
    """Runs git on our own session directories; a failure is the executor's, never the agent's
    (the tree holds only regular files and directories the tools wrote)."""
    result = subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout if stdout is not None else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=_GIT_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        command = next((word for word in argv if word in ("add", "diff")), "")
        stderr = result.stderr.decode(errors="replace").strip()[-1000:]
        raise pipeline.InfrastructureError(
            f"git {command} failed on a session tree (exit {result.returncode}): {stderr}"
        )


# -- output bounds ----------------------------------------------------------------------------


def _cut_head(text: str, max_bytes: int) -> tuple[str, bool]:
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text, False
    note = f"\n[... output cut at {max_bytes} bytes of {len(data)}: narrow the request]"
    return data[: max(0, max_bytes - len(note))].decode("utf-8", "ignore") + note, True


def _cut_tail(text: str, max_bytes: int) -> tuple[str, bool]:
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text, False
    note = f"[... {len(data) - max_bytes} earlier bytes of output cut ...]\n"
    keep = max(0, max_bytes - len(note))
    return note + data[len(data) - keep :].decode("utf-8", "ignore"), True


# -- paths ------------------------------------------------------------------------------------


def _parts(value: Any, name: str = "path", *, allow_root: bool = True) -> list[str]:
    """A tool's path argument -> its components; _ToolError for anything not a plain relative
    path inside the repository (module docstring)."""
    if not isinstance(value, str):
        raise _ToolError(
            f"{name}: must be a string, a path relative to the repository root (e.g. "
            f"'src/pkg/module.py'), got {type(value).__name__}"
        )
    if "\0" in value:
        raise _ToolError(f"{name}: contains a NUL byte; give a plain relative path")
    if len(value) > _MAX_PATH_CHARS:
        raise _ToolError(f"{name}: longer than {_MAX_PATH_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _ToolError(f"{name}: not valid Unicode text") from None
    if value.startswith("/") or value.startswith("~"):
        raise _ToolError(
            f"{name}: {value!r} is absolute; paths are relative to the repository root (e.g. "
            f"'src/pkg/module.py', or '.' for the root)"
        )
    parts = [part for part in value.split("/") if part not in ("", ".")]
    for part in parts:
        if part == "..":
            raise _ToolError(
                f"{name}: {value!r} contains '..'; paths must stay inside the repository"
            )
        if part.lower() == ".git":
            raise _ToolError(
                f"{name}: {value!r} names a .git directory, which the tools neither show nor change"
            )
        if len(part.encode("utf-8")) > _MAX_NAME_BYTES:
            raise _ToolError(f"{name}: a component of {value!r} is longer than 255 bytes")
    if not parts and not allow_root:
        raise _ToolError(f"{name}: names the repository root; give a file path")
    return parts


def _shown(parts: list[str], count: int | None = None) -> str:
    return "/".join(parts[:count]) or "."


def _open_parent(tree_fd: int, parts: list[str], *, create: bool = False) -> int:
    """An O_PATH descriptor of the directory holding `parts[-1]` (of the root for []), walked
    from the tree one component at a time without following any link. `create` makes missing
    directories. The caller closes it."""
    fd = os.dup(tree_fd)
    try:
        for depth, part in enumerate(parts[:-1], start=1):
            try:
                info = os.lstat(part, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise _ToolError(f"path: {_shown(parts, depth)!r} does not exist") from None
                os.mkdir(part, 0o755, dir_fd=fd)
                info = os.lstat(part, dir_fd=fd)
            if stat.S_ISLNK(info.st_mode):
                raise _ToolError(
                    f"path: {_shown(parts, depth)!r} is a symbolic link; the tools never follow "
                    f"links: use the real path of what it points to"
                )
            if not stat.S_ISDIR(info.st_mode):
                raise _ToolError(f"path: {_shown(parts, depth)!r} is not a directory")
            child = os.open(part, _DIR_PATH_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _lstat_last(parent_fd: int, parts: list[str]) -> os.stat_result | None:
    """lstat of the last component (None when it does not exist); refuses links by name."""
    try:
        info = os.lstat(parts[-1], dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        raise _ToolError(
            f"path: {_shown(parts)!r} is a symbolic link; the tools never follow links: use the "
            f"real path of what it points to"
        )
    return info


def _read_regular(parent_fd: int, name: str, shown: str) -> bytes:
    """The bytes of a regular file (at most MAX_FILE_BYTES), opened without following links."""
    try:
        fd = os.open(name, _FILE_READ_FLAGS, dir_fd=parent_fd)
    except OSError as error:
        raise _ToolError(f"path: cannot open {shown!r}: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _ToolError(f"path: {shown!r} is not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise _ToolError(
                f"path: {shown!r} is {info.st_size} bytes, more than the {MAX_FILE_BYTES}-byte "
                f"limit of the tools; use search to find what you need in it"
            )
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise _ToolError(f"path: {shown!r} is larger than the {MAX_FILE_BYTES}-byte limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _text_of(data: bytes, shown: str, *, strict: bool) -> str:
    if b"\0" in data[:_BINARY_SNIFF_BYTES]:
        raise _ToolError(f"path: {shown!r} is a binary file; the tools handle text files only")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if strict:
            raise _ToolError(
                f"path: {shown!r} is not UTF-8 text; replace cannot edit it (write_file can "
                f"replace the whole file)"
            ) from None
        return data.decode("utf-8", "replace")


def _lines(text: str) -> list[str]:
    """Lines as editors number them: split at \\n only (a trailing newline ends the last)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _write_bytes(parent_fd: int, name: str, data: bytes, *, create: bool) -> None:
    flags = _FILE_WRITE_FLAGS | os.O_TRUNC | (os.O_CREAT if create else 0)
    fd = os.open(name, flags, 0o644, dir_fd=parent_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _ToolError(f"path: {name!r} is not a regular file")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _int_arg(value: Any, name: str, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _ToolError(f"{name}: must be an integer, got {type(value).__name__} {value!r:.50}")
    return value


def _text_arg(value: Any, name: str, *, max_bytes: int = MAX_FILE_BYTES) -> str:
    if not isinstance(value, str):
        raise _ToolError(f"{name}: must be a string, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _ToolError(f"{name}: not valid Unicode text (an unpaired surrogate)") from None
    if size > max_bytes:
        raise _ToolError(f"{name}: {size} bytes, more than the {max_bytes}-byte limit")
    return value


# -- the host-side tools ----------------------------------------------------------------------


def _view(tree_fd: int, path: Any, start_line: Any, end_line: Any) -> str:
    parts = _parts(path)
    start = _int_arg(start_line, "start_line", 1)
    end = _int_arg(end_line, "end_line", None)
    if start < 1:
        raise _ToolError(f"start_line: must be >= 1, got {start}")
    if end is not None and end < start:
        raise _ToolError(f"end_line: must be >= start_line ({start}) or null, got {end}")
    parent = _open_parent(tree_fd, parts)
    try:
        if parts:
            info = _lstat_last(parent, parts)
            if info is None:
                raise _ToolError(f"path: {_shown(parts)!r} does not exist")
            if stat.S_ISDIR(info.st_mode):
                return _list_dir(os.open(parts[-1], _DIR_LIST_FLAGS, dir_fd=parent), parts)
            text = _text_of(
                _read_regular(parent, parts[-1], _shown(parts)), _shown(parts), strict=False
            )
        else:
            return _list_dir(os.open(".", _DIR_LIST_FLAGS, dir_fd=parent), parts)
    finally:
        os.close(parent)
    lines = _lines(text)
    if not lines:
        return f"({_shown(parts)} is empty)"
    if start > len(lines):
        raise _ToolError(
            f"start_line: {start} is past the end of {_shown(parts)!r} ({len(lines)} lines)"
        )
    last = min(len(lines), end if end is not None else len(lines), start + MAX_VIEW_LINES - 1)
    shown = [f"{number:>5}\t{lines[number - 1]}" for number in range(start, last + 1)]
    if last < len(lines) and (end is None or last < end):
        shown.append(
            f"[showing lines {start}-{last} of {len(lines)}; at most {MAX_VIEW_LINES} at a time: "
            f"view again with start_line={last + 1}]"
        )
    return "\n".join(shown)


def _list_dir(fd: int, parts: list[str]) -> str:
    try:
        with os.scandir(fd) as entries:
            names = []
            for entry in entries:
                if entry.name == ".git":
                    continue
                if entry.is_symlink():
                    names.append(f"{entry.name}@")  # a link: listed, never followed
                elif entry.is_dir(follow_symlinks=False):
                    names.append(f"{entry.name}/")
                else:
                    names.append(entry.name)
    finally:
        os.close(fd)
    return directory_listing(names, _shown(parts))


def directory_listing(names: list[str], shown_path: str) -> str:
    """What `view` answers for a directory holding `names` (directories with a trailing "/",
    links with "@"): the names sorted, at most _MAX_DIR_ENTRIES of them. Tool demonstrations
    (environments/tool_demonstrations.py) render their observations with it."""
    names = sorted(names)
    if not names:
        return f"({shown_path} is an empty directory)"
    more = len(names) - _MAX_DIR_ENTRIES
    shown = names[:_MAX_DIR_ENTRIES]
    if more > 0:
        shown.append(f"... {more} more entries")
    return "\n".join(shown)


def _search(tree_fd: int, pattern: Any, path: Any, use_regex: Any) -> str:
    if not isinstance(use_regex, bool):
        raise _ToolError(f"regex: must be true or false, got {type(use_regex).__name__}")
    pattern = _text_arg(pattern, "pattern", max_bytes=_MAX_PATTERN_CHARS * 4)
    if not pattern:
        raise _ToolError("pattern: must not be empty")
    if len(pattern) > _MAX_PATTERN_CHARS:
        raise _ToolError(f"pattern: longer than {_MAX_PATTERN_CHARS} characters")
    if "\n" in pattern:
        raise _ToolError("pattern: must not contain a newline (search matches one line at a time)")
    parts = _parts(path)
    matcher = _matcher(pattern, use_regex)
    results: list[str] = []
    num_matches = 0
    stats = {"files": 0, "bytes": 0, "stopped": ""}

    def scan(parent_fd: int, name: str, shown: str) -> None:
        nonlocal num_matches
        try:
            fd = os.open(name, _FILE_READ_FLAGS, dir_fd=parent_fd)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
                return
            data = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        stats["files"] += 1
        stats["bytes"] += len(data)
        if b"\0" in data[:_BINARY_SNIFF_BYTES]:
            return
        text = data.decode("utf-8", "replace")
        if not use_regex and pattern not in text:
            return
        for number, line in enumerate(_lines(text), start=1):
            if matcher(line):
                num_matches += 1
                if len(results) < MAX_SEARCH_RESULTS:
                    cut = line[:_MAX_SHOWN_LINE_CHARS] + (
                        "…" if len(line) > _MAX_SHOWN_LINE_CHARS else ""
                    )
                    results.append(f"{shown}:{number}:{cut}")

    parent = _open_parent(tree_fd, parts)
    try:
        info = _lstat_last(parent, parts) if parts else os.fstat(parent)
        if info is None:
            raise _ToolError(f"path: {_shown(parts)!r} does not exist")
        if parts and not stat.S_ISDIR(info.st_mode):
            if not stat.S_ISREG(info.st_mode):
                raise _ToolError(f"path: {_shown(parts)!r} is not a regular file or directory")
            scan(parent, parts[-1], _shown(parts))
        else:
            top = os.open(parts[-1] if parts else ".", _DIR_LIST_FLAGS, dir_fd=parent)
            _walk_files(top, "/".join(parts), scan, stats)
    finally:
        os.close(parent)
    if not results:
        answer = f"no matches for {pattern!r} in {_shown(parts)}"
    else:
        answer = "\n".join(results)
        if num_matches > len(results):
            answer += (
                f"\n... {num_matches - len(results)} more matches (narrow the path or the pattern)"
            )
    if stats["stopped"]:
        answer += f"\n[search stopped early: {stats['stopped']}; narrow the path]"
    return answer


def _matcher(pattern: str, use_regex: bool) -> Callable[[str], bool]:
    if not use_regex:
        return lambda line: pattern in line
    try:
        import regex  # noqa: PLC0415 - only regex searches need it
    except ImportError:
        raise _ToolError(
            "regex: regular-expression search is not available on this executor (the `regex` "
            "package is missing); search with regex=false"
        ) from None
    try:
        compiled = regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError) as error:
        raise _ToolError(f"pattern: not a valid regular expression: {error}") from None
    deadline = time.monotonic() + SEARCH_TIME_S

    def match(line: str) -> bool:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return compiled.search(line, timeout=left) is not None
        except TimeoutError:
            raise _ToolError(
                f"pattern: the regular expression ran for more than {SEARCH_TIME_S:g} s "
                f"(catastrophic backtracking?); simplify it, or search for a literal with "
                f"regex=false"
            ) from None

    return match


def _walk_files(
    top_fd: int, top: str, visit: Callable[[int, str, str], None], stats: dict[str, Any]
) -> None:
    """Calls visit(dir_fd, name, shown path) for every regular file below `top_fd` (closed
    here), depth first in name order, skipping caches, .git and links; bounded by file count and
    bytes read (stats["stopped"] says why it stopped)."""
    stack: list[tuple[int, str, list[str]]] = []

    def push(fd: int, prefix: str) -> None:
        try:
            with os.scandir(fd) as entries:
                names = sorted(
                    (entry.name, entry.is_dir(follow_symlinks=False))
                    for entry in entries
                    if not entry.is_symlink()
                )
        except OSError:
            names = []
        stack.append((fd, prefix, names[::-1]))

    push(top_fd, top)
    try:
        while stack:
            fd, prefix, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                continue
            if stats["files"] >= _MAX_SEARCH_FILES or stats["bytes"] >= _MAX_SEARCH_BYTES:
                stats["stopped"] = f"{stats['files']} files ({stats['bytes']} bytes) read"
                return
            name, is_dir = pending.pop()
            shown = f"{prefix}/{name}" if prefix else name
            if is_dir:
                if name in _SKIPPED_DIRS:
                    continue
                try:
                    child = os.open(name, _DIR_LIST_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                push(child, shown)
            else:
                visit(fd, name, shown)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _replace(tree_fd: int, path: Any, old: Any, new: Any) -> str:
    parts = _parts(path, allow_root=False)
    old = _text_arg(old, "old")
    new = _text_arg(new, "new")
    if not old:
        raise _ToolError("old: must not be empty (to create a file, use write_file)")
    parent = _open_parent(tree_fd, parts)
    try:
        info = _lstat_last(parent, parts)
        if info is None:
            raise _ToolError(f"path: {_shown(parts)!r} does not exist (write_file creates files)")
        if not stat.S_ISREG(info.st_mode):
            raise _ToolError(f"path: {_shown(parts)!r} is not a regular file")
        text = _text_of(_read_regular(parent, parts[-1], _shown(parts)), _shown(parts), strict=True)
        count = text.count(old)
        if count == 0:
            hint = (
                " (it does occur with different leading/trailing whitespace: copy the exact text)"
                if old.strip() and old.strip() in text
                else ""
            )
            raise _ToolError(
                f"old: not found in {_shown(parts)} (0 occurrences){hint}; it must match the "
                f"file exactly, indentation included: view the file and copy the text"
            )
        if count > 1:
            starts, at = [], text.find(old)
            while at >= 0 and len(starts) < 10:
                starts.append(text.count("\n", 0, at) + 1)
                at = text.find(old, at + 1)
            raise _ToolError(
                f"old: occurs {count} times in {_shown(parts)} (at lines "
                f"{', '.join(map(str, starts))}); include more surrounding lines so that it "
                f"occurs exactly once"
            )
        at = text.find(old)
        updated = text[:at] + new + text[at + len(old) :]
        data = updated.encode("utf-8")
        if len(data) > MAX_FILE_BYTES:
            raise _ToolError(
                f"new: the file would be {len(data)} bytes, over the {MAX_FILE_BYTES}-byte limit"
            )
        _write_bytes(parent, parts[-1], data, create=False)
    finally:
        os.close(parent)
    first = text.count("\n", 0, at) + 1
    lines = _lines(updated)
    last = first + max(new.count("\n"), 0)
    low, high = max(1, first - 2), min(len(lines), last + 2, first + 40)
    snippet = "\n".join(f"{n:>5}\t{lines[n - 1]}" for n in range(low, high + 1))
    return f"replaced 1 occurrence in {_shown(parts)}; lines {low}-{high} now read:\n{snippet}"


def _write_file(tree_fd: int, path: Any, content: Any) -> str:
    parts = _parts(path, allow_root=False)
    content = _text_arg(content, "content")
    parent = _open_parent(tree_fd, parts, create=True)
    try:
        info = _lstat_last(parent, parts)
        if info is not None and not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise _ToolError(f"path: {_shown(parts)!r} is {kind}; give a file path")
        data = content.encode("utf-8")
        _write_bytes(parent, parts[-1], data, create=True)
    finally:
        os.close(parent)
    what = "overwrote" if info is not None else "created"
    return f"{what} {_shown(parts)} ({len(_lines(content))} lines, {len(data)} bytes)"


def _check_test_id(tree_fd: int, test: Any) -> None:
    if not isinstance(test, str) or not test.strip():
        raise _ToolError(
            f"tests: every entry must be a non-empty string (a node id such as "
            f"'tests/test_x.py::test_name' or a path), got {str(test)[:100]!r}"
        )
    if len(test) > _MAX_TEST_ID_CHARS:
        raise _ToolError(f"tests: a node id is longer than {_MAX_TEST_ID_CHARS} characters")
    if test.startswith("-"):
        raise _ToolError(
            f"tests: {test[:100]!r} starts with '-': only node ids and paths are accepted, no "
            f"pytest options"
        )
    if "\0" in test:
        raise _ToolError("tests: a node id contains a NUL byte")
    path = test.split("::", 1)[0]
    parts = _parts(path, "tests")
    parent = _open_parent(tree_fd, parts)
    try:
        if parts and _lstat_last(parent, parts) is None:
            raise _ToolError(f"tests: {_shown(parts)!r} does not exist in the repository")
    finally:
        os.close(parent)
