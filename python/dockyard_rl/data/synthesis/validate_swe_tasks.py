"""Checks a SWE task set against an executor: does each gold patch resolve, does the empty
patch not?

    tools/bazel run //python/dockyard_rl/data/synthesis:validate_swe_tasks -- \\
        --tasks DIR/tasks.jsonl [--dataset jsonl|hf_local] [--gold-runs 3] [--workers N] \\
        [--executor-url URL] [--report report.json] [--write-cleaned cleaned.jsonl]

Run it on a synthesized set before training on it, or on a published set (SWE-Gym, SWE-smith):
their `repo` is "owner/name", so give `--repo-root DIR` holding local clones as DIR/owner/name
(the executor clones from there). A task whose gold patch does not resolve teaches
nothing (every sample scores 0), and one the empty patch resolves rewards doing nothing. Each
instance is scored `--gold-runs` times with its gold patch and once with the empty patch, with
fresh task ids (an executor never answers a re-run from its records). A running executor's bearer
token, if it has one, comes from $DOCKYARD_EXECUTOR_TOKEN.

Flaky tests: a FAIL_TO_PASS or PASS_TO_PASS test that passed in some gold runs and not in others
is flaky (only runs with a trusted report count; failed vs errored is no flip, since grading only
asks whether a test passed). A test failing a fraction q of runs shows no flip in n gold runs with
probability (1 - q) ** n + q ** n, so more runs catch rarer flakes; one run catches none. A flaky
test also makes its gold runs unresolved now and then, so the instance is reported as a problem
too. `--write-cleaned PATH` (needs `--gold-runs` >= 2) writes the set as JSONL (the SWE-bench
columns of `SweInstance`; other columns are not carried over) with the flaky tests removed from
PASS_TO_PASS; an instance with a flaky FAIL_TO_PASS test is dropped (its fix cannot be graded
reliably). Instances with other problems are written unchanged: the report names them.

Prints one line per bad task, per instance with flaky tests and per dropped instance, and a
summary per repository; `--report` also writes them as JSON: `problems`, `flaky_tests` (instance
-> its flaky tests) and, with `--write-cleaned`, `cleaned` (path, number written, and `dropped`:
instance -> why). Exit status (about the input set, whether or not a cleaned set was written): 0
when every gold run resolved and no empty patch did, 1 otherwise (infrastructure errors count as
failures: the task was not confirmed), 2 for bad flags or an unreadable dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import sys
import tempfile
import uuid
from collections import Counter, defaultdict
from typing import Any

from dockyard_rl.data import datasets
from dockyard_rl.data.schema import DatasetError, SweInstance
from dockyard_rl.sandbox.client import (
    ExecutorClient,
    ExecutorRequestError,
    ExecutorUnavailableError,
)
from dockyard_rl.sandbox.executor import token_from_environment
from dockyard_rl.sandbox.server import executor_url
from dockyard_rl.sandbox.task import FailureKind, TaskStatus, TestOutcome
from dockyard_rl.utils.paths import caller_path

logger = logging.getLogger("validate_swe_tasks")

# Verdicts whose per-test outcomes come from a trusted report; any other kind reports every
# listed test as missing (grading.py), which says nothing about the tests themselves.
_TRUSTED_KINDS = (FailureKind.NONE, FailureKind.TESTS_FAILED)


@dataclasses.dataclass(frozen=True)
class Finding:
    """What scoring one instance found."""

    problem: str | None  # why it fails validation; None = valid
    flaky_tests: tuple[str, ...]  # its FAIL_TO_PASS / PASS_TO_PASS tests that passed in some
    # gold runs and not in others (sorted)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="validate_swe_tasks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tasks", required=True, help="the dataset path given to the loader")
    parser.add_argument(
        "--dataset", default="jsonl", help=f"loader name: {', '.join(datasets.dataset_names())}"
    )
    parser.add_argument(
        "--gold-runs",
        type=int,
        default=3,
        help="times each gold patch is scored; all must resolve, and a test "
        "whose outcome differs between them is flaky (default 3)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="scoring workers of the in-process executor (default: CPU count)",
    )
    parser.add_argument("--executor-url", help="use this running executor instead of starting one")
    parser.add_argument(
        "--timeout-s", type=float, help="test-run limit per task (default: the executor's)"
    )
    parser.add_argument(
        "--repo-root",
        help="folder of local clones for datasets whose repo is owner/name: DIR/owner/name is used",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=64,
        help="instances being scored at once (keeps large sets under the executor's queue limit)",
    )
    parser.add_argument("--report", type=pathlib.Path, help="write the findings as JSON here")
    parser.add_argument(
        "--write-cleaned",
        type=pathlib.Path,
        metavar="PATH",
        help="write the set as JSONL here with flaky tests removed from "
        "PASS_TO_PASS and instances with a flaky FAIL_TO_PASS test dropped",
    )
    parser.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser.parse_args(argv)


def _problem(gold_results: list, empty_result) -> str | None:
    """Why an instance fails validation, or None when it passes."""
    for result in [*gold_results, empty_result]:
        if result.status is not TaskStatus.FINISHED:
            return f"infrastructure error: {result.error}"
    if any(r.verdict.timed_out for r in [*gold_results, empty_result]):
        return "a run timed out"
    unresolved = [r for r in gold_results if not r.verdict.resolved]
    if unresolved:
        verdict = unresolved[0].verdict
        failing = sorted(
            t
            for t, o in {**verdict.fail_to_pass, **verdict.pass_to_pass}.items()
            if o.value != "passed"
        )
        return (
            f"gold patch did not resolve in {len(unresolved)} of {len(gold_results)} runs "
            f"(apply: {verdict.apply_method.value}; not passing: {failing[:5]})"
        )
    if empty_result.verdict.resolved:
        return "the empty patch resolves it (nothing to fix)"
    return None


def _flaky_tests(gold_results: list) -> tuple[str, ...]:
    """The listed tests that passed in some gold runs and not in others (module docstring). Runs
    without a trusted report are left out: they say nothing about any test."""
    outcomes = [
        {**r.verdict.fail_to_pass, **r.verdict.pass_to_pass}
        for r in gold_results
        if r.status is TaskStatus.FINISHED and r.verdict.failure_kind in _TRUSTED_KINDS
    ]
    tests = set().union(*outcomes)
    return tuple(
        sorted(t for t in tests if len({o.get(t) is TestOutcome.PASSED for o in outcomes}) > 1)
    )


async def validate(
    instances: list[SweInstance],
    client: ExecutorClient,
    *,
    gold_runs: int,
    timeout_s: float | None = None,
    repo_root: pathlib.Path | None = None,
    max_in_flight: int = 64,
) -> dict[str, Finding]:
    """instance_id -> what was found. At most `max_in_flight` instances are scored at once; an
    instance the executor refuses or cannot take is a problem, not a crash (and shows no flaky
    test: it was not run)."""
    in_flight = asyncio.Semaphore(max_in_flight)

    async def score(instance: SweInstance, patch: str):
        repo_url = str(repo_root / instance.repo) if repo_root is not None else None
        spec = instance.to_task_spec(
            patch, repo_url=repo_url, timeout_s=timeout_s, task_id=uuid.uuid4().hex
        )
        return await client.score(spec, poll_interval_s=0.5)

    async def check(instance: SweInstance) -> Finding:
        async with in_flight:
            try:
                results = await asyncio.gather(
                    *(score(instance, instance.patch) for _ in range(gold_runs)),
                    score(instance, ""),
                )
            except (ExecutorRequestError, ExecutorUnavailableError) as error:
                return Finding(f"the executor did not take it: {error}", ())
        gold_results = list(results[:-1])
        return Finding(_problem(gold_results, results[-1]), _flaky_tests(gold_results))

    findings = await asyncio.gather(*(check(instance) for instance in instances))
    return {instance.instance_id: finding for instance, finding in zip(instances, findings)}


def summarize(instances: list[SweInstance], findings: dict[str, Finding]) -> dict[str, Any]:
    per_repo: dict[str, Counter] = defaultdict(Counter)
    for instance in instances:
        per_repo[instance.repo]["tasks"] += 1
        per_repo[instance.repo][
            "valid" if findings[instance.instance_id].problem is None else "invalid"
        ] += 1
    return {
        "num_tasks": len(instances),
        "num_valid": sum(finding.problem is None for finding in findings.values()),
        "repositories": {repo: dict(counts) for repo, counts in sorted(per_repo.items())},
        "problems": {k: f.problem for k, f in sorted(findings.items()) if f.problem is not None},
        "flaky_tests": {
            k: list(f.flaky_tests) for k, f in sorted(findings.items()) if f.flaky_tests
        },
    }


def cleaned(
    instances: list[SweInstance], findings: dict[str, Finding]
) -> tuple[list[SweInstance], dict[str, str]]:
    """(instances to keep, in order, with their flaky tests removed from PASS_TO_PASS;
    instance_id -> why it was dropped: one of its FAIL_TO_PASS tests is flaky)."""
    kept: list[SweInstance] = []
    dropped: dict[str, str] = {}
    for instance in instances:
        flaky = set(findings[instance.instance_id].flaky_tests)
        flaky_f2p = [t for t in instance.FAIL_TO_PASS if t in flaky]
        if flaky_f2p:
            dropped[instance.instance_id] = f"FAIL_TO_PASS test(s) flaky: {flaky_f2p}"
            continue
        kept.append(
            dataclasses.replace(
                instance, PASS_TO_PASS=tuple(t for t in instance.PASS_TO_PASS if t not in flaky)
            )
        )
    return kept, dropped


async def _run(args: argparse.Namespace, instances: list[SweInstance]) -> dict[str, Finding]:
    with tempfile.TemporaryDirectory(prefix="validate-") as scratch:
        async with (
            executor_url(
                args.executor_url,
                work_dir=pathlib.Path(scratch) / "executor",
                num_workers=args.workers,
            ) as url,
            ExecutorClient(
                url, auth_token=token_from_environment() if args.executor_url else None
            ) as client,
        ):
            return await validate(
                instances,
                client,
                gold_runs=args.gold_runs,
                timeout_s=args.timeout_s,
                repo_root=caller_path(args.repo_root) if args.repo_root else None,
                max_in_flight=args.max_in_flight,
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.gold_runs < 1 or args.workers < 1 or args.max_in_flight < 1:
        print(
            "validate_swe_tasks: --gold-runs, --workers and --max-in-flight must be >= 1",
            file=sys.stderr,
        )
        return 2
    if args.timeout_s is not None and not 0 < args.timeout_s <= 24 * 3600:
        print(
            f"validate_swe_tasks: --timeout-s must be in (0, 86400] seconds, got {args.timeout_s}",
            file=sys.stderr,
        )
        return 2
    if args.write_cleaned is not None and args.gold_runs < 2:
        print(
            "validate_swe_tasks: --write-cleaned needs --gold-runs >= 2 (one run cannot show "
            "that a test is flaky)",
            file=sys.stderr,
        )
        return 2
    try:
        instances = datasets.get_dataset(args.dataset)(str(caller_path(args.tasks)))
    except (DatasetError, ValueError, OSError) as error:
        print(f"validate_swe_tasks: cannot load {args.tasks}: {error}", file=sys.stderr)
        return 2
    findings = asyncio.run(_run(args, instances))
    summary = summarize(instances, findings)
    for instance_id, problem in summary["problems"].items():
        print(f"INVALID {instance_id}: {problem}")
    for instance_id, tests in summary["flaky_tests"].items():
        print(f"FLAKY {instance_id}: {tests}")
    if args.write_cleaned is not None:
        kept, dropped = cleaned(instances, findings)
        path = caller_path(args.write_cleaned)
        path.write_text("".join(json.dumps(instance.to_row()) + "\n" for instance in kept))
        summary["cleaned"] = {"path": str(path), "num_written": len(kept), "dropped": dropped}
        for instance_id, reason in dropped.items():
            print(f"DROPPED {instance_id}: {reason}")
        print(f"wrote {len(kept)} of {len(instances)} instances to {path}")
    for repo, counts in summary["repositories"].items():
        print(f"{repo}: {counts.get('valid', 0)} of {counts['tasks']} valid")
    print(
        f"total: {summary['num_valid']} of {summary['num_tasks']} valid "
        f"({args.gold_runs} gold run(s) + 1 empty run each)"
    )
    if args.report is not None:
        caller_path(args.report).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["num_valid"] == summary["num_tasks"] else 1


if __name__ == "__main__":
    sys.exit(main())
