"""Synthesizes SWE-bench-format tasks from PyPI packages (SWE-smith style, no model needed).

    tools/bazel run //python/dockyard_rl/data/synthesis:synthesize_swe_tasks -- \\
        --packages sqlparse,boltons,xmltodict --out DIR [--max-tasks-per-package 50] \\
        [--seed 0] [--num-baseline-runs 3] [--workers N] [--executor-url http://127.0.0.1:9090]

How a task is made and checked: task_synthesis.py. `--packages` takes PyPI requirements
(`name` or `name==version`), paths of local sdist archives, or `bundled:toystats` (a package
that ships with dockyard_rl: bundled_sdists.py). Without `--executor-url` an executor is started
in this process on 127.0.0.1 (a free port) with `--workers` scoring workers; with it, that
executor must run on this machine (it clones the repositories from DIR/repos by path), and its
bearer token, if it has one, comes from $DOCKYARD_EXECUTOR_TOKEN.

Writes, under DIR:
- `repos/<package>.git`: bare repositories; the tasks' `repo` field is their absolute path and
  each task's base commit is the ref refs/tasks/<instance id>.
- `tasks/<package>.jsonl` (one per package, written as soon as the package is done) and
  `tasks.jsonl` (all packages): SWE-bench rows, loadable with `data.datasets.load_jsonl`.
- `report.json`: per package the counts, the time, the rejection reasons, the flaky tests
  (`flaky_tests`: passed in some of the `--num-baseline-runs` baseline runs but not all, so never
  used in a task) and the FAIL_TO_PASS / PASS_TO_PASS size distributions; the same table is
  printed at the end (and the flaky tests are logged as they are found).
- `sdists/`: the downloaded archives (a rerun reuses them only when given as paths).

A package whose `tasks/<package>.jsonl` and report entry exist from an earlier run with the same
settings is not redone (resume after an interruption, package by package); `--force` redoes it.
Exit status: 0 when every package yielded tasks, 1 when one could not (its reason is printed),
2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

from dockyard_rl.data.synthesis import mutations, sdist_repos, task_synthesis
from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.executor import token_from_environment
from dockyard_rl.sandbox.server import executor_url
from dockyard_rl.utils.config import from_dict
from dockyard_rl.utils.paths import caller_path

logger = logging.getLogger("synthesize_swe_tasks")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="synthesize_swe_tasks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--packages",
        required=True,
        help="comma-separated PyPI requirements, local sdist archive paths or bundled:toystats",
    )
    parser.add_argument("--out", required=True, type=pathlib.Path, help="output directory")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-tasks-per-package", type=int)
    parser.add_argument("--max-candidates-per-package", type=int)
    parser.add_argument("--max-tasks-per-function", type=int)
    parser.add_argument("--max-fail-fraction", type=float)
    parser.add_argument("--num-gold-runs", type=int)
    parser.add_argument(
        "--num-baseline-runs",
        type=int,
        help="runs of the unmutated suite (default 3, at least 2): a test must "
        "pass in every one to be used; each kept mutant runs as often",
    )
    parser.add_argument(
        "--window-size",
        type=int,
        help="screenings in flight at once (default 4; the tasks found depend on "
        "it, so keep it fixed to reproduce a set)",
    )
    parser.add_argument(
        "--kinds", help=f"comma-separated subset of {','.join(mutations.MUTATION_KINDS)}"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="scoring workers of the in-process executor (default: CPU count)",
    )
    parser.add_argument("--executor-url", help="use this running executor instead of starting one")
    parser.add_argument(
        "--force", action="store_true", help="redo packages that an earlier run already finished"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> task_synthesis.SynthesisConfig:
    """Flags -> a validated SynthesisConfig; ValueError names the flag's key."""
    data: dict[str, Any] = {}
    for key in (
        "seed",
        "max_tasks_per_package",
        "max_candidates_per_package",
        "max_tasks_per_function",
        "max_fail_fraction",
        "num_gold_runs",
        "num_baseline_runs",
        "window_size",
    ):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.kinds:
        data["mutation_kinds"] = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    return from_dict(task_synthesis.SynthesisConfig, data, key_path="synthesis")


def _settings(config: task_synthesis.SynthesisConfig) -> dict[str, Any]:
    settings = dataclasses.asdict(config)
    settings["mutation_kinds"] = list(settings["mutation_kinds"])
    return settings


def _write_atomically(path: pathlib.Path, text: str) -> None:
    staging = path.with_suffix(".partial")
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)  # a reader (or a resumed run) never sees half a file


