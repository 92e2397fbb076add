"""Per-repository virtual environments: a real venv, a real package from the package index (pip
through the machine's configured index), real git and pytest under real bubblewrap.

The repository's tests import `roman` (a small pure-Python package the executor's own environment
does not have): without its requirements the gold patch cannot pass; with them it resolves, the
empty patch does not, two tasks share one build, and a requirement pip cannot install is an error
of that task only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util

import pytest

from dockyard_rl.sandbox import pipeline, repo_envs
from dockyard_rl.sandbox.task import TaskSpec, TaskValidationError
from dockyard_rl.sandbox.testing_repos import git

CONFIG = pipeline.PipelineConfig(
    timeout_s=120,
    cpu_time_s=120,
    memory_bytes=2 * 1024**3,
    max_num_processes=64,
    max_log_bytes=16 * 1024,
)
REQUIREMENTS = ("roman==4.2",)
BUGGY = "import roman\n\n\ndef year_label(year):\n    return roman.toRoman(year - 1)\n"
FIXED = "import roman\n\n\ndef year_label(year):\n    return roman.toRoman(year)\n"
TESTS = (
    "import roman\n\nfrom clock.label import year_label\n\n\n"
    "def test_roman_present():\n    assert roman.fromRoman('X') == 10\n"
)
NEW_TEST = "\n\ndef test_year_label():\n    assert year_label(2026) == 'MMXXVI'\n"


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> TaskSpec:
    assert importlib.util.find_spec("roman") is None, "the executor must not have roman itself"
    repo = tmp_path_factory.mktemp("repos") / "clock"
    (repo / "clock").mkdir(parents=True)
    git(repo, "init", "--quiet", "--initial-branch=main")
    (repo / "clock" / "__init__.py").write_text("")
    (repo / "clock" / "label.py").write_text(BUGGY)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_label.py").write_text(TESTS)
    git(repo, "add", "-A")
    git(repo, "commit", "--quiet", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "clock" / "label.py").write_text(FIXED)
    (repo / "tests" / "test_label.py").write_text(TESTS + NEW_TEST)
    git(repo, "commit", "--quiet", "-am", "fix")
    return TaskSpec(
        instance_id="clock-1",
        repo=str(repo),
        base_commit=base,
        patch=git(repo, "diff", base, "HEAD", "--", "clock"),
        test_patch=git(repo, "diff", base, "HEAD", "--", "tests"),
        fail_to_pass=("tests/test_label.py::test_year_label",),
        pass_to_pass=("tests/test_label.py::test_roman_present",),
        requirements=REQUIREMENTS,
    )


def test_the_environment_makes_the_task_scorable(spec, tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two tasks, one build
        gold = list(pool.map(lambda _: pipeline.score_task(spec, CONFIG, tmp_path), range(2)))
    assert all(v.resolved for v in gold), [(v.failure_kind, v.log_tail[-2000:]) for v in gold]
    assert "environment" in gold[0].timings_s
    built = [p for p in (tmp_path / "envs").iterdir() if (p / "env.json").exists()]
    assert len(built) == 1

    empty = pipeline.score_task(dataclasses.replace(spec, patch=""), CONFIG, tmp_path)
    assert not empty.resolved
    # Without the requirements the tests cannot even import their dependency.
    bare = pipeline.score_task(dataclasses.replace(spec, requirements=()), CONFIG, tmp_path)
    assert not bare.resolved and "roman" in bare.log_tail


def test_a_requirement_pip_cannot_install_fails_that_task_only(spec, tmp_path):
    missing = dataclasses.replace(spec, requirements=("dockyard-no-such-package-xyz==1.0",))
    with pytest.raises(ValueError, match="requirements: pip install failed"):
        pipeline.score_task(missing, CONFIG, tmp_path)
    assert list((tmp_path / "envs" / "staging").iterdir()) == []


@pytest.mark.parametrize(
    "lines,message",
    [
        (["-e ."], "is not a pip requirement specifier"),
        (["pkg @ https://example.invalid/pkg.whl"], "names a URL"),
    ],
)
def test_requirements_are_checked_at_submission(spec, lines, message):
    body = {**dataclasses.replace(spec, requirements=()).to_dict(), "requirements": lines}
    with pytest.raises(TaskValidationError, match=message) as info:
        TaskSpec.from_request(body)
    assert info.value.field == "requirements"
    with pytest.raises(TaskValidationError, match="cannot be combined with an image"):
        TaskSpec.from_request(
            {**body, "requirements": list(REQUIREMENTS), "image": "/images/x.tar"}
        )
    round_trip = TaskSpec.from_request(spec.to_dict())
    assert round_trip == spec


def test_the_key_covers_python_pytest_and_the_sorted_lines(tmp_path):
    cache = repo_envs.RepoEnvCache(tmp_path)
    assert cache.key(["a==1", "b==2"]) == cache.key(["b==2", "a==1"])
    assert cache.key(["a==1"]) != cache.key(["a==2"])
