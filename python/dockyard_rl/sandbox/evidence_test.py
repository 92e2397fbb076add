"""The bounded stream parsers on real pytest reports and on hostile bytes."""

import hashlib
import json
import subprocess
import sys
from xml.sax import saxutils

import pytest

from dockyard_rl.sandbox import grading
from dockyard_rl.sandbox.evidence import JUnitStream, RecordStream
from dockyard_rl.sandbox.task import TestOutcome

TESTS = """\
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
"""


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("evidence")
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "pkg" / "tests" / "test_mix.py").write_text(TESTS)
    report = tmp_path / "junit.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--rootdir",
            str(tmp_path),
            f"--junitxml={report}",
            "-o",
            "junit_suite_name=nonce",
            "-o",
            "junit_family=xunit1",
            "pkg/tests/test_mix.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )
    return report.read_bytes()


def _parse(data: bytes, chunk: int = 7, max_bytes: int = 1 << 20, max_testcases: int = 1000):
    stream = JUnitStream(max_bytes, max_testcases)
    for start in range(0, len(data), chunk):
        stream(data[start : start + chunk])
    stream.finish()
    return stream


def test_real_report_node_ids_and_outcomes_in_small_chunks(real_report):
    stream = _parse(real_report)
    assert not stream.error and stream.suite_names == ["nonce"]
    assert stream.sha256 == hashlib.sha256(real_report).hexdigest()
    base = "pkg/tests/test_mix.py"

    def outcome(node_id):
        return stream.outcomes.get(grading.junit_key(node_id), TestOutcome.MISSING)

    assert outcome(f"{base}::test_ok") is TestOutcome.PASSED
    assert outcome(f"{base}::test_bad") is TestOutcome.FAILED
    assert outcome(f"{base}::test_skipped") is TestOutcome.SKIPPED
    assert outcome(f"{base}::test_param[one two]") is TestOutcome.PASSED
    assert outcome(f"{base}::test_param[three [four]]") is TestOutcome.FAILED
    assert outcome(f"{base}::TestBox::test_inner") is TestOutcome.PASSED
    assert outcome(f"{base}::test_teardown_error") is TestOutcome.ERROR
    assert outcome(f"{base}::test_absent") is TestOutcome.MISSING


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", "no JUnit XML report"),
        (b"<testsuites><testsuite name='a'>", "not well-formed"),
        (b"<!DOCTYPE x [<!ENTITY a 'aaaa'>]><testsuites/>", "DOCTYPE"),
        (b"<testsuites><testsuite name='a'/><testsuite name='b'/></testsuites>", "exactly one"),
        (b"<html/>", "unexpected root"),
    ],
)
def test_broken_or_hostile_reports(data, expected):
    assert expected in _parse(data).error


def test_caps_on_size_and_testcases():
    case = b"<testcase classname='c' name='n'><failure>" + b"x" * 1000 + b"</failure></testcase>"
    huge = b"<testsuites><testsuite name='a'>" + case * 2000 + b"</testsuite></testsuites>"
    stream = _parse(huge, chunk=65536, max_bytes=100_000)
    assert "larger than 100000" in stream.error and stream.outcomes == {}
    many = (
        b"<testsuites><testsuite name='a'>"
        + b"<testcase classname='c' name='n'/>" * 20
        + b"</testsuite></testsuites>"
    )
    assert "more than 10 testcases" in _parse(many, max_testcases=10).error


def test_duplicate_testcases_keep_the_worst_outcome():
    data = (
        b"<testsuites><testsuite name='a'><testcase classname='c' name='n'><failure/>"
        b"</testcase><testcase classname='c' name='n'/></testsuite></testsuites>"
    )
    assert _parse(data).outcomes == {("c", "n"): TestOutcome.FAILED}


def test_record_stream_phases_malformed_lines_and_overflow():
    stream = RecordStream(10_000)
    lines = [
        {"event": "test", "nodeid": "t.py::a", "when": "setup", "outcome": "passed"},
        {"event": "test", "nodeid": "t.py::a", "when": "call", "outcome": "failed", "raised": True},
        {"event": "test", "nodeid": "t.py::b", "when": "teardown", "outcome": "failed"},
        {"event": "test", "nodeid": "t.py::c", "when": "call", "outcome": "passed", "raised": True},
        {"event": "exit", "code": 1},
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines) + b'not json\n{"x"\n'
    for byte in range(len(data)):
        stream(data[byte : byte + 1])
    stream(b"partial")
    stream.finish()
    assert stream.tests == {
        "t.py::a": TestOutcome.FAILED,
        "t.py::b": TestOutcome.ERROR,
        "t.py::c": TestOutcome.PASSED,
    }
    assert stream.raised_but_passed == ["t.py::c (call)"]
    assert stream.records("exit") == [{"event": "exit", "code": 1}]
    assert stream.num_malformed == 3
    assert not stream.overflowed
    stream(b"x" * 20_000)
    assert stream.overflowed


