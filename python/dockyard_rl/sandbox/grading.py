"""Grading a sandboxed pytest run: JUnit XML → per-test outcomes → resolved and reward.

Flow: `read_junit_xml(path, suite_name)` parses the report into {(classname, name): outcome};
`grade(...)` maps the task's FAIL_TO_PASS / PASS_TO_PASS node ids onto it, cross-checks the
report with pytest's exit code, and applies SWE-bench's rule: resolved only if every F2P and
every P2P test passed (skipped, errored or missing counts as failed; a collection error leaves
the file's tests missing, so it fails them). Reward: `binary` = 1.0 iff resolved; `pass_rate` =
passed / (len(F2P) + len(P2P)). A task with no expected tests at all is never resolved (nothing
was checked).

Test ids: pytest node ids, parametrized ids with spaces included ("t.py::test_x[a b-1]"). The XML
names a testcase by (classname, name), which pytest derives from the node id with
`mangle_test_address` (path with "/" → ".", ".py" dropped, "::" → ".", the parameter bracket
kept opaque). That mapping loses information, so we never parse ids back out of the XML: each
expected id is mangled the same way and looked up. No whitespace splitting of log lines anywhere.

Why the report can be trusted — the design (what the pipeline does, and what is checked here):
1. Nobody but this run can have written the file. The XML goes to a results directory the
   pipeline creates fresh per run (`tempfile.mkdtemp`, random name) OUTSIDE the worktree, inside
   the task's private directory under the work root, which the sandbox hides behind a tmpfs; only
   that one directory is bound back writable. The agent's patch is applied before the name is
   drawn, so nothing in the repository can pre-write or symlink it, earlier runs cannot leave a
   file there, and the repository's own files (a committed `report.xml`) are never read.
2. The file must look like pytest wrote it for THIS run: a regular file (opened with O_NOFOLLOW,
   fstat-checked: no symlink, FIFO or device), at most `_MAX_XML_BYTES`, no DOCTYPE/ENTITY
   declarations (pytest never writes them; they enable entity-expansion bombs), root
   `<testsuites>` with exactly one `<testsuite>` whose name is the per-run random nonce the
   pipeline passed as `-o junit_suite_name=<nonce>` (a canned or copied report fails this).
3. The exit code must agree with the report (the SWE-bench #601 lesson: a patch that replaced
   sys.stdout printed fake passes). pytest exits 0 only if no test failed or errored; 1 if some
   test failed; 2 when interrupted (e.g. collection errors); 5 when nothing was collected.
   Accepted combinations: exit 0 with no failed/errored testcase; exit 1 or 2 with at least one;
   exit 5 with no testcases. Anything else — an XML claiming all passed while the exit code says
   failure, failures with exit 0, exit 3/4 (internal/usage error), death by a signal, a timeout —
   makes the report untrusted: every expected test is reported MISSING and the task is not
   resolved. A testcase that appears several times takes its worst outcome, so appending a
   forged "passed" duplicate cannot hide a failure.
Pytest itself runs with `-p no:cacheprovider` (no state carried between runs) and the
repository's test-runner configuration is protected by integrity.py.

What this does NOT cover (no harness that runs the tests in-process can): code under test runs
inside pytest's own process, so a patch written specifically against this executor could read
the report path and nonce from its own argv, write a consistent fake report and `os._exit(0)`.
Defences against that adaptive attack live elsewhere: held-out tests the agent never saw,
integrity checks on the patch, and auditing rewarded patches. Everything generic — fake PASSED
lines, replaced stdout, exit-code forging alone, canned or pre-placed reports, rewriting the
report after pytest wrote it (atexit) while the exit code still says failure — is caught here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence

from dockyard_rl.sandbox.task import RewardMode, TestOutcome

_MAX_XML_BYTES = 64 * 1024 * 1024
# Worse outcomes win when a testcase appears more than once.
_SEVERITY = {TestOutcome.PASSED: 0, TestOutcome.SKIPPED: 1, TestOutcome.FAILED: 2,
             TestOutcome.ERROR: 3}
_FAILING = (TestOutcome.FAILED, TestOutcome.ERROR)

# pytest's exit codes (pytest.ExitCode).
EXIT_OK, EXIT_TESTS_FAILED, EXIT_INTERRUPTED, EXIT_NO_TESTS = 0, 1, 2, 5


class ReportError(ValueError):
    """The JUnit XML report is missing, malformed or not from this run."""


@dataclasses.dataclass(frozen=True)
class Grade:
    resolved: bool
    reward: float
    fail_to_pass: dict[str, TestOutcome]
    pass_to_pass: dict[str, TestOutcome]
    trusted: bool          # False: report missing/forged/inconsistent with the exit code
    reason: str            # why the report was not trusted; "" when it was


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) pytest's junitxml writes for `node_id` (see the module docstring)."""
    path, sep, tail = node_id.partition("::")
    names = [path]
    params = ""
    if sep:
        name_part, bracket, param_part = tail.partition("[")
        names += name_part.split("::")
        if bracket:
            params = f"[{param_part.removesuffix(']')}]"
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += params
    return ".".join(names[:-1]), names[-1]


