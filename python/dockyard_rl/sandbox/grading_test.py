"""grading.grade_run on hand-built evidence: SWE-bench's rule, and every tampering and untrusted
case its docstring lists, each with the FailureKind it must produce. (evidence_test parses real
pytest reports; runner_test and pipeline_test produce the evidence for real.)"""

import hashlib
import json
from xml.sax.saxutils import quoteattr

import pytest

from dockyard_rl.sandbox import grading
from dockyard_rl.sandbox.evidence import JUnitStream, RecordStream
from dockyard_rl.sandbox.task import FailureKind, RewardMode, TestOutcome

NONCE = "dockyard-0123456789abcdef"
CANARIES = ("test_c4n4ry0", "test_c4n4ry1")
BASE = "pkg/tests/test_mix.py"
RESULTS = {
    f"{BASE}::test_ok": "passed",
    f"{BASE}::test_bad": "failed",
    f"{BASE}::test_skipped": "skipped",
    f"{BASE}::test_param[one two]": "passed",
    f"{BASE}::TestBox::test_inner": "passed",
    f"{BASE}::test_teardown": "error",
}
_TAGS = {
    "failed": "<failure message='x'/>",
    "error": "<error message='x'/>",
    "skipped": "<skipped message='x'/>",
    "passed": "",
}


def _record(**fields) -> bytes:
    return (json.dumps(fields) + "\n").encode()


def make_evidence(
    results=RESULTS,
    *,
    exit_code=1,
    canaries=True,
    suite=NONCE,
    report=None,
    records=(),
    end=True,
    exit_record=True,
    exit_record_code=None,
    timed_out=False,
    canary_outcomes=("passed", "failed"),
):
    """Evidence of an honest run of `results` ({node id: outcome}), with overrides."""
    ran = dict(results)
    if canaries:
        ran.update({f"::{CANARIES[0]}": canary_outcomes[0], f"::{CANARIES[1]}": canary_outcomes[1]})
    stream = RecordStream(1 << 20)
    for nodeid, outcome in ran.items():
        if outcome == "error":
            stream(
                _record(event="test", nodeid=nodeid, when="setup", outcome="failed", raised=True)
            )
            continue
        stream(_record(event="test", nodeid=nodeid, when="setup", outcome="passed"))
        stream(
            _record(
                event="test",
                nodeid=nodeid,
                when="call",
                outcome=outcome,
                raised=outcome == "failed",
            )
        )
        stream(_record(event="test", nodeid=nodeid, when="teardown", outcome="passed"))
    for extra in records:
        stream(extra)
    if report is None:
        cases = "".join(
            f"<testcase classname={quoteattr(grading.junit_key(n)[0])} "
            f"name={quoteattr(grading.junit_key(n)[1])}>{_TAGS[o]}</testcase>"
            for n, o in ran.items()
        )
        report = f'<testsuites><testsuite name="{suite}">{cases}</testsuite></testsuites>'
    data = report.encode()
    digest = hashlib.sha256(data).hexdigest()
    if end:
        stream(_record(event="session_end", exitstatus=exit_code, report_sha256=digest, disk={}))
    if exit_record:
        code = exit_code if exit_record_code is None else exit_record_code
        stream(_record(event="exit", code=code, report_sha256=digest))
    stream.finish()
    junit = JUnitStream(1 << 20, 1000)
    junit(data)
    junit.finish()
    return grading.RunEvidence(
        records=stream,
        report=junit,
        exit_code=exit_code,
        timed_out=timed_out,
        suite_name=NONCE,
        canary_names=CANARIES if canaries else None,
    )


def grade(
    evidence,
    f2p=(f"{BASE}::test_ok",),
    p2p=(f"{BASE}::test_param[one two]",),
    mode=RewardMode.BINARY,
):
    return grading.grade_run(list(f2p), list(p2p), evidence, mode)


