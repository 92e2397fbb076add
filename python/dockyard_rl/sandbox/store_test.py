"""Tests of the SQLite task store: idempotent insertion, admission, transitions, recovery."""

import dataclasses
import sqlite3
import threading

import pytest

from dockyard_rl.sandbox.store import QueueFullError, TaskConflictError, TaskStore
from dockyard_rl.sandbox.task import ApplyMethod, TaskSpec, TaskStatus, TestOutcome, Verdict


def make_spec(task_id="t1", patch="diff --git a/x b/x\n") -> TaskSpec:
    return TaskSpec.from_request(
        {
            "instance_id": "demo__demo-1",
            "repo": "/srv/repo",
            "base_commit": "abc123",
            "patch": patch,
            "test_patch": "diff --git a/tests/t.py b/tests/t.py\n",
            "FAIL_TO_PASS": ["tests/t.py::test_a"],
            "PASS_TO_PASS": '["tests/t.py::test_b"]',
            "task_id": task_id,
        }
    )


def make_verdict(resolved=True) -> Verdict:
    outcome = TestOutcome.PASSED if resolved else TestOutcome.FAILED
    return Verdict(
        resolved=resolved,
        reward=1.0 if resolved else 0.0,
        fail_to_pass={"tests/t.py::test_a": outcome},
        pass_to_pass={"tests/t.py::test_b": TestOutcome.PASSED},
        apply_method=ApplyMethod.GIT_APPLY,
        integrity_violation=(),
        test_exit_code=0 if resolved else 1,
        timed_out=False,
        timings_s={"total": 1.5},
        log_tail="1 passed",
    )


@pytest.fixture
def store(tmp_path):
    store = TaskStore(tmp_path / "db" / "tasks.sqlite3")
    yield store
    store.close()


def test_insert_then_get_round_trips_the_spec(store):
    spec = make_spec()
    record, created = store.insert(spec)
    assert created and record.status is TaskStatus.QUEUED and record.attempts == 0
    assert store.get("t1").spec == spec
    assert store.get("nope") is None


def test_resubmission_is_idempotent_and_a_different_spec_conflicts(store):
    first, _ = store.insert(make_spec())
    again, created = store.insert(make_spec())
    assert not created and again == first
    with pytest.raises(TaskConflictError, match="'t1' was already submitted with a different spec"):
        store.insert(make_spec(patch="diff --git a/y b/y\n"))
    assert len(store.all_records()) == 1


def test_insert_requires_a_task_id(store):
    with pytest.raises(ValueError, match="spec.task_id"):
        store.insert(dataclasses.replace(make_spec(), task_id=None))


def test_admission_counts_only_queued_tasks(store):
    store.insert(make_spec("a"), max_queued=2)
    store.insert(make_spec("b"), max_queued=2)
    with pytest.raises(QueueFullError, match="2 tasks queued"):
        store.insert(make_spec("c"), max_queued=2)
    # A known id is answered even when the queue is full: it needs no new room.
    assert store.insert(make_spec("a"), max_queued=2)[1] is False
    store.start_attempt("a")
    assert store.insert(make_spec("c"), max_queued=2)[1] is True


def test_concurrent_inserts_never_overshoot_the_queue_limit(store):
    accepted, refused = [], []

    def submit(index):
        try:
            store.insert(make_spec(f"task-{index}"), max_queued=10)
            accepted.append(index)
        except QueueFullError:
            refused.append(index)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(accepted) == 10 and len(refused) == 30
    assert store.counts()[TaskStatus.QUEUED] == 10


def test_transitions_record_attempts_verdict_and_errors(store):
    store.insert(make_spec())
    running = store.start_attempt("t1")
    assert running.status is TaskStatus.RUNNING and running.attempts == 1
    assert running.started_at is not None
    retried = store.retry("t1", "InfrastructureError: clone failed")
    assert retried.status is TaskStatus.QUEUED and retried.error.endswith("clone failed")
    assert store.start_attempt("t1").attempts == 2
    finished = store.finish("t1", make_verdict())
    assert finished.status is TaskStatus.FINISHED and finished.verdict == make_verdict()
    assert finished.finished_at >= finished.started_at
    assert finished.to_dict()["verdict"]["fail_to_pass"] == {"tests/t.py::test_a": "passed"}


def test_wrong_transition_is_an_invariant_violation(store):
    store.insert(make_spec())
    with pytest.raises(AssertionError, match="expected status running, found queued"):
        store.finish("t1", make_verdict())


def test_counts_cover_every_status(store):
    store.insert(make_spec("a"))
    store.insert(make_spec("b"))
    store.start_attempt("b")
    store.fail("b", "boom")
    counts = store.counts()
    assert counts == {
        TaskStatus.QUEUED: 1,
        TaskStatus.RUNNING: 0,
        TaskStatus.FINISHED: 0,
        TaskStatus.INFRA_ERROR: 1,
    }


def test_recovery_requeues_unfinished_keeps_finished_and_fails_exhausted(tmp_path):
    path = tmp_path / "tasks.sqlite3"
    store = TaskStore(path)
    for task_id in ("done", "queued", "running", "exhausted"):
        store.insert(make_spec(task_id))
    store.start_attempt("done")
    store.finish("done", make_verdict(resolved=False))
    store.start_attempt("running")
    for _ in range(3):
        store.start_attempt("exhausted")
        if _ < 2:
            store.retry("exhausted", "flaky")
    # No close(): the process "dies" here. A second connection sees everything committed.
    reopened = TaskStore(path)
    report = reopened.recover(max_attempts=3)
    assert report.requeued == ("queued", "running")
    assert report.failed == ("exhausted",)
    assert reopened.get("done").verdict == make_verdict(resolved=False)
    assert reopened.get("running").status is TaskStatus.QUEUED
    assert reopened.get("running").attempts == 1
    exhausted = reopened.get("exhausted")
    assert exhausted.status is TaskStatus.INFRA_ERROR and "attempt 3 of 3" in exhausted.error
    reopened.close()
    store.close()


def test_requeue_interrupted_gives_the_attempt_back(store):
    store.insert(make_spec())
    store.start_attempt("t1")
    record = store.requeue_interrupted("t1")
    assert record.status is TaskStatus.QUEUED and record.attempts == 0
    assert store.requeue_interrupted("t1") is None  # no longer running


def test_database_uses_wal(tmp_path):
    TaskStore(tmp_path / "t.db").close()
    with sqlite3.connect(tmp_path / "t.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
