"""Tests for the mutation engine: exact outputs per kind, where sites are not, and the guarantees
(differs, compiles, stays within the mutated statement, deterministic, indexed in order) over
stdlib modules and seeded random programs."""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib
import inspect
import random
import textwrap
import warnings

import libcst as cst
import pytest

from dockyard_rl.data.synthesis import mutations
from dockyard_rl.data.synthesis.mutations import (
    MUTATION_KINDS,
    MutationSite,
    apply_mutation,
    find_mutation_sites,
)

CORPUS_MODULES = ("textwrap", "json.decoder", "json.encoder", "shlex", "fnmatch", "difflib")
MAX_SITES_PER_MODULE = 150  # difflib has ~1000 sites; a seeded sample keeps the test fast
NUM_RANDOM_PROGRAMS = 40
FLIP_KINDS = ("flip_comparison", "flip_boolean", "flip_arithmetic", "off_by_one_constant")


def _mutants(source: str, kind: str) -> list[str]:
    source = textwrap.dedent(source)
    return [apply_mutation(source, s) for s in find_mutation_sites(source) if s.kind == kind]


def _only_mutant(source: str, kind: str) -> str:
    mutants = _mutants(source, kind)
    assert len(mutants) == 1, mutants
    return mutants[0]


def _body(expression_or_statement: str) -> str:
    return f"def f(a, b, c, x, n):\n    {expression_or_statement}\n"


# ------------------------------------------------------------------------------------------------
# Exact outputs, every operator of every table.


@pytest.mark.parametrize(
    ("op", "flipped"),
    [
        ("==", "!="),
        ("!=", "=="),
        ("<", ">="),
        (">=", "<"),
        (">", "<="),
        ("<=", ">"),
        ("is", "is not"),
        ("is not", "is"),
        ("in", "not in"),
        ("not in", "in"),
    ],
)
def test_flip_comparison_table(op: str, flipped: str) -> None:
    mutant = _only_mutant(_body(f"y = a {op} b"), "flip_comparison")
    assert mutant == _body(f"y = a {flipped} b")


def test_flip_comparison_chained_each_operator_is_a_site() -> None:
    assert _mutants(_body("y = a < b == c"), "flip_comparison") == [
        _body("y = a >= b == c"),
        _body("y = a < b != c"),
    ]


def test_flip_comparison_keeps_tight_spacing() -> None:
    assert _only_mutant(_body("y = (a)in(b)"), "flip_comparison") == _body("y = (a)not in(b)")
    assert _only_mutant(_body("y = a<b"), "flip_comparison") == _body("y = a>=b")


def test_flip_boolean() -> None:
    assert _only_mutant(_body("y = a and b"), "flip_boolean") == _body("y = a or b")
    assert _only_mutant(_body("y = a or b"), "flip_boolean") == _body("y = a and b")


def test_flip_boolean_keeps_the_tree_shape_with_parentheses() -> None:
    # `a or b or c` is (a or b) or c: flipping the outer `or` must not regroup to a or (b and c).
    assert _mutants(_body("y = a or b or c"), "flip_boolean") == [
        _body("y = (a or b) and c"),
        _body("y = a and b or c"),
    ]
    # a or (b and c): either flip needs parentheses to keep `b and c` / `b or c` grouped.
    assert _mutants(_body("y = a or b and c"), "flip_boolean") == [
        _body("y = a and (b and c)"),
        _body("y = a or (b or c)"),
    ]


@pytest.mark.parametrize(
    ("op", "flipped"),
    [
        ("+", "-"),
        ("-", "+"),
        ("*", "/"),
        ("/", "*"),
        ("//", "/"),
        ("%", "//"),
        ("**", "*"),
        ("<<", ">>"),
        (">>", "<<"),
        ("&", "|"),
        ("|", "&"),
        ("^", "&"),
    ],
)
def test_flip_arithmetic_table(op: str, flipped: str) -> None:
    assert _only_mutant(_body(f"y = a {op} b"), "flip_arithmetic") == _body(f"y = a {flipped} b")
    assert _only_mutant(_body(f"a {op}= b"), "flip_arithmetic") == _body(f"a {flipped}= b")


