"""Tests of holdout: removing tests by node id with libcst."""

import pytest

from dockyard_rl.data.synthesis import holdout

MODULE = """import pytest


@pytest.mark.parametrize("x", [1, 2])
def test_a(x):
    assert x


def test_b():
    # keeps its comment
    assert True


class TestGroup:
    def helper(self):
        return 1

    def test_c(self):
        def test_nested():
            pass
        assert self.helper()

    class TestInner:
        def test_d(self):
            assert True
"""


def test_split_node_id():
    assert holdout.split_node_id("t/x.py::A::B::test_f[1-a b]") == (
        "t/x.py",
        ("A", "B"),
        "test_f",
    )
    assert holdout.split_node_id("x.py::test_g") == ("x.py", (), "test_g")
    with pytest.raises(holdout.HoldoutError):
        holdout.split_node_id("x.py")


def test_removes_function_with_decorators_and_all_parametrizations():
    out = holdout.remove_tests(MODULE, ["t.py::test_a[1]"])
    assert "def test_a" not in out and "parametrize" not in out
    assert "def test_b" in out and "# keeps its comment" in out
    compile(out, "t.py", "exec")


def test_removes_methods_and_keeps_classes_valid():
    out = holdout.remove_tests(
        MODULE, ["t.py::TestGroup::test_c", "t.py::TestGroup::TestInner::test_d"]
    )
    assert "def test_c" not in out and "def test_d" not in out
    assert "def helper" in out and "class TestInner:" in out
    namespace = {}
    exec(compile(out, "t.py", "exec"), namespace)  # an emptied class gets `pass`
    assert not [n for n in vars(namespace["TestGroup"].TestInner) if n.startswith("test")]


def test_only_the_named_scope_is_touched():
    # test_c exists only inside TestGroup; a module-level id does not match it.
    with pytest.raises(holdout.HoldoutError, match="test_c"):
        holdout.remove_tests(MODULE, ["t.py::test_c"])
    # Nested functions are never collected tests.
    with pytest.raises(holdout.HoldoutError):
        holdout.remove_tests(MODULE, ["t.py::TestGroup::test_nested"])


def test_unparsable_source():
    with pytest.raises(holdout.HoldoutError, match="parse"):
        holdout.remove_tests("def (:\n", ["t.py::test_a"])
