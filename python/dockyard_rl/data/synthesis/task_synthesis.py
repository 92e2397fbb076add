"""SWE-smith-style task synthesis: real packages + procedural bugs + their own tests -> SWE tasks.

`await synthesize_package(requirement, config, client, paths)` makes validated tasks from one
package; the CLI (synthesize_swe_tasks.py) runs it per package and writes the JSONL and report.

Per package:
1. sdist_repos: the sdist (pip download) unpacked into a bare git repository with a `pristine`
   commit and a `screening` commit (pristine without its test modules).
2. The test ids are collected with `pytest --collect-only` inside the executor's sandbox, then
   the baseline runs `num_baseline_runs` times through the executor (every test as
   PASS_TO_PASS). Tests that passed every time are the stable baseline; a test that passed in
   some runs but not all is flaky: it is never used (neither PASS_TO_PASS nor a FAIL_TO_PASS
   candidate, since screenings only list the stable baseline), and the package's summary lists
   it (`flaky_tests`). A test that failed in every run is simply not used. A test failing a
   fraction q of runs looks stable with probability (1 - q) ** num_baseline_runs: more runs
   catch rarer flakes. A baseline run whose outcomes are not trusted (timeout, crash, tampering)
   stops the package.
3. Candidates: every mutation site (mutations.py) of every source module, shuffled with the seed
   and interleaved by kind so each kind gets its turn. Each candidate is screened through the
   executor: base `screening`, the mutation as the patch, all test modules as the test_patch, the
   stable baseline as PASS_TO_PASS. Kept when, within the timeout: at least one test failed or
   errored (FAIL_TO_PASS), at least one still passes (PASS_TO_PASS), and no more than
   `max_fail_fraction` of the baseline fails. Tests the mutant made skip (an xfail test that
   passed before) go in neither list. A mutant that breaks the collection of a test module makes
   pytest stop before running anything: every test is missing and the mutant is rejected.
4. The task: a commit with the mutation applied and the FAIL_TO_PASS tests removed
   (holdout.py), named refs/tasks/<instance id>; the gold patch is the reverse of the
   mutation, the test_patch adds the held-out tests back, the test command runs the whole suite
   (so PASS_TO_PASS is checked everywhere, not only in the held-out files).
5. Validation through the executor, in the task's final form: the gold patch resolves it in
   `num_gold_runs` runs; the empty patch (the mutant again, with the same files as screened)
   runs `num_baseline_runs - 1` times and must reproduce the screened outcomes every time (every
   FAIL_TO_PASS test fails and every PASS_TO_PASS test passes); nothing times out. So each kept
   mutant is observed `num_baseline_runs` times like the baseline, and a test that flips on the
   mutant (say it fails a fraction p of runs) becomes FAIL_TO_PASS only if it failed in all of
   them (p ** num_baseline_runs); any flip rejects the mutant (`unstable_outcomes`). So every
   PASS_TO_PASS test passed in all baseline runs, all mutant runs and all gold runs.
6. The problem statement is written from the failing tests and their error lines
   (problem_statements.py).

Candidates are processed in windows of `window_size` concurrent screenings (skipping candidates
of functions that already have `max_tasks_per_function` tasks); results are taken in candidate
order, so the same seed, package and window size give the same tasks whatever the timing or the
number of executor workers.

Not covered: packages whose tests need dependencies the executor's interpreter lacks (the
baseline check stops such a package with a clear error); tests that flip too rarely for
`num_baseline_runs` runs to see (step 2's odds); non-pytest test suites; semantic
deduplication of mutants (two different mutations with the same failing tests are both kept,
at most `max_tasks_per_function` per function).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import pathlib
import random
import shlex
import shutil
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from dockyard_rl.data.schema import SweInstance
from dockyard_rl.data.synthesis import holdout, mutations, problem_statements, sdist_repos
from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.client import (
    ExecutorClient,
    ExecutorRequestError,
    ExecutorUnavailableError,
)
from dockyard_rl.sandbox.task import (
    ApplyMethod,
    FailureKind,
    TaskSpec,
    TaskStatus,
    TestOutcome,
    Verdict,
)
from dockyard_rl.utils.config import is_int, require

logger = logging.getLogger(__name__)

_COLLECT_OUTPUT_BYTES = 32 * 1024 * 1024
# Verdicts whose per-test outcomes come from a trusted report; any other kind reports every
# listed test as missing (grading.py), which says nothing about the tests themselves.
_TRUSTED_KINDS = (FailureKind.NONE, FailureKind.TESTS_FAILED)


@dataclasses.dataclass(frozen=True)
class SynthesisConfig:
    """How tasks are searched for and checked (the CLI flags map onto these keys)."""

    seed: int = 0
    max_tasks_per_package: int = 50
    max_candidates_per_package: int = 400  # mutants screened before giving up on a package
    max_tasks_per_function: int = 2  # spread tasks over the code
    max_fail_fraction: float = 0.5  # of the stable baseline; more is a broken package
    mutation_kinds: tuple[str, ...] = mutations.MUTATION_KINDS
    num_gold_runs: int = 2  # the gold patch must resolve every one of them
    num_baseline_runs: int = 3  # a test must pass in all to be used; each kept
    # mutant is observed as often (module docstring)
    window_size: int = 4  # screenings in flight at once (changes which
    # tasks a budget finds: part of the settings)
    timeout_factor: float = 5.0  # test-run limit = factor x the baseline's time...
    min_timeout_s: float = 60.0  # ...but never less than this

    def __post_init__(self):
        def positive_int(name: str):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, name, f"must be an integer >= 1, got {value!r}")

        require(is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        for name in (
            "max_tasks_per_package",
            "max_candidates_per_package",
            "max_tasks_per_function",
            "num_gold_runs",
            "window_size",
        ):
            positive_int(name)
        require(
            is_int(self.num_baseline_runs) and self.num_baseline_runs >= 2,
            "num_baseline_runs",
            f"must be an integer >= 2 (one run cannot show that a test "
            f"is flaky), got {self.num_baseline_runs!r}",
        )
        require(
            isinstance(self.max_fail_fraction, (int, float)) and 0 < self.max_fail_fraction <= 1,
            "max_fail_fraction",
            f"must be in (0, 1], got {self.max_fail_fraction!r}",
        )
        unknown = [k for k in self.mutation_kinds if k not in mutations.MUTATION_KINDS]
        require(
            bool(self.mutation_kinds) and not unknown,
            "mutation_kinds",
            f"must be a non-empty subset of {list(mutations.MUTATION_KINDS)}, unknown: {unknown}",
        )
        require(
            isinstance(self.timeout_factor, (int, float)) and self.timeout_factor >= 1,
            "timeout_factor",
            f"must be a number >= 1, got {self.timeout_factor!r}",
        )
        require(
            isinstance(self.min_timeout_s, (int, float)) and self.min_timeout_s > 0,
            "min_timeout_s",
            f"must be a positive number of seconds, got {self.min_timeout_s!r}",
        )


@dataclasses.dataclass(frozen=True)
class TaskSynthesisConfig:
    """Recipe sections `synthesis` and `warm_start.synthesis` (null = off): tasks to make when
    the task file (`data.train_path`, `warm_start.train_path`) is missing.

    When set and the task file does not exist, `grpo.run` runs the task synthesizer
    (synthesize_swe_tasks.py) once before training, with the folder of the task file as its
    output folder: it writes `<folder>/tasks.jsonl` (so the file must be named tasks.jsonl), its
    repositories and report, and later runs reuse them (a cache). An interrupted synthesis
    resumes package by package.
    """

    # PyPI requirements (`name==version`; pin them, the tasks depend on the code), absolute
    # paths of sdist archives, or `bundled:toystats` (ships with dockyard_rl).
    packages: tuple[str, ...] = ()
    num_workers: int | None = None  # scoring workers of its executor; null = the CPU count
    search: SynthesisConfig = dataclasses.field(default_factory=SynthesisConfig)

    def __post_init__(self):
        packages = (self.packages,) if isinstance(self.packages, str) else self.packages
        require(
            isinstance(packages, (list, tuple))
            and bool(packages)
            and all(isinstance(p, str) and p.strip() for p in packages),
            "packages",
            f"must be a non-empty list of PyPI requirements (e.g. xmltodict==1.0.4) or sdist "
            f"paths, got {self.packages!r}",
        )
        object.__setattr__(self, "packages", tuple(packages))
        require(
            self.num_workers is None or (is_int(self.num_workers) and self.num_workers >= 1),
            "num_workers",
            f"must be an integer >= 1 or null, got {self.num_workers!r}",
        )


@dataclasses.dataclass(frozen=True)
class SynthesisPaths:
    """Where one run keeps its files."""

    repos_dir: pathlib.Path  # bare repositories, one per package (the tasks' `repo`)
    sdist_dir: pathlib.Path  # downloaded archives (reused by later runs)
    scratch_dir: pathlib.Path  # unpacked sdists and the collection sandbox's work root


@dataclasses.dataclass
class PackageResult:
    """Tasks of one package and what the search saw on the way."""

    name: str
    version: str
    repo: str
    num_collected_tests: int
    num_baseline_passing: int
    flaky_tests: list[str]  # passed in some baseline runs, not all: never used
    num_candidates: int
    num_screened: int
    rejections: Counter
    tasks: list[dict[str, Any]]
    seconds: float

    def summary(self) -> dict[str, Any]:
        f2p = [len(task["FAIL_TO_PASS"]) for task in self.tasks]
        p2p = [len(task["PASS_TO_PASS"]) for task in self.tasks]
        return {
            "package": self.name,
            "version": self.version,
            "repo": self.repo,
            "num_tasks": len(self.tasks),
            "seconds": round(self.seconds, 1),
            "num_collected_tests": self.num_collected_tests,
            "num_baseline_passing": self.num_baseline_passing,
            "num_flaky_tests": len(self.flaky_tests),
            "flaky_tests": list(self.flaky_tests),
            "num_candidates": self.num_candidates,
            "num_screened": self.num_screened,
            "rejections": dict(sorted(self.rejections.items())),
            "tasks_per_kind": dict(
                sorted(Counter(t["synthesis"]["mutation_kind"] for t in self.tasks).items())
            ),
            "fail_to_pass": distribution(f2p),
            "pass_to_pass": distribution(p2p),
        }


def distribution(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "min": ordered[0],
        "p25": ordered[(len(ordered) - 1) // 4],
        "median": statistics.median(ordered),
        "p75": ordered[(3 * (len(ordered) - 1)) // 4],
        "max": ordered[-1],
        "mean": round(statistics.fmean(ordered), 2),
    }


class PackageSkipped(RuntimeError):
    """The package cannot yield tasks (no sdist tests, failing baseline ...); the message says
    why."""


def collect_test_ids(layout: sdist_repos.PackageLayout, scratch_dir: pathlib.Path) -> list[str]:
    """pytest's node ids for `layout.test_paths`, collected in the executor's sandbox."""
    work_root = pathlib.Path(tempfile.mkdtemp(prefix="collect-", dir=scratch_dir)).resolve()
    try:
        worktree = work_root / "tasks" / "repo"
        shutil.copytree(layout.root, worktree, symlinks=True)
        config = pipeline.PipelineConfig()
        limits = dataclasses.replace(config.limits(600.0), max_output_bytes=_COLLECT_OUTPUT_BYTES)
        result, _ = pipeline.run_pytest_sandboxed(
            [
                "-p",
                "no:cacheprovider",
                "--rootdir=.",
                "--collect-only",
                "-q",
                *_import_path_options(layout),
                *layout.test_paths,
            ],
            worktree,
            config,
            work_root,
            limits=limits,
        )
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    node_ids = [
        line.strip()
        for line in result.output.splitlines()
        if "::" in line and not line.startswith((" ", "="))
    ]
    if result.timed_out or result.exit_code != 0 or not node_ids:
        raise PackageSkipped(
            f"{layout.name}: collecting its tests failed (exit "
            f"{result.exit_code}, timed out: {result.timed_out}); pytest said:\n"
            f"{result.output[-3000:]}"
        )
    if result.num_output_bytes > _COLLECT_OUTPUT_BYTES:
        raise PackageSkipped(
            f"{layout.name}: the collection output was cut at "
            f"{_COLLECT_OUTPUT_BYTES} bytes; the suite is too large"
        )
    unknown = sorted({holdout.split_node_id(n)[0] for n in node_ids} - set(layout.test_files))
    if unknown:
        raise PackageSkipped(
            f"{layout.name}: collected tests from files that are not its test "
            f"modules ({unknown[:3]}); their tests could not be held out"
        )
    return sorted(set(node_ids))


def _test_command(layout: sdist_repos.PackageLayout) -> str:
    # The whole suite, so that PASS_TO_PASS covers every module; --tb=short and -rfE keep each
    # failure's error lines compact for the problem statements.
    # --rootdir=. (the worktree): node ids are repository paths even when an ini file sits in
    # the tests folder.
    return " ".join(
        [
            "python",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--rootdir=.",
            "--tb=short",
            "-rfE",
            *(shlex.quote(arg) for arg in (*_import_path_options(layout), *layout.test_paths)),
        ]
    )


def _import_path_options(layout: sdist_repos.PackageLayout) -> list[str]:
    """pytest arguments putting a src layout's folder on sys.path (pytest >= 7)."""
    if not layout.import_paths:
        return []
    return ["-o", "pythonpath=" + " ".join(layout.import_paths)]