def test_honest_run_resolves_and_swe_bench_rule():
    graded = grade(make_evidence())
    assert graded.resolved and graded.reward == 1.0 and graded.failure_kind is FailureKind.NONE
    for f2p in (
        [f"{BASE}::test_skipped"],
        [f"{BASE}::test_gone"],
        [f"{BASE}::test_bad"],
        [f"{BASE}::test_teardown"],
    ):
        graded = grade(make_evidence(), f2p=f2p)
        assert not graded.resolved and graded.failure_kind is FailureKind.TESTS_FAILED
        assert f2p[0] in graded.detail
    graded = grade(
        make_evidence(),
        p2p=[f"{BASE}::test_bad", f"{BASE}::test_skipped"],
        mode=RewardMode.PASS_RATE,
    )
    assert graded.reward == pytest.approx(1 / 3)
    assert graded.pass_to_pass == {
        f"{BASE}::test_bad": TestOutcome.FAILED,
        f"{BASE}::test_skipped": TestOutcome.SKIPPED,
    }
    assert graded.fail_to_pass[f"{BASE}::test_ok"] is TestOutcome.PASSED
    assert not grade(make_evidence(), f2p=(), p2p=()).resolved  # nothing was checked


def test_a_run_without_canaries_may_exit_0():
    results = {f"{BASE}::test_ok": "passed", f"{BASE}::test_param[one two]": "passed"}
    assert grade(make_evidence(results, exit_code=0, canaries=False)).resolved


ALL_PASSED = {n: "passed" for n in RESULTS}
FORGED_XML = (
    f'<testsuites><testsuite name="{NONCE}">'
    + "".join(
        f"<testcase classname={quoteattr(grading.junit_key(n)[0])} "
        f"name={quoteattr(grading.junit_key(n)[1])}/>"
        for n in [*RESULTS, f"::{CANARIES[0]}", f"::{CANARIES[1]}"]
    )
    + "</testsuite></testsuites>"
)


@pytest.mark.parametrize(
    "case, kwargs, expected",
    [
        (
            "everything rewritten to passed, canary included",
            dict(results=ALL_PASSED, canary_outcomes=("passed", "passed"), exit_code=0),
            "canary",
        ),
        ("forced exit 0", dict(exit_code=0, exit_record_code=0), "exit code 0"),
        ("exit record differs from the real exit", dict(exit_record_code=0), "reported exit code"),
        ("report forged to all-passed", dict(report=FORGED_XML), "report disagrees"),
        ("report suite name", dict(suite="pytest"), "nonce"),
        ("a tamper record", dict(records=[_record(event="tamper", what="x")]), "runner: x"),
        ("garbage on the stream", dict(records=[b"PASSED\n"]), "malformed"),
        (
            "two end records",
            dict(records=[_record(event="exit", code=1, report_sha256="0")]),
            "exit records",
        ),
        (
            "raised but passed",
            dict(
                records=[
                    _record(
                        event="test",
                        nodeid=f"{BASE}::test_ok",
                        when="call",
                        outcome="passed",
                        raised=True,
                    )
                ]
            ),
            "raised but were reported passed",
        ),
    ],
)
def test_tampering(case, kwargs, expected):
    graded = grade(make_evidence(**kwargs))
    assert not graded.resolved and graded.reward == 0.0, case
    assert graded.failure_kind is FailureKind.TAMPERING, (case, graded.detail)
    assert expected in graded.detail, (case, graded.detail)
    assert set(graded.fail_to_pass.values()) == {TestOutcome.MISSING}


def test_report_changed_after_pytest_wrote_it():
    evidence = make_evidence()
    evidence.records.by_kind["exit"][0]["report_sha256"] = "f" * 64
    graded = grade(evidence)
    assert graded.failure_kind is FailureKind.TAMPERING and "changed after" in graded.detail


