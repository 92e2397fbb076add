"""Crash-restart test: the executor as a real process, SIGKILLed with tasks queued, restarted on
the same database; every task it accepted gets an answer (and the right verdict).

Real everything: `python -m dockyard_rl.sandbox.executor` (the same entry point as the Bazel
binary), a git repository from testing_repos, the real pipeline under bubblewrap, the async client.
"""

import asyncio
import pathlib
import signal
import subprocess

from dockyard_rl.sandbox import testing_executor, testing_repos
from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.store import TaskStore
from dockyard_rl.sandbox.task import TaskStatus

NUM_TASKS = 6


def start_executor(work_dir: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """The executor process on a free port, retrying infrastructure errors quickly."""
    return testing_executor.start_executor_process(work_dir, "--retry-backoff-s", "0.1")


def stop(process: subprocess.Popen, signum: int) -> int:
    if process.poll() is None:
        process.send_signal(signum)
    return process.wait(timeout=60)


def test_sigkill_with_tasks_queued_then_restart_answers_every_task(tmp_path):
    repo = testing_repos.make_toy_repo(tmp_path / "toy")
    work_dir = tmp_path / "work"
    expected = {f"restart-{index}": index % 2 == 0 for index in range(NUM_TASKS)}  # gold / empty

    async def submit_and_kill(url: str, process: subprocess.Popen) -> None:
        async with ExecutorClient(url, seed=0) as client:
            for task_id, gold in expected.items():
                assert (
                    await client.submit(repo.spec(repo.gold_patch if gold else "", task_id=task_id))
                    == task_id
                )
            # Kill while the single worker is busy with the first task and the rest are queued.
            while (await client.get("restart-0")).status is TaskStatus.QUEUED:
                await asyncio.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

    process, url = start_executor(work_dir)
    try:
        asyncio.run(submit_and_kill(url, process))
    finally:
        if process.poll() is None:
            process.kill()

    store = TaskStore(work_dir / "tasks.sqlite3")
    before = {record.task_id: record.status for record in store.all_records()}
    store.close()
    assert sorted(before) == sorted(expected)
    assert sum(status is TaskStatus.QUEUED for status in before.values()) >= NUM_TASKS - 2

    async def wait_all(url: str):
        async with ExecutorClient(url, seed=0) as client:
            return await asyncio.gather(
                *(client.wait(task_id, poll_interval_s=0.2, timeout_s=120) for task_id in expected)
            )

    process, url = start_executor(work_dir)
    try:
        results = asyncio.run(wait_all(url))
    finally:
        exit_code = stop(process, signal.SIGTERM)
    assert exit_code == 0  # graceful shutdown on SIGTERM
    for result in results:
        assert result.status is TaskStatus.FINISHED, (result.task_id, result.error)
        assert result.verdict.resolved == expected[result.task_id], result.verdict.log_tail
    # The task interrupted mid-run was run again (its first attempt counted); the others once.
    for result in results:
        interrupted = before[result.task_id] is TaskStatus.RUNNING
        assert result.attempts == (2 if interrupted else 1), (result.task_id, before)
    # The killed executor's in-flight task directory was removed at restart, and every task since
    # cleaned up after itself.
    assert not list((work_dir / "tasks").glob("task-*"))
