"""Scoring one task: `score_task(spec, config, work_root) -> Verdict`.

Steps (each module's docstring has the details and the security reasoning):
1. repo_cache: the repository's cached bare mirror -> a fresh single-commit checkout of
   base_commit in `<work_root>/tasks/<random>/repo` (no remotes, refs, tags or future history).
2. integrity (patch headers) and screening: a patch that names protected files (the test
   patch's files, the files of the FAIL_TO_PASS / PASS_TO_PASS tests, test-runner config,
   `.git`, absolute or `..` paths) is an integrity violation: not applied, no test runs.
   screening.py flags references to the runner's internals, the report, the process arguments,
   exit hooks and forced exits (`Verdict.screening_flags`, for the reward pipeline; not a
   failure by itself).
3. apply: git apply -> git apply --3way -> patch --fuzz, resetting between tries; binary content
   over `max_binary_patch_bytes` is refused before any applier runs (PATCH_TOO_LARGE). Failure
   scores 0 (PATCH_NOT_APPLIED); no test runs.
4. tree_audit: the tree AFTER the patch, inspected on disk (not from headers): symlinks,
   bytecode, package metadata, modules shadowing the runner, runner configuration (parsed),
   plugin declarations and hooks, protected test files. A violation scores 0, no test runs. A
   patched tree larger than `worktree_size_bytes` is DISK_LIMIT.
5. The held-out test files are restored from base_commit, then the gold test_patch is applied
   with `git apply`. When that fails, it is retried on a fresh checkout without the patch: if it
   applies there, the patch broke it (BREAKS_TEST_PATCH, the patch's failure); if not, the task
   itself is invalid (ValueError).
6. runner: pytest runs under bubblewrap on a copy of the worktree in a size-capped tmpfs, with
   the runner's isolation (runner.py, runner_bootstrap.py); default arguments: the files the
   test patch touches. A task's `test_command` must be a pytest invocation the runner can
   isolate (runner.pytest_arguments; checked at submission too).
7. grading: the streamed records, the report, the canaries and the exit status are cross-checked
   and graded SWE-bench style (grading.py), which names the FailureKind.
The task directory is removed afterwards by cleanup.remove_tree, which never raises (a leftover
is moved to `<work_root>/trash` and removed at the next start).

Errors: `InfrastructureError` for what the patch cannot cause (clone/fetch failure, bubblewrap
missing or unable to start, disk errors on the executor's side, a trusted checkout git cannot
read) — the service retries those. `ValueError` for a malformed task (repo or base_commit not
acceptable, a test_patch that does not apply at base_commit, a test_command the runner cannot
isolate): retrying cannot help. Everything the patch or the tests do (crash, hang, fork bomb,
flood of output, deep trees, full disks, forged or rewritten reports, a test patch it blocks)
ends in a Verdict with a FailureKind, never an exception: a patch whose text is not valid
Unicode or that makes a patch parser raise is PATCH_INVALID, and a grader that raises on the run's
evidence gives REPORT_UNTRUSTED.

No git command runs in the worktree after untrusted code could have touched it: the tests run on
a copy inside the sandbox and never write the host's worktree.

Limits: a task's `timeout_s` replaces `PipelineConfig.timeout_s` for its test run; the other
limits always come from the config. A run killed at the wall clock (TIMEOUT) or at RLIMIT_CPU
(CPU_LIMIT) is the patch's failure, reward 0, like any other (a signal-like exit status is
REPORT_UNTRUSTED). It is masked (`Verdict.limit_outcome`, which the environment drops from the
loss) only when the task's baseline — base_commit with the gold test patch and no agent patch,
run the same way under the same limits — hits a limit on this executor too; the baseline runs
once per task identity and limits in this process (docs/sandbox.md, "Runs killed at a limit").
Neither the patch's exit status nor its duration nor the host's load (which the patch's own
processes drive) ever masks a verdict. A base_commit the repository does not have (after one
refresh of the mirror) is an InfrastructureError, since a stale mirror looks the same.

Not covered: the executor's interpreter and site-packages are the test environment:
per-repository environments (SWE-bench's images) are out of scope here. What in-process
tampering remains possible is in docs/sandbox.md (threat model).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import pathlib
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import unidiff

from dockyard_rl.sandbox import apply as apply_lib
from dockyard_rl.sandbox import (
    capability_screen,
    cleanup,
    grading,
    images,
    isolation,
    protected_paths,
    repo_cache,
    repo_envs,
    runner,
    screening,
    swebench_harness,
    tree_audit,
)
from dockyard_rl.sandbox.task import ApplyMethod, FailureKind, TaskSpec, TestOutcome, Verdict
from dockyard_rl.utils.config import require, require_bool

logger = logging.getLogger(__name__)


class InfrastructureError(RuntimeError):
    """Scoring could not finish for reasons outside the patch; safe to retry."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How one task is scored; build with `from_dict(PipelineConfig, data, "pipeline")`."""

    timeout_s: float = 1800.0  # test-run wall clock when the task names none
    cpu_time_s: int = 1800  # RLIMIT_CPU per process in the sandbox
    memory_bytes: int = 4 * 1024**3  # RLIMIT_AS per process
    max_num_processes: int = 256  # RLIMIT_NPROC for the sandbox's uid
    max_file_size_bytes: int = 256 * 1024**2  # RLIMIT_FSIZE
    max_num_open_files: int = 1024  # RLIMIT_NOFILE
    max_log_bytes: int = 64 * 1024  # head + tail of the test output kept in the verdict
    tmp_size_bytes: int = 512 * 1024**2  # the sandbox's private /tmp (tmpfs)
    worktree_size_bytes: int = 1024**3  # the tmpfs the tests' copy of the worktree lives in
    max_report_bytes: int = 32 * 1024**2  # the JUnit report and the runner's record stream
    max_report_testcases: int = 200_000
    max_binary_patch_bytes: int = 1024**2  # declared size of a patch's binary content
    cache_dir: str | None = None  # repository mirrors; None -> <work_root>/mirrors
    image_cache_dir: str | None = None  # unpacked task images; None -> <work_root>/images
    image_cache_max_bytes: int = 20 * 1024**3  # LRU-evicted above this (images in use stay)
    repo_env_dir: str | None = None  # per-repository venvs; None -> <work_root>/envs
    # Baseline outcomes remembered per process (a run killed at a limit is masked only when
    # its task's baseline hits a limit too; see _Scoring.charge_limit).
    max_baseline_entries: int = 4096
    # Step 4b, the AST capability screen. Off only to test the run-time layers on their own
    # (pipeline_test): in production a patch it would refuse then runs.
    capability_screen: bool = True

    def __post_init__(self):
        def positive_int(name: str, what: str):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                name,
                f"must be a positive integer ({what}), got {value!r}",
            )

        require(
            isinstance(self.timeout_s, (int, float))
            and not isinstance(self.timeout_s, bool)
            and 0 < self.timeout_s <= 24 * 3600,
            "timeout_s",
            f"must be a number of seconds in (0, 86400], got {self.timeout_s!r}",
        )
        positive_int("cpu_time_s", "CPU seconds per process")
        positive_int("memory_bytes", "bytes of address space per process")
        positive_int("max_num_processes", "processes of the sandbox user")
        positive_int("max_file_size_bytes", "bytes per written file")
        positive_int("max_num_open_files", "file descriptors per process")
        positive_int("max_log_bytes", "bytes of test output kept")
        positive_int("tmp_size_bytes", "bytes of the sandbox's /tmp")
        positive_int("worktree_size_bytes", "bytes of the tmpfs holding the tests' worktree")
        positive_int("max_report_bytes", "bytes of the test report and of the result stream")
        positive_int("max_report_testcases", "testcases in one report")
        positive_int("max_binary_patch_bytes", "bytes of binary content in a patch")
        positive_int("image_cache_max_bytes", "bytes of unpacked task images kept")
        positive_int("max_baseline_entries", "task baselines remembered per process")
        require_bool(self, "capability_screen")
        require(
            self.memory_bytes >= 64 * 1024**2,
            "memory_bytes",
            f"must be at least 64 MiB (a Python interpreter needs more), got {self.memory_bytes}",
        )
        require(
            self.max_num_open_files >= 16,
            "max_num_open_files",
            f"must be at least 16 (an interpreter needs a few), got {self.max_num_open_files}",
        )
        require(
            self.cache_dir is None or (isinstance(self.cache_dir, str) and bool(self.cache_dir)),
            "cache_dir",
            f"must be a directory path or null (= <work_root>/mirrors), got {self.cache_dir!r}",
        )

    def limits(self, timeout_s: float | None) -> isolation.SandboxLimits:
        return isolation.SandboxLimits(
            wall_timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
            cpu_s=self.cpu_time_s,
            memory_bytes=self.memory_bytes,
            num_processes=self.max_num_processes,
            file_size_bytes=self.max_file_size_bytes,
            num_open_files=self.max_num_open_files,
            max_output_bytes=self.max_log_bytes,
            tmp_size_bytes=self.tmp_size_bytes,
        )

    def runner_limits(self, timeout_s: float | None) -> runner.RunnerLimits:
        return runner.RunnerLimits(
            sandbox=self.limits(timeout_s),
            worktree_size_bytes=self.worktree_size_bytes,
            max_report_bytes=self.max_report_bytes,
            max_report_testcases=self.max_report_testcases,
        )

    def cache_path(self, work_root: pathlib.Path) -> pathlib.Path:
        return _folder(self.cache_dir, work_root / "mirrors")

    def image_cache_path(self, work_root: pathlib.Path) -> pathlib.Path:
        return _folder(self.image_cache_dir, work_root / "images")

    def repo_env_path(self, work_root: pathlib.Path) -> pathlib.Path:
        return _folder(self.repo_env_dir, work_root / "envs")


