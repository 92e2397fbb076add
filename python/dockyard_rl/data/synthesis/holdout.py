"""Holding failing tests out of a repository: `remove_tests(source, node_ids) -> source`.

A synthesized task's FAIL_TO_PASS tests must not be in the repository the agent sees (they would
give the fix away); they come back as the task's test_patch. `remove_tests` deletes, with libcst
(so everything else keeps its formatting), the definitions behind pytest node ids of one module:
`tests/test_x.py::test_f[3-4]` removes `def test_f` (every parametrization of it), and
`tests/test_x.py::TestA::TestB::test_m` removes `test_m` from class `TestB` nested in `TestA`. A
class left without statements gets `pass`, so the module still imports. Decorators and the
comments attached to a definition go with it.

`HoldoutError` is raised when a node id's definition is not found in the module's source
(a test inherited from a base class, generated at import time, or collected by a plugin): such a
test cannot be held out by editing this file, and the caller drops the candidate task.

Not covered: tests defined by assignment (`test_x = make_test(...)`), doctests, non-Python test
files.
"""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst


class HoldoutError(ValueError):
    """A node id names a test whose definition is not in the module source."""


def split_node_id(node_id: str) -> tuple[str, tuple[str, ...], str]:
    """`path::Class::Inner::test_f[param]` -> ("path", ("Class", "Inner"), "test_f")."""
    path, sep, rest = node_id.partition("::")
    if not sep or not rest:
        raise HoldoutError(f"{node_id!r} is not a pytest node id of a test (path::name)")
    parts = rest.partition("[")[0].split("::")
    return path, tuple(parts[:-1]), parts[-1]


class _TestRemover(cst.CSTTransformer):
    """Drops the function definitions named by (class path, function name) targets."""

    def __init__(self, targets: set[tuple[tuple[str, ...], str]]):
        super().__init__()
        self.targets = targets
        self.found: set[tuple[tuple[str, ...], str]] = set()
        self.class_stack: list[str] = []
        self.function_depth = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.class_stack.append(node.name.value)
        return True

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef):
        self.class_stack.pop()
        body = updated_node.body
        if isinstance(body, cst.IndentedBlock) and not body.body:
            # Every method was held out: keep a valid, empty class.
            return updated_node.with_changes(
                body=body.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
            )
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.function_depth += 1
        return True

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef):
        self.function_depth -= 1
        if self.function_depth:
            return updated_node  # a nested function is not a collected test
        key = (tuple(self.class_stack), original_node.name.value)
        if key in self.targets:
            self.found.add(key)
            return cst.RemoveFromParent()
        return updated_node


def remove_tests(source: str, node_ids: Iterable[str]) -> str:
    """`source` (one test module) without the tests `node_ids` name (module docstring).

    Raises HoldoutError naming the node ids whose definitions are not in `source`, or when the
    source cannot be parsed.
    """
    node_ids = list(node_ids)
    targets = {split_node_id(node_id)[1:] for node_id in node_ids}
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as error:
        raise HoldoutError(f"cannot parse the test module: {error}") from None
    remover = _TestRemover(targets)
    updated = module.visit(remover)
    missing = [node_id for node_id in node_ids if split_node_id(node_id)[1:] not in remover.found]
    if missing:
        raise HoldoutError(
            f"no definition in the module for {missing[:5]} (inherited, generated "
            f"or plugin-collected tests cannot be held out)"
        )
    return updated.code