def test_report_lists_a_test_that_never_ran():
    extra = FORGED_XML.replace("</testsuite>", '<testcase classname="x" name="ghost"/></testsuite>')
    evidence = make_evidence(results=ALL_PASSED, report=extra)
    graded = grade(evidence)
    assert graded.failure_kind is FailureKind.TAMPERING and "never ran" in graded.detail


@pytest.mark.parametrize(
    "kwargs, expected_kind, expected",
    [
        (
            dict(end=False, exit_record=False, exit_code=0),
            FailureKind.REPORT_UNTRUSTED,
            "before the runner finished",
        ),
        (dict(report="<testsuites>"), FailureKind.REPORT_UNTRUSTED, "not well-formed"),
        (dict(timed_out=True), FailureKind.TIMEOUT, "wall-clock"),
        (
            dict(
                records=[_record(event="setup_error", kind="disk_limit", detail="copying: ENOSPC")]
            ),
            FailureKind.DISK_LIMIT,
            "ENOSPC",
        ),
        (
            dict(records=[_record(event="setup_error", kind="copy_failed", detail="boom")]),
            FailureKind.REPORT_UNTRUSTED,
            "boom",
        ),
    ],
)
def test_untrusted_runs(kwargs, expected_kind, expected):
    graded = grade(make_evidence(**kwargs))
    assert not graded.resolved and graded.failure_kind is expected_kind, graded.detail
    assert expected in graded.detail


def test_canaries_that_did_not_run_are_untrusted():
    evidence = make_evidence()
    for nodeid in [n for n in evidence.records.tests if CANARIES[0] in n]:
        del evidence.records.tests[nodeid]
    evidence.report.outcomes = {
        k: v for k, v in evidence.report.outcomes.items() if CANARIES[0] not in k[1]
    }
    graded = grade(evidence)
    assert graded.failure_kind is FailureKind.REPORT_UNTRUSTED and "canary" in graded.detail


def test_full_disk_labels_a_failing_run():
    evidence = make_evidence()
    evidence.records.by_kind["session_end"][0]["disk"] = {
        "worktree_dir": {"free": 0, "total": 1 << 30}
    }
    assert grade(evidence, f2p=[f"{BASE}::test_bad"]).failure_kind is FailureKind.DISK_LIMIT
    assert grade(evidence).resolved  # a full disk does not matter when everything passed


def test_runtime_notes_become_flags():
    graded = grade(make_evidence(records=[_record(event="note", what="gc.get_referrers")]))
    assert graded.resolved and graded.notes == ("introspection: runtime gc.get_referrers",)


@pytest.mark.parametrize(
    "node_id, key",
    [
        ("tests/test_x.py::test_a", ("tests.test_x", "test_a")),
        ("tests/test_x.py::TestC::test_a[a b-1]", ("tests.test_x.TestC", "test_a[a b-1]")),
        ("test_x.py::test_a[x::y]", ("test_x", "test_a[x::y]")),
    ],
)
def test_junit_key(node_id, key):
    assert grading.junit_key(node_id) == key


def test_collection_errors_before_any_test_grade_as_failed_not_untrusted():
    evidence = make_evidence(
        results={},
        canaries=False,
        exit_code=2,
        records=[_record(event="collect_error", nodeid=f"{BASE}")],
        report=(
            f'<testsuites><testsuite name="{NONCE}"><testcase classname="" '
            f'name="pkg.tests.test_mix"><error message="x"/></testcase></testsuite>'
            f"</testsuites>"
        ),
    )
    evidence.canary_names = CANARIES
    graded = grade(evidence)
    assert graded.failure_kind is FailureKind.TESTS_FAILED, graded.detail
    assert set(graded.fail_to_pass.values()) == {TestOutcome.MISSING}


# -- hostile evidence (whatever the sandbox sends): grading never raises -------------------------

_NOT_RESOLVED_KINDS = {
    FailureKind.TAMPERING,
    FailureKind.REPORT_UNTRUSTED,
    FailureKind.TESTS_FAILED,
    FailureKind.DISK_LIMIT,
}


