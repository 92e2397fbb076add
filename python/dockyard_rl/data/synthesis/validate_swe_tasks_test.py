"""validate_swe_tasks on flaky tests: the validator finds them and its cleaned output drops them;
the synthesizer (which builds the tasks validated here) keeps them out of tasks in the first place.

End to end on `flakycalc` (bundled_sdists.py): real git, real executor (HTTP on 127.0.0.1, pytest
under bubblewrap). Its `FLAKY_TEST` fails one run in three, drawn from os.urandom in each run
(each sandboxed run starts from a fresh copy of the repository with a fixed environment, so the
kernel's random generator is what differs between runs). The synthesizer must list it as flaky
and put it in no task; the validator, given tasks that name it in PASS_TO_PASS or FAIL_TO_PASS,
must report it, remove it from PASS_TO_PASS in `--write-cleaned` and drop the instance that
needs it to pass.

What the checks assert is settled by the runs, not by luck in one direction: a check below
fails only if all NUM_RUNS runs of the flaky test agree (module constant P_NO_FLIP).
"""

import json
import logging
import types

import pytest

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.data.synthesis import (
    bundled_sdists,
    synthesize_swe_tasks,
    task_synthesis,
    validate_swe_tasks,
)
from dockyard_rl.sandbox.client import TaskResult
from dockyard_rl.sandbox.task import ApplyMethod, FailureKind, TaskStatus, TestOutcome, Verdict
from dockyard_rl.utils.config import from_dict

FLAKY = bundled_sdists.FLAKY_TEST
# Baseline runs of the synthesis and gold runs of the validation. The flaky test fails each run
# independently with probability p = 1/3, and a check misses it only when every run agrees:
# (2/3) ** 35 + (1/3) ** 35 = 6.9e-7 per check. This file has three such checks (the baseline,
# two validated instances): a chance failure about once in 480,000 runs of it.
NUM_RUNS = 35
_P = bundled_sdists.FLAKY_FAIL_PROBABILITY
P_NO_FLIP = (1 - _P) ** NUM_RUNS + _P**NUM_RUNS
assert P_NO_FLIP < 1e-6


