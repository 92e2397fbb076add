"""Grading a sandboxed pytest run: the runner's evidence -> trusted outcomes -> resolved, reward.

`grade_run(fail_to_pass, pass_to_pass, evidence, reward_mode)` decides, in this order, and the
first failing check names the verdict's `FailureKind`:
1. timeout (the wall clock killed the run) -> TIMEOUT;
2. the runner could not set the run up: the patched worktree does not fit its size-capped
   filesystem -> DISK_LIMIT, anything else -> REPORT_UNTRUSTED;
3. tampering, any of: `tamper` records from the runner (report written, renamed or deleted by
   anyone but pytest's JUnit writer; runner objects replaced; plugins registered by repository
   code), malformed or overflowing data on the record stream, more than one end record, an exit
   record whose code differs from the process's real exit status, a report whose digest differs
   from the one taken right after pytest wrote it (or changed later), a report suite name other
   than this run's nonce, a phase that raised yet was reported passed, a canary with the wrong
   outcome in the stream or the report, a test whose streamed outcome differs from the report's,
   a report testcase that never ran, an exit status that contradicts the report (the must-fail
   canary makes an honest run exit 1 or 2, so exit 0 is a forged exit) -> TAMPERING;
4. the run ended before the runner finished (a crash, `os._exit`, a kill signal), the report is
   missing or malformed, or the canaries did not run although some test did (collection errors
   stop pytest before any test, canaries included) -> REPORT_UNTRUSTED (DISK_LIMIT instead when
   the worktree or /tmp was full at the end);
5. SWE-bench's rule on the now-trusted outcomes: resolved only if every FAIL_TO_PASS and every
   PASS_TO_PASS test passed (skipped, errored or missing counts as failed; a collection error
   leaves the module's tests missing) -> otherwise TESTS_FAILED (or DISK_LIMIT when full). A task
   with no expected tests at all is never resolved (nothing was checked).
Any outcome but resolved reports every expected test as MISSING when the evidence is not trusted.
`grade_run` never raises, whatever the sandbox sent (hostile evidence): record fields are
type-checked where they are read, and an error a check missed ends as REPORT_UNTRUSTED.
Rewards: `binary` = 1.0 iff resolved; `pass_rate` = passed / (len(F2P) + len(P2P)), 0.0 when not
trusted.

Test ids are pytest node ids, taken from the runner's records as they are (no parsing of log
lines). The report names a testcase by (classname, name), which pytest derives from the node id
with `mangle_test_address`; that mapping loses information, so we never parse ids back out of
the XML: each streamed id is mangled the same way (`junit_key`) and looked up.

Why this holds up, and what it does not cover: docs/sandbox.md (threat model). In short, the
runner streams each outcome out of the test process as it happens, over a pipe, and the report
travels the same way; no host file is written by the sandbox. Code under test runs inside
pytest's process and could in principle reimplement the whole protocol; the canaries, the
independent stream, the audit hook and the runner-object checks turn every generic trick seen so
far into TAMPERING.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence

from dockyard_rl.sandbox.evidence import JUnitStream, RecordStream, worst
from dockyard_rl.sandbox.task import FailureKind, RewardMode, TestOutcome

logger = logging.getLogger(__name__)

_FAILING = (TestOutcome.FAILED, TestOutcome.ERROR)
# pytest's exit codes (pytest.ExitCode).
EXIT_OK, EXIT_TESTS_FAILED, EXIT_INTERRUPTED, EXIT_NO_TESTS = 0, 1, 2, 5
_MAX_LISTED = 10
# Below this much free space (bytes, and 1/_FULL_DIVISOR of the size) a filesystem counts as
# full. Integer arithmetic: the sizes come from the sandbox and may be any JSON integer.
_FULL_BYTES, _FULL_DIVISOR = 1024 * 1024, 50


@dataclasses.dataclass(frozen=True)
class Grade:
    resolved: bool
    reward: float
    fail_to_pass: dict[str, TestOutcome]
    pass_to_pass: dict[str, TestOutcome]
    failure_kind: FailureKind
    detail: str  # why it is not resolved, in words ("" when resolved)
    notes: tuple[str, ...] = ()  # runtime observations worth a flag ("introspection: ...")


@dataclasses.dataclass
class RunEvidence:
    """Everything one sandboxed run produced. `canary_names` is (must_pass, must_fail), or None
    when the run had no canaries (collection runs)."""

    records: RecordStream
    report: JUnitStream
    exit_code: int | None
    timed_out: bool
    suite_name: str
    canary_names: tuple[str, str] | None


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


def consistency_problem(
    outcomes: Mapping[tuple[str, str], TestOutcome], exit_code: int | None
) -> str:
    """Why pytest's exit code and the report disagree; "" if they do not."""
    num_failing = sum(outcome in _FAILING for outcome in outcomes.values())
    if exit_code == EXIT_OK:
        return (
            ""
            if num_failing == 0
            else f"exit code 0 but the report has {num_failing} failed/errored tests"
        )
    if exit_code in (EXIT_TESTS_FAILED, EXIT_INTERRUPTED):
        return (
            ""
            if num_failing > 0
            else f"exit code {exit_code} says tests failed but the report claims none did"
        )
    if exit_code == EXIT_NO_TESTS:
        return "" if not outcomes else "exit code 5 (no tests collected) but the report has tests"
    return f"the test runner exited with {exit_code} (not a pytest result)"