def _outcomes(verdict: Verdict) -> dict[str, TestOutcome]:
    return {**verdict.pass_to_pass, **verdict.fail_to_pass}


class _Scorer:
    """Submits specs to the executor with fresh task ids (repeated runs must really re-run)."""

    def __init__(self, client: ExecutorClient, poll_interval_s: float):
        self.client = client
        self.poll_interval_s = poll_interval_s

    async def score(self, spec: TaskSpec) -> Verdict | None:
        """The verdict, or None when the executor gave up with an infrastructure error or could
        not be reached. Raises PackageSkipped when it refuses the task (e.g. 413: its
        max_patch_bytes is below the size of the package's test patch)."""
        spec = dataclasses.replace(spec, task_id=uuid.uuid4().hex)
        try:
            result = await self.client.score(spec, poll_interval_s=self.poll_interval_s)
        except ExecutorRequestError as error:
            raise PackageSkipped(
                f"the executor refused a task of {spec.instance_id}: {error}"
            ) from None
        except ExecutorUnavailableError as error:
            logger.warning("task %s: executor unavailable: %s", spec.instance_id, error)
            return None
        if result.status is not TaskStatus.FINISHED:
            logger.warning("task %s: infrastructure error: %s", spec.instance_id, result.error)
            return None
        return result.verdict


