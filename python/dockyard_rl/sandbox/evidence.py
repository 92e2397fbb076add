"""What a sandboxed test run reports, read as it streams out: the runner's records and the report.

Two sinks for `isolation.OutputChannel`s, each fed chunk by chunk while the tests run and each
bounded in memory whatever the sandbox writes:

- `RecordStream`: the JSON lines `runner_bootstrap.py` writes on its events fd (one per test
  phase as it finishes, plus collect_error, plugin, tamper, note, setup_error, session_end and
  exit records). Lines are parsed as they complete; at most `max_bytes` are accepted, longer
  lines or undecodable ones are counted as malformed (the executor treats any of that as
  tampering: nothing but the runner writes there).
- `JUnitStream`: pytest's JUnit XML as the runner forwards it, parsed with expat's push parser
  (no tree is built, character data is dropped), so a report of any size costs O(1) memory
  beyond the per-test outcomes; more than `max_bytes` or `max_testcases` makes it invalid. DOCTYPE
  and entity declarations are refused (pytest never writes them; they enable expansion bombs).

Outcomes use `task.TestOutcome`; a testcase seen several times keeps its worst outcome
(`worst`), so a forged "passed" duplicate cannot hide a failure.

Both sinks are total (the sandbox's output is hostile evidence): whatever bytes arrive, they never
raise; anything they cannot read is counted (`num_malformed`) or recorded (`error`), and grading
turns it into TAMPERING or REPORT_UNTRUSTED. A record is a JSON object whose strings are valid
Unicode (no lone surrogates) and whose containers nest at most `_MAX_RECORD_DEPTH` deep; records
after the exit record are counted (`num_after_exit`: the runner leaves right after sending it).

Parsing is linear: expat 2.5 re-scans an unfinished token from its start at every `Parse` call,
so the report is fed in batches at least as long as the bytes since the last element event (an
open token), which keeps a crafted megabyte-long tag from costing quadratic time.
"""

from __future__ import annotations

import hashlib
import json
import xml.parsers.expat
from typing import Any

from dockyard_rl.sandbox.task import TestOutcome

# Worse outcomes win when a test is reported more than once.
SEVERITY = {
    TestOutcome.MISSING: -1,
    TestOutcome.PASSED: 0,
    TestOutcome.SKIPPED: 1,
    TestOutcome.FAILED: 2,
    TestOutcome.ERROR: 3,
}
_MAX_LINE_BYTES = 64 * 1024
# The runner's records are flat objects, at most a mapping of mappings (session_end's "disk").
_MAX_RECORD_DEPTH = 4
# Report bytes fed to expat at once, at least (see the module docstring).
_MIN_FEED_BYTES = 64 * 1024


def _well_formed(value: Any) -> bool:
    """Strings valid Unicode, containers at most _MAX_RECORD_DEPTH deep (iterative)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return False
        elif isinstance(item, dict | list):
            if depth >= _MAX_RECORD_DEPTH:
                return False
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return True


def worst(first: TestOutcome | None, second: TestOutcome) -> TestOutcome:
    return second if first is None or SEVERITY[second] > SEVERITY[first] else first


class RecordStream:
    """Sink for the runner's records (module docstring). After the run, read `tests` (node id ->
    outcome over all phases), `raised_but_passed` (phases that raised yet were reported passed),
    `by_kind` (other records by kind), `num_malformed`, `num_after_exit` and `overflowed`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.overflowed = False
        self.num_malformed = 0
        self.num_after_exit = 0  # records that came after the exit record
        self.tests: dict[str, TestOutcome] = {}
        self.raised_but_passed: list[str] = []
        self.by_kind: dict[str, list[dict[str, Any]]] = {}
        self._partial = bytearray()

    def __call__(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        if self.overflowed or self.num_bytes > self.max_bytes:
            self.overflowed = True
            return
        self._partial += chunk
        *lines, rest = bytes(self._partial).split(b"\n")
        self._partial = bytearray(rest)
        if len(self._partial) > _MAX_LINE_BYTES:
            self.num_malformed += 1
            self._partial.clear()
        for line in lines:
            self._record(line)

    def finish(self) -> None:
        """Call once the stream closed: a last line without a newline is malformed."""
        if self._partial:
            self.num_malformed += 1
            self._partial.clear()

    def _record(self, line: bytes) -> None:
        try:
            # RecursionError: deeply nested arrays; ValueError covers bad UTF-8 and huge ints.
            record = json.loads(line)
        except (ValueError, RecursionError):
            self.num_malformed += 1
            return
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("event"), str)
            or not _well_formed(record)
        ):
            self.num_malformed += 1
            return
        if "exit" in self.by_kind:
            self.num_after_exit += 1
        kind = record["event"]
        if kind == "test":
            self._test(record)
        else:
            self.by_kind.setdefault(kind, []).append(record)

    def _test(self, record: dict[str, Any]) -> None:
        nodeid, when, outcome = record.get("nodeid"), record.get("when"), record.get("outcome")
        if (
            not isinstance(nodeid, str)
            or when not in ("setup", "call", "teardown")
            or outcome not in ("passed", "failed", "skipped")
        ):
            self.num_malformed += 1
            return
        if outcome == "passed":
            mapped = TestOutcome.PASSED
        elif outcome == "skipped":
            mapped = TestOutcome.SKIPPED
        else:
            # As pytest's JUnit writer: a failing call is a failure, a failing fixture an error.
            mapped = TestOutcome.FAILED if when == "call" else TestOutcome.ERROR
        self.tests[nodeid] = worst(self.tests.get(nodeid), mapped)
        if outcome == "passed" and record.get("raised") is True:
            self.raised_but_passed.append(f"{nodeid} ({when})")

    def records(self, kind: str) -> list[dict[str, Any]]:
        return self.by_kind.get(kind, [])