def _disk_full(records: RecordStream) -> bool:
    for end in records.records("session_end")[:1]:
        disk = end.get("disk")
        for usage in disk.values() if isinstance(disk, dict) else ():
            free = usage.get("free") if isinstance(usage, dict) else None
            total = usage.get("total") if isinstance(usage, dict) else None
            if not (_is_int(free) and _is_int(total)):
                continue  # the runner writes integers; anything else says nothing about space
            if free < _FULL_BYTES and free * _FULL_DIVISOR < max(total, 1):
                return True
    return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _listed(items: Sequence[str]) -> str:
    shown = "; ".join(items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def _find_canary(tests: Mapping[str, TestOutcome], name: str) -> str | None:
    for nodeid in tests:
        if nodeid.rpartition("::")[2] == name:
            return nodeid
    return None


def _tampering(evidence: RunEvidence) -> list[str]:
    """Check 3 of the module docstring: every sign that the run altered its own results."""
    records, report = evidence.records, evidence.report
    found = [f"runner: {r.get('what')}" for r in records.records("tamper")]
    if records.overflowed:
        found.append(f"the result stream exceeded {records.max_bytes} bytes")
    if records.num_malformed:
        found.append(f"{records.num_malformed} malformed lines on the result stream")
    if records.num_after_exit:
        found.append(f"{records.num_after_exit} records after the runner's exit record")
    ends, exits = records.records("session_end"), records.records("exit")
    if len(ends) > 1 or len(exits) > 1:
        found.append(f"{len(ends)} session_end and {len(exits)} exit records (one each expected)")
    if exits and exits[0].get("code") != evidence.exit_code:
        found.append(
            f"the runner reported exit code {exits[0].get('code')!r} but the process "
            f"exited with {evidence.exit_code}"
        )
    if ends and not report.error and ends[0].get("report_sha256") != report.sha256:
        found.append("the report received differs from the one pytest wrote")
    if ends and exits and ends[0].get("report_sha256") != exits[0].get("report_sha256"):
        found.append("the report file changed after pytest wrote it")
    if not report.error and report.suite_names != [evidence.suite_name]:
        found.append("the report's suite name is not this run's nonce")
    if records.raised_but_passed:
        found.append(
            f"phases that raised but were reported passed: {_listed(records.raised_but_passed)}"
        )
    if report.error or not ends:
        return found
    if evidence.canary_names is not None:
        for name, expected in zip(evidence.canary_names, (TestOutcome.PASSED, TestOutcome.FAILED)):
            nodeid = _find_canary(records.tests, name)
            if nodeid is None:
                continue  # not run at all: check 4
            streamed, reported = records.tests[nodeid], report.outcomes.get(junit_key(nodeid))
            if streamed is not expected or reported is not expected:
                found.append(
                    f"the executor's canary test {name} must be {expected.value} but "
                    f"was {streamed.value} (stream) / "
                    f"{reported.value if reported else 'missing'} (report)"
                )
    # Distinct node ids can share a report key (the mangling loses "/" vs "."): compare per key.
    streamed_by_key: dict[tuple[str, str], TestOutcome] = {}
    for nodeid, streamed in records.tests.items():
        key = junit_key(nodeid)
        streamed_by_key[key] = worst(streamed_by_key.get(key), streamed)
    mismatched = []
    for key, streamed in streamed_by_key.items():
        reported = report.outcomes.get(key)
        if reported is not streamed:
            mismatched.append(
                f"{'::'.join(key)}: ran {streamed.value}, report says "
                f"{reported.value if reported else 'missing'}"
            )
    if mismatched:
        found.append(f"the report disagrees with what ran: {_listed(mismatched)}")
    known = {junit_key(nodeid) for nodeid in records.tests}
    known |= {junit_key(str(r.get("nodeid", ""))) for r in records.records("collect_error")}
    unknown = [
        f"{classname}::{name}"
        for classname, name in report.outcomes
        if (classname, name) not in known
    ]
    if unknown:
        found.append(f"the report lists tests that never ran: {_listed(unknown)}")
    problem = consistency_problem(report.outcomes, evidence.exit_code)
    if problem and evidence.canary_names is not None:
        found.append(problem)
    return found


def _untrusted_reason(evidence: RunEvidence) -> str:
    """Check 4 of the module docstring; "" when the evidence is complete."""
    records, report = evidence.records, evidence.report
    if not records.records("session_end") or not records.records("exit"):
        return (
            f"the test process ended (exit status {evidence.exit_code}) before the runner "
            f"finished: a crash, a forced exit or a kill; no result can be trusted"
        )
    if report.error:
        return report.error
    # Collection errors stop pytest before any test runs (canaries included): then nothing
    # passed, and the expected tests grade as missing.
    stopped_by_collection = not records.tests and bool(records.records("collect_error"))
    if evidence.canary_names is not None and not stopped_by_collection:
        missing = [
            name for name in evidence.canary_names if _find_canary(records.tests, name) is None
        ]
        if missing:
            return (
                f"the executor's canary tests did not run ({', '.join(missing)}); the "
                f"session stopped early"
            )
    problem = consistency_problem(report.outcomes, evidence.exit_code)
    return problem


# What reading hostile evidence could raise if a check above missed a case. Never expected (the
# fuzz tests in grading_test.py fail on it); if it happens, the run is REPORT_UNTRUSTED, not an
# infrastructure error that would mask the patch's sample.
_EVIDENCE_ERRORS = (
    TypeError,
    ValueError,
    KeyError,
    AttributeError,
    IndexError,
    OverflowError,
    RecursionError,
)
GRADER_ERROR = "the grader could not read the evidence"


def grade_run(
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    evidence: RunEvidence,
    reward_mode: RewardMode,
) -> Grade:
    """The verdict's grade (module docstring). Never raises for any evidence the sandbox sent."""
    try:
        return _grade_run(fail_to_pass, pass_to_pass, evidence, reward_mode)
    except _EVIDENCE_ERRORS as error:
        logger.error("grading raised on the sandbox's evidence", exc_info=True)
        return ungraded(
            fail_to_pass,
            pass_to_pass,
            FailureKind.REPORT_UNTRUSTED,
            f"{GRADER_ERROR}: {type(error).__name__}: {str(error)[:200]}",
        )


def _grade_run(
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    evidence: RunEvidence,
    reward_mode: RewardMode,
) -> Grade:
    records = evidence.records
    notes = tuple(
        sorted({f"introspection: runtime {r.get('what')}" for r in records.records("note")})
    )

    def untrusted(kind: FailureKind, detail: str) -> Grade:
        return ungraded(fail_to_pass, pass_to_pass, kind, detail, notes)

    if evidence.timed_out:
        return untrusted(FailureKind.TIMEOUT, "the test run was killed at the wall-clock limit")
    for setup in records.records("setup_error")[:1]:
        kind = (
            FailureKind.DISK_LIMIT
            if setup.get("kind") == "disk_limit"
            else FailureKind.REPORT_UNTRUSTED
        )
        return untrusted(kind, f"the test run could not start: {setup.get('detail')}")
    tampering = _tampering(evidence)
    if tampering:
        return untrusted(FailureKind.TAMPERING, f"tampering detected: {_listed(tampering)}")
    full = _disk_full(records)
    reason = _untrusted_reason(evidence)
    if reason:
        kind = FailureKind.DISK_LIMIT if full else FailureKind.REPORT_UNTRUSTED
        return untrusted(kind, f"test report not trusted: {reason}")

    def outcome(test_id: str) -> TestOutcome:
        return records.tests.get(test_id, TestOutcome.MISSING)

    graded = grade_outcomes(fail_to_pass, pass_to_pass, outcome, reward_mode, notes)
    if full and not graded.resolved:
        return dataclasses.replace(
            graded,
            failure_kind=FailureKind.DISK_LIMIT,
            detail=f"the worktree or /tmp filled its size cap; {graded.detail}",
        )
    return graded


def ungraded(
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    kind: FailureKind,
    detail: str,
    notes: tuple[str, ...] = (),
) -> Grade:
    """The grade of a run whose results cannot be used: every expected test MISSING."""
    return Grade(
        resolved=False,
        reward=0.0,
        fail_to_pass={test_id: TestOutcome.MISSING for test_id in fail_to_pass},
        pass_to_pass={test_id: TestOutcome.MISSING for test_id in pass_to_pass},
        failure_kind=kind,
        detail=detail,
        notes=notes,
    )


def grade_outcomes(
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    outcome: Callable[[str], TestOutcome],
    reward_mode: RewardMode,
    notes: tuple[str, ...] = (),
) -> Grade:
    """SWE-bench grading of trusted per-test outcomes: resolved when every FAIL_TO_PASS and
    PASS_TO_PASS test passed; the reward follows `reward_mode`."""
    f2p = {test_id: outcome(test_id) for test_id in fail_to_pass}
    p2p = {test_id: outcome(test_id) for test_id in pass_to_pass}
    num_expected = len(f2p) + len(p2p)
    num_passed = sum(o is TestOutcome.PASSED for o in [*f2p.values(), *p2p.values()])
    resolved = num_expected > 0 and num_passed == num_expected
    if reward_mode == RewardMode.BINARY:
        reward = 1.0 if resolved else 0.0
    else:
        reward = num_passed / num_expected if num_expected else 0.0
    if resolved:
        return Grade(True, reward, f2p, p2p, FailureKind.NONE, "", notes)
    failing = [
        f"{test_id}: {o.value}"
        for test_id, o in [*f2p.items(), *p2p.items()]
        if o is not TestOutcome.PASSED
    ]
    detail = (
        f"not every expected test passed: {_listed(failing)}"
        if num_expected
        else "the task names no FAIL_TO_PASS or PASS_TO_PASS test"
    )
    return Grade(False, reward, f2p, p2p, FailureKind.TESTS_FAILED, detail, notes)