def test_flip_arithmetic_skips_matmul_and_string_formatting() -> None:
    assert _mutants(_body("y = a @ b"), "flip_arithmetic") == []
    assert _mutants(_body("a @= b"), "flip_arithmetic") == []
    assert _mutants(_body("y = '%s' % b"), "flip_arithmetic") == []
    assert _mutants(_body("y = f'{a}%s' % b"), "flip_arithmetic") == []
    assert _only_mutant(_body("y = a % b"), "flip_arithmetic") == _body("y = a // b")


def test_flip_arithmetic_adds_parentheses_where_precedence_drops() -> None:
    assert _only_mutant(_body("y = -a ** b"), "flip_arithmetic") == _body("y = -(a * b)")
    assert _mutants(_body("y = a ^ b | c"), "flip_arithmetic") == [
        _body("y = (a ^ b) & c"),
        _body("y = a & b | c"),
    ]
    assert _mutants(_body("y = a & b ^ c"), "flip_arithmetic") == [
        _body("y = a & b & c"),
        _body("y = (a | b) ^ c"),
    ]
    assert _only_mutant(_body("y = (a ** b).c"), "flip_arithmetic") == _body("y = (a * b).c")


@pytest.mark.parametrize(
    ("literal", "bumped"),
    [
        ("0", "1"),
        ("9", "10"),
        ("0x1F", "0x20"),
        ("0xff", "0x100"),
        ("0o17", "0o20"),
        ("0b101", "0b110"),
        ("1_000", "1_001"),
        ("-1", "-2"),
    ],
)
def test_off_by_one_constant(literal: str, bumped: str) -> None:
    assert _only_mutant(_body(f"y = {literal}"), "off_by_one_constant") == _body(f"y = {bumped}")


def test_off_by_one_constant_skips_booleans_slice_bounds_and_version_checks() -> None:
    assert _mutants(_body("y = True or False"), "off_by_one_constant") == []
    assert _mutants(_body("y = x[1:n - 2]"), "off_by_one_constant") == []
    assert _mutants(_body("y = sys.version_info >= (3, 8)"), "off_by_one_constant") == []
    assert _mutants(_body("y = sys.version_info[0] == 2"), "off_by_one_constant") == []
    # The step is not a bound: its literal is an ordinary constant.
    assert _only_mutant(_body("y = x[::2]"), "off_by_one_constant") == _body("y = x[::3]")
    assert _mutants(_body("y = x[::2]"), "off_by_one_slice") == []


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("x[1:]", "x[2:]"),
        ("x[:-1]", "x[:0]"),
        ("x[:-3]", "x[:-2]"),
        ("x[:n]", "x[:n + 1]"),
        ("x[:n - 1]", "x[:n]"),
        ("x[:(n - 1)]", "x[:(n)]"),
        ("x[:n - 3]", "x[:n - 2]"),
        ("x[:n + 1]", "x[:n + 2]"),
        ("x[:len(a) * 2]", "x[:len(a) * 2 + 1]"),
        ("x[:a | b]", "x[:(a | b) + 1]"),
        ("x[:a if b else c]", "x[:(a if b else c) + 1]"),
        ("x[n:n + 1:2]", "x[n:n + 2:2]"),
    ],
)
def test_off_by_one_slice_upper_or_single_bound(before: str, after: str) -> None:
    mutants = _mutants(_body(f"y = {before}"), "off_by_one_slice")
    assert mutants[-1] == _body(f"y = {after}")


