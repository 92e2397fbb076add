"""What a per-task image costs: scoring one task on the executor's own interpreter vs in its image.

    tools/bazel run //tests/benchmarks:task_image_benchmark -- [--repeats 5] [--tasks 12]

Same task both ways (the toy repository's gold patch; its tests need nothing but pytest, which the
image has too), scored by the real pipeline (git, bubblewrap, pytest):
- host: today's path, the executor's interpreter;
- image, cold: a fresh image cache, so the lease includes skopeo's copy and umoci's unpack;
- image, warm: the image already unpacked (the usual case: one image serves many tasks);
then throughput: `--tasks` warm image-backed tasks through 1 and 2 concurrent scorers (the
executor's worker threads), as tasks per minute. Prints medians and ratios against the host path
measured in the same run; on a shared machine only the ratios are comparable between runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import pathlib
import statistics
import tempfile
import time

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.testing_repos import make_toy_repo

_IMAGE = pathlib.Path(__file__).absolute().parents[1] / "task_images" / "moonphase_task_image.tar"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", type=pathlib.Path, default=_IMAGE)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=12)
    args = parser.parse_args()

    root = pathlib.Path(tempfile.mkdtemp(prefix="task-image-bench-"))
    toy = make_toy_repo(root / "toy")
    config = pipeline.PipelineConfig(timeout_s=300, max_num_processes=128)
    host_spec = toy.spec(toy.gold_patch)
    image_spec = dataclasses.replace(host_spec, image=f"oci-archive:{args.image}")

    def score(spec, cfg, work_root) -> float:
        start = time.monotonic()
        verdict = pipeline.score_task(spec, cfg, work_root)
        assert verdict.resolved, (verdict.failure_kind, verdict.failure_detail)
        return time.monotonic() - start

    host = [score(host_spec, config, root / "host") for _ in range(args.repeats)]
    cold = []
    for index in range(args.repeats):
        cold_config = dataclasses.replace(config, image_cache_dir=str(root / f"cold-{index}"))
        cold.append(score(image_spec, cold_config, root / "image"))
    warm_config = dataclasses.replace(config, image_cache_dir=str(root / "cold-0"))
    warm = [score(image_spec, warm_config, root / "image") for _ in range(args.repeats)]

    host_s = statistics.median(host)
    print(f"{'path':<22} {'median s':>9} {'vs host':>8}")
    for name, times in (
        ("host (today)", host),
        ("image, cold cache", cold),
        ("image, warm cache", warm),
    ):
        median = statistics.median(times)
        print(f"{name:<22} {median:>9.2f} {median / host_s:>7.2f}x")
    print(
        f"per-task overhead of an image: cold {statistics.median(cold) - host_s:+.2f} s, "
        f"warm {statistics.median(warm) - host_s:+.2f} s"
    )

    for workers in (1, 2):
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(
                pool.map(
                    lambda _: score(image_spec, warm_config, root / "image"), range(args.tasks)
                )
            )
        elapsed = time.monotonic() - start
        print(
            f"throughput, {workers} worker(s): {args.tasks / elapsed * 60:.1f} tasks/min "
            f"({args.tasks} image-backed tasks in {elapsed:.1f} s)"
        )


if __name__ == "__main__":
    main()