def _candidates(
    repo: sdist_repos.SdistRepository, config: SynthesisConfig
) -> list[tuple[str, mutations.MutationSite]]:
    """(source path, site) pairs: per kind shuffled with the seed, then taken round-robin."""
    by_kind: dict[str, list[tuple[str, mutations.MutationSite]]] = defaultdict(list)
    for path in repo.layout.source_files:
        try:
            sites = mutations.find_mutation_sites(repo.read(repo.pristine, path))
        except ValueError as error:
            logger.info("%s: not mutated (%s)", path, error)
            continue
        for site in sites:
            if site.kind in config.mutation_kinds:
                by_kind[site.kind].append((path, site))
    rng = random.Random(f"{config.seed}:{repo.layout.name}")
    queues = []
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
        queues.append(by_kind[kind])
    ordered = []
    for position in range(max((len(q) for q in queues), default=0)):
        ordered.extend(q[position] for q in queues if position < len(q))
    return ordered


async def synthesize_package(
    requirement: str,
    config: SynthesisConfig,
    client: ExecutorClient,
    paths: SynthesisPaths,
    *,
    poll_interval_s: float = 0.5,
    reserved_repo_names: set[str] | None = None,
) -> PackageResult:
    """Tasks from one package (module docstring). Raises PackageSkipped when the package cannot
    yield any (no tests in the sdist, collection or baseline failing, the executor refusing its
    tasks, or the same package and version already done in this run: pass one
    `reserved_repo_names` set to every call of a run) and SdistError when downloading or
    unpacking fails."""
    reserved_repo_names = set() if reserved_repo_names is None else reserved_repo_names
    start = time.monotonic()
    archive = sdist_repos.fetch_sdist(requirement, paths.sdist_dir)
    layout = sdist_repos.unpack_sdist(archive, paths.scratch_dir / "sdists")
    if layout.repo_name in reserved_repo_names:
        raise PackageSkipped(
            f"{requirement}: {layout.name} {layout.version} was already "
            f"synthesized by an earlier requirement of this run"
        )
    reserved_repo_names.add(layout.repo_name)
    repo = sdist_repos.SdistRepository.create(paths.repos_dir / f"{layout.repo_name}.git", layout)
    logger.info(
        "%s %s: %d source modules, %d test modules (%s)",
        layout.name,
        layout.version,
        len(layout.source_files),
        len(layout.test_files),
        ", ".join(layout.test_paths),
    )
    scorer = _Scorer(client, poll_interval_s)
    test_command = _test_command(layout)
    test_patch_all = repo.screening_test_patch

    collected = collect_test_ids(layout, paths.scratch_dir)
    baseline_spec = TaskSpec(
        instance_id=f"{layout.slug}__baseline",
        repo=str(repo.path),
        base_commit=repo.screening,
        patch="",
        test_patch=test_patch_all,
        fail_to_pass=(),
        pass_to_pass=tuple(collected),
        test_command=test_command,
        timeout_s=1800.0,
    )
    baselines = await asyncio.gather(
        *(scorer.score(baseline_spec) for _ in range(config.num_baseline_runs))
    )
    if any(v is None for v in baselines):
        raise PackageSkipped(f"{layout.name}: the executor could not run the baseline")
    for verdict in baselines:
        if verdict.failure_kind not in _TRUSTED_KINDS:
            raise PackageSkipped(
                f"{layout.name}: a baseline run's outcomes are not trusted "
                f"({verdict.failure_kind.value}: {verdict.failure_detail}); "
                f"log tail:\n{verdict.log_tail[-2000:]}"
            )
    passing = [{t for t, o in _outcomes(v).items() if o is TestOutcome.PASSED} for v in baselines]
    stable = sorted(set.intersection(*passing))
    flaky = sorted(set.union(*passing) - set(stable))
    if len(stable) < 2:
        raise PackageSkipped(
            f"{layout.name}: only {len(stable)} of {len(collected)} tests pass "
            f"at baseline (missing test dependencies in the executor's "
            f"interpreter?); log tail:\n{baselines[0].log_tail[-2000:]}"
        )
    baseline_s = max(v.timings_s.get("tests", 0.0) for v in baselines)
    timeout_s = max(config.min_timeout_s, config.timeout_factor * baseline_s)
    logger.info(
        "%s: %d tests collected, %d pass stably, %d flaky; baseline %.1f s, timeout %.0f s",
        layout.name,
        len(collected),
        len(stable),
        len(flaky),
        baseline_s,
        timeout_s,
    )
    if flaky:
        logger.warning(
            "%s: %d flaky test(s) passed in some of %d baseline runs but not all; "
            "they are never used: %s%s",
            layout.name,
            len(flaky),
            config.num_baseline_runs,
            ", ".join(flaky[:10]),
            " ..." if len(flaky) > 10 else "",
        )

    candidates = _candidates(repo, config)
    rejections: Counter = Counter()
    tasks: list[dict[str, Any]] = []
    per_function: Counter = Counter()
    seen_patches: set[str] = set()
    num_screened = 0
    position = 0
    search = _Search(repo, config, scorer, test_command, test_patch_all, stable, timeout_s)
    while (
        len(tasks) < config.max_tasks_per_package
        and num_screened < config.max_candidates_per_package
        and position < len(candidates)
    ):
        # The next window: candidates whose function still has room, in candidate order.
        window = []
        while (
            len(window) < config.window_size
            and position < len(candidates)
            and num_screened + len(window) < config.max_candidates_per_package
        ):
            path, site = candidates[position]
            position += 1
            if per_function[(path, site.function)] >= config.max_tasks_per_function:
                rejections["function_quota"] += 1
            else:
                window.append((path, site))
        outcomes = await asyncio.gather(
            *(search.try_candidate(path, site, seen_patches) for path, site in window)
        )
        num_screened += len(window)
        for (path, site), (task, reason) in zip(window, outcomes):
            if task is None:
                rejections[reason] += 1
            elif (
                len(tasks) < config.max_tasks_per_package
                and per_function[(path, site.function)] < config.max_tasks_per_function
            ):
                tasks.append(task)
                per_function[(path, site.function)] += 1
            else:
                rejections["quota_reached"] += 1
        if window:
            logger.info(
                "%s: %d screened, %d tasks, rejections %s",
                layout.name,
                num_screened,
                len(tasks),
                dict(rejections),
            )
    return PackageResult(
        name=layout.name,
        version=layout.version,
        repo=str(repo.path),
        num_collected_tests=len(collected),
        num_baseline_passing=len(stable),
        flaky_tests=flaky,
        num_candidates=len(candidates),
        num_screened=num_screened,
        rejections=rejections,
        tasks=tasks,
        seconds=time.monotonic() - start,
    )