def read_junit_xml(path: str | os.PathLike, suite_name: str) -> dict[tuple[str, str], TestOutcome]:
    """Parses pytest's JUnit XML at `path`; raises ReportError unless it passes the checks of
    point 2 in the module docstring."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ReportError("no JUnit XML report was written") from None
    except OSError as error:
        raise ReportError(f"cannot open the JUnit XML report: {error}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ReportError("the JUnit XML report is not a regular file")
        if info.st_size > _MAX_XML_BYTES:
            raise ReportError(f"the JUnit XML report is larger than {_MAX_XML_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(_MAX_XML_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_XML_BYTES:
        raise ReportError(f"the JUnit XML report is larger than {_MAX_XML_BYTES} bytes")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise ReportError("the JUnit XML report declares a DOCTYPE/ENTITY (pytest never does)")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as error:
        raise ReportError(f"the JUnit XML report is not well-formed: {error}") from None
    suites = [root] if root.tag == "testsuite" else list(root)
    if root.tag not in ("testsuites", "testsuite") or len(suites) != 1 \
            or suites[0].tag != "testsuite":
        raise ReportError("the JUnit XML report must hold exactly one <testsuite>")
    if suites[0].get("name") != suite_name:
        raise ReportError(f"the JUnit XML report's suite name {suites[0].get('name')!r} is not "
                          f"this run's nonce")
    outcomes: dict[tuple[str, str], TestOutcome] = {}
    for case in suites[0].iter("testcase"):
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = TestOutcome.ERROR
        elif "failure" in tags:
            outcome = TestOutcome.FAILED
        elif "skipped" in tags:
            outcome = TestOutcome.SKIPPED
        else:
            outcome = TestOutcome.PASSED
        key = (case.get("classname", ""), case.get("name", ""))
        previous = outcomes.get(key)
        if previous is None or _SEVERITY[outcome] > _SEVERITY[previous]:
            outcomes[key] = outcome
    return outcomes


def consistency_problem(outcomes: Mapping[tuple[str, str], TestOutcome],
                        exit_code: int | None, timed_out: bool) -> str:
    """Why the report and the exit code disagree (point 3 of the module docstring); "" if not."""
    if timed_out or exit_code is None:
        return "the test run timed out"
    num_failing = sum(outcome in _FAILING for outcome in outcomes.values())
    if exit_code == EXIT_OK:
        return "" if num_failing == 0 else \
            f"exit code 0 but the report has {num_failing} failed/errored tests"
    if exit_code in (EXIT_TESTS_FAILED, EXIT_INTERRUPTED):
        return "" if num_failing > 0 else \
            f"exit code {exit_code} says tests failed but the report claims none did"
    if exit_code == EXIT_NO_TESTS:
        return "" if not outcomes else "exit code 5 (no tests collected) but the report has tests"
    return f"the test runner exited with {exit_code} (not a pytest result)"


def grade(fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
          outcomes: Mapping[tuple[str, str], TestOutcome] | None, exit_code: int | None,
          timed_out: bool, reward_mode: RewardMode, report_problem: str = "") -> Grade:
    """SWE-bench grading (module docstring). `outcomes` is None when the report could not be
    read; `report_problem` then says why."""
    reason = report_problem
    if outcomes is not None and not reason:
        reason = consistency_problem(outcomes, exit_code, timed_out)
    elif outcomes is None and not reason:
        reason = "no report"
    trusted = not reason

    def lookup(node_id: str) -> TestOutcome:
        if not trusted:
            return TestOutcome.MISSING
        return outcomes.get(junit_key(node_id), TestOutcome.MISSING)

    f2p = {test_id: lookup(test_id) for test_id in fail_to_pass}
    p2p = {test_id: lookup(test_id) for test_id in pass_to_pass}
    num_expected = len(f2p) + len(p2p)
    num_passed = sum(o == TestOutcome.PASSED for o in [*f2p.values(), *p2p.values()])
    resolved = trusted and num_expected > 0 and num_passed == num_expected
    if reward_mode == RewardMode.BINARY:
        reward = 1.0 if resolved else 0.0
    else:
        reward = num_passed / num_expected if num_expected else 0.0
    return Grade(resolved=resolved, reward=reward, fail_to_pass=f2p, pass_to_pass=p2p,
                 trusted=trusted, reason=reason)