def _folder(setting: str | None, default: pathlib.Path) -> pathlib.Path:
    return default if setting is None else pathlib.Path(setting).expanduser().resolve()


# One image cache and one environment cache per folder and process: their locks and leases only
# work when every task scored in the process goes through the same object.
_caches_lock = threading.Lock()
_caches: dict[tuple[type, pathlib.Path], object] = {}


def _one_per_folder(kind: type, path: pathlib.Path, make: Callable[[], object]):
    with _caches_lock:
        if (kind, path) not in _caches:
            _caches[(kind, path)] = make()
        return _caches[(kind, path)]


def image_cache(config: PipelineConfig, work_root: pathlib.Path) -> images.ImageCache:
    """The process's one ImageCache for the config's cache folder (created on first use)."""
    path = config.image_cache_path(pathlib.Path(work_root).expanduser().resolve())
    return _one_per_folder(
        images.ImageCache, path, lambda: images.ImageCache(path, config.image_cache_max_bytes)
    )


def repo_env_cache(config: PipelineConfig, work_root: pathlib.Path) -> repo_envs.RepoEnvCache:
    """The process's one RepoEnvCache for the config's folder (created on first use)."""
    path = config.repo_env_path(pathlib.Path(work_root).expanduser().resolve())
    return _one_per_folder(repo_envs.RepoEnvCache, path, lambda: repo_envs.RepoEnvCache(path))


