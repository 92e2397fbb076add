"""SWE-bench rows whose tests use another runner go through the official harness's test command and
log parser (the `swebench` package), with real git, a real sandbox and real unittest output.

The repository is a miniature stand-in laid out like Django's (not Django itself): its tests are
unittest modules under tests/, run by tests/runtests.py with Django's flags, so the harness's spec
for "django/django" 4.0 (`./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1
<module labels>`) and its Django log parser apply unchanged. The rows are written in SWE-bench's
own JSONL format and read by our dataset loader, which picks the harness from repo and version.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.sandbox import pipeline, swebench_harness
from dockyard_rl.sandbox.task import FailureKind, TestOutcome
from dockyard_rl.sandbox.testing_repos import git

WORKSPACE = pathlib.Path(__file__).absolute().parents[1]  # also the runfiles root
IMAGE = WORKSPACE / "tests" / "task_images" / "moonphase_task_image.tar"
CONFIG = pipeline.PipelineConfig(
    timeout_s=120,
    cpu_time_s=120,
    memory_bytes=2 * 1024**3,
    max_num_processes=64,
    max_log_bytes=16 * 1024,
)

RUNTESTS = '''\
#!/usr/bin/env python3
"""Runs unittest modules by label, with Django's runtests.py flags (verbose output)."""
import argparse
import os
import sys
import unittest

parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel")
args = parser.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here)]
suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
'''
SLUG_BUGGY = "def slugify(text):\n    return text.replace(' ', '-')\n"
SLUG_FIXED = "def slugify(text):\n    return text.strip().lower().replace(' ', '-')\n"
TESTS_BASE = """\
import unittest

from minidj.text import slugify


class SlugTests(unittest.TestCase):
    def test_spaces(self):
        self.assertEqual(slugify("a b"), "a-b")
"""
TESTS_NEW = (
    TESTS_BASE
    + """
    def test_case_and_edges(self):
        self.assertEqual(slugify(" Hello World "), "hello-world")
"""
)
F2P = "test_case_and_edges (slugs.tests.SlugTests.test_case_and_edges)"
P2P = "test_spaces (slugs.tests.SlugTests.test_spaces)"


@dataclasses.dataclass(frozen=True)
class Rows:
    path: pathlib.Path  # the JSONL file, SWE-bench's row format
    repo_root: pathlib.Path  # owner/name -> a local clone under it (validate --repo-root)
    gold_patch: str


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Rows:
    root = tmp_path_factory.mktemp("swebench")
    repo = root / "mirrors" / "django" / "django"
    (repo / "minidj").mkdir(parents=True)
    git(repo, "init", "--quiet", "--initial-branch=main")
    (repo / "minidj" / "__init__.py").write_text("")
    (repo / "minidj" / "text.py").write_text(SLUG_BUGGY)
    (repo / "tests" / "slugs").mkdir(parents=True)
    (repo / "tests" / "runtests.py").write_text(RUNTESTS)
    (repo / "tests" / "runtests.py").chmod(0o755)
    (repo / "tests" / "slugs" / "__init__.py").write_text("")
    (repo / "tests" / "slugs" / "tests.py").write_text(TESTS_BASE)
    git(repo, "add", "-A")
    git(repo, "commit", "--quiet", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "minidj" / "text.py").write_text(SLUG_FIXED)
    (repo / "tests" / "slugs" / "tests.py").write_text(TESTS_NEW)
    git(repo, "commit", "--quiet", "-am", "fix")
    row = {
        "instance_id": "django__django-90001",
        "repo": "django/django",
        "base_commit": base,
        "patch": git(repo, "diff", base, "HEAD", "--", "minidj"),
        "test_patch": git(repo, "diff", base, "HEAD", "--", "tests"),
        "FAIL_TO_PASS": json.dumps([F2P]),
        "PASS_TO_PASS": json.dumps([P2P]),
        "version": "4.0",
        "environment_setup_commit": base,
        "problem_statement": "slugs",
        "hints_text": "",
        "created_at": "2026-01-01T00:00:00Z",
    }
    path = root / "rows.jsonl"
    path.write_text(
        json.dumps(row)
        + "\n"
        + json.dumps(
            {**row, "instance_id": "django__django-90002", "image": f"oci-archive:{IMAGE}"}
        )
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
