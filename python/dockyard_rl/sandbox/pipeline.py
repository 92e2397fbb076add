"""Scoring one task: `score_task(spec, config, work_root) -> Verdict`.

Steps (each module's docstring has the details and the security reasoning):
1. repo_cache: the repository's cached bare mirror → a fresh single-commit checkout of
   base_commit in `<work_root>/tasks/<random>/repo` (no remotes, refs, tags or future history).
2. integrity: the agent's patch must not touch the test_patch's files or test-runner config. A
   violation scores 0; the patch is not even applied (ApplyMethod.NOT_ATTEMPTED) and no test runs.
3. apply: git apply → git apply --3way → patch --fuzz, resetting between tries. Failure scores 0
   (ApplyMethod.FAILED, the appliers' messages in the log tail); no test runs.
4. The held-out test files are restored from base_commit (`git checkout <base> -- <files>`, a
   second line of defence behind step 2), then the gold test_patch is applied with `git apply`.
5. isolation: the tests run under bubblewrap with the config's limits. Default command:
   `<sys.executable> -m pytest -p no:cacheprovider --rootdir <worktree> <files test_patch
   touches>` — the executor's own interpreter (its prefix is bound read-only into the sandbox).
   A task's `test_command` replaces it and must be a pytest invocation (it is split with shlex,
   never given to a shell). Either way the JUnit arguments are appended: the report goes to a
   fresh random directory outside the worktree with a per-run nonce as the suite name.
6. grading: the report is cross-checked with the exit code, then graded SWE-bench style.
The task directory (worktree, report, scratch) is deleted afterwards, whatever happened.

Errors: `InfrastructureError` for anything outside the patch's control (clone/fetch failure,
bubblewrap missing or unable to start, disk errors, a worktree that cannot be reset) — the
service retries those. `ValueError` for a malformed task (repo or base_commit not acceptable, a
test_patch that does not apply at base_commit): retrying cannot help. Everything the patch or the
tests do (crash, hang, fork bomb, flood of output, forged report) ends in a Verdict, never an
exception.

No git command runs in the worktree after the sandboxed tests started: the tests could have
planted a .git/config (core.fsmonitor, hooks) that git would execute as the executor's user.

Limits: a task's `timeout_s` replaces `PipelineConfig.timeout_s` for its test run; the other
limits always come from the config. A base_commit the repository does not have (after one
refresh of the mirror) is an InfrastructureError, since a stale mirror looks the same.

Not covered: the tests run with the worktree as the current directory (as SWE-bench does), so a
patch could add modules that shadow pytest's own imports; like any code under test it already
runs inside pytest's process, and grading.py says what such code can and cannot fake. The
executor's interpreter and site-packages are the test environment: per-repository environments
(SWE-bench's conda images) are out of scope here.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time

import unidiff

from dockyard_rl.sandbox import apply as apply_lib
from dockyard_rl.sandbox import grading, integrity, isolation, repo_cache
from dockyard_rl.sandbox.task import ApplyMethod, TaskSpec, TestOutcome, Verdict
from dockyard_rl.utils.config import require

_JUNIT_FILE = "junit.xml"


class InfrastructureError(RuntimeError):
    """Scoring could not finish for reasons outside the patch; safe to retry."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How one task is scored; build with `from_dict(PipelineConfig, data, "pipeline")`."""

    timeout_s: float = 1800.0                  # test-run wall clock when the task names none
    cpu_time_s: int = 1800                     # RLIMIT_CPU per process in the sandbox
    memory_bytes: int = 4 * 1024**3            # RLIMIT_AS per process
    max_num_processes: int = 256               # RLIMIT_NPROC for the sandbox's uid
    max_file_size_bytes: int = 256 * 1024**2   # RLIMIT_FSIZE
    max_num_open_files: int = 1024             # RLIMIT_NOFILE
    max_log_bytes: int = 64 * 1024             # head + tail of the test output kept in the verdict
    tmp_size_bytes: int = 512 * 1024**2        # the sandbox's private /tmp (tmpfs)
    cache_dir: str | None = None               # repository mirrors; None -> <work_root>/mirrors

    def __post_init__(self):
        def positive_int(name: str, what: str):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                    f"must be a positive integer ({what}), got {value!r}")

        require(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                and 0 < self.timeout_s <= 24 * 3600, "timeout_s",
                f"must be a number of seconds in (0, 86400], got {self.timeout_s!r}")
        positive_int("cpu_time_s", "CPU seconds per process")
        positive_int("memory_bytes", "bytes of address space per process")
        positive_int("max_num_processes", "processes of the sandbox user")
        positive_int("max_file_size_bytes", "bytes per written file")
        positive_int("max_num_open_files", "file descriptors per process")
        positive_int("max_log_bytes", "bytes of test output kept")
        positive_int("tmp_size_bytes", "bytes of the sandbox's /tmp")
        require(self.memory_bytes >= 64 * 1024**2, "memory_bytes",
                f"must be at least 64 MiB (a Python interpreter needs more), got "
                f"{self.memory_bytes}")
        require(self.max_num_open_files >= 16, "max_num_open_files",
                f"must be at least 16 (an interpreter needs a few), got {self.max_num_open_files}")
        require(self.cache_dir is None
                or (isinstance(self.cache_dir, str) and bool(self.cache_dir)), "cache_dir",
                f"must be a directory path or null (= <work_root>/mirrors), got "
                f"{self.cache_dir!r}")

    def limits(self, timeout_s: float | None) -> isolation.SandboxLimits:
        return isolation.SandboxLimits(
            wall_timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
            cpu_s=self.cpu_time_s, memory_bytes=self.memory_bytes,
            num_processes=self.max_num_processes, file_size_bytes=self.max_file_size_bytes,
            num_open_files=self.max_num_open_files, max_output_bytes=self.max_log_bytes,
            tmp_size_bytes=self.tmp_size_bytes)

    def cache_path(self, work_root: pathlib.Path) -> pathlib.Path:
        if self.cache_dir is None:
            return work_root / "mirrors"
        return pathlib.Path(self.cache_dir).expanduser().resolve()


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
            name = integrity.normalize_path(raw) if raw else None
            if name:
                names.add(os.path.normpath(name))
        target = integrity.normalize_path(patched_file.target_file or "")
        if target and not patched_file.is_removed_file:
            kept.add(os.path.normpath(target))
    if not names:
        raise ValueError("test_patch: names no file (is it a unified diff?)")
    return sorted(names), sorted(kept)


