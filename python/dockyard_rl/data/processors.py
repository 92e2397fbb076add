"""Prompt processors: one SWE instance -> chat messages -> prompt token ids.

The prompt holds the problem statement, the code it needs and the instructions for the output
format (`PatchFormat`: a diff, SEARCH/REPLACE blocks or whole functions), rendered with the
model's own chat template. The code context is the files the gold patch modifies (the "oracle"
file set), read at base_commit through a `read_file(path) -> str | None` callable:

1. whole files, when they fit `max_context_tokens` together;
2. else Python files are cut to the functions/methods the gold hunks touch (found with `ast`;
   a touched method brings its class's header line and, where the budget allows, the class's
   state: its `__init__` and its class-level assignments, which say what the method's `self.x`
   are; module-level lines come alone), with `...` marking the gaps; non-Python files (or ones
   `ast` cannot parse) to the hunks +-10 lines;
3. if that is still over budget, files are added in order until the budget runs out, the last
   one cut at a line boundary (without the class state), the rest omitted.

Shown code is the exact file text (no line numbers), so SEARCH blocks copied from it match.
`Prompt` carries the token ids plus metadata: format, files shown, which were cut or omitted.

The processor registers itself as "swe_single_shot" in the dataset registry.

Not covered: retrieval of files the gold patch does not touch (BM25 or agentic search), multi-turn
prompts, and token counts of the chat template's own overhead in the budget (only the code
context is budgeted; `Prompt.num_tokens` reports the total).
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import unidiff

from dockyard_rl.data.datasets import register_processor
from dockyard_rl.data.patch_formats import PatchFormat, ReadFile
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.utils.config import require, require_bool

_HUNK_WINDOW_LINES = 10  # lines shown around a hunk when a file cannot be cut by ast

SYSTEM_PROMPT = (
    "You are an expert software engineer. You fix bugs in Python repositories by "
    "editing their source code. You never edit the tests."
)

DIFF_INSTRUCTIONS = """\
Fix the issue by writing a patch. Answer with a single unified diff in a ```diff fenced block,
relative to the repository root, with `--- a/<path>` and `+++ b/<path>` file headers and correct
`@@ -start,count +start,count @@` hunk headers, for example:

```diff
--- a/pkg/module.py
+++ b/pkg/module.py
@@ -10,3 +10,3 @@ def area(width, height):
     if width < 0:
         raise ValueError("negative width")
-    return width + height
+    return width * height
```"""

SEARCH_REPLACE_INSTRUCTIONS = """\
Fix the issue with one or more SEARCH/REPLACE edit blocks. Each block is the file path (relative
to the repository root) on its own line, then the exact lines to find, then their replacement:

pkg/module.py
<<<<<<< SEARCH
    return width + height
=======
    return width * height
>>>>>>> REPLACE

The SEARCH lines must match the file exactly (whitespace included) and occur exactly once in it;
add surrounding lines to make them unique. Blocks apply in order."""

FUNCTION_INSTRUCTIONS = """\
Fix the issue by rewriting the function that holds the bug. Answer with the whole corrected
function, from its `def` line (decorators included) to its last line, in a ```python fenced
block, for example:

```python
def area(width, height):
    if width < 0:
        raise ValueError("negative width")
    return width * height
```

