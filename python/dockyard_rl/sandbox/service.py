"""The task executor service: an aiohttp app in front of a bounded pool of scoring workers.

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

Every error body is JSON {"error": "<message>", "field": "<field or null>"}.

How a task flows: the submission is validated, written to the SQLite store (store.py) and only then
acknowledged, so an accepted task survives a crash; its id goes on an in-memory queue that
`num_workers` threads drain, each calling the scoring function (pipeline.score_task by default) for
one task at a time. Threads suffice: scoring is subprocesses (git, pytest under bubblewrap), so
workers spend their time waiting, not holding the GIL. The queue is bounded by admission control
(`max_queue` QUEUED tasks in the store), not by the in-memory queue, so re-queued tasks from a
restart or a retry are never refused.

Retries: only `pipeline.InfrastructureError` (a clone that failed, bubblewrap that could not start,
a full disk) is retried, after `retry_backoff_s * 2**(attempt - 1)` seconds, up to
`max_infra_attempts` attempts; then the task is INFRA_ERROR. A patch that fails its tests is a
verdict, never a retry. A ValueError from the scoring function means the task itself cannot be
scored (the pipeline's contract): INFRA_ERROR at once, error "invalid task: ...". Any other
exception is a bug in the executor: INFRA_ERROR at once, error "internal error: ...". Neither is
retried: running the same input again would fail the same way. Most invalid tasks never get that
far: `check_scorable` runs the pipeline's repo / base_commit / test_patch checks at submission
(400).

Security scope: this module authenticates callers (optional bearer token, compared in constant
time), bounds what they may send (body and patch sizes, queue depth, a task_id alphabet that is safe
in paths) and binds 127.0.0.1 unless told otherwise (config.py refuses a non-loopback host without a
token). Isolation of the code under test is the pipeline's job (bubblewrap, rlimits), not this
one's.

Shutdown: the HTTP server stops first (in-flight requests finish), then workers finish their
current task within `shutdown_grace_s`; a task still running after that is put back to QUEUED
without spending its attempt, so the next start re-runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import pathlib
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import prometheus_client
from aiohttp import web

from dockyard_rl.sandbox import pipeline, repo_cache, runner, swebench_harness
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.metrics import ExecutorMetrics, ImageStatsFn
from dockyard_rl.sandbox.store import (QueueFullError, RecoveryReport, TaskConflictError,
                                       TaskRecord, TaskStore)
from dockyard_rl.sandbox.task import TaskSpec, TaskStatus, TaskValidationError, Verdict

logger = logging.getLogger(__name__)

# Scores one task: (spec with its timeout filled in, the executor's work root) -> verdict.
# Raises pipeline.InfrastructureError for failures outside the patch (those are retried).
ScoreFn = Callable[[TaskSpec, pathlib.Path], Verdict]

# Client task ids end up in log lines and may name directories: keep them to a safe alphabet.
_TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Submissions carry two patches plus small fields (ids, test lists, commands); this is the room
# allowed for everything but the patches before the body itself is refused with 413.
_BODY_OVERHEAD_BYTES = 1 << 20


class ShuttingDownError(Exception):
    """The executor is stopping and accepts no new tasks (the service answers 503)."""


def pipeline_score_fn(pipeline_config: pipeline.PipelineConfig) -> ScoreFn:
    """The production scoring function: pipeline.score_task with the given configuration."""
    return functools.partial(_score_with_pipeline, pipeline_config)


def _score_with_pipeline(pipeline_config: pipeline.PipelineConfig, spec: TaskSpec,
                         work_root: pathlib.Path) -> Verdict:
    return pipeline.score_task(spec, pipeline_config, work_root)


def check_scorable(spec: TaskSpec) -> None:
    """The pipeline's own checks of repo, base_commit, test_patch, test_command and test_harness,
    run at submission so that a task that could never be scored is a 400 now rather than an
    infra_error later.

    Raises TaskValidationError naming the field. A local repo path must exist on this machine.
    """
    for field, check in (("repo", lambda: repo_cache.normalize_repo(spec.repo)),
                         ("base_commit", lambda: repo_cache.validate_commit(spec.base_commit)),
                         ("test_patch", lambda: pipeline.test_files_of(spec.test_patch)),
                         ("test_command", lambda: runner.pytest_arguments(spec.test_command)),
                         ("test_harness", lambda: spec.test_harness and
                          swebench_harness.parse_harness(spec.test_harness))):
        try:
            check()
        except ValueError as error:
            message = str(error)
            if message.startswith(f"{field}: "):
                message = message[len(field) + 2:]
            raise TaskValidationError(field, message) from None


class TaskExecutor:
    """The store, the queue and the worker threads; no HTTP (see `create_app`).

    Call order: `start()` once (recovers unfinished tasks from the store, starts the workers), then
    `submit()` / `get()` from any thread, then `stop()` once (safe to repeat).
    """

    def __init__(self, config: ExecutorConfig, score_fn: ScoreFn | None = None, *,
                 image_stats: ImageStatsFn | None = None):
        """`image_stats`, when given, reports the unpacked-image cache on /metrics (see
        metrics.ImageStatsFn); with the default (pipeline) scoring it is the pipeline's own image
        cache."""
        self.config = config
        self._score_fn = (score_fn if score_fn is not None
                          else pipeline_score_fn(config.pipeline))
        if score_fn is None and image_stats is None:
            def image_stats() -> dict[str, float]:
                return pipeline.image_cache(config.pipeline, config.work_path).stats()
        self._store = TaskStore(config.db_file)
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._metrics = ExecutorMetrics(num_workers=config.num_workers, counts=self._store.counts,
                                        num_workers_alive=lambda: self.num_workers_alive,
                                        image_stats=image_stats)
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._running: set[str] = set()
        self._retry_timers: set[threading.Timer] = set()
        self._accepting = False
        self._stopping = threading.Event()  # workers start no new task once set
        self._abandoned = False  # set when stop() gave up on running tasks: workers write nothing

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> RecoveryReport:
        assert not self._workers, "start() called twice"
        self.config.work_path.mkdir(parents=True, exist_ok=True)
        # A killed executor leaves its in-flight tasks' directories behind; those tasks are
        # re-queued below and get fresh directories.
        num_stale = pipeline.remove_stale_task_dirs(self.config.work_path)
        if num_stale:
            logger.warning("removed %d task directories left by a previous executor", num_stale)
        report = self._store.recover(self.config.max_infra_attempts)
        if report.requeued or report.failed:
            logger.warning("recovered %d unfinished task(s) from %s; %d out of attempts marked "
                           "infra_error", len(report.requeued), self.config.db_file,
                           len(report.failed))
        for task_id in report.requeued:
            self._queue.put(task_id)
        for index in range(self.config.num_workers):
            worker = threading.Thread(target=self._worker_loop, name=f"executor-worker-{index}",
                                      daemon=True)
            worker.start()
            self._workers.append(worker)
        self._accepting = True
        return report

    def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting, lets running tasks finish within `grace_s` (default from the config),
        re-queues the ones that do not, and closes the store."""
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._accepting = False
            for timer in self._retry_timers:
                timer.cancel()  # the task stays QUEUED in the store: the next start re-runs it
            self._retry_timers.clear()
        # Workers take no new task once _stopping is set; ids left on the in-memory queue are
        # QUEUED in the store, so the next start runs them. The sentinels wake idle workers.
        for _ in self._workers:
            self._queue.put(None)
        deadline = time.monotonic() + grace_s
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._abandoned = True
            interrupted = sorted(self._running)
        for task_id in interrupted:
            if self._store.requeue_interrupted(task_id) is not None:
                logger.warning("task %s still running after %.1f s of shutdown grace; re-queued",
                               task_id, grace_s)
        self._workers.clear()
        self._store.close()

    # -- requests -------------------------------------------------------------------------------

    def submit(self, spec: TaskSpec) -> tuple[TaskRecord, bool]:
        """Records and enqueues a task; returns (record, created). `spec.task_id` must be set.

        Raises TaskConflictError, QueueFullError (see store.TaskStore.insert), ShuttingDownError.
        """
        if not self._accepting:
            raise ShuttingDownError("the executor is shutting down; submit to another executor "
                                    "or retry after it restarts")
        record, created = self._store.insert(spec, max_queued=self.config.max_queue)
        if created:
            self._queue.put(record.task_id)
        return record, created

    def get(self, task_id: str) -> TaskRecord | None:
        return self._store.get(task_id)

    def counts(self) -> dict[TaskStatus, int]:
        return self._store.counts()

    def all_records(self) -> list[TaskRecord]:
        return self._store.all_records()

    @property
    def num_workers_alive(self) -> int:
        return sum(worker.is_alive() for worker in self._workers)

    def metrics_exposition(self) -> bytes:
        """GET /metrics's body (reads the store: call it off the event loop)."""
        return self._metrics.exposition()

    def note_rejected(self, reason: str) -> None:
        self._metrics.rejected(reason)

    # -- workers --------------------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while True:
            task_id = self._queue.get()
            if task_id is None or self._stopping.is_set():
                return
            try:
                self._run_one(task_id)
            except Exception:  # keep the worker alive whatever one task does
                if self._abandoned:
                    return
                logger.exception("worker failed to record the outcome of task %s", task_id)

    def _run_one(self, task_id: str) -> None:
        record = self._store.start_attempt(task_id)
        with self._lock:
            self._running.add(task_id)
        started = time.monotonic()
        try:
            verdict = self._score_fn(record.spec, self.config.work_path)
        except pipeline.InfrastructureError as error:
            self._after_infra_error(record, f"{type(error).__name__}: {error}",
                                    time.monotonic() - started, retryable=True)
        except ValueError as error:
            # The pipeline's word for a task that can never be scored (e.g. a test_patch that
            # does not apply at base_commit); submission-time checks catch most of these.
            self._after_infra_error(record, f"invalid task: {error}",
                                    time.monotonic() - started, retryable=False)
        except Exception as error:
            logger.exception("scoring task %s raised a non-infrastructure exception", task_id)
            self._after_infra_error(record, f"internal error: {type(error).__name__}: {error}",
                                    time.monotonic() - started, retryable=False)
        else:
            if not self._abandoned:
                self._store.finish(task_id, verdict)
                self._metrics.verdict_recorded(verdict, time.monotonic() - started)
        finally:
            with self._lock:
                self._running.discard(task_id)

    def _after_infra_error(self, record: TaskRecord, error: str, duration_s: float,
                           retryable: bool) -> None:
        if self._abandoned:
            return
        if retryable and record.attempts < self.config.max_infra_attempts:
            delay_s = self.config.retry_backoff_s * 2 ** (record.attempts - 1)
            logger.warning("task %s attempt %d/%d: %s; retrying in %.1f s", record.task_id,
                           record.attempts, self.config.max_infra_attempts, error, delay_s)
            self._store.retry(record.task_id, error)
            self._metrics.retried()
            self._enqueue_later(record.task_id, delay_s)
            return
        logger.error("task %s failed after %d attempt(s): %s", record.task_id, record.attempts,
                     error)
        self._store.fail(record.task_id, error)
        self._metrics.infra_error_recorded(duration_s)

    def _enqueue_later(self, task_id: str, delay_s: float) -> None:
        def fire():
            with self._lock:
                self._retry_timers.discard(timer)
                if not self._accepting:
                    return  # stopping: the task is QUEUED in the store for the next start
            self._queue.put(task_id)

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        with self._lock:
            if not self._accepting:
                return
            self._retry_timers.add(timer)
        timer.start()