def test_off_by_one_slice_each_bound_is_a_site() -> None:
    assert _mutants(_body("y = x[a:b]"), "off_by_one_slice") == [
        _body("y = x[a + 1:b]"),
        _body("y = x[a:b + 1]"),
    ]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("if a:\n        pass", "if not a:\n        pass"),
        ("if f(a):\n        pass", "if not f(a):\n        pass"),
        ("if a.b[0]:\n        pass", "if not a.b[0]:\n        pass"),
        ("if a and b:\n        pass", "if not (a and b):\n        pass"),
        ("if a == b:\n        pass", "if not (a == b):\n        pass"),
        ("if(a):\n        pass", "if not (a):\n        pass"),
        ("while a:\n        pass", "while not a:\n        pass"),
        ("while(a):\n        pass", "while not (a):\n        pass"),
        ("y = a if b else c", "y = a if not b else c"),
        ("y = a if b < c else c", "y = a if not (b < c) else c"),
        ("if (x := a):\n        pass", "if not (x := a):\n        pass"),
    ],
)
def test_invert_condition(before: str, after: str) -> None:
    assert _only_mutant(_body(before), "invert_condition") == _body(after)


def test_invert_condition_elif_is_its_own_site() -> None:
    source = "def f(a, b):\n    if a:\n        pass\n    elif b:\n        pass\n"
    assert _mutants(source, "invert_condition") == [
        "def f(a, b):\n    if not a:\n        pass\n    elif b:\n        pass\n",
        "def f(a, b):\n    if a:\n        pass\n    elif not b:\n        pass\n",
    ]
    sites = [s for s in find_mutation_sites(source) if s.kind == "invert_condition"]
    assert [s.description for s in sites] == [
        "if condition `a` -> `not a`",
        "elif condition `b` -> `not b`",
    ]


def test_remove_statement_keeps_comments_and_never_empties_a_block() -> None:
    source = textwrap.dedent(
        """\
        def f(a):
            '''Doc.'''
            # about b
            b = a + 1
            call(b)  # trailing
            if a:
                a = 2
            # about c
            c = 3
            return b
        """
    )
    mutants = _mutants(source, "remove_statement")
    assert mutants == [
        source.replace("    b = a + 1\n", ""),
        source.replace("    call(b)  # trailing\n", ""),
        source.replace("    c = 3\n", ""),
    ]
    # Last statement of its block: its comment lines move to the block footer and stay.
    source = "def f(a):\n    a = 1\n    # about b\n    b = 2\n# after\n"
    assert _mutants(source, "remove_statement") == [
        "def f(a):\n    # about b\n    b = 2\n# after\n",
        "def f(a):\n    a = 1\n    # about b\n# after\n",
    ]


def test_remove_statement_kinds_and_exclusions() -> None:
    removable = ["y = 1", "y: int = 1", "a += 1", "del a", "assert a", "g(a)", "y = 1; z = 2"]
    for statement in removable:
        source = f"def f(a):\n    {statement}\n    return a\n"
        assert _mutants(source, "remove_statement") == ["def f(a):\n    return a\n"], statement
    not_removable = [
        "return a",
        "raise ValueError",
        "pass",
        "global q",
        "import os",
        "y: int",
        "'string'",
        "...",
        "a",
        "yield a",
        "y = yield a",
        "y = 1; return y",
    ]
    for statement in not_removable:
        source = f"def f(a):\n    {statement}\n    g()\n"
        sites = [s for s in find_mutation_sites(source) if s.kind == "remove_statement"]
        assert [s.line for s in sites] == [3], statement
    loops = "def f(a):\n    for i in a:\n        continue\n        g()\n        break\n"
    assert [s.line for s in find_mutation_sites(loops) if s.kind == "remove_statement"] == [4]
    # Removing the only binding of a nonlocal name would be a SyntaxError.
    source = textwrap.dedent(
        """\
        def f():
            count = 0
            def bump():
                nonlocal count
                count += 1
            bump()
            return count
        """
    )
    sites = [s for s in find_mutation_sites(source) if s.kind == "remove_statement"]
    assert [s.description for s in sites] == ["remove `bump()`"]
    for site in find_mutation_sites(source):
        compile(apply_mutation(source, site), "<mutant>", "exec")


