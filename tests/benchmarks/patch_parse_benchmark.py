"""Host-side patch parsing cost (issue 25, class 7): for each parser of the agent's patch on the
executor, the parse time of a 1 MiB adversarial patch of every shape in
`sandbox.testing_patches`, and its ratio to a 1 MiB ordinary patch parsed by the same parser in
the same run. Linear parsers keep every ratio a small constant; a superlinear one shows ratios
of hundreds or more (seconds to minutes per patch).

    tools/bazel run //tests/benchmarks:patch_parse_benchmark [-- --num-bytes 1048576]
"""

from __future__ import annotations

import argparse
import time

from dockyard_rl.sandbox import apply, integrity, screening
from dockyard_rl.sandbox.testing_patches import adversarial_patches, ordinary_patch

PARSERS = {
    "check_integrity": lambda patch: integrity.check_integrity(
        patch, ["tests/test_x.py"], lambda path: "[tool.pytest.ini_options]\n"
    ),
    "screen_patch": screening.screen_patch,
    "binary_hunks": apply.binary_hunks,
}


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
    args = parser.parse_args()
    if args.num_bytes < 1024 or args.repeats < 1:
        raise ValueError("--num-bytes must be >= 1024 and --repeats >= 1")
    ordinary = ordinary_patch(args.num_bytes)
    baselines = {name: _seconds(parse, ordinary, args.repeats) for name, parse in PARSERS.items()}
    print(f"patch size {args.num_bytes} bytes; best of {args.repeats}; ratio = / ordinary patch")
    print(f"{'shape':30s}" + "".join(f"{name:>28s}" for name in PARSERS))
    print(f"{'ordinary':30s}" + "".join(f"{baselines[n]:>20.4f} s (1.0)" for n in PARSERS))
    worst = 0.0
    for shape, patch in adversarial_patches(args.num_bytes).items():
        cells = []
        for name, parse in PARSERS.items():
            seconds = _seconds(parse, patch, args.repeats)
            worst = max(worst, seconds)
            cells.append(f"{seconds:>14.4f} s ({seconds / max(baselines[name], 1e-9):6.1f}x)")
        print(f"{shape:30s}" + "".join(f"{cell:>28s}" for cell in cells))
    print(f"slowest adversarial parse: {worst:.4f} s")


if __name__ == "__main__":
    main()