# -- HTTP --------------------------------------------------------------------------------------


def _error(status: int, message: str, field: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "field": field}, status=status, headers=headers)


def create_app(executor: TaskExecutor) -> web.Application:
    """The aiohttp application serving the routes in the module docstring."""
    config = executor.config
    expected_auth = (f"Bearer {config.auth_token}".encode()
                     if config.auth_token is not None else None)
    max_body_bytes = 2 * config.max_patch_bytes + _BODY_OVERHEAD_BYTES

    def unauthorized(request: web.Request) -> web.Response | None:
        if expected_auth is None:
            return None
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected_auth):
            return None
        executor.note_rejected("unauthorized")
        return _error(401, "missing or wrong bearer token: send `Authorization: Bearer <token>`",
                      "Authorization", headers={"WWW-Authenticate": 'Bearer realm="executor"'})

    async def submit(request: web.Request) -> web.Response:
        if (response := unauthorized(request)) is not None:
            return response
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            executor.note_rejected("too_large")
            return _error(413, f"request body exceeds {max_body_bytes} bytes "
                               f"(max_patch_bytes = {config.max_patch_bytes} per patch)", "body")
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
            num_bytes = len(getattr(spec, name).encode())
            if num_bytes > config.max_patch_bytes:
                executor.note_rejected("too_large")
                return _error(413, f"{name}: {num_bytes} bytes exceeds max_patch_bytes = "
                                   f"{config.max_patch_bytes}", name)
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
            return _error(400, f"task_id: must match {_TASK_ID_RE.pattern} (letters, digits, "
                               f"'.', '_', '-'; at most 128), got {spec.task_id[:200]!r}",
                          "task_id")
        try:
            # A thread: the store commits with fsync, which must not stall the event loop.
            record, created = await asyncio.to_thread(executor.submit, spec)
        except TaskConflictError as error:
            executor.note_rejected("conflict")
            return _error(409, str(error), "task_id")
        except QueueFullError as error:
            executor.note_rejected("queue_full")
            return _error(429, f"queue full: {error}; retry later", None,
                          headers={"Retry-After": str(config.retry_after_s)})
        except ShuttingDownError as error:
            return _error(503, str(error), None, headers={"Retry-After": str(config.retry_after_s)})
        return web.json_response({"task_id": record.task_id, "status": record.status.value},
                                 status=202 if created else 200)

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
            {"status": "ok" if num_alive > 0 else "no_workers",
             "workers": config.num_workers, "workers_alive": num_alive,
             "queue_depth": counts[TaskStatus.QUEUED], "running": counts[TaskStatus.RUNNING]},
            status=200 if num_alive > 0 else 503)

    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.to_thread(executor.metrics_exposition)
        # Passed as a header: aiohttp's content_type argument refuses a charset parameter.
        return web.Response(body=body,
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=max_body_bytes)
    app.add_routes([
        web.post("/task/submit", submit),
        web.get("/task/{task_id}", get_task),
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
    ])
    return app