def test_swap_arguments() -> None:
    assert _only_mutant(_body("g(a, b)"), "swap_arguments") == _body("g(b, a)")
    assert _only_mutant(_body("g(a, b + 1, c, key=n)"), "swap_arguments") == _body(
        "g(b + 1, a, c, key=n)"
    )
    assert _only_mutant(_body("g(a, *b, c)"), "swap_arguments") == _body("g(c, *b, a)")
    multi_line = "def f(a, b):\n    g(\n        a,\n        b,\n    )\n"
    swapped = multi_line.replace("a,\n        b,", "b,\n        a,")
    assert _only_mutant(multi_line, "swap_arguments") == swapped
    for call in ("g(a, a)", "g(a)", "g(a, *b)", "g(a, key=b)", "g(*a, **b)"):
        assert _mutants(_body(call), "swap_arguments") == [], call
    site = next(s for s in find_mutation_sites(_body("x.g(a, b)")) if s.kind == "swap_arguments")
    assert site.description == "swap arguments 1 and 2 of `x.g(...)`"


def test_change_return() -> None:
    assert _only_mutant(_body("return a + b"), "change_return") == _body("return None")
    assert _only_mutant(_body("return(a)"), "change_return") == _body("return None")
    assert _only_mutant(_body("return True"), "change_return") == _body("return False")
    assert _only_mutant(_body("return False"), "change_return") == _body("return True")
    assert _only_mutant(_body("return (\n        a,\n        b)"), "change_return") == _body(
        "return None"
    )
    for statement in ("return", "return None", "return (yield a)"):
        assert _mutants(_body(statement), "change_return") == [], statement


def test_descriptions_and_lines() -> None:
    source = textwrap.dedent(
        """\
        def f(a, b):
            y = (a
                 + b)
            return a < b
        """
    )
    sites = find_mutation_sites(source)
    assert [(s.kind, s.line, s.description) for s in sites] == [
        ("remove_statement", 2, "remove `y = (a + b)`"),
        ("flip_arithmetic", 3, "`+` -> `-`"),
        ("change_return", 4, "`return a < b` -> `return None`"),
        ("flip_comparison", 4, "`<` -> `>=`"),
    ]
    assert [s.index for s in sites] == [0, 1, 2, 3]


def test_qualified_function_names() -> None:
    source = textwrap.dedent(
        """\
        class Lexer:
            def get_tokens(self):
                return 1
            class Inner:
                async def run(self):
                    return 2
        def outer():
            def inner():
                return 3
            class Local:
                def method(self):
                    return 4
            key = lambda v: v + 5
            return inner
        """
    )
    functions = {s.function for s in find_mutation_sites(source)}
    assert functions == {
        "Lexer.get_tokens",
        "Lexer.Inner.run",
        "outer.inner",
        "outer.Local.method",
        "outer",
    }


def test_nothing_outside_function_bodies() -> None:
    source = textwrap.dedent(
        '''\
        """Module docstring 1 + 2."""
        import sys
        X = 1 + 2
        Y = X if X > 1 else 2
        if X and Y:
            Z = g(X, Y)[1:2]
        key = lambda v: v + 1

        def deco(arg):
            """Docstring with 1 < 2 and a + b."""

        @deco(1 + 2)
        def f(a=1 + 2, b: list[1 > 2] = g(3, 4), *, c=not X) -> (1 < 2):
            """Docstring 1 + 2."""

        class C(Base, metaclass=g(1, 2)):
            """Class docstring."""
            attribute = [x + 1 for x in range(3) if x > 1]
            other = g(attribute, X)
            @staticmethod
            def method(a=lambda: 1 + 2):
                "Single-quoted docstring 3 - 4"

        if __name__ == "__main__":
            def main(a):
                return a + 1 if a < 2 else a[1:]
            main(1 + 2, 3)
        '''
    )
    assert find_mutation_sites(source) == []


def test_match_case_patterns_are_not_mutated() -> None:
    source = "def f(a):\n    match a:\n        case 1 | [2, 3]:\n            return a + 1\n"
    kinds = [(s.kind, s.line) for s in find_mutation_sites(source)]
    assert kinds == [("change_return", 4), ("flip_arithmetic", 4), ("off_by_one_constant", 4)]


