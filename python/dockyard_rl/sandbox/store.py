"""Durable task records for the executor: SQLite, one row per accepted task.

The executor promises that a task it accepted (answered 202/200 with a task id) gets an answer,
even across a crash or restart. The store is what keeps that promise: a task is written (and the
write committed with `synchronous=FULL`) before the submission is acknowledged, every status change
is committed before the worker moves on, and `recover()` at start-up hands back the tasks a previous
process left QUEUED or RUNNING. A RUNNING task was interrupted mid-attempt: it is re-queued if it
has attempts left, otherwise marked INFRA_ERROR (a task that repeatedly kills the executor must not
loop forever). Finished tasks keep their verdict.

Covered: idempotent insertion (same task id + same spec -> the existing record; different spec ->
`TaskConflictError`), admission control under the same transaction (`QueueFullError`), status
transitions QUEUED -> RUNNING -> FINISHED | INFRA_ERROR (or back to QUEUED for a retry).
Not covered: pruning old records, several processes sharing one database (one executor per file;
WAL mode is for readers such as a debugging `sqlite3` shell, not for a second writer).

Thread-safety: one connection, guarded by a lock; every public method is one short transaction.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sqlite3
import threading
import time
from typing import Any

from dockyard_rl.sandbox.task import TaskSpec, TaskStatus, Verdict


class TaskConflictError(Exception):
    """A task id was resubmitted with a different spec (the service answers 409)."""


class QueueFullError(Exception):
    """Admission refused: the number of queued tasks reached the limit (the service answers 429)."""


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    task_id: str
    spec: TaskSpec
    status: TaskStatus
    verdict: Verdict | None  # set once FINISHED
    error: str | None  # last infrastructure error (kept on a retry, final on INFRA_ERROR)
    attempts: int  # scoring attempts started so far
    submitted_at: float  # wall-clock seconds since the epoch
    started_at: float | None  # start of the latest attempt
    finished_at: float | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `GET /task/{id}` (the spec itself is not echoed back)."""
        return {
            "task_id": self.task_id,
            "instance_id": self.spec.instance_id,
            "status": self.status.value,
            "verdict": self.verdict.to_dict() if self.verdict is not None else None,
            "error": self.error,
            "attempts": self.attempts,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


@dataclasses.dataclass(frozen=True)
class RecoveryReport:
    requeued: tuple[str, ...]  # task ids to enqueue again, in submission order
    failed: tuple[str, ...]  # interrupted tasks out of attempts, now INFRA_ERROR


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id      TEXT PRIMARY KEY,
    spec_json    TEXT NOT NULL,
    status       TEXT NOT NULL,
    verdict_json TEXT,
    error        TEXT,
    attempts     INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at   REAL,
    finished_at  REAL
);
CREATE INDEX IF NOT EXISTS tasks_by_status ON tasks (status);
"""

_COLUMNS = (
    "task_id, spec_json, status, verdict_json, error, attempts, submitted_at, started_at, "
    "finished_at"
)


def canonical_spec_json(spec: TaskSpec) -> str:
    """The stored form of a spec; equal specs give equal strings (the idempotency check)."""
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


class TaskStore:
    """SQLite-backed task records. See the module docstring for the guarantees."""

    def __init__(self, path: pathlib.Path):
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # One connection shared by the HTTP thread and the worker threads, serialised by _lock;
        # isolation_level=None so that each method controls its own BEGIN/COMMIT.
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: an acknowledged submission survives even a power loss, not only a process kill.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._db.close()
                self._closed = True

    # -- start-up -------------------------------------------------------------------------------

    def recover(self, max_attempts: int) -> RecoveryReport:
        """Re-queues what a previous process left unfinished; see the module docstring."""
        now = time.time()
        with self._lock, self._transaction():
            rows = self._db.execute(
                "SELECT task_id, status, attempts FROM tasks WHERE status IN (?, ?) ORDER BY rowid",
                (TaskStatus.QUEUED.value, TaskStatus.RUNNING.value),
            ).fetchall()
            requeued, failed = [], []
            for task_id, status, attempts in rows:
                if status == TaskStatus.RUNNING.value and attempts >= max_attempts:
                    self._db.execute(
                        "UPDATE tasks SET status = ?, error = ?, finished_at = ? WHERE task_id = ?",
                        (
                            TaskStatus.INFRA_ERROR.value,
                            f"the executor stopped during attempt {attempts} of {max_attempts}; "
                            f"no attempts left",
                            now,
                            task_id,
                        ),
                    )
                    failed.append(task_id)
                else:
                    self._db.execute(
                        "UPDATE tasks SET status = ? WHERE task_id = ?",
                        (TaskStatus.QUEUED.value, task_id),
                    )
                    requeued.append(task_id)
        return RecoveryReport(requeued=tuple(requeued), failed=tuple(failed))

    # -- submission -----------------------------------------------------------------------------

    def insert(self, spec: TaskSpec, max_queued: int | None = None) -> tuple[TaskRecord, bool]:
        """Records a new QUEUED task, or returns the existing one for a resubmitted id.

        Returns (record, created). Raises TaskConflictError when `spec.task_id` exists with a
        different spec, QueueFullError when creating it would exceed `max_queued` QUEUED tasks
        (checked in the same transaction, so concurrent submissions cannot overshoot).
        """
        if not spec.task_id:
            raise ValueError(
                "spec.task_id: the store needs a task id; the service assigns one "
                "when the client sends none"
            )
        spec_json = canonical_spec_json(spec)
        with self._lock, self._transaction():
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ?", (spec.task_id,)
            ).fetchone()
            if row is not None:
                if row[1] != spec_json:
                    raise TaskConflictError(
                        f"task_id {spec.task_id!r} was already submitted with a different spec; "
                        f"use a new task_id for a different task"
                    )
                return _record(row), False
            if max_queued is not None:
                (num_queued,) = self._db.execute(
                    "SELECT COUNT(*) FROM tasks WHERE status = ?", (TaskStatus.QUEUED.value,)
                ).fetchone()
                if num_queued >= max_queued:
                    raise QueueFullError(f"{num_queued} tasks queued (max_queue = {max_queued})")
            self._db.execute(
                "INSERT INTO tasks (task_id, spec_json, status, attempts, submitted_at) "
                "VALUES (?, ?, ?, 0, ?)",
                (spec.task_id, spec_json, TaskStatus.QUEUED.value, time.time()),
            )
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ?", (spec.task_id,)
            ).fetchone()
        return _record(row), True

    # -- reads ----------------------------------------------------------------------------------

    def get(self, task_id: str) -> TaskRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ?", (task_id,)
            ).fetchone()
        return _record(row) if row is not None else None

    def counts(self) -> dict[TaskStatus, int]:
        """Number of tasks per status (every status present, zero when none)."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM tasks GROUP BY status").fetchall()
        counts = {status: 0 for status in TaskStatus}
        for status, count in rows:
            counts[TaskStatus(status)] = count
        return counts

    def all_records(self) -> list[TaskRecord]:
        """Every record in submission order (tests and tooling; not used on the request path)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM tasks ORDER BY rowid").fetchall()
        return [_record(row) for row in rows]

    # -- worker transitions ---------------------------------------------------------------------

    def start_attempt(self, task_id: str) -> TaskRecord:
        """QUEUED -> RUNNING, counting the attempt. Returns the updated record."""
        return self._transition(
            task_id,
            TaskStatus.QUEUED,
            "status = ?, attempts = attempts + 1, started_at = ?",
            (TaskStatus.RUNNING.value, time.time()),
        )

    def finish(self, task_id: str, verdict: Verdict) -> TaskRecord:
        """RUNNING -> FINISHED with the verdict."""
        return self._transition(
            task_id,
            TaskStatus.RUNNING,
            "status = ?, verdict_json = ?, finished_at = ?",
            (TaskStatus.FINISHED.value, json.dumps(verdict.to_dict()), time.time()),
        )

    def retry(self, task_id: str, error: str) -> TaskRecord:
        """RUNNING -> QUEUED after an infrastructure failure; the error is kept for inspection."""
        return self._transition(
            task_id, TaskStatus.RUNNING, "status = ?, error = ?", (TaskStatus.QUEUED.value, error)
        )

    def fail(self, task_id: str, error: str) -> TaskRecord:
        """RUNNING -> INFRA_ERROR: no attempts left, or a failure that retrying cannot fix."""
        return self._transition(
            task_id,
            TaskStatus.RUNNING,
            "status = ?, error = ?, finished_at = ?",
            (TaskStatus.INFRA_ERROR.value, error, time.time()),
        )

    def requeue_interrupted(self, task_id: str) -> TaskRecord | None:
        """RUNNING -> QUEUED without spending the attempt: a graceful shutdown cut it short, the
        task did not fail. Returns None when the task is no longer RUNNING (it just finished)."""
        with self._lock, self._transaction():
            cursor = self._db.execute(
                "UPDATE tasks SET status = ?, attempts = MAX(attempts - 1, 0) "
                "WHERE task_id = ? AND status = ?",
                (TaskStatus.QUEUED.value, task_id, TaskStatus.RUNNING.value),
            )
            if cursor.rowcount == 0:
                return None
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ?", (task_id,)
            ).fetchone()
        return _record(row)

    # -- internals ------------------------------------------------------------------------------

    def _transition(
        self, task_id: str, expected: TaskStatus, assignments: str, values: tuple
    ) -> TaskRecord:
        with self._lock, self._transaction():
            cursor = self._db.execute(
                f"UPDATE tasks SET {assignments} WHERE task_id = ? AND status = ?",
                (*values, task_id, expected.value),
            )
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ?", (task_id,)
            ).fetchone()
        # Only the worker that owns a task moves it, so a mismatch is a bug in the executor.
        assert cursor.rowcount == 1, (
            f"task {task_id!r}: expected status {expected.value}, found "
            f"{row[2] if row is not None else 'no such task'}"
        )
        return _record(row)

    def _transaction(self):
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception); the caller holds the store's lock."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self):
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb):
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        return False


def _record(row: tuple) -> TaskRecord:
    (
        task_id,
        spec_json,
        status,
        verdict_json,
        error,
        attempts,
        submitted_at,
        started_at,
        finished_at,
    ) = row
    return TaskRecord(
        task_id=task_id,
        spec=TaskSpec.from_request(json.loads(spec_json)),
        status=TaskStatus(status),
        verdict=Verdict.from_dict(json.loads(verdict_json)) if verdict_json is not None else None,
        error=error,
        attempts=attempts,
        submitted_at=submitted_at,
        started_at=started_at,
        finished_at=finished_at,
    )