_sandbox_checked = threading.Lock()
_sandbox_ok = False


def _ensure_sandbox() -> None:
    """Probes bubblewrap once per process (a failed probe is retried on the next task)."""
    global _sandbox_ok
    with _sandbox_checked:
        if _sandbox_ok:
            return
        try:
            isolation.check_available()
        except isolation.SandboxUnavailableError as error:
            raise InfrastructureError(str(error)) from error
        _sandbox_ok = True


def test_files_of(test_patch: str) -> tuple[list[str], list[str]]:
    """(every file test_patch names — old and new names —, the ones that exist after applying
    it) as repository paths. The test patch is trusted input, so unidiff's parse is enough."""
    names: set[str] = set()
    kept: set[str] = set()
    try:
        patch_set = unidiff.PatchSet(test_patch)
    except (unidiff.UnidiffParseError, UnicodeError, ValueError, IndexError) as error:
        raise ValueError(f"test_patch: cannot be parsed as a unified diff: {error}") from None
    for patched_file in patch_set:
        for raw in (patched_file.source_file, patched_file.target_file):
            name = protected_paths.normalize_path(raw) if raw else None
            if name:
                names.add(os.path.normpath(name))
        target = protected_paths.normalize_path(patched_file.target_file or "")
        if target and not patched_file.is_removed_file:
            kept.add(os.path.normpath(target))
    if not names:
        raise ValueError("test_patch: names no file (is it a unified diff?)")
    return sorted(names), sorted(kept)


def protected_test_files(spec: TaskSpec, all_test_files: list[str]) -> list[str]:
    """The repository files the task's tests live in: the test patch's files and the module of
    every FAIL_TO_PASS / PASS_TO_PASS node id. The patch may not touch them."""
    files = set(all_test_files)
    for test_id in (*spec.fail_to_pass, *spec.pass_to_pass):
        path = test_id.split("::", 1)[0]
        if path.endswith(".py"):
            files.add(os.path.normpath(path))
    return sorted(files)


def run_pytest_sandboxed(
    pytest_args: list[str],
    worktree: pathlib.Path,
    config: PipelineConfig,
    work_root: pathlib.Path,
    *,
    limits: isolation.SandboxLimits | None = None,
    canaries: bool = False,
) -> tuple[isolation.SandboxResult, grading.RunEvidence]:
    """Runs pytest with `pytest_args` on `worktree` the way scoring does (step 6 of the module
    docstring; no canaries by default, e.g. for collecting test ids). `limits` default to the
    config's. Raises InfrastructureError when the sandbox cannot start."""
    runner_limits = config.runner_limits(None)
    if limits is not None:
        runner_limits = dataclasses.replace(runner_limits, sandbox=limits)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="runner-", dir=worktree.parent))
    try:
        return runner.run_pytest(
            pytest_args,
            worktree,
            scratch,
            runner_limits,
            canaries=canaries,
            hidden_paths=[work_root, config.cache_path(work_root)],
        )
    except isolation.SandboxUnavailableError as error:
        raise InfrastructureError(str(error)) from error
    finally:
        cleanup.remove_tree(scratch)


# A test process killed by RLIMIT_CPU (SIGXCPU) exits with 128 + the signal's number inside
# the sandbox; a negative status is the same signal seen by a direct parent.
_CPU_LIMIT_EXIT = 128 + signal.SIGXCPU
_CPU_LIMIT_EXITS = (_CPU_LIMIT_EXIT, -signal.SIGXCPU)
# The failure kinds of a run killed at a limit: the only ones charge_limit may mask.
_LIMIT_KINDS = (FailureKind.TIMEOUT, FailureKind.CPU_LIMIT)


def _limit_kind(timed_out: bool, exit_code: int | None) -> FailureKind | None:
    """The limit that ended a test run: TIMEOUT (wall clock), CPU_LIMIT (RLIMIT_CPU), or None.
    A patch can forge the CPU status (it can send itself SIGXCPU), which is why the status only
    names the failure and never masks it (_Scoring.charge_limit)."""
    if timed_out:
        return FailureKind.TIMEOUT
    if exit_code in _CPU_LIMIT_EXITS:
        return FailureKind.CPU_LIMIT
    return None