# -- hostile bytes (whatever the sandbox sends): the sinks never raise ---------------------------


def _feed(sink, data: bytes, chunk: int) -> None:
    for start in range(0, len(data), chunk):
        sink(data[start : start + chunk])
    sink.finish()


def test_fuzz_record_stream_on_arbitrary_bytes():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.binary(max_size=2000), chunk=st.integers(1, 64))
    def check(data, chunk):
        stream = RecordStream(1000)
        _feed(stream, data, chunk)
        assert all(isinstance(nodeid, str) for nodeid in stream.tests)
        assert all(isinstance(r, dict) for rs in stream.by_kind.values() for r in rs)

    check()


_HOSTILE_XML = [
    b'<!DOCTYPE x [<!ENTITY a "aaaa">]><testsuite name="n">&a;</testsuite>',
    b'<testsuite name="n"><testcase classname="a" name="b">&undefined;</testcase></testsuite>',
    b'<testsuite name="n">' + b"<a>" * 100_000 + b"</a>" * 100_000 + b"</testsuite>",
    b'<testsuite name="n" name="m"/>',
    b'<testsuite name="&#0;"/>',
    b'<testsuite name="\xff\xfe"/>',
    b'<?xml version="1.0" encoding="utf-16"?><testsuite name="n"/>',
    b'<testsuite name="n"><testcase classname="a" name="b"/><testcase classname="a" name="b">'
    b"<failure/></testcase></testsuite>",
    b'<testsuite xmlns:x="urn:x" x:name="n"><x:testcase x:classname="a"/></testsuite>',
    b'<testsuite name="n"><![CDATA[' + b"x" * 10_000 + b"]]></testsuite>",
    b'<testsuite name="n"/><testsuite name="m"/>',
    b"<testsuites>" + b'<testsuite name="n"/>' * 3 + b"</testsuites>",
    b"",
    b"\x00" * 100,
]


@pytest.mark.parametrize("data", _HOSTILE_XML, ids=range(len(_HOSTILE_XML)))
def test_hostile_reports_never_raise(data):
    for chunk in (1, 7, 4096):
        report = JUnitStream(1 << 22, 1000)
        _feed(report, data, chunk)
        assert report.error or len(report.suite_names) == 1


def test_fuzz_junit_stream():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tags = st.sampled_from(["testsuites", "testsuite", "testcase", "failure", "error", "skipped"])
    attributes = st.dictionaries(
        st.sampled_from(["name", "classname", "x", "time"]), st.text(max_size=10), max_size=3
    )

    def element(children):
        return st.builds(
            lambda tag, attrs, inner: (
                f"<{tag}"
                + "".join(f" {k}={saxutils.quoteattr(v)}" for k, v in attrs.items())
                + f">{''.join(inner)}</{tag}>"
            ),
            tags,
            attributes,
            st.lists(children, max_size=3),
        )

    documents = st.recursive(st.just(""), element, max_leaves=10).map(str.encode)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        data=st.one_of(documents, st.binary(max_size=500)),
        chunk=st.integers(1, 50),
        max_testcases=st.integers(1, 5),
    )
    def check(data, chunk, max_testcases):
        report = JUnitStream(400, max_testcases)
        _feed(report, data, chunk)
        assert report.error or len(report.suite_names) == 1
        assert all(isinstance(o, TestOutcome) for o in report.outcomes.values())

    check()


def test_a_huge_tag_in_small_chunks_parses_in_linear_time():
    # expat 2.5 re-scans an unfinished token at every Parse call: fed 4 KiB at a time, a 16 MiB
    # attribute cost minutes before the report was fed in growing batches.
    import time

    value = b"x" * (16 << 20)
    data = b'<testsuite name="n"><testcase classname="a" name="' + value + b'"/></testsuite>'
    report = JUnitStream(32 << 20, 10)
    start = time.perf_counter()
    _feed(report, data, 4096)
    elapsed = time.perf_counter() - start
    print(f"16 MiB attribute in 4 KiB chunks: {elapsed:.2f} s")
    assert not report.error and elapsed < 10