def test_file_layouts_round_trip() -> None:
    # Header comments, CRLF newlines, tabs, no trailing newline (the whole-module fallback path).
    source = "#!/usr/bin/env python\n# header\n\nimport os\n"
    source += "def f(a):\n    return a + 1\nX = 1\n"
    variants = [source, source.replace("\n", "\r\n"), source.replace("    ", "\t"), source[:-1]]
    for variant in variants:
        mutant = _only_mutant(variant, "flip_arithmetic")
        assert mutant == variant.replace("a + 1", "a - 1")
        spliced = mutations._analyze(variant).top_level_offsets is not None
        assert spliced == variant.endswith("\n"), repr(variant)


# ------------------------------------------------------------------------------------------------
# Errors.


def test_unparsable_source_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        find_mutation_sites("def f(:\n    pass\n")
    with pytest.raises(ValueError, match="cannot parse"):
        apply_mutation("def f(:\n", MutationSite("flip_boolean", 0, 1, "f", "`and` -> `or`"))


def test_stale_or_mismatched_site_is_a_value_error() -> None:
    source = _body("return a < b")
    sites = find_mutation_sites(source)
    with pytest.raises(ValueError, match="out of range"):
        apply_mutation(source, dataclasses.replace(sites[0], index=len(sites)))
    with pytest.raises(ValueError, match="out of range"):
        apply_mutation(source, dataclasses.replace(sites[0], index=-1))
    with pytest.raises(ValueError, match="stale"):
        apply_mutation(source, dataclasses.replace(sites[0], kind="flip_boolean"))
    with pytest.raises(ValueError, match="stale"):
        apply_mutation(source, dataclasses.replace(sites[0], line=sites[0].line + 1))
    # A site of another source at the same index.
    other = find_mutation_sites(_body("return a + b"))
    with pytest.raises(ValueError, match="stale"):
        apply_mutation(source, other[1])
    with pytest.raises(ValueError, match="MutationSite.kind"):
        MutationSite("typo", 0, 1, "f", "")


# ------------------------------------------------------------------------------------------------
# Guarantees, checked on every site of a source.


def _statement_spans(tree: ast.Module) -> list[tuple[int, int]]:
    """(first line, last header line) of every statement: a simple statement's own lines, a
    compound statement's header (`if`/`elif`/`while` up to the end of the condition)."""

    def header_end(node: ast.stmt) -> int:
        if isinstance(node, (ast.If, ast.While)):
            return node.test.end_lineno
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return node.iter.end_lineno
        if isinstance(node, ast.Match):
            return node.subject.end_lineno
        if hasattr(node, "body") and isinstance(node.body, list):
            return node.body[0].lineno - 1 if node.body[0].lineno > node.lineno else node.lineno
        return node.end_lineno

    statements = [node for node in ast.walk(tree) if isinstance(node, ast.stmt)]
    return [(node.lineno, header_end(node)) for node in statements]


def _statement_bounds(spans: list[tuple[int, int]], line: int) -> tuple[int, int]:
    """Lines of the statements whose (header) span holds `line`: the edit must stay inside."""
    holding = [(start, end) for start, end in spans if start <= line <= end]
    assert holding, f"no statement holds line {line}"
    return min(s for s, _ in holding), max(e for _, e in holding)


def _changed_original_lines(before: str, after: str) -> tuple[int, int]:
    """(first, last) 1-based lines of `before` not in the common prefix/suffix with `after`."""
    old, new = before.splitlines(), after.splitlines()
    prefix = 0
    while prefix < min(len(old), len(new)) and old[prefix] == new[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(old), len(new)) - prefix and old[-1 - suffix] == new[-1 - suffix]:
        suffix += 1
    return prefix + 1, len(old) - suffix


_IGNORED_SHAPE_NODES = (
    cst.LeftParen,
    cst.RightParen,
    cst.BaseParenthesizableWhitespace,
    cst.Newline,
    cst.EmptyLine,
    cst.TrailingWhitespace,
    cst.Comment,
)


