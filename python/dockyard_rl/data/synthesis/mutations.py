"""Procedural bug-introducing mutations of Python source, for SWE-smith-style task synthesis.

`find_mutation_sites(source)` lists every place where one small, deterministic, bug-shaped edit
can be made; `apply_mutation(source, site)` makes exactly that edit and returns the new source.
The orchestration (not this module) applies a site to a package, runs its tests and keeps the
mutant when some fail; the gold fix is the reverse patch. Edits go through libcst, so everything
outside the mutated node (formatting, comments, quoting) round-trips byte for byte.

Mutation kinds (`MUTATION_KINDS`), one site per node, each with exactly one edit:
- flip_comparison: every operator of a (chained) comparison is its own site:
  `==`<->`!=`, `<`->`>=`, `>=`->`<`, `>`->`<=`, `<=`->`>`, `is`<->`is not`, `in`<->`not in`.
- flip_boolean: each `and`/`or` node (libcst nests `a and b and c` as two): `and`<->`or`.
- flip_arithmetic: binary operators `+`->`-`, `-`->`+`, `*`->`/`, `/`->`*`, `//`->`/`, `%`->`//`,
  `**`->`*`, `<<`<->`>>`, `&`->`|`, `|`->`&`, `^`->`&` (`@` is left alone), and augmented
  assignments with the same table (`+=`->`-=`, ...). A `%` whose left operand is a string literal
  is string formatting and is skipped.
  For both flips, parentheses are added where the new operator would regroup the expression
  (`-a ** b` -> `-(a * b)`, `a or b and c` flipping `and` -> `a or (b or c)`, `a ^ b | c`
  flipping `|` -> `(a ^ b) & c`), so the mutant parses to the same tree with one operator changed.
- off_by_one_constant: an integer literal n -> n + 1, in the same base (`0x1F` -> `0x20`, `1_000`
  -> `1_001`); `-1` is `-(1)`, so it becomes `-2`. Skipped: booleans (not integers in libcst),
  literals inside a slice's lower/upper bound (those are off_by_one_slice) and literals inside a
  comparison that mentions `version_info` (version checks are not bugs anyone would write).
- off_by_one_slice: each present lower/upper bound of a slice, always +1: a literal is bumped
  (`x[1:]` -> `x[2:]`, `x[:-1]` -> `x[:0]`, `x[:-3]` -> `x[:-2]`), a literal offset is adjusted
  (`x[:n + 1]` -> `x[:n + 2]`, `x[:n - 1]` -> `x[:n]`, `x[:n - 3]` -> `x[:n - 2]`), and any other
  expression e becomes `e + 1` (`(e) + 1` when e binds less tightly than `+`). The step is never
  touched.
- invert_condition: the test of `if`, `elif`, `while` and of a ternary -> `not c`, written
  `not (c)` unless c is a primary (name, attribute, call, subscript, literal, parenthesised) or an
  `await`. Comprehension `if` clauses and `assert` tests are not sites.
- remove_statement: a whole simple-statement line (every statement on it an assignment,
  annotated assignment with a value, augmented assignment, `del`, `assert` or expression statement)
  in an indented block of at least 2 statements, so no block is left empty. Skipped: docstrings,
  lines holding `return`/`raise`/`pass`/`break`/`continue`/`global`/`nonlocal`/`import`, a bare
  constant or name as an expression statement (removing it changes nothing), anything containing
  `yield` (removal could turn a generator into a function), and any line naming a variable that
  some `nonlocal` in the module declares (removing the only binding is a SyntaxError). Comment
  lines above a removed statement are kept.
- swap_arguments: a call with at least 2 positional non-starred arguments whose first two (in
  order, skipping keywords and starred ones) differ textually -> those two values swapped.
- change_return: `return <expr>` -> `return None`, except `return True`<->`return False`.
  Skipped: bare `return`, `return None`, and values containing `yield`.

Where: only code in function bodies (`def`/`async def`, methods, nested functions, lambdas inside
them). Never module- or class-level statements (a class inside a function is class-level), never
decorators, parameter defaults or annotations, type parameters, docstrings, `match` case patterns
(their literal grammar is narrower than expressions), or anything under an
`if __name__ == "__main__":` guard.

Sites are listed in pre-order traversal order (a node's own sites before those of its
children, children in source order); `MutationSite.index` is the position in that list, so it is
stable for a given source. `MutationSite.line` is the 1-based line where the mutated node starts:
the operator token for the flip_* kinds, the literal or bound for the off_by_one kinds, the
condition for invert_condition, and the statement / call / `return` otherwise. Every edit stays
within the lines of the statement holding that line (or, for `if`/`elif`/`while`, the header up
to the end of the condition).

Not covered: semantic equivalence (`a * 1` -> `a / 1`, or any flip in dead code, gives an
equivalent mutant; the tests decide whether a mutant is a bug), type plausibility (`"a" + s` ->
`"a" - s` is produced and fails at run time, which the tests also decide), async subtleties
(`await` and `async for` inside comprehensions are mutated like any other code, and nothing checks
that a coroutine is still awaited after a statement is removed), binding rules beyond the
`nonlocal` case above (removing the only assignment to a local name can leave an
`UnboundLocalError` at run time, which is a fine bug), and syntax newer than the installed libcst
parser accepts. The analyses of the 8 most recent sources are cached, so applying many sites of
one file is cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

MUTATION_KINDS: tuple[str, ...] = (
    "flip_comparison",
    "flip_boolean",
    "flip_arithmetic",
    "off_by_one_constant",
    "off_by_one_slice",
    "invert_condition",
    "remove_statement",
    "swap_arguments",
    "change_return",
)


@dataclasses.dataclass(frozen=True)
class MutationSite:
    """One place in a module where one deterministic mutation can be applied.

    kind: one of MUTATION_KINDS.
    index: position of this site in `find_mutation_sites(source)`.
    line: 1-based line in the original source where the mutated node starts.
    function: qualified name of the enclosing function, e.g. "Lexer.get_tokens" or "outer.inner".
    description: short human text, e.g. "`<` -> `>=`" or "remove `x = y + 1`".
    """

    kind: str
    index: int
    line: int
    function: str
    description: str

    def __post_init__(self) -> None:
        if self.kind not in MUTATION_KINDS:
            raise ValueError(f"MutationSite.kind {self.kind!r} is not one of {MUTATION_KINDS}")


def find_mutation_sites(source: str) -> list[MutationSite]:
    """Every mutation site of a module's source, in a deterministic order.

    Raises ValueError (with the parse error) when libcst cannot parse `source`.
    """
    return [site.public for site in _analyze(source).sites]


def apply_mutation(source: str, site: MutationSite) -> str:
    """`source` with exactly the mutation of `site` applied.

    Raises ValueError if the site does not match `source`: its index is out of range, or any of
    its fields differs from `find_mutation_sites(source)[site.index]` (a stale site).
    """
    analysis = _analyze(source)
    if not 0 <= site.index < len(analysis.sites):
        raise ValueError(
            f"MutationSite.index {site.index} is out of range: this source has "
            f"{len(analysis.sites)} mutation sites; call find_mutation_sites(source) again"
        )
    found = analysis.sites[site.index]
    if found.public != site:
        raise ValueError(
            f"MutationSite {site} does not match this source, whose site {site.index} is "
            f"{found.public}; the site is stale, call find_mutation_sites(source) again"
        )
    # Rebuild only the path from the top-level statement to the mutated node (untouched subtrees
    # are shared), then splice that statement's new text into the source: regenerating the code
    # of the whole module per mutant would dominate the cost on big files.
    old: cst.CSTNode = found.target
    new: cst.CSTNode = found.build()
    module = found.ancestors[0]
    # Sites are inside function bodies, so the path always holds a top-level statement.
    assert isinstance(module, cst.Module) and len(found.ancestors) >= 2
    for parent in reversed(found.ancestors[1:]):
        new = _replace_child(parent, old, new)
        old = parent
    if analysis.top_level_offsets is None:
        mutated = _replace_child(module, old, new).code
    else:
        position = next(i for i, stmt in enumerate(module.body) if stmt is old)
        start, end = analysis.top_level_offsets[position : position + 2]
        mutated = source[:start] + module.code_for_node(new) + source[end:]
    assert mutated != source, f"mutation {site} left the source unchanged"
    return mutated


# ------------------------------------------------------------------------------------------------
# Analysis: one traversal that records every site with what it takes to apply it.


@dataclasses.dataclass(frozen=True)
class _Site:
    public: MutationSite
    target: cst.CSTNode  # the node that `build()` replaces
    ancestors: tuple[cst.CSTNode, ...]  # module first, the target's parent last
    build: Callable[[], cst.CSTNode]


@dataclasses.dataclass(frozen=True)
class _Analysis:
    sites: tuple[_Site, ...]
    # Character offsets where each top-level statement of the module starts, plus where the last
    # one ends; None when the statements' code does not concatenate back to the source (a file
    # without a trailing newline), in which case mutants are generated from the whole module.
    top_level_offsets: tuple[int, ...] | None


@functools.lru_cache(maxsize=8)
def _analyze(source: str) -> _Analysis:
    # Cached because the orchestration applies many sites of one file, and parsing plus position
    # metadata dominate the cost (libcst nodes are immutable, so sharing them is safe).
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as error:
        raise ValueError(f"cannot parse the source with libcst: {error}") from error
    # unsafe_skip_copy: positions must be keyed by the very nodes the collector visits.
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    collector = _SiteCollector(module, positions)
    module.visit(collector)
    return _Analysis(sites=collector.finish(), top_level_offsets=_top_level_offsets(module, source))


def _top_level_offsets(module: cst.Module, source: str) -> tuple[int, ...] | None:
    header = "".join(module.code_for_node(line) for line in module.header)
    codes = [module.code_for_node(statement) for statement in module.body]
    if not source.startswith(header + "".join(codes)):
        return None
    offsets = [len(header)]
    for code in codes:
        offsets.append(offsets[-1] + len(code))
    return tuple(offsets)


@dataclasses.dataclass
class _Candidate:
    kind: str
    line: int
    function: str
    description: str
    target: cst.CSTNode
    ancestors: tuple[cst.CSTNode, ...]
    build: Callable[[], cst.CSTNode]
    # For remove_statement / change_return: filled during the traversal of the node's subtree.
    names: set[str] = dataclasses.field(default_factory=set)
    has_yield: bool = False


# Subtrees never mutated, wherever they are.
_NEVER_MUTATED: tuple[type[cst.CSTNode], ...] = (cst.Decorator, cst.Parameters, cst.Annotation) + (
    (cst.TypeParameters,) if hasattr(cst, "TypeParameters") else ()
)


class _SiteCollector(cst.CSTVisitor):
    def __init__(self, module: cst.Module, positions) -> None:
        super().__init__()
        self._module = module
        self._positions = positions
        self._stack: list[cst.CSTNode] = []  # every node being visited, root first
        self._names: list[str] = []  # enclosing def/class names
        self._frames: list[tuple[cst.CSTNode, bool]] = []  # (owner, is a function body)
        self._function_body_ids: set[int] = set()
        self._skip_ids: set[int] = set()
        self._slice_bound_ids: set[int] = set()
        self._num_in_slice_bound = 0
        self._version_check_ids: set[int] = set()
        self._num_in_version_check = 0
        # (candidate, node): remove/return candidates whose node's subtree is being visited.
        self._watched: list[tuple[_Candidate, cst.CSTNode]] = []
        self._nonlocal_names: set[str] = set()
        self._candidates: list[_Candidate] = []

    # -- traversal bookkeeping -------------------------------------------------------------------

    def on_visit(self, node: cst.CSTNode) -> bool:
        self._stack.append(node)
        # Counters first: on_leave undoes them for every node, skipped or not.
        if id(node) in self._slice_bound_ids:
            self._num_in_slice_bound += 1
        if isinstance(node, cst.Comparison) and _mentions_version_info(node):
            self._version_check_ids.add(id(node))
            self._num_in_version_check += 1
        if isinstance(node, _NEVER_MUTATED) or id(node) in self._skip_ids:
            return False
        if isinstance(node, cst.If) and _is_main_guard(node.test):
            return False
        if isinstance(node, cst.FunctionDef):
            self._names.append(node.name.value)
            self._function_body_ids.add(id(node.body))
            docstring = _docstring_node(node.body)
            if docstring is not None:
                self._skip_ids.add(id(docstring))
        elif isinstance(node, cst.ClassDef):
            self._names.append(node.name.value)
            self._frames.append((node, False))
        elif isinstance(node, cst.MatchCase):
            self._skip_ids.add(id(node.pattern))
        elif isinstance(node, cst.Nonlocal):
            self._nonlocal_names.update(item.name.value for item in node.names)
        if id(node) in self._function_body_ids:
            self._frames.append((node, True))
        if isinstance(node, cst.Slice):
            self._slice_bound_ids.update(id(b) for b in (node.lower, node.upper) if b is not None)
        if self._watched:
            if isinstance(node, cst.Name):
                for candidate, _ in self._watched:
                    candidate.names.add(node.value)
            elif isinstance(node, cst.Yield):
                for candidate, _ in self._watched:
                    candidate.has_yield = True
        if self._frames and self._frames[-1][1]:
            self._collect(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        node = self._stack.pop()
        assert node is original_node
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            self._names.pop()
        if self._frames and self._frames[-1][0] is node:
            self._frames.pop()
        if id(node) in self._slice_bound_ids:
            self._num_in_slice_bound -= 1
        if id(node) in self._version_check_ids:
            self._num_in_version_check -= 1
        while self._watched and self._watched[-1][1] is node:
            self._watched.pop()

    def finish(self) -> tuple[_Site, ...]:
        sites = []
        for candidate in self._candidates:
            if candidate.has_yield:
                continue
            if candidate.kind == "remove_statement" and candidate.names & self._nonlocal_names:
                continue
            public = MutationSite(
                kind=candidate.kind,
                index=len(sites),
                line=candidate.line,
                function=candidate.function,
                description=candidate.description,
            )
            sites.append(_Site(public, candidate.target, candidate.ancestors, candidate.build))
        return tuple(sites)

    # -- site recording --------------------------------------------------------------------------

    def _add(
        self,
        kind: str,
        anchor: cst.CSTNode,
        description: str,
        target: cst.CSTNode,
        ancestors: Sequence[cst.CSTNode],
        build: Callable[[], cst.CSTNode],
    ) -> _Candidate:
        candidate = _Candidate(
            kind=kind,
            line=self._positions[anchor].start.line,
            function=".".join(self._names),
            description=description,
            target=target,
            ancestors=tuple(ancestors),
            build=build,
        )
        self._candidates.append(candidate)
        return candidate

    def _code(self, node: cst.CSTNode) -> str:
        return self._module.code_for_node(node)

    def _snippet(self, node: cst.CSTNode) -> str:
        return _shorten(self._code(node))

    def _collect(self, node: cst.CSTNode) -> None:
        parent = self._stack[-2] if len(self._stack) >= 2 else None
        here = self._stack[:-1]  # ancestors when `node` itself is replaced
        if isinstance(node, cst.ComparisonTarget):
            self._collect_comparison(node, here)
        elif isinstance(node, cst.BooleanOperation):
            new_op = cst.Or if isinstance(node.operator, cst.And) else cst.And
            self._add_operator_flip("flip_boolean", node, new_op, parent, here)
        elif isinstance(node, cst.BinaryOperation):
            new_op = _ARITHMETIC_FLIPS.get(type(node.operator))
            if new_op is None:
                return
            if isinstance(node.operator, cst.Modulo) and _is_string_literal(node.left):
                return  # `"%s" % x` is formatting, not arithmetic
            self._add_operator_flip("flip_arithmetic", node, new_op, parent, here)
        elif isinstance(node, cst.AugAssign):
            new_op = _AUG_FLIPS.get(type(node.operator))
            if new_op is None:
                return
            self._add(
                "flip_arithmetic",
                node.operator,
                f"`{_op_text(node.operator)}` -> `{_OP_TEXT[new_op]}`",
                node,
                here,
                lambda: node.with_changes(operator=_same_spacing(new_op, node.operator)),
            )
        elif isinstance(node, cst.Integer):
            if self._num_in_slice_bound or self._num_in_version_check:
                return
            bumped = _bump_integer(node.value, +1)
            self._add(
                "off_by_one_constant",
                node,
                f"`{node.value}` -> `{bumped}`",
                node,
                here,
                lambda: node.with_changes(value=bumped),
            )
        elif isinstance(node, cst.Slice):
            for which, bound in (("lower", node.lower), ("upper", node.upper)):
                if bound is None:
                    continue
                replacement = _slice_bound_plus_one(bound)
                self._add(
                    "off_by_one_slice",
                    bound,
                    f"slice {which} bound `{self._snippet(bound)}` -> "
                    f"`{self._snippet(replacement)}`",
                    bound,
                    self._stack,
                    _returning(replacement),
                )
        elif isinstance(node, (cst.If, cst.While, cst.IfExp)):
            self._collect_condition(node, parent, here)
        elif isinstance(node, cst.SimpleStatementLine):
            self._collect_removal(node, parent)
        elif isinstance(node, cst.Call):
            self._collect_swap(node, here)
        elif isinstance(node, cst.Return):
            self._collect_return(node, here)

    def _add_operator_flip(self, kind: str, node, new_op, parent, here) -> None:
        """A site replacing `node`'s binary/boolean operator with `new_op` (parenthesised as
        needed, see _flip_binary_like)."""
        self._add(
            kind,
            node.operator,
            f"`{_op_text(node.operator)}` -> `{_OP_TEXT[new_op]}`",
            node,
            here,
            functools.partial(_flip_binary_like, node, new_op, parent),
        )

    def _collect_comparison(self, node: cst.ComparisonTarget, here) -> None:
        new_op = _COMPARISON_FLIPS[type(node.operator)]
        self._add(
            "flip_comparison",
            node.operator,
            f"`{_op_text(node.operator)}` -> `{_OP_TEXT[new_op]}`",
            node,
            here,
            lambda: node.with_changes(operator=_same_spacing(new_op, node.operator)),
        )

    def _collect_condition(self, node, parent, here) -> None:
        if isinstance(node, cst.If):
            keyword = "elif" if isinstance(parent, cst.If) and parent.orelse is node else "if"
            field = "whitespace_before_test"
        elif isinstance(node, cst.While):
            keyword, field = "while", "whitespace_after_while"
        else:
            keyword, field = "ternary", "whitespace_after_if"
        negated = _negate(node.test)

        def build() -> cst.CSTNode:
            whitespace = getattr(node, field)
            if isinstance(whitespace, cst.SimpleWhitespace) and not whitespace.value:
                whitespace = cst.SimpleWhitespace(" ")  # `if(x):` -> `if not (x):`
            return node.with_changes(test=negated, **{field: whitespace})

        self._add(
            "invert_condition",
            node.test,
            f"{keyword} condition `{self._snippet(node.test)}` -> `{self._snippet(negated)}`",
            node,
            here,
            build,
        )

    def _collect_removal(self, node: cst.SimpleStatementLine, parent) -> None:
        if not isinstance(parent, cst.IndentedBlock) or len(parent.body) < 2:
            return
        if not all(_is_removable(statement) for statement in node.body):
            return
        position = next(i for i, statement in enumerate(parent.body) if statement is node)

        def build() -> cst.CSTNode:
            # Keep the comments/blank lines above the removed line: they move to the next
            # statement, or to the block's footer when the removed line was the last one.
            body = list(parent.body)
            del body[position]
            if position < len(body):
                following = body[position]
                body[position] = following.with_changes(
                    leading_lines=(*node.leading_lines, *following.leading_lines)
                )
                return parent.with_changes(body=body)
            return parent.with_changes(body=body, footer=(*node.leading_lines, *parent.footer))

        candidate = self._add(
            "remove_statement",
            node,
            f"remove `{self._snippet(node.with_changes(leading_lines=()))}`",
            parent,
            self._stack[:-2],
            build,
        )
        self._watch(candidate, node)

    def _collect_swap(self, node: cst.Call, here) -> None:
        positional = [i for i, arg in enumerate(node.args) if arg.keyword is None and not arg.star]
        if len(positional) < 2:
            return
        i, j = positional[0], positional[1]
        first, second = node.args[i], node.args[j]
        if self._code(first.value) == self._code(second.value):
            return

        def build() -> cst.CSTNode:
            args = list(node.args)
            args[i] = first.with_changes(value=second.value)
            args[j] = second.with_changes(value=first.value)
            return node.with_changes(args=args)

        self._add(
            "swap_arguments",
            node,
            f"swap arguments {i + 1} and {j + 1} of `{self._snippet(node.func)}(...)`",
            node,
            here,
            build,
        )

    def _collect_return(self, node: cst.Return, here) -> None:
        value = node.value
        if value is None or (isinstance(value, cst.Name) and value.value == "None"):
            return
        if isinstance(value, cst.Name) and value.value in ("True", "False"):
            new_value: cst.BaseExpression = value.with_changes(
                value="False" if value.value == "True" else "True"
            )
        else:
            new_value = cst.Name("None")

        def build() -> cst.CSTNode:
            whitespace = node.whitespace_after_return
            if isinstance(whitespace, cst.SimpleWhitespace) and not whitespace.value:
                whitespace = cst.SimpleWhitespace(" ")  # `return(x)` -> `return None`
            return node.with_changes(value=new_value, whitespace_after_return=whitespace)

        candidate = self._add(
            "change_return",
            node,
            f"`return {self._snippet(value)}` -> `return {self._code(new_value)}`",
            node,
            here,
            build,
        )
        self._watch(candidate, node)

    def _watch(self, candidate: _Candidate, node: cst.CSTNode) -> None:
        # Names and yields met inside `node` are recorded on the candidate until `node` is left.
        self._watched.append((candidate, node))


# ------------------------------------------------------------------------------------------------
# Operator tables and precedence.

_OP_TEXT: dict[type[cst.CSTNode], str] = {
    cst.Equal: "==",
    cst.NotEqual: "!=",
    cst.LessThan: "<",
    cst.LessThanEqual: "<=",
    cst.GreaterThan: ">",
    cst.GreaterThanEqual: ">=",
    cst.Is: "is",
    cst.IsNot: "is not",
    cst.In: "in",
    cst.NotIn: "not in",
    cst.And: "and",
    cst.Or: "or",
    cst.Add: "+",
    cst.Subtract: "-",
    cst.Multiply: "*",
    cst.Divide: "/",
    cst.FloorDivide: "//",
    cst.Modulo: "%",
    cst.Power: "**",
    cst.LeftShift: "<<",
    cst.RightShift: ">>",
    cst.BitAnd: "&",
    cst.BitOr: "|",
    cst.BitXor: "^",
    cst.MatrixMultiply: "@",
    cst.AddAssign: "+=",
    cst.SubtractAssign: "-=",
    cst.MultiplyAssign: "*=",
    cst.DivideAssign: "/=",
    cst.FloorDivideAssign: "//=",
    cst.ModuloAssign: "%=",
    cst.PowerAssign: "**=",
    cst.LeftShiftAssign: "<<=",
    cst.RightShiftAssign: ">>=",
    cst.BitAndAssign: "&=",
    cst.BitOrAssign: "|=",
    cst.BitXorAssign: "^=",
}

_COMPARISON_FLIPS: dict[type[cst.CSTNode], type[cst.CSTNode]] = {
    cst.Equal: cst.NotEqual,
    cst.NotEqual: cst.Equal,
    cst.LessThan: cst.GreaterThanEqual,
    cst.GreaterThanEqual: cst.LessThan,
    cst.GreaterThan: cst.LessThanEqual,
    cst.LessThanEqual: cst.GreaterThan,
    cst.Is: cst.IsNot,
    cst.IsNot: cst.Is,
    cst.In: cst.NotIn,
    cst.NotIn: cst.In,
}

_ARITHMETIC_FLIPS: dict[type[cst.CSTNode], type[cst.CSTNode]] = {
    cst.Add: cst.Subtract,
    cst.Subtract: cst.Add,
    cst.Multiply: cst.Divide,
    cst.Divide: cst.Multiply,
    cst.FloorDivide: cst.Divide,
    cst.Modulo: cst.FloorDivide,
    cst.Power: cst.Multiply,
    cst.LeftShift: cst.RightShift,
    cst.RightShift: cst.LeftShift,
    cst.BitAnd: cst.BitOr,
    cst.BitOr: cst.BitAnd,
    cst.BitXor: cst.BitAnd,
}

_AUG_FLIPS: dict[type[cst.CSTNode], type[cst.CSTNode]] = {
    cst.AddAssign: cst.SubtractAssign,
    cst.SubtractAssign: cst.AddAssign,
    cst.MultiplyAssign: cst.DivideAssign,
    cst.DivideAssign: cst.MultiplyAssign,
    cst.FloorDivideAssign: cst.DivideAssign,
    cst.ModuloAssign: cst.FloorDivideAssign,
    cst.PowerAssign: cst.MultiplyAssign,
    cst.LeftShiftAssign: cst.RightShiftAssign,
    cst.RightShiftAssign: cst.LeftShiftAssign,
    cst.BitAndAssign: cst.BitOrAssign,
    cst.BitOrAssign: cst.BitAndAssign,
    cst.BitXorAssign: cst.BitAndAssign,
}

# Python's expression precedence, loosest first (the language reference's table).
_NAMED_EXPR, _LAMBDA, _TERNARY, _OR, _AND, _NOT, _COMPARISON = 0, 1, 2, 3, 4, 5, 6
_BIT_OR, _BIT_XOR, _BIT_AND, _SHIFT, _ARITH, _TERM, _UNARY, _POWER, _AWAIT, _ATOM = range(7, 17)

_BINARY_PRECEDENCE: dict[type[cst.CSTNode], int] = {
    cst.BitOr: _BIT_OR,
    cst.BitXor: _BIT_XOR,
    cst.BitAnd: _BIT_AND,
    cst.LeftShift: _SHIFT,
    cst.RightShift: _SHIFT,
    cst.Add: _ARITH,
    cst.Subtract: _ARITH,
    cst.Multiply: _TERM,
    cst.MatrixMultiply: _TERM,
    cst.Divide: _TERM,
    cst.FloorDivide: _TERM,
    cst.Modulo: _TERM,
    cst.Power: _POWER,
    cst.And: _AND,
    cst.Or: _OR,
}


def _precedence(node: cst.CSTNode) -> int:
    """How tightly `node` binds as written (a parenthesised node is an atom)."""
    if getattr(node, "lpar", ()):
        return _ATOM
    if isinstance(node, (cst.BinaryOperation, cst.BooleanOperation)):
        return _BINARY_PRECEDENCE[type(node.operator)]
    if isinstance(node, cst.UnaryOperation):
        return _NOT if isinstance(node.operator, cst.Not) else _UNARY
    if isinstance(node, cst.Comparison):
        return _COMPARISON
    if isinstance(node, cst.IfExp):
        return _TERNARY
    if isinstance(node, cst.Lambda):
        return _LAMBDA
    if isinstance(node, cst.NamedExpr):
        return _NAMED_EXPR
    if isinstance(node, cst.Await):
        return _AWAIT
    return _ATOM


def _operand_requirements(operator: cst.CSTNode) -> tuple[int, int]:
    """Least precedence a (left, right) operand of `operator` may have without parentheses."""
    precedence = _BINARY_PRECEDENCE[type(operator)]
    if isinstance(operator, cst.Power):
        return _AWAIT, _UNARY  # `(-a) ** b`, but `a ** -b`
    return precedence, precedence + 1  # left-associative


def _required_precedence(parent: cst.CSTNode | None, child: cst.CSTNode) -> int:
    """Least precedence `child` may have at its place in `parent` without parentheses."""
    if isinstance(parent, (cst.BinaryOperation, cst.BooleanOperation)):
        left, right = _operand_requirements(parent.operator)
        return left if child is parent.left else right
    if isinstance(parent, cst.UnaryOperation):
        return _NOT if isinstance(parent.operator, cst.Not) else _UNARY
    if isinstance(parent, (cst.Comparison, cst.ComparisonTarget)):
        return _BIT_OR
    if isinstance(parent, (cst.Attribute, cst.Subscript)) and child is parent.value:
        return _ATOM
    if isinstance(parent, cst.Call) and child is parent.func:
        return _ATOM
    if isinstance(parent, cst.Await):
        return _ATOM
    if isinstance(parent, (cst.StarredElement, cst.StarredDictElement)):
        return _BIT_OR
    if isinstance(parent, cst.Arg) and parent.star:
        return _BIT_OR
    if isinstance(parent, cst.IfExp) and child is not parent.orelse:
        return _OR
    return _NAMED_EXPR


def _paren(node: cst.BaseExpression) -> cst.BaseExpression:
    return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _same_spacing(new_cls: type[cst.CSTNode], old: cst.CSTNode) -> cst.CSTNode:
    kwargs = {"whitespace_before": old.whitespace_before, "whitespace_after": old.whitespace_after}
    if new_cls in (cst.IsNot, cst.NotIn):
        kwargs["whitespace_between"] = cst.SimpleWhitespace(" ")
    return new_cls(**kwargs)


def _op_text(operator: cst.CSTNode) -> str:
    return _OP_TEXT[type(operator)]


def _flip_binary_like(node, new_cls, parent) -> cst.CSTNode:
    """`node` (a BinaryOperation or BooleanOperation) with operator `new_cls`, the tree shape kept.

    Parentheses go around an operand that the new operator would capture differently, and around
    the node when it now binds less tightly than its place in `parent` needs.
    """
    operator = _same_spacing(new_cls, node.operator)
    left_needed, right_needed = _operand_requirements(operator)
    left, right = node.left, node.right
    if _precedence(left) < left_needed:
        left = _paren(left)
    if _precedence(right) < right_needed:
        right = _paren(right)
    flipped = node.with_changes(operator=operator, left=left, right=right)
    if _precedence(flipped) < _required_precedence(parent, node):
        flipped = _paren(flipped)
    return flipped


# ------------------------------------------------------------------------------------------------
# Helpers for the individual kinds.


def _bump_integer(text: str, delta: int) -> str:
    """The integer literal `text` plus `delta`, written in the same base and style."""
    value = int(text.replace("_", ""), 0) + delta
    assert value >= 0, (text, delta)
    prefix = text[:2].lower()
    if prefix in ("0x", "0o", "0b"):
        digits = format(value, prefix[1])
        if any(c.isupper() for c in text[2:]):
            digits = digits.upper()
        return text[:2] + digits
    return f"{value:_}" if "_" in text else str(value)


def _slice_bound_plus_one(bound: cst.BaseExpression) -> cst.BaseExpression:
    """A slice bound that is one more than `bound`, written the way a person would."""
    if isinstance(bound, cst.Integer):
        return bound.with_changes(value=_bump_integer(bound.value, +1))
    if (
        isinstance(bound, cst.UnaryOperation)
        and isinstance(bound.operator, cst.Minus)
        and isinstance(bound.expression, cst.Integer)
        and not bound.expression.lpar
    ):
        magnitude = int(bound.expression.value.replace("_", ""), 0)
        if magnitude == 1:
            return cst.Integer("0", lpar=bound.lpar, rpar=bound.rpar)
        if magnitude > 1:
            return bound.with_changes(
                expression=bound.expression.with_changes(
                    value=_bump_integer(bound.expression.value, -1)
                )
            )
    if isinstance(bound, cst.BinaryOperation) and isinstance(bound.right, cst.Integer):
        k = int(bound.right.value.replace("_", ""), 0)
        if isinstance(bound.operator, cst.Add):
            return bound.with_changes(
                right=bound.right.with_changes(value=_bump_integer(bound.right.value, +1))
            )
        if isinstance(bound.operator, cst.Subtract) and k == 1:
            left = bound.left
            # `x[:(n - 1)]` -> `x[:(n)]`: keep the outer parentheses around what is left.
            return left.with_changes(lpar=[*bound.lpar, *left.lpar], rpar=[*left.rpar, *bound.rpar])
        if isinstance(bound.operator, cst.Subtract) and k > 1:
            return bound.with_changes(
                right=bound.right.with_changes(value=_bump_integer(bound.right.value, -1))
            )
    left = bound if _precedence(bound) >= _ARITH else _paren(bound)
    return cst.BinaryOperation(
        left=left,
        operator=cst.Add(
            whitespace_before=cst.SimpleWhitespace(" "), whitespace_after=cst.SimpleWhitespace(" ")
        ),
        right=cst.Integer("1"),
    )


def _returning(node: cst.CSTNode) -> Callable[[], cst.CSTNode]:
    return lambda: node


def _negate(test: cst.BaseExpression) -> cst.BaseExpression:
    operand = test if _precedence(test) >= _AWAIT else _paren(test)
    return cst.UnaryOperation(
        operator=cst.Not(whitespace_after=cst.SimpleWhitespace(" ")), expression=operand
    )


_REMOVABLE = (cst.Assign, cst.AugAssign, cst.Del, cst.Assert)
_CONSTANTS = (
    cst.SimpleString,
    cst.ConcatenatedString,
    cst.FormattedString,
    cst.Integer,
    cst.Float,
    cst.Imaginary,
    cst.Ellipsis,
    cst.Name,
)


def _is_removable(statement: cst.BaseSmallStatement) -> bool:
    if isinstance(statement, _REMOVABLE):
        return True
    if isinstance(statement, cst.AnnAssign):
        return statement.value is not None  # `x: int` alone does nothing at run time
    if isinstance(statement, cst.Expr):
        return not isinstance(statement.value, _CONSTANTS)
    return False


def _is_string_literal(node: cst.BaseExpression) -> bool:
    return isinstance(node, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString))


def _docstring_node(body: cst.BaseSuite) -> cst.CSTNode | None:
    """The docstring statement of a function body, if it has one."""
    if isinstance(body, cst.SimpleStatementSuite):
        first = body.body[0] if body.body else None
        if isinstance(first, cst.Expr) and _is_string_literal(first.value):
            return first
        return None
    if not body.body:
        return None
    first_line = body.body[0]
    if (
        isinstance(first_line, cst.SimpleStatementLine)
        and len(first_line.body) == 1
        and isinstance(first_line.body[0], cst.Expr)
        and isinstance(first_line.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    ):
        return first_line
    return None


def _is_main_guard(test: cst.BaseExpression) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return False
    target = test.comparisons[0]
    if not isinstance(target.operator, cst.Equal):
        return False
    sides = (test.left, target.comparator)
    names = [s for s in sides if isinstance(s, cst.Name) and s.value == "__name__"]
    strings = [
        s for s in sides if isinstance(s, cst.SimpleString) and s.evaluated_value == "__main__"
    ]
    return len(names) == 1 and len(strings) == 1


def _mentions_version_info(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.Name) and node.value == "version_info":
        return True
    return any(_mentions_version_info(child) for child in node.children)


def _shorten(code: str, limit: int = 60) -> str:
    text = re.sub(r"\s+", " ", code).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _replace_child(parent: cst.CSTNode, old: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    """`parent` with its direct child `old` (by identity) replaced by `new`."""
    for field in dataclasses.fields(parent):
        value = getattr(parent, field.name)
        if value is old:
            return parent.with_changes(**{field.name: new})
        if isinstance(value, (list, tuple)) and any(item is old for item in value):
            items = [new if item is old else item for item in value]
            return parent.with_changes(**{field.name: type(value)(items)})
    raise AssertionError(f"{type(old).__name__} is not a child of {type(parent).__name__}")
