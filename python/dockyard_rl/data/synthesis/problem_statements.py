"""Problem statements for synthesized tasks, written from the failing tests (no model needed).

`write_problem_statement(package, version, failing_tests, log)` turns the FAIL_TO_PASS node ids
and the output of the test run that found them into an issue-like text: which tests fail and
what error each one reports (pytest's `E ` lines), at most `max_tests` tests with at most
`max_lines` lines each. It names symptoms only: never the mutated file, line or operator, and no
traceback frames (those would point at the bug's location).

The error lines come from pytest's failure blocks (`--tb=short` or the default long style):
a block starts with a `____ headline ____` rule, where the headline is the node id without its
path (`TestClass.test_name[param]`); `ERROR at setup of ...` headlines are understood too. When a
test's block is not in the (possibly truncated) log, the short summary line
`FAILED path::test - message` is used, and failing that the test is listed without a message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_RULE_RE = re.compile(r"^_{3,} (?P<headline>.+?) _{3,}$")
_SUMMARY_RE = re.compile(r"^(?:FAILED|ERROR) (?P<node_id>\S.*?)(?: - (?P<message>.*))?$")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_SETUP_PREFIX_RE = re.compile(r"^ERROR at (?:setup|teardown) of ")
# Object reprs carry memory addresses, which differ between runs: masked so that the same task
# gets the same text.
_ADDRESS_RE = re.compile(r"\b0x[0-9a-fA-F]{6,16}\b")
_MAX_LINE_CHARS = 300


def headline_of(node_id: str) -> str:
    """The headline pytest prints above a test's failure block: the node id without its path,
    with "::" written as "."."""
    return node_id.partition("::")[2].replace("::", ".")


def failure_messages(log: str) -> dict[str, list[str]]:
    """Headline -> the `E ` lines of its failure block, from a pytest log (module docstring).
    Also maps each node id of the short test summary to its one-line message. Memory addresses
    are masked. A headline with several blocks (same test name in two files) is left out."""
    messages: dict[str, list[str]] = {}
    num_blocks: dict[str, int] = {}
    current: list[str] | None = None
    for raw_line in _ANSI_RE.sub("", log).splitlines():
        rule = _RULE_RE.match(raw_line)
        if rule:
            headline = _SETUP_PREFIX_RE.sub("", rule.group("headline"))
            num_blocks[headline] = num_blocks.get(headline, 0) + 1
            current = messages.setdefault(headline, [])
            continue
        if raw_line.startswith("=") and raw_line.endswith("="):
            current = None  # a section rule ends the block (e.g. the short summary starts)
            summary = None
        else:
            summary = _SUMMARY_RE.match(raw_line)
        if summary and summary.group("message"):
            messages.setdefault(
                summary.group("node_id"), [_ADDRESS_RE.sub("0x...", summary.group("message"))]
            )
            continue
        if current is not None and raw_line.startswith("E "):
            current.append(_ADDRESS_RE.sub("0x...", raw_line[1:].strip())[:_MAX_LINE_CHARS])
    # A headline is the node id without its path: tests of the same name in two files (or a test
    # and its setup error) share it, and their blocks cannot be told apart. Dropped, so the
    # caller falls back to the summary line, which names the node id.
    for headline, count in num_blocks.items():
        if count > 1:
            del messages[headline]
    return messages


def write_problem_statement(
    package: str,
    version: str,
    failing_tests: Sequence[str],
    log: str,
    *,
    max_tests: int = 5,
    max_lines: int = 6,
) -> str:
    """An issue-like report of `failing_tests` (node ids) from the log of the run where they
    failed. Deterministic: the same inputs give the same text."""
    if not failing_tests:
        raise ValueError("failing_tests: a problem statement needs at least one failing test")
    messages = failure_messages(log)
    names = [node_id.partition("::")[2] or node_id for node_id in failing_tests]
    if len(failing_tests) == 1:
        title = f"{package} {version}: `{names[0]}` fails"
    else:
        title = (
            f"{package} {version}: `{names[0]}` and {len(failing_tests) - 1} other "
            f"test{'s' if len(failing_tests) > 2 else ''} fail"
        )
    lines = [
        title,
        "",
        f"With the current code of {package}, these tests fail; they are expected to pass:",
        "",
    ]
    for node_id in failing_tests[:max_tests]:
        lines.append(f"- `{node_id}`")
        error = messages.get(headline_of(node_id)) or messages.get(node_id) or []
        shown = [line for line in error if line][:max_lines]
        if shown:
            lines.append("  ```")
            lines.extend(f"  {line}" for line in shown)
            lines.append("  ```")
    if len(failing_tests) > max_tests:
        lines.append(f"- ... and {len(failing_tests) - max_tests} more")
    lines += [
        "",
        "The other tests that passed before still pass. These tests are not in the "
        "checkout; they will be run against your change. Fix the library code (not the "
        "tests) so that they pass without breaking the others.",
    ]
    return "\n".join(lines) + "\n"
