"""Tests under runners other than pytest, with the official SWE-bench harness's commands and
parsers.

    harness = parse_harness("swebench:django/django@4.0")        # ValueError names the problem
    commands = harness.test_commands(spec.test_patch, image)      # eval commands + test command
    run = runner.run_script(commands, worktree, limits, image=image, worktree_dir=...)
    grade = harness.grade(run, spec.instance_id, spec.fail_to_pass, spec.pass_to_pass,
                          spec.reward_mode)

A task opts in with `test_harness: "swebench:<owner/name>@<version>"`, the `repo` and `version` of
its SWE-bench row. From the `swebench` package (PyPI, 4.x; imported on first use, and only its
harness modules: the package's own `__init__` files pull in docker, modal and the dataset tools,
which the sandbox image leaves out) come:
- the test command: `MAP_REPO_VERSION_TO_SPECS[repo][version]["test_cmd"]` (Django's
  `./tests/runtests.py ...`, sympy's `bin/test ...`, `tox ...`, or pytest for the others), run on
  the harness's test directives (`get_test_directives`: the files the test patch touches, as
  module labels for Django), after the spec's `eval_commands`; in an image with SWE-bench's conda
  layout, the `testbed` environment is activated first, as the harness does;
- the parser: `MAP_REPO_TO_PARSER[repo]`, which turns the log into test -> status. A test passes
  when its status is PASSED or XFAIL (the harness's rule); FAIL_TO_PASS and PASS_TO_PASS ids are
  matched exactly as the parser names them, and a test the log does not name is MISSING.
Only Python repositories are accepted (the harness's other languages need their own directives).

Where swebench cannot be loaded, nothing falls back to the pytest runner: the dataset side
(`harness_for_row`) raises HarnessUnavailableError, and the executor refuses a task that names a
harness (`parse_harness`: ValueError, a 400 on field test_harness). Every lock the executor and the
dataset side run from holds swebench (tests/swebench_harness_test.py checks it).

Forgeability: these outcomes come from the log the tests print, and the code under test can print
anything, e.g. "test_x ... ok". What contains that: the patch still passes every integrity check
before any test runs (protected test files, runner configuration, symlinks, tree audit; the test
patch is re-applied after it), the runner script the test command names (`tests/runtests.py`,
`bin/test`) is protected like a test file, the run must reach the completion line whose nonce
only the executor's shell knows (a killed or crashed run is REPORT_UNTRUSTED, never parsed as
passing), and the verdict carries the flag "evidence: parsed_log" so the reward side can weigh or
audit such verdicts. It is still weaker than the pytest runner's streamed records, JUnit report,
canaries and tampering checks, which is why pytest tasks never take this path.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import posixpath
import shlex
import sys
import types
from collections.abc import Sequence

from dockyard_rl.sandbox import grading, images
from dockyard_rl.sandbox.runner import ScriptRun
from dockyard_rl.sandbox.task import FailureKind, RewardMode, TestOutcome

PREFIX = "swebench:"
EVIDENCE_FLAG = "evidence: parsed_log"
SWEBENCH_MAJOR = 4  # requirements/*.in pin 4.1.0
# SWE-bench's images keep a conda install here with the repository's environment "testbed".
_CONDA_ACTIVATE = "/opt/miniconda3/bin/activate"
_STATUS_TO_OUTCOME = {
    "PASSED": TestOutcome.PASSED,
    "XFAIL": TestOutcome.PASSED,
    "FAILED": TestOutcome.FAILED,
    "ERROR": TestOutcome.ERROR,
    "SKIPPED": TestOutcome.SKIPPED,
}


class HarnessUnavailableError(RuntimeError):
    """The swebench package cannot be loaded here: a set-up error of this environment (every
    lock the executor and the dataset side run from holds it), never a reason to grade a row that
    needs the harness with the pytest runner instead."""


class _ImportedByNameOnly(types.ModuleType):
    """Stands in for a module that a harness file imports at its top but whose functions we never
    call (`datasets` in swebench/harness/utils.py: its dataset loaders)."""

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def unavailable(*args, **kwargs):
            raise HarnessUnavailableError(
                f"{self.__name__}.{attribute}: not installed in this environment (the sandbox "
                f"image installs only what the harness's specs and parsers need)"
            )

        return unavailable


def _load_harness_modules():
    """Imports the four harness modules we use without running `swebench/__init__.py` and
    `swebench/harness/__init__.py`: those import docker, modal, ghapi and the dataset collectors,
    which the sandbox image does not install (requirements/sandbox.in). The two packages are
    registered as empty packages over the installed folders; the modules themselves are the
    installed files, unchanged. A `datasets` that is not installed is replaced by a placeholder
    while they load (harness/utils.py imports its loaders by name) and removed again."""
    if "swebench" not in sys.modules:
        found = importlib.util.find_spec("swebench")
        if found is None or not found.submodule_search_locations:
            raise ImportError("No module named 'swebench'", name="swebench")
        root = pathlib.Path(list(found.submodule_search_locations)[0])
        for name, folder in (("swebench", root), ("swebench.harness", root / "harness")):
            if name not in sys.modules:
                package_spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
                package_spec.submodule_search_locations = [str(folder)]
                sys.modules[name] = importlib.util.module_from_spec(package_spec)
    placeholder = None
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        placeholder = sys.modules["datasets"] = _ImportedByNameOnly("datasets")
    try:
        constants = importlib.import_module("swebench.harness.constants")
        log_parsers = importlib.import_module("swebench.harness.log_parsers")
        python_specs = importlib.import_module("swebench.harness.test_spec.python")
        test_spec = importlib.import_module("swebench.harness.test_spec.test_spec")
    finally:
        if placeholder is not None and sys.modules.get("datasets") is placeholder:
            del sys.modules["datasets"]
    return constants, log_parsers, python_specs, test_spec.TestSpec


@functools.cache
def _swebench():
    """The harness's tables, imported once. Raises HarnessUnavailableError when swebench (4.x)
    or what its harness modules import is missing."""
    try:
        version = importlib.metadata.version("swebench")
        loaded = _load_harness_modules()
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        raise HarnessUnavailableError(
            f"the swebench package cannot be loaded in this environment ({error}); "
            f"requirements/cpu.lock.txt, cuda.lock.txt and sandbox.lock.txt all hold it"
        ) from error
    if not version.startswith(f"{SWEBENCH_MAJOR}."):
        raise HarnessUnavailableError(
            f"swebench {version} is installed; this harness needs {SWEBENCH_MAJOR}.x (5.x expects "
            f"the test commands in each row)"
        )
    return loaded


@dataclasses.dataclass(frozen=True)
class Harness:
    """One repository/version of the SWE-bench harness (module docstring)."""

    repo: str
    version: str

    @property
    def spec(self) -> dict:
        constants, _, _, _ = _swebench()
        return constants.MAP_REPO_VERSION_TO_SPECS[self.repo][self.version]

    def test_commands(self, test_patch: str, image: images.Image | None) -> list[str]:
        """The shell lines that run this version's tests on the test patch's files; in an image
        with SWE-bench's conda layout the `testbed` environment is activated first."""
        _, _, python_specs, _ = _swebench()
        conda = image is not None and os.path.lexists(image.rootfs / _CONDA_ACTIVATE.lstrip("/"))
        directives = python_specs.get_test_directives({"repo": self.repo, "test_patch": test_patch})
        activate = [f"source {_CONDA_ACTIVATE}", "conda activate testbed"] if conda else []
        return [
            *activate,
            *self.spec.get("eval_commands", []),
            " ".join([self.spec["test_cmd"], *map(shlex.quote, directives)]),
        ]

    def protected_files(self) -> list[str]:
        """The runner scripts the test command names (`./tests/runtests.py`, `bin/test`): like
        the test files, a patch must not edit them (it could print any result)."""
        words = shlex.split(self.spec["test_cmd"])
        return sorted(
            {
                posixpath.normpath(word)
                for word in words
                if "/" in word and not word.startswith(("-", "/")) and "=" not in word
            }
        )

    def parse(
        self, log: str, instance_id: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]
    ) -> dict[str, str]:
        """The harness parser's test -> status map for `log`."""
        constants, log_parsers, _, test_spec_class = _swebench()
        test_spec = test_spec_class(
            instance_id=instance_id,
            repo=self.repo,
            version=self.version,
            repo_script_list=[],
            eval_script_list=[],
            env_script_list=[],
            arch="x86_64",
            FAIL_TO_PASS=list(fail_to_pass),
            PASS_TO_PASS=list(pass_to_pass),
            language="py",
            docker_specs={},
            namespace=None,
        )
        return log_parsers.MAP_REPO_TO_PARSER[self.repo](log, test_spec)

    def grade(
        self,
        run: ScriptRun,
        instance_id: str,
        fail_to_pass: Sequence[str],
        pass_to_pass: Sequence[str],
        reward_mode: RewardMode,
    ) -> grading.Grade:
        """The verdict's grade for a run of `test_commands`."""
        notes = (EVIDENCE_FLAG,)
        if run.result.timed_out:
            return grading.ungraded(
                fail_to_pass,
                pass_to_pass,
                FailureKind.TIMEOUT,
                "the test run was killed at the wall-clock limit",
                notes,
            )
        if run.exit_status is None:
            return grading.ungraded(
                fail_to_pass,
                pass_to_pass,
                FailureKind.REPORT_UNTRUSTED,
                f"the test command did not finish (sandbox exit status "
                f"{run.result.exit_code}): a crash, a forced exit or a kill; its log is not "
                f"graded",
                notes,
            )
        try:
            statuses = self.parse(run.log, instance_id, fail_to_pass, pass_to_pass)
        except Exception as error:  # noqa: BLE001 - a third-party parser on a hostile log
            # The log is the tests' output: whatever the parser raises on it is the patch's
            # doing, never an infrastructure error (the logs are hostile evidence).
            return grading.ungraded(
                fail_to_pass,
                pass_to_pass,
                FailureKind.REPORT_UNTRUSTED,
                f"the harness's log parser failed on the test log: {type(error).__name__}: "
                f"{str(error)[:200]}",
                notes,
            )
        if not isinstance(statuses, dict):
            statuses = {}

        def outcome(test_id: str) -> TestOutcome:
            status = statuses.get(test_id, "")
            return _STATUS_TO_OUTCOME.get(
                status if isinstance(status, str) else "", TestOutcome.MISSING
            )

        return grading.grade_outcomes(fail_to_pass, pass_to_pass, outcome, reward_mode, notes)