def _patch_text_problem(patch: str) -> str:
    """Why the patch's text cannot be handled as text ("" when it can): JSON lets a client send
    lone surrogates, which no file, diff tool or UTF-8 encoder accepts."""
    try:
        patch.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"the patch is not valid Unicode text (an unpaired surrogate at offset {error.start})"
        )
    return ""


def _grade_safely(grade: Callable[[], grading.Grade]) -> grading.Grade:
    """`grade()`, or REPORT_UNTRUSTED when it raises: the grader reads what the sandbox sent,
    which the patch's code controls, so a grader crash is the patch's failure, not an
    infrastructure error (logged: it is still a grader bug to fix)."""
    try:
        return grade()
    except Exception as error:
        logger.exception("the grader raised on a run's evidence")
        return grading.Grade(
            resolved=False,
            reward=0.0,
            fail_to_pass={},
            pass_to_pass={},
            failure_kind=FailureKind.REPORT_UNTRUSTED,
            detail=f"the run's evidence could not be graded ({type(error).__name__})",
        )


def _baseline_key(spec: TaskSpec, limits: runner.RunnerLimits) -> tuple:
    """What a task's baseline run depends on: the repository at base_commit, the held-out
    tests, how they are run, where, and under which limits (not the agent's patch)."""
    tests = hashlib.sha256()
    for part in (spec.test_patch, *spec.fail_to_pass, "", *spec.pass_to_pass):
        tests.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return (
        spec.repo,
        spec.base_commit,
        tests.hexdigest(),
        spec.test_command,
        spec.test_harness,
        spec.image,
        spec.repo_path,
        spec.requirements,
        limits,
    )


class _BaselineCache:
    """Baseline outcomes (the limit hit, or None) by _baseline_key, least recently used dropped
    past `max_entries`. Concurrent scorings of one task wait for a single baseline run; a run
    that raises is not remembered (the next scoring tries again)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple, FailureKind | None] = (
            collections.OrderedDict()
        )
        self._running: dict[tuple, threading.Lock] = {}

    def get_or_run(
        self, key: tuple, max_entries: int, run: Callable[[], FailureKind | None]
    ) -> FailureKind | None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            key_lock = self._running.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._entries:
                    return self._entries[key]
            outcome = run()
            with self._lock:
                self._entries[key] = outcome
                while len(self._entries) > max_entries:
                    self._entries.popitem(last=False)
                self._running.pop(key, None)
            return outcome


# One per process: a baseline says something about this executor only.
_BASELINES = _BaselineCache()


def _verdict(
    spec: TaskSpec,
    *,
    apply_method: ApplyMethod,
    kind: FailureKind,
    detail: str,
    violation: tuple[str, ...] = (),
    grade: grading.Grade | None = None,
    exit_code: int | None = None,
    timed_out: bool = False,
    flags: tuple[str, ...] = (),
    timings: dict[str, float],
    log_tail: str,
) -> Verdict:
    verdict = _graded_verdict(
        spec,
        apply_method=apply_method,
        kind=kind,
        detail=detail,
        violation=violation,
        grade=grade,
        exit_code=exit_code,
        timed_out=timed_out,
        flags=flags,
        timings=timings,
        log_tail=log_tail,
    )
    # A run that ended at the CPU-time limit without anything more specific to say (tampering,
    # a full disk) is CPU_LIMIT; grading itself names TIMEOUT. Neither is masked here: only
    # _Scoring.charge_limit may mask, and only on the baseline's evidence.
    if (
        not verdict.resolved
        and verdict.failure_kind is FailureKind.REPORT_UNTRUSTED
        and _limit_kind(timed_out, exit_code) is FailureKind.CPU_LIMIT
    ):
        verdict = dataclasses.replace(
            verdict,
            failure_kind=FailureKind.CPU_LIMIT,
            failure_detail=f"the test run was killed at the CPU-time limit (exit status "
            f"{exit_code}); {verdict.failure_detail}",
        )
    # File names the patch chose reach the verdict through the checks' findings; as decoded
    # from disk they may hold lone surrogates, which no UTF-8 consumer downstream accepts.
    return dataclasses.replace(
        verdict,
        integrity_violation=tuple(_valid_text(name) for name in verdict.integrity_violation),
        failure_detail=_valid_text(verdict.failure_detail),
        screening_flags=tuple(_valid_text(flag) for flag in verdict.screening_flags),
        log_tail=_valid_text(verdict.log_tail),
    )


def _valid_text(text: str) -> str:
    """`text` encodable as UTF-8: a byte that was not UTF-8 in a file name (surrogateescape)
    becomes `\\xNN`, like tree_audit shows it; any other lone surrogate `\\udNNN`."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _graded_verdict(
    spec: TaskSpec,
    *,
    apply_method: ApplyMethod,
    kind: FailureKind,
    detail: str,
    violation: tuple[str, ...],
    grade: grading.Grade | None,
    exit_code: int | None,
    timed_out: bool,
    flags: tuple[str, ...],
    timings: dict[str, float],
    log_tail: str,
) -> Verdict:
    if grade is None:
        missing_f2p = {test_id: TestOutcome.MISSING for test_id in spec.fail_to_pass}
        missing_p2p = {test_id: TestOutcome.MISSING for test_id in spec.pass_to_pass}
        return Verdict(
            resolved=False,
            reward=0.0,
            fail_to_pass=missing_f2p,
            pass_to_pass=missing_p2p,
            apply_method=apply_method,
            integrity_violation=violation,
            test_exit_code=exit_code,
            timed_out=timed_out,
            timings_s=timings,
            log_tail=log_tail,
            failure_kind=kind,
            failure_detail=detail,
            screening_flags=flags,
        )
    return Verdict(
        resolved=grade.resolved,
        reward=grade.reward,
        fail_to_pass=grade.fail_to_pass,
        pass_to_pass=grade.pass_to_pass,
        apply_method=apply_method,
        integrity_violation=violation,
        test_exit_code=exit_code,
        timed_out=timed_out,
        timings_s=timings,
        log_tail=log_tail,
        failure_kind=grade.failure_kind,
        failure_detail=grade.detail,
        screening_flags=tuple(sorted(set(flags) | set(grade.notes))),
    )


