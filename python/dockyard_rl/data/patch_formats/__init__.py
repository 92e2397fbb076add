"""Turning a model's output into a unified diff: the output formats and their failures.

Formats (`PatchFormat`), one module each, all subclasses of `interfaces.OutputFormat`:
- DIFF (diff.py): a unified diff, fenced or raw, re-serialised from unidiff's parse
  (unidiff_linear.py reads it in linear time).
- SEARCH_REPLACE (search_replace.py): edit blocks, each naming a file, applied to the base
  commit's files and written as a diff.
- FUNCTION (function_rewrite.py): whole functions in ```python blocks, each replacing the
  function of that name in the files the prompt showed.

A leading `<think>...</think>` block is stripped first and returned as `thinking`
(interfaces.py). Failures are returned, never raised: `ParsedPatch.invalid_reason` is an
`InvalidReason` (for the invalid-action penalty) and `detail` says what was wrong.

Callers use `parse_model_output(output, format, read_file, files)` and `gold_answer(patch,
format, read_file)` (factory.py), with `git_file_reader(repo, commit)` (base_files.py) as the
`read_file` over the base commit.

Cost: the output is the model's, so every parse here is linear in its length (or capped) and
returns a result for any text. A 1 MiB adversarial output parses in about a second:
`bazel run //tests/benchmarks:patch_parse_benchmark -- --trainer`.

Not covered: binary patches, renames and mode changes in SEARCH/REPLACE and FUNCTION (diffs may
carry them through), and checking that a patch applies (the executor's apply chain does that).
"""

from dockyard_rl.data.patch_formats.base_files import file_diff, git_dir_lister, git_file_reader
from dockyard_rl.data.patch_formats.diff import DiffFormat, extract_diff
from dockyard_rl.data.patch_formats.factory import gold_answer, output_format, parse_model_output
from dockyard_rl.data.patch_formats.function_rewrite import (
    FunctionFormat,
    diff_to_function_rewrite,
    function_rewrite_to_diff,
)
from dockyard_rl.data.patch_formats.interfaces import (
    InvalidReason,
    OutputFormat,
    ParsedPatch,
    PatchFormat,
    ReadFile,
    invalid,
    strip_think,
)
from dockyard_rl.data.patch_formats.search_replace import (
    EditBlock,
    SearchReplaceFormat,
    diff_to_search_replace,
    parse_edit_blocks,
    search_replace_to_diff,
)

__all__ = [
    "DiffFormat",
    "EditBlock",
    "FunctionFormat",
    "InvalidReason",
    "OutputFormat",
    "ParsedPatch",
    "PatchFormat",
    "ReadFile",
    "SearchReplaceFormat",
    "diff_to_function_rewrite",
    "diff_to_search_replace",
    "extract_diff",
    "file_diff",
    "function_rewrite_to_diff",
    "git_dir_lister",
    "git_file_reader",
    "gold_answer",
    "invalid",
    "output_format",
    "parse_model_output",
    "parse_edit_blocks",
    "search_replace_to_diff",
    "strip_think",
]
