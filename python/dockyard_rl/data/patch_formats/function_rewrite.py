"""The FUNCTION output format: the model rewrites whole functions; we turn that into a diff.

The model answers with one or more ```python fenced blocks (a last block cut off by the token
limit needs no closing fence). Every top-level `def` / `async def` in them, decorators included,
replaces the one function or method of that name in the files the prompt showed (the prompt's
instructions, processors.FUNCTION_INSTRUCTIONS, show an example).

The name must match exactly one definition across those files (top-level functions, methods and
nested functions all count); the replacement is re-indented to where the original sits (libcst
keeps the body's relative indentation and leaves string literals alone) and keeps the lines
before the original (comments, blank lines). The result is a git-style unified diff, like the
other formats (the package's docstring).

This is the easiest format for small models: it asks them to copy and edit code they were shown,
not to count diff lines or quote exact SEARCH text. It is also the narrowest.

Failures are returned, never raised (`ParsedPatch.invalid_reason`): NO_PATCH (no block with a
definition), SYNTAX_ERROR (a block does not parse), UNKNOWN_FUNCTION (a shown file libcst
cannot parse counts as holding no functions), AMBIGUOUS_FUNCTION (a name defined more than once
in the shown files: the detail lists where), MALFORMED_BLOCK (one function
given twice, or a function and a function nested in it), NO_CHANGE.

Cost: the output is the model's, and libcst is slow (about 10 us a byte on
ordinary code, more and superlinear with nesting: a 24 KB chain of lambdas takes seconds) and
crashes the process (a native stack overflow) on a few thousand nested brackets. So each block is
first read by CPython's parser, which is fast and refuses deep nesting safely: a block it rejects,
or one nested more than `_MAX_NESTING` levels, is a SYNTAX_ERROR without libcst; a block without
a top-level `def` is not given to libcst at all; and blocks of more than `_MAX_CODE_CHARS`
characters in all are a MALFORMED_BLOCK. Finding the blocks is one linear regular expression.

Not covered: anything outside functions (module-level statements in a block, such as imports,
are ignored), new functions, classes as a whole, renaming a function, choosing between two
definitions of one name (e.g. `__init__` in two classes) and non-Python files.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Sequence

import libcst as cst
import unidiff

from dockyard_rl.data.patch_formats.base_files import file_diff
from dockyard_rl.data.patch_formats.interfaces import (
    InvalidReason,
    OutputFormat,
    ParsedPatch,
    PatchFormat,
    ReadFile,
    invalid,
)

# A ```python (or ```py, or bare ```) fence up to its closing fence or the end of the output.
# Linear: once a fence opens, a match always ends (at the next fence or at \Z), and the search
# goes on after it.
_PYTHON_BLOCK = re.compile(r"^```(?:python3?|py)?[ \t]*\n(.*?)(?:^```|\Z)", re.S | re.M)
# Code blocks longer than this in all are refused before parsing: libcst's time per byte is
# large (module docstring), and no rewrite of the shown functions comes near it.
_MAX_CODE_CHARS = 64 * 1024
# Deeper syntax trees than this are refused before libcst, whose time grows faster than the
# text with nesting. Ordinary code nests a few tens of levels (a long `a + b + ...` chain adds
# one per term).
_MAX_NESTING = 100


@dataclasses.dataclass(frozen=True)
class _Definition:
    path: str
    line: int  # of the `def` (decorators start above it)
    end_line: int


class _Collect(cst.CSTVisitor):
    """(def line, last line) of every function, method and nested function, by name."""

    METADATA_DEPENDENCIES = (cst.metadata.PositionProvider,)

    def __init__(self):
        super().__init__()
        self.found: dict[str, list[tuple[int, int]]] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        # libcst's position of a FunctionDef starts at its `def` line (decorators and leading
        # lines are before it) and ends at its last line.
        position = self.get_metadata(cst.metadata.PositionProvider, node)
        self.found.setdefault(node.name.value, []).append((position.start.line, position.end.line))


@functools.lru_cache(maxsize=32)
def _parse(source: str) -> tuple[cst.metadata.MetadataWrapper, dict] | None:
    """A shown file's tree and its functions (`_Collect.found`); None when libcst cannot parse
    it. Cached: every sample of a prompt looks up the same files."""
    try:
        wrapper = cst.metadata.MetadataWrapper(cst.parse_module(source))
    except cst.ParserSyntaxError:
        return None
    collector = _Collect()
    wrapper.visit(collector)
    return wrapper, collector.found


class _Replace(cst.CSTTransformer):
    """Swaps the FunctionDef that starts at each wanted line for its replacement."""

    METADATA_DEPENDENCIES = (cst.metadata.PositionProvider,)

    def __init__(self, by_line: dict[int, cst.FunctionDef]):
        super().__init__()
        self.by_line = by_line
        self.replaced: set[int] = set()

    def leave_FunctionDef(
        self, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.FunctionDef:
        line = self.get_metadata(cst.metadata.PositionProvider, original).start.line
        new = self.by_line.get(line)
        if new is None:
            return updated
        self.replaced.add(line)
        return new.with_changes(leading_lines=original.leading_lines)


def _blocks(text: str) -> list[str]:
    return [match.group(1) for match in _PYTHON_BLOCK.finditer(text)]


def _nesting(tree: ast.AST) -> int:
    """The depth of the syntax tree (iterative: a deep tree does not recurse here)."""
    deepest = 0
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _cpython_problem(block: str) -> tuple[str | None, bool]:
    """(why CPython's parser refuses `block` or finds it too deeply nested, or None; whether it
    has a top-level function). Safe on any text: deep nesting is a SyntaxError or MemoryError
    there, not a crash."""
    try:
        tree = ast.parse(block)
    except SyntaxError as error:
        return f"{error.msg} (line {error.lineno})", False
    except (ValueError, MemoryError, RecursionError) as error:
        return f"{type(error).__name__}: {error}" if str(error) else "nested too deeply", False
    if _nesting(tree) > _MAX_NESTING:
        return f"nested more than {_MAX_NESTING} levels deep", False
    defines = any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in tree.body)
    return None, defines


class FunctionFormat(OutputFormat):
    """The FUNCTION format (module docstring): `files` are the paths whose functions may be
    rewritten (the prompt's shown files), read at base_commit through `read_file`."""

    patch_format = PatchFormat.FUNCTION
    reads_base_files = True

    def parse_answer(
        self,
        answer: str,
        thinking: str | None,
        read_file: ReadFile | None,
        files: Sequence[str],
    ) -> ParsedPatch:
        assert read_file is not None  # OutputFormat.parse checks it
        blocks = _blocks(answer)
        if sum(len(block) for block in blocks) > _MAX_CODE_CHARS:
            return invalid(
                InvalidReason.MALFORMED_BLOCK,
                f"the code blocks hold more than {_MAX_CODE_CHARS} characters; "
                "give only the functions that change",
                thinking,
            )
        new_functions: list[tuple[str, cst.FunctionDef]] = []
        for number, block in enumerate(blocks, start=1):
            problem, defines = _cpython_problem(block)
            if problem is not None:
                return invalid(
                    InvalidReason.SYNTAX_ERROR,
                    f"code block {number} is not valid Python: {problem}",
                    thinking,
                )
            if not defines:
                continue  # nothing in it is used (module docstring)
            try:
                module = cst.parse_module(block)
            except cst.ParserSyntaxError as error:
                first_line = str(error).splitlines()[0] if str(error) else "syntax error"
                return invalid(
                    InvalidReason.SYNTAX_ERROR,
                    f"code block {number} is not valid Python: {first_line}",
                    thinking,
                )
            new_functions += [
                (statement.name.value, statement)
                for statement in module.body
                if isinstance(statement, cst.FunctionDef)
            ]
        if not new_functions:
            return invalid(
                InvalidReason.NO_PATCH, "no ```python block with a `def` in the output", thinking
            )

        sources = {path: read_file(path) for path in dict.fromkeys(files)}
        parsed = {
            path: tree
            for path, source in sources.items()
            if source is not None and (tree := _parse(source)) is not None
        }
        index: dict[str, list[_Definition]] = {}
        for path, (_, functions) in parsed.items():
            for name, spans_found in functions.items():
                index.setdefault(name, []).extend(
                    _Definition(path, line, end) for line, end in spans_found
                )

        edits: dict[str, dict[int, cst.FunctionDef]] = {}
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for name, function in new_functions:
            found = index.get(name, [])
            if not found:
                shown = ", ".join(sources) or "none"
                return invalid(
                    InvalidReason.UNKNOWN_FUNCTION,
                    f"no function named {name!r} in the "
                    f"files shown ({shown}); rewrite an existing function under its own "
                    "name",
                    thinking,
                )
            if len(found) > 1:
                where = ", ".join(f"{d.path}:{d.line}" for d in found)
                return invalid(
                    InvalidReason.AMBIGUOUS_FUNCTION,
                    f"{name!r} is defined {len(found)} times ({where}); this format cannot choose",
                    thinking,
                )
            [target] = found
            for start, end, other in spans.get(target.path, []):
                if start <= target.end_line and target.line <= end:
                    what = (
                        "twice" if other == name else f"together with {other!r}, which overlaps it"
                    )
                    return invalid(
                        InvalidReason.MALFORMED_BLOCK,
                        f"{name!r} is given {what}; give each function once",
                        thinking,
                    )
            spans.setdefault(target.path, []).append((target.line, target.end_line, name))
            edits.setdefault(target.path, {})[target.line] = function

        changed = []
        for path, by_line in edits.items():
            wrapper, _ = parsed[path]
            transformer = _Replace(by_line)
            new_source = wrapper.visit(transformer).code
            assert transformer.replaced == set(by_line), (path, sorted(by_line))
            if new_source != sources[path]:
                changed.append((path, new_source))
        if not changed:
            return invalid(
                InvalidReason.NO_CHANGE, "the rewritten functions equal the originals", thinking
            )
        patch = "".join(file_diff(path, sources[path], new) for path, new in changed)
        return ParsedPatch(
            patch=patch,
            invalid_reason=None,
            thinking=thinking,
            files=tuple(path for path, _ in changed),
        )

    def gold_answer(self, patch: str, read_file: ReadFile) -> str:
        return diff_to_function_rewrite(patch, read_file)


def function_rewrite_to_diff(output: str, read_file: ReadFile, files: Sequence[str]) -> ParsedPatch:
    """The FUNCTION format (module docstring): `files` are the paths whose functions may be
    rewritten (the prompt's shown files), read at base_commit through `read_file`."""
    return FunctionFormat().parse(output, read_file, files)


class _OutermostFunctions(cst.CSTVisitor):
    """(first line, last line, node) of every function not nested in another function:
    module-level functions and methods."""

    METADATA_DEPENDENCIES = (cst.metadata.PositionProvider,)

    def __init__(self):
        super().__init__()
        self.found: list[tuple[int, int, cst.FunctionDef]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        position = self.get_metadata(cst.metadata.PositionProvider, node)
        self.found.append((position.start.line, position.end.line, node))
        return False  # a nested function goes with its outer one


def _apply(patched: unidiff.PatchedFile, old: str) -> tuple[str, set[int]]:
    """The file after the diff, and the new file's line numbers the diff touched (an added line;
    for a removal, the line before it)."""
    old_lines = old.splitlines(keepends=True)
    new_lines: list[str] = []
    touched: set[int] = set()
    cursor = 0
    for hunk in patched:
        # A hunk with no old lines inserts after line source_start; others start at it.
        start = hunk.source_start - 1 if hunk.source_length else hunk.source_start
        new_lines += old_lines[cursor:start]
        for line in hunk:
            if line.is_removed:
                touched.add(max(1, len(new_lines)))
            else:
                new_lines.append(line.value)
                if line.is_added:
                    touched.add(len(new_lines))
        cursor = start + hunk.source_length
    new_lines += old_lines[cursor:]
    return "".join(new_lines), touched


def diff_to_function_rewrite(patch: str, read_file: ReadFile) -> str:
    """Expresses a unified diff in the FUNCTION format: one ```python block per changed function
    (the outermost function around each change, as it reads after the diff). Used to build gold
    answers in this format for tests, few-shot examples and supervised warm starts.

    Raises ValueError when the diff cannot be said this way: a change outside any function, a
    new or missing file, a patched file libcst cannot parse, or a function whose name the format
    cannot place (the answer is parsed
    back with function_rewrite_to_diff and must give the same diff)."""
    blocks = []
    paths = []
    expected = ""
    for patched in unidiff.PatchSet(patch):
        old = read_file(patched.path)
        if old is None or patched.is_added_file or patched.is_removed_file:
            raise ValueError(f"{patched.path}: the function format only edits existing files")
        new, touched = _apply(patched, old)
        try:
            wrapper = cst.metadata.MetadataWrapper(cst.parse_module(new))
        except cst.ParserSyntaxError as error:
            raise ValueError(
                f"{patched.path}: libcst cannot parse the patched file: "
                f"{str(error).splitlines()[0]}"
            ) from None
        functions = _OutermostFunctions()
        wrapper.visit(functions)
        changed = []
        for line in sorted(touched):
            around = [entry for entry in functions.found if entry[0] <= line <= entry[1]]
            if not around:
                raise ValueError(f"{patched.path}:{line}: the change is outside any function")
            if around[0] not in changed:
                changed.append(around[0])
        for _, _, node in changed:
            code = wrapper.module.code_for_node(node.with_changes(leading_lines=()))
            blocks.append(f"```python\n{code}```\n")
        paths.append(patched.path)
        expected += file_diff(patched.path, old, new)
    answer = "\n".join(blocks)
    parsed = function_rewrite_to_diff(answer, read_file, paths)
    if parsed.patch != expected:
        why = parsed.detail or "the rewritten functions give a different diff"
        raise ValueError(f"the function format cannot say this diff: {why}")
    return answer


__all__ = ["FunctionFormat", "diff_to_function_rewrite", "function_rewrite_to_diff"]
