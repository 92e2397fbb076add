import os
import subprocess
import sys

import pytest

from dockyard_rl.sandbox import grading
from dockyard_rl.sandbox.task import RewardMode, TestOutcome

NONCE = "dockyard-0123456789abcdef"

TESTS = '''\
import pytest


def test_ok():
    pass


def test_bad():
    assert False


@pytest.mark.skip(reason="no")
def test_skipped():
    pass


@pytest.mark.parametrize("x", [1, 2], ids=["one two", "three [four]"])
def test_param(x):
    assert x == 1


class TestBox:
    def test_inner(self):
        pass


@pytest.fixture
def broken():
    yield
    raise RuntimeError("teardown")


def test_teardown_error(broken):
    pass
'''


def _run_pytest(tmp_path, files: dict[str, str], suite_name: str = NONCE):
    """Runs the real pytest on `files` and returns (report path, exit code)."""
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    report = tmp_path / "out" / "junit.xml"
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                             "--rootdir", str(tmp_path), f"--junitxml={report}",
                             "-o", f"junit_suite_name={suite_name}", "-o", "junit_family=xunit1",
                             *files], cwd=tmp_path, capture_output=True, text=True)
    return report, result.returncode


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("grading")
    report, exit_code = _run_pytest(tmp_path, {"pkg/tests/test_mix.py": TESTS})
    return report, exit_code


def test_node_ids_map_to_real_pytest_outcomes(real_report):
    report, exit_code = real_report
    assert exit_code == 1
    outcomes = grading.read_junit_xml(report, NONCE)
    base = "pkg/tests/test_mix.py"

    def outcome(node_id):
        return outcomes.get(grading.junit_key(node_id), TestOutcome.MISSING)

    assert outcome(f"{base}::test_ok") == TestOutcome.PASSED
    assert outcome(f"{base}::test_bad") == TestOutcome.FAILED
    assert outcome(f"{base}::test_skipped") == TestOutcome.SKIPPED
    assert outcome(f"{base}::test_param[one two]") == TestOutcome.PASSED
    assert outcome(f"{base}::test_param[three [four]]") == TestOutcome.FAILED
    assert outcome(f"{base}::TestBox::test_inner") == TestOutcome.PASSED
    assert outcome(f"{base}::test_teardown_error") == TestOutcome.ERROR
    assert outcome(f"{base}::test_absent") == TestOutcome.MISSING


def test_swe_bench_rule_and_rewards(real_report):
    report, exit_code = real_report
    outcomes = grading.read_junit_xml(report, NONCE)
    base = "pkg/tests/test_mix.py"
    passing = [f"{base}::test_ok", f"{base}::test_param[one two]"]
    graded = grading.grade(passing[:1], passing[1:], outcomes, exit_code, False, RewardMode.BINARY)
    assert graded.trusted and graded.resolved and graded.reward == 1.0
    # A skipped or missing F2P test fails the task; so does a failing P2P test.
    for f2p, p2p in [([f"{base}::test_skipped"], passing), ([f"{base}::test_gone"], passing),
                     (passing, [f"{base}::test_bad"])]:
        graded = grading.grade(f2p, p2p, outcomes, exit_code, False, RewardMode.BINARY)
        assert not graded.resolved and graded.reward == 0.0
    graded = grading.grade(passing, [f"{base}::test_bad", f"{base}::test_skipped"], outcomes,
                           exit_code, False, RewardMode.PASS_RATE)
    assert not graded.resolved and graded.reward == pytest.approx(0.5)
    assert graded.pass_to_pass == {f"{base}::test_bad": TestOutcome.FAILED,
                                   f"{base}::test_skipped": TestOutcome.SKIPPED}
    # Nothing expected: nothing was checked, so not resolved.
    assert not grading.grade([], [], outcomes, exit_code, False, RewardMode.BINARY).resolved


def test_collection_error_fails_the_file(tmp_path):
    report, exit_code = _run_pytest(tmp_path, {
        "test_ok.py": "def test_fine():\n    pass\n",
        "test_broken.py": "def test_x(:\n    pass\n"})
    assert exit_code == 2
    outcomes = grading.read_junit_xml(report, NONCE)
    graded = grading.grade(["test_broken.py::test_x"], ["test_ok.py::test_fine"], outcomes,
                           exit_code, False, RewardMode.PASS_RATE)
    assert graded.trusted
    assert graded.fail_to_pass == {"test_broken.py::test_x": TestOutcome.MISSING}
    assert not graded.resolved