def _check_total(graded: grading.Grade) -> None:
    assert isinstance(graded, grading.Grade)
    assert not graded.detail.startswith(grading.GRADER_ERROR), graded.detail
    assert graded.resolved or graded.failure_kind in _NOT_RESOLVED_KINDS
    json.dumps(graded.detail, ensure_ascii=False).encode("utf-8")  # storable: no surrogates


@pytest.mark.parametrize(
    "line",
    [
        b"[" * 50_000 + b"]" * 50_000 + b"\n",  # RecursionError in json
        b'{"event": "test", "nodeid": {"a": [[[[[1]]]]]}}\n',
        b'{"event": "session_end", "disk": {"/": {"free": Infinity, "total": 1e999}}}\n',
        b'{"event": "session_end", "disk": {"/": {"free": 0, "total": 1' + b"0" * 400 + b"}}}\n",
        b'{"event": "session_end", "disk": {"/": {"free": NaN, "total": -Infinity}}}\n',
        b'{"event": "session_end", "disk": [1, 2]}\n',
        b'{"event": "exit", "code": NaN}\n',
        b'{"event": "test", "nodeid": "\\ud800::x", "when": "call", "outcome": "passed"}\n',
        b'{"event": "test", "nodeid": 7, "when": "call", "outcome": "passed"}\n',
        b'{"event": "test", "nodeid": "a::b", "when": ["call"], "outcome": {"x": 1}}\n',
        b'{"event": 1}\n',
        b'{"event": "tamper", "what": "' + b"x" * 60_000 + b'"}\n',
        b'[{"event": "exit"}]\n',
        b'"just a string"\n',
        b"\xff\xfe\x00junk\n",
        b'{"event": "note", "what": "\xed\xa0\x80"}\n',  # UTF-8 encoded surrogate
        b'{"event": "setup_error", "kind": ["disk_limit"], "detail": {"x": 1}}\n',
        b'{"event": "collect_error", "nodeid": null}\n',
        b"1" * 5000 + b"\n",  # int too long for int()
    ],
)
def test_hostile_records_end_as_a_verdict(line):
    for placement in ("before_end", "after_exit"):
        evidence = make_evidence(records=[line] if placement == "before_end" else ())
        if placement == "after_exit":
            evidence.records(line)
            evidence.records.finish()
        graded = grade(evidence)
        _check_total(graded)
        if placement == "after_exit":
            assert not graded.resolved, (line[:80], graded.detail)


def test_records_after_the_exit_record_are_tampering():
    evidence = make_evidence()
    evidence.records(_record(event="note", what="late"))
    graded = grade(evidence)
    assert graded.failure_kind is FailureKind.TAMPERING
    assert "after the runner's exit record" in graded.detail


def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=10**300, max_value=10**400),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.sampled_from(["\ud800", "a\udfff", "passed", "failed", "call", "setup", CANARIES[0]]),
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=8), children, max_size=3)
        ),
        max_leaves=8,
    )


def test_fuzz_grade_run_on_hostile_records():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    kinds = st.sampled_from(
        ["test", "tamper", "note", "setup_error", "session_end", "exit", "collect_error", "x"]
    )
    record = st.fixed_dictionaries(
        {"event": kinds},
        optional={
            key: _json_values()
            for key in ("nodeid", "when", "outcome", "raised", "code", "disk", "what", "kind")
        },
    )
    line = st.one_of(
        record.map(lambda r: (json.dumps(r) + "\n").encode()),
        _json_values().map(lambda v: (json.dumps(v) + "\n").encode()),
        st.binary(max_size=200),
    )

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(lines=st.lists(line, max_size=5), exit_code=st.sampled_from([0, 1, 2, 5, None, -9]))
    def check(lines, exit_code):
        evidence = make_evidence(records=lines)
        evidence.exit_code = exit_code
        _check_total(grade(evidence))

    check()