def remove_stale_task_dirs(work_root: pathlib.Path) -> int:
    """Removes what a killed executor left under `work_root` (cleanup.remove_stale_task_dirs:
    never raises, whatever the leftovers hold). Call once at start-up; one executor owns a work
    root."""
    return cleanup.remove_stale_task_dirs(pathlib.Path(work_root).expanduser())


def score_task(spec: TaskSpec, config: PipelineConfig, work_root: pathlib.Path) -> Verdict:
    """Scores `spec` (module docstring). Raises InfrastructureError (retry) or ValueError (bad
    task); every outcome of the patch itself is a Verdict."""
    start = time.monotonic()
    timings: dict[str, float] = {}
    _ensure_sandbox()
    work_root = pathlib.Path(work_root).expanduser().resolve()
    cache = repo_cache.RepoCache(config.cache_path(work_root))
    all_test_files, test_files = test_files_of(spec.test_patch)
    harness = (
        swebench_harness.parse_harness(spec.test_harness) if spec.test_harness is not None else None
    )
    pytest_args = runner.pytest_arguments(spec.test_command)
    if pytest_args is None:
        pytest_args = runner.default_pytest_arguments(test_files)
    try:
        (work_root / "tasks").mkdir(parents=True, exist_ok=True)
        task_dir = pathlib.Path(tempfile.mkdtemp(prefix="task-", dir=work_root / "tasks"))
    except OSError as error:
        raise InfrastructureError(
            f"cannot create a task directory under {work_root}: {error}"
        ) from error
    try:
        scoring = _Scoring(spec, config, work_root, cache, task_dir, timings, start, harness)
        if spec.requirements:
            with repo_env_cache(config, work_root).lease(spec.requirements) as env:
                scoring.repo_env = env.root
                scoring.lap("environment")
                return scoring.run(all_test_files, pytest_args)
        if spec.image is None:
            return scoring.run(all_test_files, pytest_args)
        with image_cache(config, work_root).lease(spec.image) as image:
            scoring.use_image(image)
            return scoring.run(all_test_files, pytest_args)
    except images.ImageUnavailableError as error:
        raise InfrastructureError(str(error)) from error
    except (
        OSError,
        tree_audit.TreeAuditError,
        subprocess.CalledProcessError,
        subprocess.TimeoutExpired,
    ) as error:
        # Disk full, git failing on our own trusted checkout, ...: not the patch's doing (the
        # patch's own effects are contained in the sandbox or judged by the checks above;
        # pipeline_test's "infra" tests try what a patch can do to these paths).
        raise InfrastructureError(f"disk or process error while scoring: {error}") from error
    finally:
        problem = cleanup.remove_tree(task_dir, trash_dir=cleanup.trash_path(work_root))
        if problem:
            logger.warning("task directory %s not fully removed: %s", task_dir, problem)