def _xml(cases: str, suite: str = NONCE) -> str:
    return f'<?xml version="1.0"?><testsuites><testsuite name="{suite}">{cases}' \
           f'</testsuite></testsuites>'


PASSED_CASE = '<testcase classname="t" name="test_a" />'
FAILED_CASE = '<testcase classname="t" name="test_a"><failure message="x"/></testcase>'


@pytest.mark.parametrize("content, exit_code, timed_out, trusted", [
    (_xml(PASSED_CASE), 0, False, True),
    (_xml(PASSED_CASE), 1, False, False),      # claims all passed, exit code says failure
    (_xml(FAILED_CASE), 0, False, False),      # failures but exit 0
    (_xml(FAILED_CASE), 1, False, True),
    (_xml(PASSED_CASE), None, True, False),    # timed out
    (_xml(PASSED_CASE), 137, False, False),    # killed by a signal
    (_xml(PASSED_CASE), 4, False, False),      # usage error
    (_xml(""), 5, False, True),
    (_xml(PASSED_CASE), 5, False, False),
    (_xml(PASSED_CASE + FAILED_CASE), 0, False, False),  # a forged duplicate cannot hide it
])
def test_exit_code_cross_check(tmp_path, content, exit_code, timed_out, trusted):
    path = tmp_path / "junit.xml"
    path.write_text(content)
    graded = grading.grade(["t.py::test_a"], [], grading.read_junit_xml(path, NONCE), exit_code,
                           timed_out, RewardMode.BINARY)
    assert graded.trusted == trusted
    assert graded.resolved == (trusted and exit_code == 0)
    if not trusted:
        assert graded.fail_to_pass == {"t.py::test_a": TestOutcome.MISSING}
        assert graded.reason


@pytest.mark.parametrize("content", [
    _xml(PASSED_CASE, suite="pytest"),                        # not this run's nonce
    "<testsuites>" + _xml(PASSED_CASE)[21:] + "</testsuites>",  # two suites deep
    '<?xml version="1.0"?><!DOCTYPE lol [<!ENTITY a "aaaa">]><testsuites/>',
    "<testsuites><testsuite name=",                            # truncated
    "",
])
def test_forged_or_broken_reports_are_rejected(tmp_path, content):
    path = tmp_path / "junit.xml"
    path.write_text(content)
    with pytest.raises(grading.ReportError):
        grading.read_junit_xml(path, NONCE)


def test_report_must_be_a_regular_file(tmp_path):
    real = tmp_path / "real.xml"
    real.write_text(_xml(PASSED_CASE))
    link = tmp_path / "junit.xml"
    link.symlink_to(real)
    with pytest.raises(grading.ReportError, match="open"):
        grading.read_junit_xml(link, NONCE)
    fifo = tmp_path / "fifo.xml"
    os.mkfifo(fifo)
    with pytest.raises(grading.ReportError, match="regular"):
        grading.read_junit_xml(fifo, NONCE)
    with pytest.raises(grading.ReportError, match="no JUnit"):
        grading.read_junit_xml(tmp_path / "absent.xml", NONCE)


def test_missing_report_grades_as_missing():
    graded = grading.grade(["a.py::t"], ["a.py::u"], None, 0, False, RewardMode.PASS_RATE,
                           report_problem="no JUnit XML report was written")
    assert not graded.trusted and graded.reward == 0.0
    assert set(graded.fail_to_pass.values()) == {TestOutcome.MISSING}


@pytest.mark.parametrize("node_id, key", [
    ("tests/test_x.py::test_a", ("tests.test_x", "test_a")),
    ("tests/test_x.py::TestC::test_a[a b-1]", ("tests.test_x.TestC", "test_a[a b-1]")),
    ("test_x.py::test_a[x::y]", ("test_x", "test_a[x::y]")),
])
def test_junit_key(node_id, key):
    assert grading.junit_key(node_id) == key
