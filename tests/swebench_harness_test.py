"""SWE-bench rows whose tests use another runner go through the official harness's test command and
log parser (the `swebench` package), with real git, a real sandbox and real unittest output.

The repository is a miniature stand-in laid out like Django's (tests/swebench_rows.py). The rows
are written in SWE-bench's own JSONL format and read by our dataset loader, which picks the harness
from repo and version. Also here: every lock the executor and the dataset side run from holds
swebench, the sandbox lock's slim install loads the harness, and without swebench a row that needs
it fails loudly instead of being graded by the pytest runner.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.sandbox import pipeline, swebench_harness
from dockyard_rl.sandbox.task import FailureKind, TestOutcome
from dockyard_rl.sandbox.testing_repos import git
from tests.swebench_rows import F2P, P2P, SLUG_BUGGY, make_django_like_repo

WORKSPACE = pathlib.Path(__file__).absolute().parents[1]  # also the runfiles root
IMAGE = WORKSPACE / "tests" / "task_images" / "moonphase_task_image.tar"
# The locks an executor or the dataset side runs from: the CPU and CUDA venvs (and fleet images),
# and the sandbox image.
EXECUTOR_LOCKS = ("cpu.lock.txt", "cuda.lock.txt", "sandbox.lock.txt")
CONFIG = pipeline.PipelineConfig(
    timeout_s=120,
    cpu_time_s=120,
    memory_bytes=2 * 1024**3,
    max_num_processes=64,
    max_log_bytes=16 * 1024,
)


@dataclasses.dataclass(frozen=True)
class Rows:
    path: pathlib.Path  # the JSONL file, SWE-bench's row format
    repo_root: pathlib.Path  # owner/name -> a local clone under it (validate --repo-root)
    gold_patch: str


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Rows:
    root = tmp_path_factory.mktemp("swebench")
    repo = make_django_like_repo(root / "mirrors" / "django" / "django")
    row = repo.row()
    path = root / "rows.jsonl"
    path.write_text(
        json.dumps(row)
        + "\n"
        + json.dumps(repo.row("django__django-90002", image=f"oci-archive:{IMAGE}"))
        + "\n"
    )
    return Rows(path=path, repo_root=root / "mirrors", gold_patch=row["patch"])


def _patch_for(rows: Rows, base_commit: str, files: dict[str, str]) -> str:
    clone = rows.repo_root.parent / "edit"
    if not clone.exists():
        git(
            rows.repo_root.parent,
            "clone",
            "--quiet",
            str(rows.repo_root / "django" / "django"),
            str(clone),
        )
    git(clone, "checkout", "--quiet", "--force", "--detach", base_commit)
    for name, text in files.items():
        (clone / name).write_text(text)
    patch = git(clone, "diff", base_commit)
    git(clone, "checkout", "--quiet", "--force", base_commit)
    return patch


def _spec(rows: Rows, index: int, patch: str):
    instance = load_jsonl(rows.path)[index]
    return instance.to_task_spec(patch, repo_url=str(rows.repo_root / instance.repo))


def test_the_row_selects_the_harness_and_its_command():
    assert swebench_harness.harness_for_row("django/django", "4.0") == "swebench:django/django@4.0"
    assert swebench_harness.harness_for_row("astropy/astropy", "5.0") is None  # pytest: ours
    assert swebench_harness.harness_for_row("/srv/repo", "4.0") is None
    harness = swebench_harness.parse_harness("swebench:django/django@4.0")
    commands = harness.test_commands(
        "diff --git a/tests/slugs/tests.py b/tests/slugs/tests.py\n", None
    )
    assert commands[-1] == (
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 slugs.tests"
    )
    assert harness.protected_files() == ["tests/runtests.py"]
    with pytest.raises(ValueError, match="no version '9.9' of django/django"):
        swebench_harness.parse_harness("swebench:django/django@9.9")
    with pytest.raises(ValueError, match="no Python repository 'nobody/nothing'"):
        swebench_harness.parse_harness("swebench:nobody/nothing@1.0")


@pytest.mark.parametrize("index", [0, 1], ids=["executor interpreter", "task image"])
def test_verdicts_come_from_the_harness_runner_and_parser(rows, index, tmp_path):
    gold = pipeline.score_task(_spec(rows, index, rows.gold_patch), CONFIG, tmp_path)
    assert gold.resolved, (gold.failure_kind, gold.failure_detail, gold.log_tail[-3000:])
    assert gold.fail_to_pass == {F2P: TestOutcome.PASSED}
    assert swebench_harness.EVIDENCE_FLAG in gold.screening_flags
    assert f"{F2P} ... ok" in gold.log_tail  # unittest's own verbose line, parsed by the harness

    empty = pipeline.score_task(_spec(rows, index, ""), CONFIG, tmp_path)
    assert not empty.resolved and empty.failure_kind is FailureKind.TESTS_FAILED
    assert empty.fail_to_pass == {F2P: TestOutcome.FAILED}
    assert empty.pass_to_pass == {P2P: TestOutcome.PASSED}


def test_the_runner_script_is_protected_and_a_killed_run_is_not_graded(rows, tmp_path):
    fake_runner = (
        "#!/usr/bin/env python3\nprint('" + F2P + " ... ok')\nprint('" + P2P + " ... ok')\n"
    )
    spec = _spec(rows, 0, "")
    hostile_patch = _patch_for(rows, spec.base_commit, {"tests/runtests.py": fake_runner})
    hostile = pipeline.score_task(dataclasses.replace(spec, patch=hostile_patch), CONFIG, tmp_path)
    assert not hostile.resolved and hostile.failure_kind is FailureKind.INTEGRITY_VIOLATION
    assert hostile.integrity_violation == ("tests/runtests.py",)

    # A patch that prints a passing line for every test and then kills the run: the completion
    # line never comes, so nothing of the log is graded.
    killer = SLUG_BUGGY + (
        "import os, signal\nprint('" + F2P + " ... ok', flush=True)\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
    )
    killer_patch = _patch_for(rows, spec.base_commit, {"minidj/text.py": killer})
    killer_spec = dataclasses.replace(spec, patch=killer_patch)
    # The capability screen refuses os.kill before anything runs ...
    screened = pipeline.score_task(killer_spec, CONFIG, tmp_path)
    assert screened.failure_kind is FailureKind.UNSAFE_CAPABILITY, screened
    # ... and without it, the run-time layer alone: the killed run is not graded.
    unscreened = dataclasses.replace(CONFIG, capability_screen=False)
    killed = pipeline.score_task(killer_spec, unscreened, tmp_path)
    assert not killed.resolved and killed.failure_kind is FailureKind.REPORT_UNTRUSTED, killed


def _lock_pins(name: str) -> dict[str, str]:
    text = (WORKSPACE / "requirements" / name).read_text()
    return {
        pin.lower().replace("_", "-"): version
        for pin, version in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\$", text, re.M)
    }


@pytest.mark.parametrize("lock", EXECUTOR_LOCKS)
def test_every_lock_the_executor_runs_from_holds_swebench(lock):
    # Without swebench, Django/sympy rows could not be graded at all there (see the next tests).
    pins = _lock_pins(lock)
    assert pins.get("swebench", "").startswith(f"{swebench_harness.SWEBENCH_MAJOR}."), (
        f"requirements/{lock} lacks swebench {swebench_harness.SWEBENCH_MAJOR}.x: add it to the "
        f".in file and regenerate the lock with tools/python/lock.py (command in its header)"
    )
    assert pins["swebench"] == _lock_pins("cpu.lock.txt")["swebench"]
    # What the harness modules import at their top (swebench_harness._load_harness_modules).
    assert {"requests", "unidiff", "python-dotenv"} <= set(pins), lock


# Run in a fresh interpreter, where `swebench` has not been imported yet (argv: P2P, F2P).
_HARNESS_CHECK = """
import json, sys
from dockyard_rl.sandbox import swebench_harness as h
harness = h.parse_harness("swebench:django/django@4.0")
passing, failing = sys.argv[1:]
print(json.dumps({
    "row": h.harness_for_row("django/django", "4.0"),
    "pytest_row": h.harness_for_row("astropy/astropy", "5.0"),
    "command": harness.test_commands("diff --git a/tests/slugs/tests.py b/tests/slugs/tests.py\\n",
                                     None)[-1],
    "statuses": harness.parse(f"{passing} ... ok\\n{failing} ... FAIL\\n", "d-1", [], []),
    "loaded": sorted(m for m in ("datasets", "docker", "modal", "ghapi") if m in sys.modules),
}))
"""


def test_the_sandbox_locks_slim_install_loads_the_harness(tmp_path):
    # A site folder with exactly the sandbox lock's distributions (linked from this venv, which
    # has the same versions), and an interpreter that sees nothing else: the image's situation.
    site = tmp_path / "site"
    site.mkdir()
    for name, version in _lock_pins("sandbox.lock.txt").items():
        dist = importlib.metadata.distribution(name)
        assert dist.version == version, (name, dist.version, version)
        base = pathlib.Path(dist.locate_file(""))
        tops = {pathlib.PurePath(f).parts[0] for f in dist.files or ()}
        for top in tops - {"..", "__pycache__"}:
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    run = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path[:0] = [{str(site)!r}, {str(WORKSPACE / 'python')!r}]\n"
            + _HARNESS_CHECK,
            P2P,
            F2P,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result == {
        "row": "swebench:django/django@4.0",
        "pytest_row": None,
        "command": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
        "slugs.tests",
        "statuses": {P2P: "PASSED", F2P: "FAILED"},
        "loaded": [],  # neither datasets nor the docker/modal clients
    }


def test_without_swebench_a_row_that_needs_it_fails_loudly():
    # Never the pytest runner for a Django row: the dataset side raises, the executor refuses.
    code = """
import sys
sys.modules["swebench"] = None  # as if not installed
from dockyard_rl.sandbox import swebench_harness as h
assert h.harness_for_row("/srv/repo", "4.0") is None  # a local repository: ours, no harness
try:
    h.harness_for_row("django/django", "4.0")
except h.HarnessUnavailableError as error:
    print("row:", error)
try:
    h.parse_harness("swebench:django/django@4.0")
except ValueError as error:
    print("executor:", error)
"""
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(WORKSPACE / "python")},
    )
    assert run.returncode == 0, run.stderr
    row, executor = run.stdout.splitlines()
    assert row.startswith("row: the swebench package cannot be loaded in this environment")
    assert "sandbox.lock.txt" in row
    assert executor.startswith("executor: test_harness: 'swebench:django/django@4.0' cannot be ")