def _readonly_interpreter_paths() -> list[pathlib.Path]:
    paths = {pathlib.Path(sys.prefix).resolve(), pathlib.Path(sys.base_prefix).resolve(),
             pathlib.Path(os.path.realpath(sys.executable)).parent.parent}
    # Without this the venv's bin/python symlink can point at an interpreter outside both
    # prefixes (e.g. a pyenv build under /root).
    paths.add(pathlib.Path(sys.executable).parent.parent)
    return sorted(paths)


def run_tests_sandboxed(command: list[str], worktree: pathlib.Path, config: PipelineConfig,
                        work_root: pathlib.Path, *,
                        extra_writable_dirs: list[pathlib.Path] = (),
                        limits: isolation.SandboxLimits | None = None) -> isolation.SandboxResult:
    """Runs a test command in `worktree` under bubblewrap the way scoring does (step 5 of the
    module docstring): worktree (and `extra_writable_dirs`) writable, the work root, mirror cache,
    /root and /home hidden, this interpreter bound read-only and first on PATH, a minimal
    environment. `limits` default to the config's. Raises InfrastructureError when the sandbox
    cannot start; whatever the command does ends in the returned result."""
    hidden = [work_root, config.cache_path(work_root), pathlib.Path("/root"),
              pathlib.Path("/home")]
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
           "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONHASHSEED": "0"}
    try:
        return isolation.run_sandboxed(
            command, writable_dirs=[worktree, *extra_writable_dirs],
            limits=limits if limits is not None else config.limits(None), cwd=worktree,
            hidden_paths=hidden, readonly_paths=_readonly_interpreter_paths(), env=env)
    except isolation.SandboxUnavailableError as error:
        raise InfrastructureError(str(error)) from error