class _Scoring:
    """One run of the module docstring's steps 1-7 in a fresh task directory."""

    def __init__(
        self,
        spec: TaskSpec,
        config: PipelineConfig,
        work_root: pathlib.Path,
        cache: repo_cache.RepoCache,
        task_dir: pathlib.Path,
        timings: dict[str, float],
        start: float,
        harness: swebench_harness.Harness | None,
    ):
        self.spec, self.config, self.work_root, self.cache = spec, config, work_root, cache
        self.harness = harness
        self.task_dir, self.timings, self.start = task_dir, timings, start
        self.worktree = task_dir / "repo"
        self.scratch = task_dir / "scratch"
        self.flags: tuple[str, ...] = ()
        self.phase_start = time.monotonic()
        self.image: images.Image | None = None
        self.interpreter: str | None = None
        self.repo_env: pathlib.Path | None = None  # a per-repository venv (repo_envs.py)

    def use_image(self, image: images.Image) -> None:
        """Runs the tests in `image` (raises images.ImageError when it cannot host them)."""
        self.interpreter = runner.image_interpreter(image, self.spec.test_command)
        self.image = image
        self.lap("image")

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.phase_start
        self.phase_start = now

    def finish(self, **kwargs) -> Verdict:
        self.timings["total"] = time.monotonic() - self.start
        return _verdict(self.spec, timings=self.timings, flags=self.flags, **kwargs)

    def checkout(self, dest: pathlib.Path) -> str:
        try:
            self.cache.checkout(self.spec.repo, self.spec.base_commit, dest)
        except repo_cache.RepoCacheError as error:
            raise InfrastructureError(str(error)) from error
        commit = apply_lib.git(dest, "rev-parse", "HEAD", check=False).stdout.strip()
        if not commit:
            raise InfrastructureError(f"checkout of {self.spec.base_commit} in {dest} has no HEAD")
        return commit

    def run(self, all_test_files: list[str], pytest_args: list[str]) -> Verdict:
        spec, config = self.spec, self.config
        # A patch that is not a well-formed diff is the patch's failure before anything runs
        # (protected_paths.parse_patch reads it in linear time and never raises).
        problem = _patch_text_problem(spec.patch) or protected_paths.parse_patch(spec.patch).problem
        if problem:
            return self.patch_invalid(problem)
        self.scratch.mkdir()
        commit = self.checkout(self.worktree)
        self.lap("checkout")

        # 2. integrity of the patch's headers, and screening
        def read_base_file(path: str) -> str | None:
            result = apply_lib.git(self.worktree, "show", f"HEAD:{path}", check=False)
            return result.stdout if result.returncode == 0 else None

        protected = protected_test_files(spec, all_test_files)
        if self.harness is not None:
            protected = sorted(set(protected) | set(self.harness.protected_files()))
        try:
            self.flags = screening.screen_patch(spec.patch)
            violation = protected_paths.check_integrity(spec.patch, protected, read_base_file)
            patched_files = sorted(protected_paths.touched_paths(spec.patch)[0])
        except Exception as error:
            # The patch text is these parsers' only untrusted input: whatever makes one of them
            # raise is the patch's doing, so it is a verdict, never an infrastructure error.
            logger.exception("a patch parser raised on task %s", spec.instance_id)
            return self.patch_invalid(f"the patch could not be parsed: {type(error).__name__}")
        if violation:
            self.lap("apply")
            return self.violation(violation, "the patch touches protected files")

        # 3. the agent's patch
        try:
            applied = apply_lib.apply_patch(
                self.worktree,
                spec.patch,
                self.scratch,
                max_binary_bytes=config.max_binary_patch_bytes,
                max_file_bytes=config.max_file_size_bytes,
            )
        except apply_lib.ApplyInfrastructureError as error:
            raise InfrastructureError(str(error)) from error
        if applied.method == ApplyMethod.FAILED:
            self.lap("apply")
            kind = (
                FailureKind.PATCH_TOO_LARGE if applied.too_large else FailureKind.PATCH_NOT_APPLIED
            )
            return self.finish(
                apply_method=ApplyMethod.FAILED,
                kind=kind,
                detail=applied.message.strip().splitlines()[-1]
                if applied.message.strip()
                else "the patch did not apply",
                log_tail=f"the patch did not apply:\n{applied.message}",
            )

        # 4. the tree after the patch
        audit = tree_audit.audit_worktree(
            self.worktree, tree_audit.base_tree_state(self.worktree), protected_test_files=protected
        )
        if audit.violations:
            self.lap("apply")
            return self.violation(
                audit.violations, "the patched tree breaks integrity", apply_method=applied.method
            )
        if audit.num_bytes > config.worktree_size_bytes:
            self.lap("apply")
            detail = (
                f"the patched worktree holds {audit.num_bytes} bytes, more than the "
                f"{config.worktree_size_bytes}-byte limit (pipeline.worktree_size_bytes)"
            )
            return self.finish(
                apply_method=applied.method,
                kind=FailureKind.DISK_LIMIT,
                detail=detail,
                log_tail=detail,
            )
        # 4b. capabilities only tampering needs, read from the changed files' ASTs on disk
        # (capability_screen.py); git still reads only trusted state here.
        findings = ()
        if config.capability_screen:
            changed = capability_screen.changed_files(self.worktree)
            findings = capability_screen.screen_tree(
                self.worktree,
                changed,
                binary_targets=capability_screen.binary_hunk_targets(spec.patch),
                read_base=capability_screen.base_reader(self.worktree, changed),
            )
        if findings:
            self.lap("apply")
            self.flags = tuple(sorted({*self.flags, *(f"capability: {f}" for f in findings)}))
            shown = "; ".join(findings[:20]) + (
                f"; and {len(findings) - 20} more" if len(findings) > 20 else ""
            )
            detail = f"the patch uses capabilities only tampering needs ({shown}); no test ran"
            return self.finish(
                apply_method=applied.method,
                kind=FailureKind.UNSAFE_CAPABILITY,
                detail=detail,
                log_tail="\n".join(("[dockyard] unsafe capabilities:", *findings)),
            )

        # 5. held-out tests back to base, then the gold test patch
        problem = self.install_tests(self.worktree, commit, all_test_files)
        if problem:
            self.confirm_test_patch_applies(all_test_files, problem)
            self.lap("apply")
            detail = f"the gold test patch no longer applies after this patch: {problem}"
            return self.finish(
                apply_method=applied.method,
                kind=FailureKind.BREAKS_TEST_PATCH,
                detail=detail,
                log_tail=detail,
            )
        self.lap("apply")

        # 6. tests, sandboxed; 7. grade. A run killed at a limit is then charged to the patch
        # unless the task's baseline hits a limit too (charge_limit).
        verdict = self.test_and_grade(
            self.worktree, protected, pytest_args, applied.method, patched_files
        )
        return self.charge_limit(verdict, all_test_files, protected, pytest_args)

    def test_and_grade(
        self,
        worktree: pathlib.Path,
        protected: list[str],
        pytest_args: list[str],
        apply_method: ApplyMethod,
        patched_files: list[str],
    ) -> Verdict:
        """Steps 6 and 7 on `worktree` (tests installed, nothing run in it yet). The baseline
        (run_baseline) comes through here too, so it runs the same way under the same limits."""
        read_only, verified = runner.protected_test_files(worktree, protected)
        if self.harness is not None:
            return self.run_harness(worktree, apply_method, read_only)
        spec, config = self.spec, self.config
        try:
            result, evidence = runner.run_pytest(
                pytest_args,
                worktree,
                self.scratch,
                config.runner_limits(spec.timeout_s),
                canaries=True,
                hidden_paths=[self.work_root, config.cache_path(self.work_root)],
                patched_files=patched_files,
                read_only_files=read_only,
                verified_files=verified,
                image=self.image,
                interpreter=self.interpreter,
                worktree_dir=pathlib.Path(spec.repo_path),
                repo_env=self.repo_env,
            )
        except isolation.SandboxUnavailableError as error:
            raise InfrastructureError(str(error)) from error
        self.lap("tests")
        graded = _grade_safely(
            lambda: grading.grade_run(
                spec.fail_to_pass, spec.pass_to_pass, evidence, spec.reward_mode
            )
        )
        self.lap("grade")
        log_tail = result.output
        if not graded.resolved:
            log_tail += f"\n[dockyard] {graded.failure_kind.value}: {graded.detail}\n"
        return self.finish(
            apply_method=apply_method,
            grade=graded,
            kind=graded.failure_kind,
            detail=graded.detail,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            log_tail=log_tail,
        )

    def run_harness(
        self, worktree: pathlib.Path, apply_method: ApplyMethod, read_only: list[str]
    ) -> Verdict:
        """Steps 6 and 7 with the SWE-bench harness's runner and log parser; `read_only`: the
        test files and runner script bound read-only (runner.protected_test_files)."""
        spec, config = self.spec, self.config
        commands = self.harness.test_commands(spec.test_patch, self.image)
        try:
            run = runner.run_script(
                commands,
                worktree,
                config.runner_limits(spec.timeout_s),
                hidden_paths=[self.work_root, config.cache_path(self.work_root)],
                image=self.image,
                worktree_dir=pathlib.Path(spec.repo_path),
                read_only_files=read_only,
            )
        except isolation.SandboxUnavailableError as error:
            raise InfrastructureError(str(error)) from error
        self.lap("tests")
        graded = _grade_safely(
            lambda: self.harness.grade(
                run, spec.instance_id, spec.fail_to_pass, spec.pass_to_pass, spec.reward_mode
            )
        )
        self.lap("grade")
        log_tail = (run.result.output + run.log)[-config.max_log_bytes :]
        if not graded.resolved:
            log_tail += f"\n[dockyard] {graded.failure_kind.value}: {graded.detail}\n"
        return self.finish(
            apply_method=apply_method,
            grade=graded,
            kind=graded.failure_kind,
            detail=graded.detail,
            exit_code=run.exit_status,
            timed_out=run.result.timed_out,
            log_tail=log_tail,
        )

    def patch_invalid(self, detail: str) -> Verdict:
        """The patch's text itself is unusable: PATCH_INVALID, nothing applied or run."""
        self.lap("apply")
        return self.finish(
            apply_method=ApplyMethod.NOT_ATTEMPTED,
            kind=FailureKind.PATCH_INVALID,
            detail=detail,
            log_tail=detail,
        )

    def charge_limit(
        self,
        verdict: Verdict,
        all_test_files: list[str],
        protected: list[str],
        pytest_args: list[str],
    ) -> Verdict:
        """A run killed at a limit (TIMEOUT, CPU_LIMIT) is the patch's failure (reward 0,
        `limit_outcome` False) unless this task's baseline hits a limit on this executor too;
        only then is it masked (`limit_outcome` True). The patch's own exit status and duration
        never decide it: the patch controls both. The baseline is run once per task identity
        and limits in this process (_BASELINES); when it runs here, `timings_s["baseline"]`."""
        if verdict.resolved or verdict.failure_kind not in _LIMIT_KINDS:
            return verdict
        limits = self.config.runner_limits(self.spec.timeout_s)
        baseline = _BASELINES.get_or_run(
            _baseline_key(self.spec, limits),
            self.config.max_baseline_entries,
            lambda: self.run_baseline(all_test_files, protected, pytest_args),
        )
        self.timings["total"] = time.monotonic() - self.start
        if baseline is None:
            return dataclasses.replace(
                verdict,
                timings_s=dict(self.timings),
                failure_detail=f"{verdict.failure_detail}; charged to the patch: this task's "
                "baseline (base commit and tests, no agent patch) finishes within the limits",
            )
        return dataclasses.replace(
            verdict,
            timings_s=dict(self.timings),
            limit_outcome=True,
            failure_detail=f"{verdict.failure_detail}; masked: this task's baseline (base "
            f"commit and tests, no agent patch) hits a limit too ({baseline.value})",
        )

    def run_baseline(
        self, all_test_files: list[str], protected: list[str], pytest_args: list[str]
    ) -> FailureKind | None:
        """Runs the task's baseline — base_commit with the gold test patch and no agent patch —
        in its own checkout through test_and_grade (same runner, image, environment and
        limits); returns the limit it hit (TIMEOUT, CPU_LIMIT) or None. Only trusted code runs
        in it, so its outcome is the executor's and the task's, never the patch's."""
        start = time.monotonic()
        base = _Scoring(
            dataclasses.replace(self.spec, patch=""),
            self.config,
            self.work_root,
            self.cache,
            self.task_dir / "baseline",
            {},
            start,
            self.harness,
        )
        base.image, base.interpreter, base.repo_env = self.image, self.interpreter, self.repo_env
        base.task_dir.mkdir()
        base.scratch.mkdir()
        commit = base.checkout(base.worktree)
        problem = base.install_tests(base.worktree, commit, all_test_files)
        if problem:
            raise ValueError(f"test_patch: does not apply at base_commit {commit}: {problem}")
        verdict = base.test_and_grade(base.worktree, protected, pytest_args, ApplyMethod.EMPTY, [])
        self.timings["baseline"] = time.monotonic() - start
        logger.info(
            "task %s: baseline %s in %.1f s",
            self.spec.instance_id,
            "hit a limit" if verdict.timed_out else f"exited {verdict.test_exit_code}",
            self.timings["baseline"],
        )
        return _limit_kind(verdict.timed_out, verdict.test_exit_code)

    def violation(
        self,
        violation: tuple[str, ...],
        what: str,
        apply_method: ApplyMethod = ApplyMethod.NOT_ATTEMPTED,
    ) -> Verdict:
        shown = ", ".join(violation[:20]) + (
            f" and {len(violation) - 20} more" if len(violation) > 20 else ""
        )
        detail = f"integrity violation: {what} ({shown}); no test ran"
        return self.finish(
            apply_method=apply_method,
            kind=FailureKind.INTEGRITY_VIOLATION,
            violation=tuple(violation),
            detail=detail,
            log_tail=detail,
        )

    def install_tests(self, worktree: pathlib.Path, commit: str, all_test_files: list[str]) -> str:
        """Restores the held-out files from `commit` and applies the gold test patch; returns
        git's complaint, or "" when both worked."""
        # One listing of the base tree (no pathspecs: test file names may hold glob characters).
        listed = apply_lib.git(
            worktree, "ls-tree", "-r", "-z", "--name-only", "--full-tree", commit, text=False
        ).stdout
        at_base = {os.fsdecode(name) for name in listed.split(b"\0") if name}
        existing = [path for path in all_test_files if path in at_base]
        if existing:
            restored = apply_lib.git(worktree, "checkout", commit, "--", *existing, check=False)
            if restored.returncode != 0:
                return f"restoring the held-out files failed: {restored.stderr.strip()[-500:]}"
        for path in all_test_files:
            target = worktree / path
            if path not in existing and (target.is_symlink() or target.is_file()):
                target.unlink()  # a file the test patch creates must not pre-exist
        test_patch_file = self.scratch / "test.patch"
        test_patch = self.spec.test_patch
        test_patch_file.write_text(
            test_patch if test_patch.endswith("\n") else test_patch + "\n", encoding="utf-8"
        )
        applied = apply_lib.git(
            worktree, "apply", "--whitespace=nowarn", str(test_patch_file), check=False
        )
        return "" if applied.returncode == 0 else applied.stderr.strip()[-1000:]

    def confirm_test_patch_applies(self, all_test_files: list[str], problem: str) -> None:
        """The test patch failed after the agent's patch: raises ValueError (invalid task) unless
        it applies on a fresh checkout without that patch."""
        clean = self.task_dir / "clean"
        commit = self.checkout(clean)
        if self.install_tests(clean, commit, all_test_files):
            raise ValueError(f"test_patch: does not apply at base_commit {commit}: {problem}")