class JUnitStream:
    """Sink for the JUnit XML bytes (module docstring). After `finish()`: `outcomes`
    ({(classname, name): outcome}) and `suite_name`, or `error` (why the report is unusable);
    `sha256` and `num_bytes` of what arrived."""

    def __init__(self, max_bytes: int, max_testcases: int):
        self.max_bytes = max_bytes
        self.max_testcases = max_testcases
        self.num_bytes = 0
        self.outcomes: dict[tuple[str, str], TestOutcome] = {}
        self.suite_names: list[str] = []
        self.error = ""
        self._hash = hashlib.sha256()
        self._stack: list[str] = []
        self._case: tuple[str, str] | None = None
        self._case_outcome = TestOutcome.PASSED
        self._num_testcases = 0
        self._pending = bytearray()  # received, not yet fed to expat
        self._num_fed = 0
        self._last_event = 0  # byte offset of the last element event
        self._parser = xml.parsers.expat.ParserCreate()
        self._parser.SetParamEntityParsing(xml.parsers.expat.XML_PARAM_ENTITY_PARSING_NEVER)
        self._parser.StartDoctypeDeclHandler = self._refuse_doctype
        self._parser.EntityDeclHandler = self._refuse_doctype
        self._parser.StartElementHandler = self._start
        self._parser.EndElementHandler = self._end

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def __call__(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        self._hash.update(chunk)
        if self.error:
            return
        if self.num_bytes > self.max_bytes:
            self._fail(f"the JUnit XML report is larger than {self.max_bytes} bytes")
            return
        self._pending += chunk
        if len(self._pending) >= max(_MIN_FEED_BYTES, self._num_fed - self._last_event):
            self._feed(final=False)

    def _feed(self, final: bool) -> None:
        data = bytes(self._pending)
        self._pending.clear()
        self._num_fed += len(data)
        try:
            self._parser.Parse(data, final)
        except (xml.parsers.expat.ExpatError, ValueError, RecursionError) as error:
            self._fail(f"the JUnit XML report is not well-formed: {error}")

    def finish(self) -> None:
        if self.error:
            return
        if self.num_bytes == 0:
            self._fail("no JUnit XML report was written")
            return
        self._feed(final=True)
        if self.error:
            return
        if len(self.suite_names) != 1:
            self._fail("the JUnit XML report must hold exactly one <testsuite>")

    def _fail(self, message: str) -> None:
        self.error = message
        self.outcomes = {}
        # Stop parsing: the handlers are dropped with the parser.
        self._parser = None

    def _refuse_doctype(self, *args) -> None:
        raise ValueError("the JUnit XML report declares a DOCTYPE/ENTITY (pytest never does)")

    def _start(self, tag: str, attributes: dict[str, str]) -> None:
        self._last_event = self._parser.CurrentByteIndex
        parent = self._stack[-1] if self._stack else None
        self._stack.append(tag)
        if parent is None and tag not in ("testsuites", "testsuite"):
            raise ValueError(f"unexpected root element <{tag}>")
        if tag == "testsuite" and parent in (None, "testsuites"):
            self.suite_names.append(attributes.get("name", ""))
        elif tag == "testcase" and parent == "testsuite":
            self._num_testcases += 1
            if self._num_testcases > self.max_testcases:
                raise ValueError(f"more than {self.max_testcases} testcases")
            self._case = (attributes.get("classname", ""), attributes.get("name", ""))
            self._case_outcome = TestOutcome.PASSED
        elif parent == "testcase" and self._case is not None:
            found = {
                "error": TestOutcome.ERROR,
                "failure": TestOutcome.FAILED,
                "skipped": TestOutcome.SKIPPED,
            }.get(tag)
            if found is not None:
                self._case_outcome = worst(self._case_outcome, found)

    def _end(self, tag: str) -> None:
        self._last_event = self._parser.CurrentByteIndex
        self._stack.pop()
        if (
            tag == "testcase"
            and self._case is not None
            and (not self._stack or self._stack[-1] == "testsuite")
        ):
            self.outcomes[self._case] = worst(self.outcomes.get(self._case), self._case_outcome)
            self._case = None
