"""The runner for real (bubblewrap, pytest in the sandbox): what the tests can and cannot see,
the canaries under deselection, the disk cap, and which commands are accepted."""

import pytest

from dockyard_rl.sandbox import grading, isolation, runner
from dockyard_rl.sandbox.task import FailureKind, RewardMode, TestOutcome
from dockyard_rl.sandbox.testing_repos import toy_worktree

LIMITS = runner.RunnerLimits(
    isolation.SandboxLimits(wall_timeout_s=60, cpu_s=60, memory_bytes=2 * 1024**3),
    worktree_size_bytes=64 * 1024**2,
    max_report_bytes=4 * 1024**2,
    max_report_testcases=10_000,
)


@pytest.fixture
def worktree(tmp_path):
    return toy_worktree(tmp_path)


def _run(tmp_path, worktree, test_source, args=("tests/test_probe.py",), **kwargs):
    (worktree / "tests" / "test_probe.py").write_text(test_source)
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    return runner.run_pytest(list(args), worktree, scratch, kwargs.pop("limits", LIMITS), **kwargs)


def test_tests_see_no_secrets_and_never_write_the_host_worktree(tmp_path, worktree):
    probe = """\
import os, sys

def test_probe():
    cmdline = open("/proc/self/cmdline", "rb").read().decode()
    environ = open("/proc/self/environ", "rb").read().decode()
    assert "junit" not in cmdline and "dockyard-" not in cmdline, cmdline
    assert "junit" not in environ and "dockyard-" not in environ
    assert os.getcwd() == "/testbed"
    assert not os.path.exists(os.path.expanduser("~/.cache"))
    assert "/testbed" in sys.path[:2]
    open("/testbed/planted", "w").write("x")
"""
    result, evidence = _run(tmp_path, worktree, probe)
    assert evidence.records.tests["tests/test_probe.py::test_probe"] is TestOutcome.PASSED, (
        result.output
    )
    assert not (worktree / "planted").exists()  # the host's worktree stayed read-only
    graded = grading.grade_run(["tests/test_probe.py::test_probe"], [], evidence, RewardMode.BINARY)
    assert graded.resolved, graded.detail


def test_canaries_run_last_even_when_deselected(tmp_path, worktree):
    probe = "def test_a():\n    pass\n\ndef test_b():\n    pass\n"
    result, evidence = _run(tmp_path, worktree, probe, args=("-k", "test_a", "tests/test_probe.py"))
    names = [nodeid.rpartition("::")[2] for nodeid in evidence.records.tests]
    assert names[:1] == ["test_a"] and "test_b" not in names
    assert names[1:] == list(evidence.canary_names)
    graded = grading.grade_run(["tests/test_probe.py::test_a"], [], evidence, RewardMode.BINARY)
    assert graded.resolved, graded.detail


def test_filling_the_worktree_is_a_disk_limit(tmp_path, worktree):
    probe = """\
def test_fill():
    with open("/testbed/fill", "wb") as handle:
        for _ in range(200):
            handle.write(b"x" * 1024 * 1024)
"""
    small = runner.RunnerLimits(
        LIMITS.sandbox,
        worktree_size_bytes=16 * 1024**2,
        max_report_bytes=LIMITS.max_report_bytes,
        max_report_testcases=LIMITS.max_report_testcases,
    )
    _, evidence = _run(tmp_path, worktree, probe, limits=small)
    graded = grading.grade_run(["tests/test_probe.py::test_fill"], [], evidence, RewardMode.BINARY)
    assert graded.failure_kind is FailureKind.DISK_LIMIT, graded.detail
    # A worktree that does not fit at all cannot even be copied in.
    (worktree / "big.bin").write_bytes(b"x" * 20 * 1024**2)
    _, evidence = _run(tmp_path, worktree, "def test_x():\n    pass\n", limits=small)
    graded = grading.grade_run(["tests/test_probe.py::test_x"], [], evidence, RewardMode.BINARY)
    assert graded.failure_kind is FailureKind.DISK_LIMIT and "copying" in graded.detail


def test_monkeypatched_report_objects_are_tampering(tmp_path, worktree):
    probe = """\
from _pytest import reports

_original = reports.TestReport.__init__

def _init(self, *args, **kwargs):
    _original(self, *args, **kwargs)
    self.outcome = "passed"

reports.TestReport.__init__ = _init

def test_fails():
    assert False
"""
    _, evidence = _run(tmp_path, worktree, probe)
    graded = grading.grade_run(["tests/test_probe.py::test_fails"], [], evidence, RewardMode.BINARY)
    assert graded.failure_kind is FailureKind.TAMPERING, graded.detail
    assert "TestReport.__init__ was replaced" in graded.detail


@pytest.mark.parametrize(
    "command, expected",
    [
        (None, None),
        ("pytest -x tests", ["-x", "tests"]),
        (
            "python3 -m pytest -p no:cacheprovider tests/test_a.py",
            ["-p", "no:cacheprovider", "tests/test_a.py"],
        ),
        ("/opt/py/bin/python -m pytest -rA", ["-rA"]),
    ],
)
def test_accepted_commands(command, expected):
    assert runner.pytest_arguments(command) == expected


@pytest.mark.parametrize(
    "command, reason",
    [
        ("./tests/runtests.py --verbosity 2", "only pytest invocations"),
        ("PYTHONPATH=. pytest tests", "environment assignments"),
        ("pytest -p evil tests", "-p evil"),
        ("pytest -pevil tests", "-p evil"),
        ("pytest --junitxml=out.xml", "JUnit"),
        ("pytest -o junit_suite_name=x", "junit_"),
        ("pytest -n 4", "xdist"),
        ("pytest -n4", "xdist"),
        ("pytest -c other.ini", "configuration file"),
        ("pytest 'unterminated", "cannot be split"),
    ],
)
def test_refused_commands_say_why(command, reason):
    with pytest.raises(ValueError, match="test_command") as error:
        runner.pytest_arguments(command)
    assert reason in str(error.value)
