"""Host-side patch parsing cost (the patch is the agent's): for each parser of the agent's patch on
the executor, the parse time of a 1 MiB adversarial patch of every shape in
`sandbox.testing_patches`, and its ratio to a 1 MiB ordinary patch parsed by the same parser in the
same run. Linear parsers keep every ratio a small constant; a superlinear one shows ratios of
hundreds or more (seconds to minutes per patch).

`--trainer` measures the trainer's parsers of the model's output instead (data.patch_formats:
the diff, SEARCH/REPLACE and function formats), on the executor's shapes after a valid file and
on the trainer's own (unclosed fences, many edit blocks, deep nesting): the time of each,
against the same ordinary patch in a ```diff fence.

    tools/bazel run //tests/benchmarks:patch_parse_benchmark [-- --num-bytes 1048576] [--trainer]
"""

from __future__ import annotations

import argparse
import time

from dockyard_rl.data import patch_formats
from dockyard_rl.sandbox import apply, protected_paths, screening
from dockyard_rl.sandbox.testing_patches import adversarial_patches, ordinary_patch

PARSERS = {
    "check_integrity": lambda patch: protected_paths.check_integrity(
        patch, ["tests/test_x.py"], lambda path: "[tool.pytest.ini_options]\n"
    ),
    "screen_patch": screening.screen_patch,
    "binary_hunks": apply.binary_hunks,
}


_OPS = "def mul(a, b):\n    return a + b\n"
_LEAD = "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"  # a valid file first: the rest is parsed

TRAINER_PARSERS = {
    "extract_diff": patch_formats.extract_diff,
    "search_replace": lambda output: patch_formats.search_replace_to_diff(
        output, {"calc/ops.py": _OPS}.get
    ),
    "function_rewrite": lambda output: patch_formats.function_rewrite_to_diff(
        output, {"calc/ops.py": _OPS}.get, ["calc/ops.py"]
    ),
}


def trainer_outputs(num_bytes: int) -> dict[str, str]:
    """Model outputs of about `num_bytes` for the trainer's parsers (module docstring)."""
    n = num_bytes
    outputs = {shape: _LEAD + patch for shape, patch in adversarial_patches(n).items()}
    outputs.update(
        unclosed_diff_fences="```diff\nx\n" * (n // 10),
        unclosed_bare_fences="```\n--- a\n" * (n // 10),
        unclosed_python_fences="```python\nx\n" * (n // 12),
        many_search_blocks="calc/ops.py\n<<<<<<< SEARCH\n=======\n>>>>>>> REPLACE\n" * (n // 52),
        many_growing_blocks=(
            "calc/ops.py\n<<<<<<< SEARCH\ndef mul(a, b):\n=======\ndef mul(a, b):\n"
            + "#" * 40
            + "\n>>>>>>> REPLACE\n"
        )
        * (n // 120),
        nested_parens="```python\ndef mul(a, b):\n    return " + "(" * 5000 + "\n```\n",
        deep_nesting_under_the_size_cap=(
            "```python\ndef mul(a, b):\n" + ("    x = " + "-" * 95 + "1\n") * 600 + "```\n"
        ),
    )
    return outputs


def _seconds(parse, patch: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        parse(patch)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-bytes", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument(
        "--trainer", action="store_true", help="the trainer's parsers of model output instead"
    )
    args = parser.parse_args()
    if args.num_bytes < 1024 or args.repeats < 1:
        raise ValueError("--num-bytes must be >= 1024 and --repeats >= 1")
    parsers, shapes = PARSERS, adversarial_patches(args.num_bytes)
    ordinary = ordinary_patch(args.num_bytes)
    if args.trainer:
        parsers, shapes = TRAINER_PARSERS, trainer_outputs(args.num_bytes)
        ordinary = f"```diff\n{ordinary}```\n"
    baselines = {name: _seconds(parse, ordinary, args.repeats) for name, parse in parsers.items()}
    print(f"patch size {args.num_bytes} bytes; best of {args.repeats}; ratio = / ordinary patch")
    print(f"{'shape':32s}" + "".join(f"{name:>28s}" for name in parsers))
    print(f"{'ordinary':32s}" + "".join(f"{baselines[n]:>20.4f} s (1.0)" for n in parsers))
    worst = 0.0
    for shape, patch in shapes.items():
        cells = []
        for name, parse in parsers.items():
            seconds = _seconds(parse, patch, args.repeats)
            worst = max(worst, seconds)
            cells.append(f"{seconds:>14.4f} s ({seconds / max(baselines[name], 1e-9):6.1f}x)")
        print(f"{shape:32s}" + "".join(f"{cell:>28s}" for cell in cells))
    print(f"slowest adversarial parse: {worst:.4f} s")


if __name__ == "__main__":
    main()
