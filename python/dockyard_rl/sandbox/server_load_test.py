"""Load test of the executor with the real scoring pipeline: 50 tasks submitted at once, 2 workers.

Real everything: a git repository built by testing_repos, the pipeline (mirror cache, checkout,
patch apply chain, pytest under bubblewrap, JUnit grading), the HTTP service on 127.0.0.1 and the
async client. Checks that every task finishes, none is lost or scored twice, and each verdict is
the right one for its patch. Restart after a crash is executor_restart_test.py.
"""

import asyncio
import collections
import threading

from dockyard_rl.sandbox import testing_repos
from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task import ApplyMethod, TaskStatus, TestOutcome
from dockyard_rl.sandbox.task_executor import pipeline_score_fn

NUM_TASKS = 50


def test_fifty_tasks_two_workers_all_finish_once_with_correct_verdicts(tmp_path):
    repo = testing_repos.make_toy_repo(tmp_path / "toy")
    patches = {
        "gold": repo.gold_patch,
        "empty": "",
        "wrong": repo.wrong_patch,
        "conflict": repo.conflicting_patch,
    }
    kinds = {f"load-{index:02d}": list(patches)[index % len(patches)] for index in range(NUM_TASKS)}
    config = ExecutorConfig(
        port=0, num_workers=2, work_dir=str(tmp_path / "work"), max_infra_attempts=1
    )
    real_score = pipeline_score_fn(config.pipeline)
    calls = collections.Counter()
    lock = threading.Lock()

    def counting_score(spec, work_root):  # the real pipeline, counted
        with lock:
            calls[spec.task_id] += 1
        return real_score(spec, work_root)

    async def scenario():
        async with running_server(config, counting_score) as server:
            async with ExecutorClient(server.url, seed=0) as client:
                submitted = await asyncio.gather(
                    *(
                        client.submit(repo.spec(patches[kind], task_id=task_id))
                        for task_id, kind in kinds.items()
                    )
                )
                results = await asyncio.gather(
                    *(
                        client.wait(task_id, poll_interval_s=0.25, timeout_s=300)
                        for task_id in submitted
                    )
                )
            return submitted, results, server.executor.all_records()

    submitted, results, records = asyncio.run(scenario())
    assert sorted(submitted) == sorted(kinds)
    assert sorted(record.task_id for record in records) == sorted(kinds)  # none lost, none extra
    assert all(count == 1 for count in calls.values()) and len(calls) == NUM_TASKS
    for result in results:
        kind = kinds[result.task_id]
        assert result.status is TaskStatus.FINISHED, (result.task_id, result.error)
        assert result.attempts == 1
        verdict = result.verdict
        assert verdict.resolved == (kind == "gold"), (result.task_id, verdict.log_tail)
        if kind == "gold":
            assert verdict.reward == 1.0 and verdict.apply_method is ApplyMethod.GIT_APPLY
            assert set(verdict.fail_to_pass.values()) == {TestOutcome.PASSED}
        elif kind == "empty":
            assert verdict.apply_method is ApplyMethod.EMPTY
            assert TestOutcome.PASSED not in verdict.fail_to_pass.values()
            assert set(verdict.pass_to_pass.values()) == {TestOutcome.PASSED}
        elif kind == "wrong":  # mul fixed, sub broken: F2P pass, the sub P2P tests fail
            assert set(verdict.fail_to_pass.values()) == {TestOutcome.PASSED}
            assert (
                verdict.pass_to_pass["tests/test_ops.py::test_sub[five minus three]"]
                is TestOutcome.FAILED
            )
            assert verdict.pass_to_pass["tests/test_ops.py::test_add"] is TestOutcome.PASSED
        else:
            assert verdict.apply_method is ApplyMethod.FAILED and verdict.test_exit_code is None