def _rmtree(path: pathlib.Path) -> None:
    def make_writable_and_retry(function, failed_path, _):
        # The tests may leave read-only directories behind (chmod 000); we own them, so we can
        # make them writable again.
        parent = os.path.dirname(failed_path)
        for target in (parent, failed_path):
            try:
                os.chmod(target, stat.S_IRWXU)
            except OSError:
                pass
        function(failed_path)

    if path.exists():
        shutil.rmtree(path, onerror=make_writable_and_retry)


def _verdict(spec: TaskSpec, *, apply_method: ApplyMethod, violation: tuple[str, ...] = (),
             grade: grading.Grade | None = None, exit_code: int | None = None,
             timed_out: bool = False, timings: dict[str, float], log_tail: str) -> Verdict:
    if grade is None:
        missing_f2p = {test_id: TestOutcome.MISSING for test_id in spec.fail_to_pass}
        missing_p2p = {test_id: TestOutcome.MISSING for test_id in spec.pass_to_pass}
        return Verdict(resolved=False, reward=0.0, fail_to_pass=missing_f2p,
                       pass_to_pass=missing_p2p, apply_method=apply_method,
                       integrity_violation=violation, test_exit_code=exit_code,
                       timed_out=timed_out, timings_s=timings, log_tail=log_tail)
    return Verdict(resolved=grade.resolved, reward=grade.reward, fail_to_pass=grade.fail_to_pass,
                   pass_to_pass=grade.pass_to_pass, apply_method=apply_method,
                   integrity_violation=violation, test_exit_code=exit_code, timed_out=timed_out,
                   timings_s=timings, log_tail=log_tail)


def remove_stale_task_dirs(work_root: pathlib.Path) -> int:
    """Deletes the task directories a killed executor left under `work_root` and returns how many.

    Only safe before any task of this work root runs: call it once at executor start-up (one
    executor owns a work root). Mirrors are kept: they are shared and verified on use.
    """
    tasks_dir = pathlib.Path(work_root).expanduser() / "tasks"
    stale = sorted(tasks_dir.glob("task-*")) if tasks_dir.is_dir() else []
    for task_dir in stale:
        _rmtree(task_dir)
    return len(stale)


def score_task(spec: TaskSpec, config: PipelineConfig, work_root: pathlib.Path) -> Verdict:
    """Scores `spec` (module docstring). Raises InfrastructureError (retry) or ValueError (bad
    task); every outcome of the patch itself is a Verdict."""
    start = time.monotonic()
    timings: dict[str, float] = {}
    _ensure_sandbox()
    work_root = pathlib.Path(work_root).expanduser().resolve()
    cache = repo_cache.RepoCache(config.cache_path(work_root))
    all_test_files, test_files = test_files_of(spec.test_patch)
    try:
        (work_root / "tasks").mkdir(parents=True, exist_ok=True)
        task_dir = pathlib.Path(tempfile.mkdtemp(prefix="task-", dir=work_root / "tasks"))
    except OSError as error:
        raise InfrastructureError(f"cannot create a task directory under {work_root}: "
                                  f"{error}") from error
    try:
        return _score_in(spec, config, work_root, cache, task_dir, all_test_files, test_files,
                         timings, start)
    except (OSError, subprocess.SubprocessError) as error:
        # Disk full, a git command that hung past its timeout, ...: not the patch's doing.
        raise InfrastructureError(f"disk or process error while scoring: {error}") from error
    finally:
        _rmtree(task_dir)


