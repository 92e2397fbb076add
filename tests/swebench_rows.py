"""A miniature repository laid out like Django's, for SWE-bench rows graded by the official
harness (sandbox/swebench_harness.py) rather than our pytest runner.

It is not Django: its tests are unittest modules under tests/, run by tests/runtests.py with
Django's flags, so the harness's spec for "django/django" 4.0 (`./tests/runtests.py --verbosity 2
--settings=test_sqlite --parallel 1 <module labels>`) and its Django log parser apply unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from dockyard_rl.sandbox.task import TaskSpec
from dockyard_rl.sandbox.testing_repos import git

REPO = "django/django"
VERSION = "4.0"
HARNESS = f"swebench:{REPO}@{VERSION}"
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
# As the harness's Django parser names them (unittest's verbose "name (module.Class.name)").
F2P = "test_case_and_edges (slugs.tests.SlugTests.test_case_and_edges)"
P2P = "test_spaces (slugs.tests.SlugTests.test_spaces)"


@dataclasses.dataclass(frozen=True)
class DjangoLikeRepo:
    path: pathlib.Path
    base_commit: str
    gold_patch: str  # the fix of minidj/text.py
    test_patch: str  # the new test in tests/slugs/tests.py

    def row(self, instance_id: str = "django__django-90001", **extra) -> dict:
        """The repository's SWE-bench row (the published datasets' JSONL format)."""
        return {
            "instance_id": instance_id,
            "repo": REPO,
            "base_commit": self.base_commit,
            "patch": self.gold_patch,
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": json.dumps([F2P]),
            "PASS_TO_PASS": json.dumps([P2P]),
            "version": VERSION,
            "environment_setup_commit": self.base_commit,
            "problem_statement": "slugs",
            "hints_text": "",
            "created_at": "2026-01-01T00:00:00Z",
            **extra,
        }

    def spec(self, patch: str, **fields) -> TaskSpec:
        """The row as the executor takes it, with the harness named explicitly."""
        return TaskSpec(
            instance_id="django__django-90001",
            repo=str(self.path),
            base_commit=self.base_commit,
            patch=patch,
            test_patch=self.test_patch,
            fail_to_pass=(F2P,),
            pass_to_pass=(P2P,),
            test_harness=HARNESS,
            **fields,
        )


def make_django_like_repo(path: pathlib.Path) -> DjangoLikeRepo:
    """Writes the repository at `path` (two commits: base, fix) and returns its row's parts."""
    (path / "minidj").mkdir(parents=True)
    git(path, "init", "--quiet", "--initial-branch=main")
    (path / "minidj" / "__init__.py").write_text("")
    (path / "minidj" / "text.py").write_text(SLUG_BUGGY)
    (path / "tests" / "slugs").mkdir(parents=True)
    (path / "tests" / "runtests.py").write_text(RUNTESTS)
    (path / "tests" / "runtests.py").chmod(0o755)
    (path / "tests" / "slugs" / "__init__.py").write_text("")
    (path / "tests" / "slugs" / "tests.py").write_text(TESTS_BASE)
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "base")
    base = git(path, "rev-parse", "HEAD").strip()
    (path / "minidj" / "text.py").write_text(SLUG_FIXED)
    (path / "tests" / "slugs" / "tests.py").write_text(TESTS_NEW)
    git(path, "commit", "--quiet", "-am", "fix")
    return DjangoLikeRepo(
        path=path,
        base_commit=base,
        gold_patch=git(path, "diff", base, "HEAD", "--", "minidj"),
        test_patch=git(path, "diff", base, "HEAD", "--", "tests"),
    )