@dataclasses.dataclass(frozen=True)
class RunningServer:
    url: str                  # http://host:port, with the port actually bound
    executor: TaskExecutor


@contextlib.asynccontextmanager
async def running_server(config: ExecutorConfig, score_fn: ScoreFn | None = None, *,
                         image_stats: ImageStatsFn | None = None) -> AsyncIterator[RunningServer]:
    """Starts the executor and its HTTP server; on exit shuts both down gracefully.

    With `config.port = 0` the OS picks a free port; `RunningServer.url` has the bound one.
    `image_stats` is passed to TaskExecutor.
    """
    executor = TaskExecutor(config, score_fn, image_stats=image_stats)
    executor.start()
    # HTTP requests here are short (no handler waits on scoring), so shutdown need not wait long;
    # lingering_time bounds how long the server drains the rest of a body it refused with 413.
    runner = web.AppRunner(create_app(executor), handle_signals=False, access_log=None,
                           shutdown_timeout=5.0, lingering_time=1.0)
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield RunningServer(url=f"http://{_url_host(host)}:{port}", executor=executor)
    finally:
        await runner.cleanup()  # stop accepting, finish in-flight requests
        await asyncio.to_thread(executor.stop)


@contextlib.asynccontextmanager
async def executor_url(url: str | None, *, work_dir: pathlib.Path, num_workers: int,
                       max_log_bytes: int | None = None) -> AsyncIterator[str]:
    """For command-line tools that score tasks: `url` itself when given (an executor running
    elsewhere), else the URL of an executor started here on 127.0.0.1 (a free port) for the
    duration, with `num_workers` workers and its records and worktrees under `work_dir`. Patches
    up to 16 MiB are accepted; `max_log_bytes` sets how much test output verdicts keep."""
    if url:
        yield url
        return
    pipeline_config = pipeline.PipelineConfig() if max_log_bytes is None \
        else pipeline.PipelineConfig(max_log_bytes=max_log_bytes)
    config = ExecutorConfig(port=0, num_workers=num_workers, work_dir=str(work_dir),
                            max_patch_bytes=16 * 1024 * 1024, retry_backoff_s=1.0,
                            pipeline=pipeline_config)
    async with running_server(config) as server:
        logger.info("executor with %d workers at %s", num_workers, server.url)
        yield server.url


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve(config: ExecutorConfig, stop: asyncio.Event,
                score_fn: ScoreFn | None = None,
                on_ready: Callable[[RunningServer], None] | None = None) -> None:
    """Runs the service until `stop` is set (the entry point sets it on SIGTERM / SIGINT)."""
    async with running_server(config, score_fn) as server:
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