def _count_leaf_differences(a: cst.CSTNode, b: cst.CSTNode) -> int:
    """Operators/literals that differ between two trees of the same shape (parentheses ignored).

    Raises AssertionError when the shapes differ, e.g. a flip that regrouped an expression."""
    if isinstance(a, (cst.BaseBinaryOp, cst.BaseBooleanOp, cst.BaseCompOp, cst.BaseAugOp)):
        assert isinstance(b, (cst.BaseBinaryOp, cst.BaseBooleanOp, cst.BaseCompOp, cst.BaseAugOp))
        return int(type(a) is not type(b))
    assert type(a) is type(b), (type(a).__name__, type(b).__name__)
    if isinstance(a, (cst.Integer, cst.Name, cst.SimpleString, cst.Float)):
        return int(a.value != b.value)
    children_a = [c for c in a.children if not isinstance(c, _IGNORED_SHAPE_NODES)]
    children_b = [c for c in b.children if not isinstance(c, _IGNORED_SHAPE_NODES)]
    assert len(children_a) == len(children_b), type(a).__name__
    return sum(_count_leaf_differences(x, y) for x, y in zip(children_a, children_b))


def _check_guarantees(
    source: str, sites: list[MutationSite], sample: list[int], num_deep_checks: int, seed: int
) -> None:
    """(a)-(d) for `sites[i]`, i in `sample`; the costly checks for `num_deep_checks` of them."""
    spans = _statement_spans(ast.parse(source))
    mutants = {}
    for position in sample:
        site = sites[position]
        mutant = apply_mutation(source, site)
        mutants[position] = mutant
        assert mutant != source, site  # (a)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # `x is 1` from random programs
            compile(mutant, f"<mutant {site}>", "exec")  # (b)
        first, last = _changed_original_lines(source, mutant)  # (c)
        low, high = _statement_bounds(spans, site.line)
        assert low <= first and last <= high, (site, (first, last), (low, high))
        assert site.line <= last, (site, first, last)  # the node starts at or before the edit

    deep = sorted(random.Random(seed).sample(sample, min(num_deep_checks, len(sample))))
    mutations._analyze.cache_clear()
    for position in deep:
        assert apply_mutation(source, sites[position]) == mutants[position]  # (d), fresh parse

    original_cst = cst.parse_module(source)
    for position in deep:
        site, mutant = sites[position], mutants[position]
        if site.kind not in FLIP_KINDS:
            continue
        # Exactly one operator/literal changed and the tree shape is the same; every other site
        # is still there. Descriptions that quote code (remove `...`) may show the change; those
        # of the one-token kinds must not. swap_arguments sites are left out: `g(7, 7)` ->
        # `g(8, 7)` rightly gains one.
        assert _count_leaf_differences(original_cst, cst.parse_module(mutant)) == 1, site
        before = [s for s in sites if s.kind != "swap_arguments"]
        after = [s for s in find_mutation_sites(mutant) if s.kind != "swap_arguments"]
        assert len(after) == len(before), site
        for before_site, after_site in zip(before, after):
            assert (before_site.kind, before_site.line, before_site.function) == (
                after_site.kind,
                after_site.line,
                after_site.function,
            ), (site, before_site, after_site)
            if before_site.index == site.index:
                assert after_site.description != site.description
            elif before_site.kind in FLIP_KINDS:
                assert after_site.description == before_site.description, site


def _corpus() -> list[tuple[str, str]]:
    modules = []
    for name in CORPUS_MODULES:
        path = inspect.getsourcefile(importlib.import_module(name))
        assert path is not None, name
        with open(path, encoding="utf-8") as handle:
            modules.append((name, handle.read()))
    return modules


def test_guarantees_over_stdlib_corpus() -> None:
    counts: collections.Counter[str] = collections.Counter()
    for module_number, (name, source) in enumerate(_corpus()):
        sites = find_mutation_sites(source)
        mutations._analyze.cache_clear()
        assert find_mutation_sites(source) == sites, name  # (e) deterministic
        assert [s.index for s in sites] == list(range(len(sites))), name  # (e) indexed in order
        assert all(s.kind in MUTATION_KINDS and s.function for s in sites)
        counts.update(s.kind for s in sites)
        sample = list(range(len(sites)))
        if len(sites) > MAX_SITES_PER_MODULE:
            sample = sorted(random.Random(module_number).sample(sample, MAX_SITES_PER_MODULE))
        _check_guarantees(source, sites, sample, num_deep_checks=6, seed=module_number)
    print("\nmutation sites per kind over", ", ".join(CORPUS_MODULES))
    for kind in MUTATION_KINDS:
        print(f"  {kind:22s} {counts[kind]}")
    assert all(counts[kind] > 0 for kind in MUTATION_KINDS), counts