class _Search:
    """Screens one candidate and, when it qualifies, builds and validates its task."""

    def __init__(
        self,
        repo: sdist_repos.SdistRepository,
        config: SynthesisConfig,
        scorer: _Scorer,
        test_command: str,
        test_patch_all: str,
        stable: list[str],
        timeout_s: float,
    ):
        self.repo = repo
        self.config = config
        self.scorer = scorer
        self.test_command = test_command
        self.test_patch_all = test_patch_all
        self.stable = tuple(stable)
        self.timeout_s = timeout_s

    async def try_candidate(
        self, path: str, site: mutations.MutationSite, seen: set[str]
    ) -> tuple[dict[str, Any] | None, str]:
        """(task row, "") when the candidate becomes a validated task, else (None, reason)."""
        repo, layout = self.repo, self.repo.layout
        original = repo.read(repo.pristine, path)
        try:
            mutated = mutations.apply_mutation(original, site)
            compile(mutated, path, "exec")
        except (ValueError, SyntaxError):
            return None, "mutation_invalid"
        mutant = repo.commit_files(repo.pristine, {path: mutated}, f"mutant of {path}")
        mutation_patch = repo.diff(repo.pristine, mutant, [path])
        digest = hashlib.sha256(mutation_patch.encode()).hexdigest()
        if digest in seen:
            return None, "duplicate"
        seen.add(digest)
        instance_id = f"{layout.slug}__{layout.safe_version}.{site.kind}.{digest[:10]}"

        # Screening: the full suite against the mutated code.
        screened = await self.scorer.score(
            TaskSpec(
                instance_id=instance_id,
                repo=str(repo.path),
                base_commit=repo.screening,
                patch=mutation_patch,
                test_patch=self.test_patch_all,
                fail_to_pass=(),
                pass_to_pass=self.stable,
                test_command=self.test_command,
                timeout_s=self.timeout_s,
            )
        )
        if screened is None:
            return None, "infra_error"
        if screened.timed_out:
            return None, "timeout"
        if screened.apply_method is not ApplyMethod.GIT_APPLY:
            return None, "apply_failed"
        outcomes = _outcomes(screened)
        # A test the mutant made skip (an xfail test that passed before) says nothing clear: it
        # goes in neither list. Missing tests (a collection error stops the whole session) leave
        # no failing test, so such a mutant is rejected below.
        fail_to_pass = sorted(
            t for t, o in outcomes.items() if o in (TestOutcome.FAILED, TestOutcome.ERROR)
        )
        pass_to_pass = sorted(t for t, o in outcomes.items() if o is TestOutcome.PASSED)
        if not fail_to_pass:
            return None, "no_test_fails"
        if not pass_to_pass:
            return None, "no_test_passes"
        if len(fail_to_pass) > self.config.max_fail_fraction * len(self.stable):
            return None, "too_many_fail"

        # The task's own commit: mutation in, FAIL_TO_PASS tests out.
        by_file: dict[str, list[str]] = defaultdict(list)
        for node_id in fail_to_pass:
            by_file[holdout.split_node_id(node_id)[0]].append(node_id)
        changes: dict[str, str | None] = {path: mutated}
        try:
            for test_file, node_ids in sorted(by_file.items()):
                if test_file not in layout.test_files:
                    return None, "holdout_failed"
                changes[test_file] = holdout.remove_tests(
                    repo.read(repo.pristine, test_file), node_ids
                )
        except holdout.HoldoutError:
            return None, "holdout_failed"
        base_commit = repo.commit_files(
            repo.pristine, changes, f"task {instance_id}", ref=f"refs/tasks/{instance_id}"
        )
        gold_patch = repo.diff(base_commit, repo.pristine, [path])
        test_patch = repo.diff(base_commit, repo.pristine, sorted(by_file))
        task_spec = TaskSpec(
            instance_id=instance_id,
            repo=str(repo.path),
            base_commit=base_commit,
            patch=gold_patch,
            test_patch=test_patch,
            fail_to_pass=tuple(fail_to_pass),
            pass_to_pass=tuple(pass_to_pass),
            test_command=self.test_command,
            timeout_s=self.timeout_s,
        )

        # Validation in the final form: gold resolves every time, and the empty patch (the
        # mutant again) reproduces the screened outcomes exactly in each of its runs, so the
        # mutant is observed num_baseline_runs times in all, like the baseline: a test that
        # flips on the mutant is caught as often as a flaky baseline test would be.
        num_gold_runs = self.config.num_gold_runs
        runs = await asyncio.gather(
            *(self.scorer.score(task_spec) for _ in range(num_gold_runs)),
            *(
                self.scorer.score(dataclasses.replace(task_spec, patch=""))
                for _ in range(self.config.num_baseline_runs - 1)
            ),
        )
        if any(run is None for run in runs):
            return None, "infra_error"
        if any(run.timed_out for run in runs):
            return None, "timeout"
        gold_runs, empty_runs = runs[:num_gold_runs], runs[num_gold_runs:]
        if not all(run.resolved for run in gold_runs):
            return None, "gold_not_resolved"
        for empty_run in empty_runs:
            if (
                empty_run.resolved
                or any(o is TestOutcome.PASSED for o in empty_run.fail_to_pass.values())
                or any(o is not TestOutcome.PASSED for o in empty_run.pass_to_pass.values())
            ):
                return None, "unstable_outcomes"

        statement = problem_statements.write_problem_statement(
            layout.name, layout.version, fail_to_pass, screened.log_tail
        )
        instance = SweInstance(
            instance_id=instance_id,
            repo=str(repo.path),
            base_commit=base_commit,
            patch=gold_patch,
            test_patch=test_patch,
            FAIL_TO_PASS=tuple(fail_to_pass),
            PASS_TO_PASS=tuple(pass_to_pass),
            problem_statement=statement,
            version=layout.version,
            environment_setup_commit=repo.pristine,
            test_command=self.test_command,
        )
        row = instance.to_row()
        # Not part of the SWE-bench schema (loaders ignore it); it locates the bug, so prompts
        # must never include it.
        row["synthesis"] = {
            "package": layout.name,
            "mutation_kind": site.kind,
            "file": path,
            "function": site.function,
            "line": site.line,
            "description": site.description,
            "test_seconds": round(max(r.timings_s.get("tests", 0.0) for r in runs), 2),
        }
        return row, ""