class _Messages(logging.Handler):
    """Keeps the log messages (the module-scoped fixture cannot use caplog)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def synthesis(tmp_path_factory):
    root = tmp_path_factory.mktemp("flaky")
    archive = bundled_sdists.make_flaky_sdist(root / "downloads")
    out = root / "out"
    log = _Messages()
    synthesis_logger = logging.getLogger(task_synthesis.__name__)
    synthesis_logger.addHandler(log)
    try:
        # One window of one candidate: the first mutant that qualifies is the only one validated
        # (each validation runs the mutant NUM_RUNS - 1 more times).
        code = synthesize_swe_tasks.main(
            [
                "--packages",
                str(archive),
                "--out",
                str(out),
                "--max-tasks-per-package",
                "1",
                "--window-size",
                "1",
                "--num-baseline-runs",
                str(NUM_RUNS),
                "--workers",
                "2",
                "--log-level",
                "WARNING",
            ]
        )
    finally:
        synthesis_logger.removeHandler(log)
    return types.SimpleNamespace(root=root, out=out, code=code, messages=log.messages)


def test_synthesis_lists_the_flaky_test_and_uses_it_nowhere(synthesis):
    assert synthesis.code == 0
    report = json.loads((synthesis.out / "report.json").read_text())
    assert report["settings"]["num_baseline_runs"] == NUM_RUNS
    (package,) = report["packages"]
    assert package["flaky_tests"] == [FLAKY] and package["num_flaky_tests"] == 1
    assert package["num_collected_tests"] == 5 and package["num_baseline_passing"] == 4
    assert any("flaky" in m and FLAKY in m for m in synthesis.messages)
    (instance,) = load_jsonl(synthesis.out / "tasks.jsonl")
    assert FLAKY not in instance.PASS_TO_PASS and FLAKY not in instance.FAIL_TO_PASS
    assert len(instance.FAIL_TO_PASS) + len(instance.PASS_TO_PASS) == 4


def test_validation_finds_flaky_tests_and_writes_a_cleaned_set(synthesis, tmp_path, capsys):
    (row,) = [json.loads(line) for line in (synthesis.out / "tasks.jsonl").read_text().splitlines()]
    # As a set made with too few baseline runs (or a published one) might have them: the flaky
    # test in one task's PASS_TO_PASS, and in another's FAIL_TO_PASS.
    in_p2p = {**row, "PASS_TO_PASS": [*row["PASS_TO_PASS"], FLAKY]}
    in_f2p = {
        **row,
        "instance_id": row["instance_id"] + "_f2p",
        "FAIL_TO_PASS": [*row["FAIL_TO_PASS"], FLAKY],
    }
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in (in_p2p, in_f2p)))
    report, cleaned = tmp_path / "report.json", tmp_path / "cleaned.jsonl"
    # The flaky test fails in some gold run (else it would not flip), so neither is valid.
    assert (
        validate_swe_tasks.main(
            [
                "--tasks",
                str(tasks),
                "--gold-runs",
                str(NUM_RUNS),
                "--workers",
                "2",
                "--report",
                str(report),
                "--write-cleaned",
                str(cleaned),
            ]
        )
        == 1
    )
    summary = json.loads(report.read_text())
    p2p_id, f2p_id = in_p2p["instance_id"], in_f2p["instance_id"]
    assert summary["flaky_tests"] == {p2p_id: [FLAKY], f2p_id: [FLAKY]}
    assert summary["num_tasks"] == 2 and summary["num_valid"] == 0
    assert set(summary["problems"]) == {p2p_id, f2p_id}
    assert all("gold patch did not resolve" in p for p in summary["problems"].values())
    assert summary["cleaned"] == {
        "path": str(cleaned),
        "num_written": 1,
        "dropped": {f2p_id: f"FAIL_TO_PASS test(s) flaky: {[FLAKY]}"},
    }
    out = capsys.readouterr().out
    assert f"FLAKY {p2p_id}" in out and f"DROPPED {f2p_id}" in out
    # The cleaned set is the synthesized task again, and it validates.
    assert load_jsonl(cleaned) == load_jsonl(synthesis.out / "tasks.jsonl")
    assert (
        validate_swe_tasks.main(
            ["--tasks", str(cleaned), "--gold-runs", "2", "--workers", "2", "--report", str(report)]
        )
        == 0
    )
    assert json.loads(report.read_text())["flaky_tests"] == {}


def _result(outcomes: dict[str, TestOutcome], kind: FailureKind) -> TaskResult:
    resolved = kind is FailureKind.NONE
    verdict = Verdict(
        resolved=resolved,
        reward=float(resolved),
        fail_to_pass={},
        pass_to_pass=outcomes,
        apply_method=ApplyMethod.GIT_APPLY,
        integrity_violation=(),
        test_exit_code=0 if resolved else 1,
        timed_out=kind is FailureKind.TIMEOUT,
        timings_s={},
        log_tail="",
        failure_kind=kind,
    )
    return TaskResult(
        task_id="t", status=TaskStatus.FINISHED, verdict=verdict, error=None, attempts=1
    )


def test_a_flip_is_passed_versus_not_passed_in_trusted_runs():
    passed, failed, error, missing = (
        TestOutcome.PASSED,
        TestOutcome.FAILED,
        TestOutcome.ERROR,
        TestOutcome.MISSING,
    )
    runs = [
        _result({"a": passed, "b": failed, "c": passed}, FailureKind.TESTS_FAILED),
        _result({"a": passed, "b": error, "c": failed}, FailureKind.TESTS_FAILED),
        # Untrusted runs report every test missing: they say nothing about "a".
        _result({"a": missing, "b": missing, "c": missing}, FailureKind.TIMEOUT),
        _result({"a": missing, "b": missing, "c": missing}, FailureKind.REPORT_UNTRUSTED),
    ]
    assert validate_swe_tasks._flaky_tests(runs) == ("c",)
    assert validate_swe_tasks._flaky_tests(runs[:1]) == ()


def test_settings_that_cannot_show_a_flaky_test_are_refused(tmp_path, capsys):
    assert task_synthesis.SynthesisConfig().num_baseline_runs == 3
    with pytest.raises(
        ValueError,
        match=r"^synthesis\.search\.num_baseline_runs: must be an "
        r"integer >= 2",
    ):
        from_dict(
            task_synthesis.TaskSynthesisConfig,
            {"packages": ["x==1"], "search": {"num_baseline_runs": 1}},
            "synthesis",
        )
    with pytest.raises(ValueError, match="num_baseline_runs"):
        task_synthesis.SynthesisConfig(num_baseline_runs=True)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("")
    assert (
        validate_swe_tasks.main(
            [
                "--tasks",
                str(tasks),
                "--gold-runs",
                "1",
                "--write-cleaned",
                str(tmp_path / "c.jsonl"),
            ]
        )
        == 2
    )
    assert "--write-cleaned needs --gold-runs >= 2" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()