# ------------------------------------------------------------------------------------------------
# Seeded random programs: every site of every program keeps the guarantees.


class _ProgramGenerator:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def expression(self, depth: int) -> str:
        rng = self._rng
        if depth == 0 or rng.random() < 0.25:
            return rng.choice(["a", "b", "n", "x.y", "0", "1", "7", "0x1F", "-1", "True", "None"])
        choice = rng.randrange(9)
        sub = lambda: self.expression(depth - 1)  # noqa: E731
        if choice == 0:
            ops = ["==", "!=", "<", "<=", ">", ">=", "is", "is not", "in", "not in"]
            return f"{sub()} {rng.choice(ops)} {sub()}"
        if choice == 1:
            return f"{sub()} {rng.choice(['and', 'or'])} {sub()}"
        if choice == 2:
            ops = ["+", "-", "*", "/", "//", "%", "**", "<<", ">>", "&", "|", "^", "@"]
            return f"{sub()} {rng.choice(ops)} {sub()}"
        if choice == 3:
            return f"{rng.choice(['not ', '-', '~'])}{sub()}"
        if choice == 4:
            return f"({sub()})"
        if choice == 5:
            return f"{sub()} if {sub()} else {sub()}"
        if choice == 6:
            lower = rng.choice(["", sub()])
            upper = rng.choice(["", sub()])
            return f"x[{lower}:{upper}]"
        if choice == 7:
            return f"g({sub()}, {sub()}, k={sub()})"
        return f"(lambda v: {sub()})"

    def block(self, indent: str, depth: int, size: int) -> list[str]:
        rng = self._rng
        lines = []
        for _ in range(size):
            choice = rng.randrange(7)
            expr = lambda: self.expression(3)  # noqa: E731
            if choice == 0 and depth > 0:
                lines.append(f"{indent}if {expr()}:")
                lines += self.block(indent + "    ", depth - 1, rng.randint(1, 3))
                if rng.random() < 0.5:
                    lines.append(f"{indent}elif {expr()}:")
                    lines += self.block(indent + "    ", depth - 1, 1)
            elif choice == 1 and depth > 0:
                lines.append(f"{indent}while {expr()}:")
                lines += self.block(indent + "    ", depth - 1, rng.randint(1, 2))
            elif choice == 2:
                lines.append(f"{indent}n {rng.choice(['+=', '-=', '*=', '|='])} {expr()}")
            elif choice == 3:
                lines.append(f"{indent}g({expr()}, {expr()})  # comment")
            elif choice == 4:
                lines.append(f"{indent}return {expr()}")
            else:
                lines.append(f"{indent}a = {expr()}")
        return lines

    def program(self) -> str:
        # Text is composed without regard to precedence (that is what exercises the engine's
        # parenthesisation), so some programs are invalid (`a + not b`): draw until one parses.
        while True:
            lines = ["def f(a, b, n, x):", '    """Docstring."""']
            lines += self.block("    ", 2, self._rng.randint(1, 4))
            source = "\n".join(lines) + "\n"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SyntaxWarning)
                    compile(source, "<program>", "exec")
            except SyntaxError:
                continue
            return source


def test_guarantees_over_seeded_random_programs() -> None:
    rng = random.Random(20240611)
    generator = _ProgramGenerator(rng)
    num_sites = 0
    for program_number in range(NUM_RANDOM_PROGRAMS):
        source = generator.program()
        sites = find_mutation_sites(source)
        assert [s.index for s in sites] == list(range(len(sites)))
        num_sites += len(sites)
        all_sites = list(range(len(sites)))
        _check_guarantees(source, sites, all_sites, num_deep_checks=10, seed=program_number)
    assert num_sites > 500, num_sites