def _write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    _write_atomically(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def format_report(summaries: list[dict[str, Any]], total_s: float) -> str:
    header = (
        f"{'package':<14}{'version':<10}{'tasks':>6}{'screened':>9}{'flaky':>6}"
        f"{'time s':>8}  {'F2P min/med/mean/max':<22}{'P2P min/med/max':<18}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        if "error" in s:
            lines.append(
                f"{s['package']:<14}{'':<10}{0:>6}{'':>9}{'':>6}{'':>8}  skipped: "
                f"{s['error'].splitlines()[0][:80]}"
            )
            continue
        f2p, p2p = s["fail_to_pass"], s["pass_to_pass"]
        f2p_text = (
            f"{f2p['min']}/{f2p['median']}/{f2p['mean']}/{f2p['max']}" if f2p["count"] else "-"
        )
        p2p_text = f"{p2p['min']}/{p2p['median']}/{p2p['max']}" if p2p["count"] else "-"
        lines.append(
            f"{s['package']:<14}{s['version']:<10}{s['num_tasks']:>6}"
            f"{s['num_screened']:>9}{s['num_flaky_tests']:>6}{s['seconds']:>8.0f}  "
            f"{f2p_text:<22}{p2p_text:<18}"
        )
    total = sum(s.get("num_tasks", 0) for s in summaries)
    lines.append(f"total: {total} validated tasks in {total_s:.0f} s")
    return "\n".join(lines)


def requirements_of(packages: str) -> list[str]:
    """The --packages list: stripped, duplicates dropped (first kept), archive paths made
    absolute against the caller's directory."""
    requirements: list[str] = []
    for item in (p.strip() for p in packages.split(",")):
        if item.endswith(sdist_repos.ARCHIVE_SUFFIXES):
            item = str(caller_path(item))
        if item and item not in requirements:
            requirements.append(item)
    return requirements


def _read_report(path: pathlib.Path) -> dict[str, Any]:
    """An earlier run's report; {} when there is none or it cannot be read (a run killed while
    writing it): then nothing is reused."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    _write_atomically(path, json.dumps(data, indent=2) + "\n")


async def _run(
    args: argparse.Namespace, config: task_synthesis.SynthesisConfig, out: pathlib.Path
) -> int:
    requirements = requirements_of(args.packages)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    report_path = out / "report.json"
    previous = _read_report(report_path)
    settings = _settings(config)
    reuse = {
        s["requirement"]: s
        for s in previous.get("packages", [])
        if previous.get("settings") == settings
        and not args.force
        and "error" not in s
        and (out / "tasks" / f"{s['slug']}.jsonl").is_file()
        and (out / "repos" / f"{s['slug']}.git").is_dir()
    }
    reserved_repo_names = {s["slug"] for s in reuse.values()}
    summaries: list[dict[str, Any]] = []
    rows_by_package: dict[str, list[dict[str, Any]]] = {}
    start = time.monotonic()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="synthesis-"))
    try:
        # A large log keeps every failure block for the problem statements.
        async with (
            executor_url(
                args.executor_url,
                work_dir=scratch / "executor",
                num_workers=args.workers,
                max_log_bytes=1024 * 1024,
            ) as url,
            ExecutorClient(
                url, auth_token=token_from_environment() if args.executor_url else None
            ) as client,
        ):
            paths = task_synthesis.SynthesisPaths(
                repos_dir=out / "repos", sdist_dir=out / "sdists", scratch_dir=scratch
            )
            for requirement in requirements:
                if requirement in reuse:
                    summary = reuse[requirement]
                    logger.info(
                        "%s: done by an earlier run, reusing %d tasks",
                        requirement,
                        summary["num_tasks"],
                    )
                    rows_by_package[requirement] = [
                        json.loads(line)
                        for line in (out / "tasks" / f"{summary['slug']}.jsonl")
                        .read_text()
                        .splitlines()
                    ]
                    summaries.append(summary)
                    continue
                try:
                    result = await task_synthesis.synthesize_package(
                        requirement, config, client, paths, reserved_repo_names=reserved_repo_names
                    )
                except (task_synthesis.PackageSkipped, sdist_repos.SdistError) as error:
                    logger.error("%s: skipped: %s", requirement, error)
                    summaries.append(
                        {"requirement": requirement, "package": requirement, "error": str(error)}
                    )
                    continue
                slug = pathlib.Path(result.repo).name.removesuffix(".git")
                _write_jsonl(out / "tasks" / f"{slug}.jsonl", result.tasks)
                rows_by_package[requirement] = result.tasks
                summaries.append({"requirement": requirement, "slug": slug, **result.summary()})
                _write_json(report_path, {"settings": settings, "packages": summaries})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    all_rows = [row for requirement in requirements for row in rows_by_package.get(requirement, [])]
    _write_jsonl(out / "tasks.jsonl", all_rows)
    total_s = time.monotonic() - start
    report = {
        "settings": settings,
        "packages": summaries,
        "seconds": round(total_s, 1),
        "num_tasks": len(all_rows),
        "fail_to_pass": task_synthesis.distribution([len(r["FAIL_TO_PASS"]) for r in all_rows]),
        "pass_to_pass": task_synthesis.distribution([len(r["PASS_TO_PASS"]) for r in all_rows]),
    }
    _write_json(report_path, report)
    print(format_report(summaries, total_s))
    print(f"wrote {out / 'tasks.jsonl'} and {report_path}")
    return 0 if all("error" not in s and s["num_tasks"] > 0 for s in summaries) else 1


def synthesize(
    packages: list[str],
    config: task_synthesis.SynthesisConfig,
    out: pathlib.Path,
    *,
    workers: int,
    executor_url: str | None = None,
    force: bool = False,
) -> int:
    """The command's work from Python (e.g. a training run making its task set once): same
    output, same resume rules, same exit status as `main`."""
    args = argparse.Namespace(
        packages=",".join(packages), workers=workers, executor_url=executor_url, force=force
    )
    return asyncio.run(_run(args, config, pathlib.Path(out)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The executor's own per-request logs would drown the progress lines.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    out = caller_path(args.out)
    try:
        config = config_from_args(args)
        if args.workers < 1:
            raise ValueError(f"--workers: must be >= 1, got {args.workers}")
        if not [p for p in args.packages.split(",") if p.strip()]:
            raise ValueError(
                "--packages: name at least one package (e.g. sqlparse,boltons) or "
                "sdist archive path"
            )
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out: {out} exists and is not a directory")
    except ValueError as error:
        print(f"synthesize_swe_tasks: invalid settings: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_run(args, config, out))


if __name__ == "__main__":
    sys.exit(main())