def _score_in(spec: TaskSpec, config: PipelineConfig, work_root: pathlib.Path,
              cache: repo_cache.RepoCache, task_dir: pathlib.Path, all_test_files: list[str],
              test_files: list[str], timings: dict[str, float], start: float) -> Verdict:
    worktree = task_dir / "repo"
    scratch = task_dir / "scratch"
    scratch.mkdir()

    def lap(phase: str, since: float) -> float:
        now = time.monotonic()
        timings[phase] = now - since
        return now

    # 1. checkout
    phase_start = time.monotonic()
    try:
        cache.checkout(spec.repo, spec.base_commit, worktree)
    except repo_cache.RepoCacheError as error:
        raise InfrastructureError(str(error)) from error
    commit = apply_lib.git(worktree, "rev-parse", "HEAD", check=False).stdout.strip()
    if not commit:
        raise InfrastructureError(f"checkout of {spec.base_commit} in {worktree} has no HEAD")
    phase_start = lap("checkout", phase_start)

    def finish(**kwargs) -> Verdict:
        timings["total"] = time.monotonic() - start
        return _verdict(spec, timings=timings, **kwargs)

    # 2. integrity, before anything from the patch touches the disk
    def read_base_file(path: str) -> str | None:
        result = apply_lib.git(worktree, "show", f"HEAD:{path}", check=False)
        return result.stdout if result.returncode == 0 else None

    violation = integrity.check_integrity(spec.patch, all_test_files, read_base_file)
    if violation:
        lap("apply", phase_start)
        shown = ", ".join(violation[:20]) + (f" and {len(violation) - 20} more"
                                             if len(violation) > 20 else "")
        return finish(apply_method=ApplyMethod.NOT_ATTEMPTED, violation=violation,
                      log_tail=f"integrity violation: the patch touches protected files "
                               f"({shown}); it was not applied and no test ran")

    # 3. the agent's patch
    try:
        applied = apply_lib.apply_patch(worktree, spec.patch, scratch)
    except apply_lib.ApplyInfrastructureError as error:
        raise InfrastructureError(str(error)) from error
    if applied.method == ApplyMethod.FAILED:
        lap("apply", phase_start)
        return finish(apply_method=ApplyMethod.FAILED,
                      log_tail=f"the patch did not apply:\n{applied.message}")

    # 4. held-out tests back to base, then the gold test patch
    existing = [p for p in all_test_files if read_base_file(p) is not None]
    if existing:
        restored = apply_lib.git(worktree, "checkout", commit, "--", *existing, check=False)
        if restored.returncode != 0:
            raise InfrastructureError(f"cannot restore test files: {restored.stderr.strip()}")
    for path in all_test_files:
        if path not in existing:
            # A file test_patch creates must not pre-exist (integrity already refuses patches that
            # touch it; this only guards against a failed check).
            target = worktree / path
            if target.is_symlink() or target.is_file():
                target.unlink()
    test_patch_file = scratch / "test.patch"
    test_patch_file.write_text(spec.test_patch if spec.test_patch.endswith("\n")
                               else spec.test_patch + "\n", encoding="utf-8")
    applied_tests = apply_lib.git(worktree, "apply", "--whitespace=nowarn", str(test_patch_file),
                                  check=False)
    if applied_tests.returncode != 0:
        raise ValueError(f"test_patch: does not apply at base_commit {commit}: "
                         f"{applied_tests.stderr.strip()[-1000:]}")
    phase_start = lap("apply", phase_start)

    # 5. tests, sandboxed
    results_dir = pathlib.Path(tempfile.mkdtemp(prefix="results-", dir=task_dir))
    report = results_dir / _JUNIT_FILE
    nonce = f"dockyard-{secrets.token_hex(16)}"
    if spec.test_command:
        try:
            command = shlex.split(spec.test_command)
        except ValueError as error:
            raise ValueError(f"test_command: cannot be split into arguments: {error}") from None
        if not command:
            raise ValueError("test_command: must not be empty")
    else:
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir",
                   str(worktree), "-rN", *test_files]
    command += [f"--junitxml={report}", "-o", f"junit_suite_name={nonce}",
                "-o", "junit_family=xunit1"]
    result = run_tests_sandboxed(command, worktree, config, work_root,
                                 extra_writable_dirs=[results_dir],
                                 limits=config.limits(spec.timeout_s))
    phase_start = lap("tests", phase_start)

    # 6. grade
    try:
        outcomes = grading.read_junit_xml(report, nonce)
        problem = ""
    except grading.ReportError as error:
        outcomes, problem = None, str(error)
    graded = grading.grade(spec.fail_to_pass, spec.pass_to_pass, outcomes, result.exit_code,
                           result.timed_out, spec.reward_mode, report_problem=problem)
    lap("grade", phase_start)
    log_tail = result.output
    if not graded.trusted:
        log_tail += f"\n[dockyard] test report not trusted: {graded.reason}\n"
    if result.timed_out:
        limit_s = config.limits(spec.timeout_s).wall_timeout_s
        log_tail += f"\n[dockyard] killed after the {limit_s} s wall-clock limit\n"
    return finish(apply_method=applied.method, grade=graded, exit_code=result.exit_code,
                  timed_out=result.timed_out, log_tail=log_tail)

