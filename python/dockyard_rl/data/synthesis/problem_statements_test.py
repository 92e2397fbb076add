"""Tests of problem_statements: error lines from pytest logs, the statement's content."""

import pytest

from dockyard_rl.data.synthesis import problem_statements

LOG = """============================= test session starts ==============================
collected 6 items

tests/test_core.py ..FF.F                                                  [100%]

=================================== FAILURES ===================================
_______________________________ test_clamp[42-10] ______________________________
tests/test_core.py:7: in test_clamp
    assert clamp(value, 0, 10) == expected
E   assert 0 == 10
E    +  where 0 = clamp(42, 0, 10)
____________________________ TestMedian.test_even _____________________________
tests/test_core.py:29: in test_even
    assert median([4, 1, 3, 2]) == 2.5
E   TypeError: unsupported operand type(s) for /: 'list' and 'int'
==================================== ERRORS ====================================
__________________________ ERROR at setup of test_mean __________________________
E   FileNotFoundError: samples.txt
=========================== short test summary info ============================
FAILED tests/test_core.py::test_clamp[42-10] - assert 0 == 10
FAILED tests/test_core.py::TestMedian::test_even - TypeError: unsupported operand
FAILED tests/test_other.py::test_only_in_summary - ValueError: boom
ERROR tests/test_core.py::test_mean - FileNotFoundError: samples.txt
==================== 3 failed, 2 passed, 1 error in 0.12s =====================
"""


def test_failure_messages():
    messages = problem_statements.failure_messages(LOG)
    assert messages["test_clamp[42-10]"] == ["assert 0 == 10", "+  where 0 = clamp(42, 0, 10)"]
    assert messages["TestMedian.test_even"][0].startswith("TypeError")
    assert messages["test_mean"] == ["FileNotFoundError: samples.txt"]
    assert messages["tests/test_other.py::test_only_in_summary"] == ["ValueError: boom"]


def test_statement_names_tests_and_errors_but_not_the_code():
    failing = [
        "tests/test_core.py::test_clamp[42-10]",
        "tests/test_core.py::TestMedian::test_even",
        "tests/test_other.py::test_only_in_summary",
        "tests/test_core.py::test_unknown",
    ]
    text = problem_statements.write_problem_statement("toystats", "1.0", failing, LOG)
    assert text.startswith("toystats 1.0: `test_clamp[42-10]` and 3 other tests fail\n")
    for node_id in failing:
        assert f"`{node_id}`" in text
    assert "assert 0 == 10" in text and "ValueError: boom" in text
    # Tracebacks point at code; only error lines are kept.
    assert "tests/test_core.py:7" not in text and "assert clamp(value" not in text
    assert text == problem_statements.write_problem_statement("toystats", "1.0", failing, LOG)


def test_memory_addresses_are_masked():
    log = (
        "______ test_tokens ______\n"
        "E   assert 6 == 1\n"
        "E    +  where 6 = len([<Identifier 'foo' at 0x7F7B6FE3E3D0>])\n"
        "=== short test summary info ===\n"
        "FAILED t.py::test_other - <built-in method at 0x7f7dff5e74b0>\n"
    )
    messages = problem_statements.failure_messages(log)
    assert messages["test_tokens"][1] == "+  where 6 = len([<Identifier 'foo' at 0x...>])"
    assert messages["t.py::test_other"] == ["<built-in method at 0x...>"]


def test_same_test_name_in_two_files_falls_back_to_the_summary():
    log = (
        "______ test_f ______\n"
        "E   ValueError: from file a\n"
        "______ test_f ______\n"
        "E   ValueError: from file b\n"
        "=== short test summary info ===\n"
        "FAILED tests/test_a.py::test_f - ValueError: from file a\n"
        "FAILED tests/test_b.py::test_f - ValueError: from file b\n"
    )
    text = problem_statements.write_problem_statement("p", "1", ["tests/test_a.py::test_f"], log)
    assert "from file a" in text and "from file b" not in text


def test_statement_limits():
    failing = [f"t.py::test_{i}" for i in range(9)]
    text = problem_statements.write_problem_statement("p", "2", failing, "", max_tests=3)
    assert "... and 6 more" in text and "`t.py::test_3`" not in text
    single = problem_statements.write_problem_statement("p", "2", failing[:1], "")
    assert single.startswith("p 2: `test_0` fails")
    with pytest.raises(ValueError, match="at least one"):
        problem_statements.write_problem_statement("p", "2", [], LOG)