Keep the function's name: it replaces the function of that name in the code above. Give several
functions in the block if several need a change."""

_INSTRUCTIONS = {
    PatchFormat.DIFF: DIFF_INSTRUCTIONS,
    PatchFormat.SEARCH_REPLACE: SEARCH_REPLACE_INSTRUCTIONS,
    PatchFormat.FUNCTION: FUNCTION_INSTRUCTIONS,
}

THINK_INSTRUCTION = (
    "First reason step by step inside <think> ... </think>, then give the "
    "answer after the closing tag."
)
NO_THINK_INSTRUCTION = "Answer with the edit only, without explanations."


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """Config section `data.prompt`."""

    patch_format: str = "diff"  # diff | search_replace | function: what the model writes
    max_context_tokens: int = 6000  # budget of the code context (files), in tokens
    enable_thinking: bool = False  # ask for a leading <think> block
    include_hints: bool = False  # add hints_text (SWE-bench's issue comments) to the prompt

    def __post_init__(self) -> None:
        valid = [f.value for f in PatchFormat]
        require(
            self.patch_format in valid,
            "patch_format",
            f"must be one of {valid}, got {self.patch_format!r}",
        )
        require(
            isinstance(self.max_context_tokens, int) and self.max_context_tokens > 0,
            "max_context_tokens",
            f"must be a positive integer, got {self.max_context_tokens!r}",
        )
        require_bool(self, "enable_thinking", "include_hints")


@dataclasses.dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    messages: tuple[dict[str, str], ...]
    patch_format: PatchFormat
    files_shown: tuple[str, ...]  # in order; whole or cut
    files_cut: tuple[str, ...]  # shown, but cut to functions/hunks or at the budget
    files_omitted: tuple[str, ...]  # touched by the gold patch but not shown (budget/missing)
    num_context_tokens: int
    num_tokens: int

    @property
    def truncated(self) -> bool:
        return bool(self.files_cut or self.files_omitted)


def touched_files(patch: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """(path, [(first, last) 1-based base_commit line ranges]) for each file the patch modifies;
    added files are skipped (they do not exist there). Ranges cover the removed lines and, for
    pure insertions, the lines on both sides; not the hunks' context lines, which would drag in
    the neighbouring functions."""
    result = []
    for patched in unidiff.PatchSet(patch):
        if patched.is_added_file:
            continue
        ranges = []
        for hunk in patched:
            previous = hunk.source_start - 1  # the base line just before the current position
            in_change = False  # added lines right after removed ones replace them: no insertion
            for line in hunk:
                if line.source_line_no is not None:
                    previous = line.source_line_no
                    in_change = line.is_removed
                    if line.is_removed:
                        ranges.append((previous, previous))
                elif line.is_added and not in_change:
                    ranges.append((max(1, previous), previous + 1))
                    in_change = True
        result.append((patched.path, _merge(ranges)))
    return result


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def python_spans(
    source: str, ranges: list[tuple[int, int]], class_state: bool = False
) -> list[tuple[int, int]] | None:
    """1-based line intervals to show for the hunk `ranges` of a Python file: the innermost
    function around each touched line (decorators included; a method adds its class's header
    line), or the line alone at module/class level. With `class_state`, a method also adds its
    class's `__init__` and class-level assignments (a dataclass's fields, constants): the
    attributes its body reads. None when `source` does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    # (start, end, class header line or None) for every function, innermost found by span size.
    functions: list[tuple[int, int, int | None]] = []
    # Class header line -> the spans of its state (__init__, class-level assignments).
    states: dict[int, list[tuple[int, int]]] = {}

    def span(node: ast.stmt) -> tuple[int, int]:
        decorators = getattr(node, "decorator_list", [])
        return min([node.lineno] + [d.lineno for d in decorators]), node.end_lineno or node.lineno

    def visit(node: ast.AST, class_line: int | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((*span(child), class_line))
                visit(child, None)
            elif isinstance(child, ast.ClassDef):
                states[child.lineno] = [
                    span(statement)
                    for statement in child.body
                    if isinstance(statement, (ast.Assign, ast.AnnAssign))
                    or (isinstance(statement, ast.FunctionDef) and statement.name == "__init__")
                ]
                visit(child, child.lineno)
            else:
                visit(child, class_line)

    visit(tree, None)
    intervals = []
    num_lines = len(source.splitlines())
    for first, last in ranges:
        for line in range(max(1, first), min(last, num_lines) + 1):
            around = [f for f in functions if f[0] <= line <= f[1]]
            if not around:
                intervals.append((line, line))
                continue
            start, end, class_line = min(around, key=lambda f: f[1] - f[0])
            intervals.append((start, end))
            if class_line is not None:
                intervals.append((class_line, class_line))
                if class_state:
                    intervals.extend(states[class_line])
    return _merge(intervals)


def _render(lines: list[str], intervals: list[tuple[int, int]]) -> str:
    parts = []
    previous_end = 0
    for start, end in intervals:
        if start > previous_end + 1:
            parts.append("...\n")
        parts.append("".join(lines[start - 1 : end]))
        previous_end = end
    if previous_end < len(lines):
        parts.append("...\n")
    return "".join(parts)


def _file_block(path: str, text: str) -> str:
    if not text.endswith("\n"):
        text += "\n"
    language = "python" if path.endswith(".py") else ""
    return f"{path}\n```{language}\n{text}```\n"


class SwePromptProcessor:
    """Builds prompts for single-shot SWE tasks. Stateless apart from the tokenizer; safe to
    call from several threads if the tokenizer is."""

    def __init__(self, tokenizer: Any, config: PromptConfig | None = None):
        self.config = config or PromptConfig()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; use an instruct/chat model's "
                "tokenizer or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self.patch_format = PatchFormat(self.config.patch_format)

    def _num_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fit_lines(self, path: str, text: str, budget: int) -> str | None:
        """The longest prefix of `text` (whole lines) whose file block fits `budget` tokens."""
        lines = text.splitlines(keepends=True)
        low, high = 0, len(lines)
        while low < high:  # binary search on the number of lines kept
            mid = (low + high + 1) // 2
            if self._num_tokens(_file_block(path, "".join(lines[:mid]) + "...\n")) <= budget:
                low = mid
            else:
                high = mid - 1
        return "".join(lines[:low]) + "...\n" if low else None

    def build_context(
        self, instance: SweInstance, read_file: ReadFile
    ) -> tuple[str, list[str], list[str], list[str], int]:
        """(context text, shown, cut, omitted, num tokens) under `max_context_tokens`."""
        budget = self.config.max_context_tokens
        files = []
        omitted = []
        for path, ranges in touched_files(instance.patch):
            content = read_file(path)
            if content is None:
                omitted.append(path)  # the gold patch names a file base_commit lacks
            else:
                files.append((path, ranges, content))
        whole = "".join(_file_block(path, content) for path, _, content in files)
        num_whole = self._num_tokens(whole)
        if num_whole <= budget:
            return whole, [p for p, _, _ in files], [], omitted, num_whole
        # Per file: the excerpt with its methods' class state, and the one without (the same
        # text when nothing differs); the first is shown when it fits what is left of the budget.
        excerpts = []
        for path, ranges, content in files:
            lines = content.splitlines(keepends=True)
            if path.endswith(".py") and (spans := python_spans(content, ranges)) is not None:
                with_state = python_spans(content, ranges, class_state=True) or spans
                excerpts.append((path, _render(lines, with_state), _render(lines, spans)))
                continue
            spans = _merge(
                [
                    (max(1, a - _HUNK_WINDOW_LINES), min(len(lines), b + _HUNK_WINDOW_LINES))
                    for a, b in ranges
                ]
            )
            excerpts.append((path, _render(lines, spans), _render(lines, spans)))
        shown: list[str] = []
        blocks: list[str] = []
        used = 0
        for path, rich_text, text in excerpts:
            block = _file_block(path, rich_text)
            cost = self._num_tokens(block)
            if used + cost > budget and text != rich_text:
                block = _file_block(path, text)
                cost = self._num_tokens(block)
            if used + cost > budget:
                fitted = self._fit_lines(path, text, budget - used)
                if fitted is None:
                    omitted.append(path)
                    continue
                block = _file_block(path, fitted)
                cost = self._num_tokens(block)
            shown.append(path)
            blocks.append(block)
            used += cost
        # Every shown file is cut here (to functions, or at the budget): this branch only runs
        # when the whole files did not fit.
        return "".join(blocks), shown, list(shown), omitted, used

    def messages(self, instance: SweInstance, context: str) -> list[dict[str, str]]:
        instructions = _INSTRUCTIONS[self.patch_format]
        think = THINK_INSTRUCTION if self.config.enable_thinking else NO_THINK_INSTRUCTION
        parts = [
            f"Repository: {instance.repo}",
            "",
            "The issue:",
            instance.problem_statement.strip(),
            "",
        ]
        if self.config.include_hints and instance.hints_text.strip():
            parts += ["Hints from the discussion:", instance.hints_text.strip(), ""]
        parts += [
            "The code that is relevant to the issue ('...' marks omitted lines):",
            "",
            context if context else "(no source files available)\n",
            instructions,
            "",
            think,
        ]
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "\n".join(parts)},
        ]

    def __call__(self, instance: SweInstance, read_file: ReadFile) -> Prompt:
        context, shown, cut, omitted, num_context = self.build_context(instance, read_file)
        messages = self.messages(instance, context)
        # tokenize=False then encode: apply_chat_template's tokenize=True return type differs
        # across transformers versions (list vs BatchEncoding). The template already holds the
        # special tokens, so none are added again.
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=self.config.enable_thinking,
        )
        token_ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Prompt(
            token_ids=token_ids,
            messages=tuple(messages),
            patch_format=self.patch_format,
            files_shown=tuple(shown),
            files_cut=tuple(cut),
            files_omitted=tuple(omitted),
            num_context_tokens=num_context,
            num_tokens=len(token_ids),
        )


register_processor("swe_single_shot", SwePromptProcessor)