def parse_harness(value: str) -> Harness:
    """Reads a task's `test_harness` ("swebench:<owner/name>@<version>"); raises ValueError
    naming the field and what the harness knows."""
    if not value.startswith(PREFIX) or "@" not in value:
        raise ValueError(
            f"test_harness: must look like 'swebench:<owner/name>@<version>' (the "
            f"SWE-bench row's repo and version), got {value!r}"
        )
    repo, _, version = value[len(PREFIX) :].rpartition("@")
    try:
        constants, log_parsers, _, _ = _swebench()
    except HarnessUnavailableError as error:
        # The executor refuses the task (400, field test_harness) rather than grading it with
        # the pytest runner: the client side raises on that answer, loudly.
        raise ValueError(f"test_harness: {value!r} cannot be graded here: {error}") from None
    specs, parsers = constants.MAP_REPO_VERSION_TO_SPECS, log_parsers.MAP_REPO_TO_PARSER_PY
    if repo not in specs or repo not in parsers:
        known = ", ".join(sorted(set(specs) & set(parsers)))
        raise ValueError(
            f"test_harness: the swebench harness has no Python repository {repo!r} (known: {known})"
        )
    if version not in specs[repo]:
        raise ValueError(
            f"test_harness: the swebench harness has no version {version!r} of "
            f"{repo} (known: {', '.join(sorted(specs[repo]))})"
        )
    return Harness(repo=repo, version=version)


def harness_for_row(repo: str, version: str) -> str | None:
    """The `test_harness` a SWE-bench row needs: "swebench:<repo>@<version>" when the harness
    knows that Python repository and version and runs its tests with something other than pytest
    (pytest tasks keep our stronger pytest runner); None otherwise, and always for a `repo` that
    is a path or URL rather than "owner/name".

    Raises HarnessUnavailableError for an "owner/name" row with a version when swebench cannot be
    loaded: without its tables nobody can tell a Django or sympy row from a pytest one, and
    grading the former with the pytest runner would score every patch wrong."""
    if not version or repo.count("/") != 1 or repo.startswith((".", "/")) or ":" in repo:
        return None
    _swebench()
    try:
        harness = parse_harness(f"{PREFIX}{repo}@{version}")
    except ValueError:
        return None
    runner_word = shlex.split(harness.spec["test_cmd"])[0]
    return None if runner_word in ("pytest", "py.test") else f"{PREFIX}{repo}@{version}"
