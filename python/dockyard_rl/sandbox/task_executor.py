"""The task executor's scoring side: `TaskExecutor`, a bounded pool of worker threads that score
the tasks recorded in the SQLite store; no HTTP (http_app.py serves it, server.py runs the two).

How a task flows: the submission is validated (http_app.py), written to the SQLite store (store.py)
and only then acknowledged, so an accepted task survives a crash; its id goes on an in-memory queue
that `num_workers` threads drain, each calling the scoring function (pipeline.score_task by default)
for one task at a time. Threads suffice: scoring is subprocesses (git, pytest under bubblewrap), so
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
far: `http_app.check_scorable` runs the pipeline's repo / base_commit / test_patch checks at
submission (400).

Shutdown (`stop`): workers finish their current task within `shutdown_grace_s`; a task still
running after that is put back to QUEUED without spending its attempt, so the next start re-runs
it.

Sessions: the executor also owns a `sessions.SessionManager` (`self.sessions`), the multi-turn
agents' working trees; `start` wipes what a previous run left of them and starts their idle
reaper, `stop` closes them all. They share nothing with the worker threads but the work root.

`pipeline_score_fn` is the production scoring function (pipeline.score_task), the default; tests
inject their own (`ScoreFn`).
"""

from __future__ import annotations

import functools
import logging
import pathlib
import queue
import threading
import time
from collections.abc import Callable

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.metrics import ExecutorMetrics, ImageStatsFn
from dockyard_rl.sandbox.sessions import SessionManager
from dockyard_rl.sandbox.store import RecoveryReport, TaskRecord, TaskStore
from dockyard_rl.sandbox.task import TaskSpec, TaskStatus, Verdict

logger = logging.getLogger(__name__)

# Scores one task: (spec with its timeout filled in, the executor's work root) -> verdict.
# Raises pipeline.InfrastructureError for failures outside the patch (those are retried).
ScoreFn = Callable[[TaskSpec, pathlib.Path], Verdict]


class ShuttingDownError(Exception):
    """The executor is stopping and accepts no new tasks (the service answers 503)."""


def pipeline_score_fn(pipeline_config: pipeline.PipelineConfig) -> ScoreFn:
    """The production scoring function: pipeline.score_task with the given configuration."""
    return functools.partial(_score_with_pipeline, pipeline_config)


def _score_with_pipeline(
    pipeline_config: pipeline.PipelineConfig, spec: TaskSpec, work_root: pathlib.Path
) -> Verdict:
    return pipeline.score_task(spec, pipeline_config, work_root)


class TaskExecutor:
    """The store, the queue and the worker threads; no HTTP (see `http_app.create_app`).

    Call order: `start()` once (recovers unfinished tasks from the store, starts the workers), then
    `submit()` / `get()` from any thread, then `stop()` once (safe to repeat).
    """

    def __init__(
        self,
        config: ExecutorConfig,
        score_fn: ScoreFn | None = None,
        *,
        image_stats: ImageStatsFn | None = None,
    ):
        """`image_stats`, when given, reports the unpacked-image cache on /metrics (see
        metrics.ImageStatsFn); with the default (pipeline) scoring it is the pipeline's own image
        cache."""
        self.config = config
        self._score_fn = score_fn if score_fn is not None else pipeline_score_fn(config.pipeline)
        if score_fn is None and image_stats is None:

            def image_stats() -> dict[str, float]:
                return pipeline.image_cache(config.pipeline, config.work_path).stats()

        self._store = TaskStore(config.db_file)
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._metrics = ExecutorMetrics(
            num_workers=config.num_workers,
            counts=self._store.counts,
            num_workers_alive=lambda: self.num_workers_alive,
            image_stats=image_stats,
        )
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._running: set[str] = set()
        self._retry_timers: set[threading.Timer] = set()
        self._accepting = False
        self._stopping = threading.Event()  # workers start no new task once set
        self._abandoned = False  # set when stop() gave up on running tasks: workers write nothing
        self.sessions = SessionManager(
            config.sessions, config.pipeline, config.work_path, config.max_patch_bytes
        )

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
            logger.warning(
                "recovered %d unfinished task(s) from %s; %d out of attempts marked infra_error",
                len(report.requeued),
                self.config.db_file,
                len(report.failed),
            )
        for task_id in report.requeued:
            self._queue.put(task_id)
        # Sessions do not survive a restart: their directories are wiped before any opens.
        self.sessions.start()
        for index in range(self.config.num_workers):
            worker = threading.Thread(
                target=self._worker_loop, name=f"executor-worker-{index}", daemon=True
            )
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
        self.sessions.stop(grace_s)
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
                logger.warning(
                    "task %s still running after %.1f s of shutdown grace; re-queued",
                    task_id,
                    grace_s,
                )
        self._workers.clear()
        self._store.close()

    # -- requests -------------------------------------------------------------------------------

    def submit(self, spec: TaskSpec) -> tuple[TaskRecord, bool]:
        """Records and enqueues a task; returns (record, created). `spec.task_id` must be set.

        Raises TaskConflictError, QueueFullError (see store.TaskStore.insert), ShuttingDownError.
        """
        if not self._accepting:
            raise ShuttingDownError(
                "the executor is shutting down; submit to another executor "
                "or retry after it restarts"
            )
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
            self._after_infra_error(
                record,
                f"{type(error).__name__}: {error}",
                time.monotonic() - started,
                retryable=True,
            )
        except ValueError as error:
            # The pipeline's word for a task that can never be scored (e.g. a test_patch that
            # does not apply at base_commit); submission-time checks catch most of these.
            self._after_infra_error(
                record, f"invalid task: {error}", time.monotonic() - started, retryable=False
            )
        except Exception as error:
            logger.exception("scoring task %s raised a non-infrastructure exception", task_id)
            self._after_infra_error(
                record,
                f"internal error: {type(error).__name__}: {error}",
                time.monotonic() - started,
                retryable=False,
            )
        else:
            if not self._abandoned:
                self._store.finish(task_id, verdict)
                self._metrics.verdict_recorded(verdict, time.monotonic() - started)
        finally:
            with self._lock:
                self._running.discard(task_id)

    def _after_infra_error(
        self, record: TaskRecord, error: str, duration_s: float, retryable: bool
    ) -> None:
        if self._abandoned:
            return
        if retryable and record.attempts < self.config.max_infra_attempts:
            delay_s = self.config.retry_backoff_s * 2 ** (record.attempts - 1)
            logger.warning(
                "task %s attempt %d/%d: %s; retrying in %.1f s",
                record.task_id,
                record.attempts,
                self.config.max_infra_attempts,
                error,
                delay_s,
            )
            self._store.retry(record.task_id, error)
            self._metrics.retried()
            self._enqueue_later(record.task_id, delay_s)
            return
        logger.error(
            "task %s failed after %d attempt(s): %s", record.task_id, record.attempts, error
        )
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
