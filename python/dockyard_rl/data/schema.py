"""The SWE-bench instance schema (`SweInstance`) and its validation on load.

A row of a SWE-bench, SWE-Gym or SWE-smith release (a JSON object or a datasets row) becomes a
frozen `SweInstance` through `SweInstance.from_row`, which raises `DatasetError` naming the source,
the row index and the field at fault, so a bad row in a 20,000-row file is found at load time,
not mid-training. `to_task_spec(patch)` turns an instance plus the model's patch into the sandbox
executor's `TaskSpec`.

FAIL_TO_PASS / PASS_TO_PASS may be JSON lists or JSON-encoded strings (the published datasets
use strings). `hints_text`, `version`, `environment_setup_commit` and `created_at` are optional
(SWE-smith rows lack some of them) and default to "". Columns outside the schema are ignored.

Not covered: checking that base_commit exists in the repository or that the patches apply (the
executor does that when it scores), and multi-language test specs (only `test_command`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from dockyard_rl.sandbox import swebench_harness
from dockyard_rl.sandbox.task import DEFAULT_REPO_PATH, RewardMode, TaskSpec


class DatasetError(ValueError):
    """A dataset row is malformed; the message names the source, row index and field."""

    def __init__(self, source: str, row_index: int, field: str, message: str):
        super().__init__(f"{source}: row {row_index}: field {field!r}: {message}")
        self.source = source
        self.row_index = row_index
        self.field = field


_REQUIRED_TEXT = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
_OPTIONAL_TEXT = ("hints_text", "version", "environment_setup_commit", "created_at")


@dataclasses.dataclass(frozen=True)
class SweInstance:
    """One SWE task: a repository at a commit, the issue, the gold fix and the held-out tests."""

    instance_id: str
    repo: str  # "owner/name", a local path or a git URL the executor can clone
    base_commit: str
    patch: str  # the gold fix (unified diff); used for code context and checks
    test_patch: str  # the held-out tests (unified diff)
    FAIL_TO_PASS: tuple[str, ...]  # test ids that must go from failing to passing
    PASS_TO_PASS: tuple[str, ...]  # test ids that must keep passing
    problem_statement: str
    hints_text: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    created_at: str = ""
    test_command: str | None = None  # None: the executor's default (pytest on test_patch files)
    image: str | None = None  # OCI image the tests run in (sandbox/images.py references)
    repo_path: str | None = None  # the repository's folder in the image (None: /testbed)
    test_harness: str | None = None  # None: swebench_harness.harness_for_row(repo, version)
    requirements: tuple[str, ...] = ()  # pip requirements of a per-repository venv (no image)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], row_index: int, source: str) -> SweInstance:
        """Validates one row. Raises DatasetError(source, row_index, field) on the first bad
        field: a missing or non-string text field, an empty required one, or a test list that is
        neither a JSON list of strings nor a string encoding one."""
        if not isinstance(row, Mapping):
            raise DatasetError(
                source, row_index, "<row>", f"must be a JSON object, got {type(row).__name__}"
            )

        def text(name: str, required: bool) -> str:
            value = row.get(name)
            if value is None:
                if required:
                    raise DatasetError(source, row_index, name, "is required")
                return ""
            if not isinstance(value, str):
                # Some releases store version as a number (e.g. 3.0); keep its text.
                if (
                    name == "version"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    return str(value)
                raise DatasetError(
                    source, row_index, name, f"must be a string, got {type(value).__name__}"
                )
            if required and not value.strip():
                raise DatasetError(source, row_index, name, "must not be empty")
            return value

        def test_ids(name: str) -> tuple[str, ...]:
            value = row.get(name)
            if value is None:
                raise DatasetError(
                    source, row_index, name, "is required (a list of test ids, may be empty)"
                )
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise DatasetError(
                        source, row_index, name, f"is a string but not a JSON list: {error}"
                    ) from None
            # datasets/pyarrow may hand list columns over as tuples or numpy arrays.
            if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
                value = value.tolist()
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise DatasetError(source, row_index, name, "must be a list of test-id strings")
            return tuple(value)

        fields: dict[str, Any] = {name: text(name, True) for name in _REQUIRED_TEXT}
        fields.update({name: text(name, False) for name in _OPTIONAL_TEXT})
        fields["FAIL_TO_PASS"] = test_ids("FAIL_TO_PASS")
        fields["PASS_TO_PASS"] = test_ids("PASS_TO_PASS")
        command = text("test_command", False)
        fields["test_command"] = command if command.strip() else None
        for name in ("image", "repo_path", "test_harness"):
            fields[name] = text(name, False).strip() or None
        requirements = row.get("requirements") or []
        if isinstance(requirements, str):
            requirements = requirements.splitlines()
        if not isinstance(requirements, (list, tuple)) or not all(
            isinstance(line, str) for line in requirements
        ):
            raise DatasetError(
                source, row_index, "requirements", "must be a list of pip requirement strings"
            )
        fields["requirements"] = tuple(line.strip() for line in requirements if line.strip())
        if not fields["FAIL_TO_PASS"]:
            # Without a failing test there is nothing to resolve: every patch would score 1.
            raise DatasetError(
                source,
                row_index,
                "FAIL_TO_PASS",
                "must list at least one test that the fix makes pass",
            )
        return cls(**fields)

    def to_row(self) -> dict[str, Any]:
        """The SWE-bench JSON form (test lists as JSON lists); `from_row` reads it back."""
        data = dataclasses.asdict(self)
        data["FAIL_TO_PASS"] = list(self.FAIL_TO_PASS)
        data["PASS_TO_PASS"] = list(self.PASS_TO_PASS)
        for name in ("test_command", "image", "repo_path", "test_harness"):
            if data[name] is None:
                del data[name]
        if self.requirements:
            data["requirements"] = list(self.requirements)
        else:
            del data["requirements"]
        return data

    def to_task_spec(
        self,
        patch: str,
        *,
        repo_url: str | None = None,
        timeout_s: float | None = None,
        reward_mode: RewardMode = RewardMode.BINARY,
        task_id: str | None = None,
    ) -> TaskSpec:
        """The executor task scoring `patch` (the model's unified diff; may be empty) on this
        instance. `repo_url` overrides `repo` when the dataset names a GitHub "owner/name" but
        the executor clones from a local mirror."""
        return TaskSpec(
            instance_id=self.instance_id,
            repo=repo_url or self.repo,
            base_commit=self.base_commit,
            patch=patch,
            test_patch=self.test_patch,
            fail_to_pass=self.FAIL_TO_PASS,
            pass_to_pass=self.PASS_TO_PASS,
            test_command=self.test_command,
            timeout_s=timeout_s,
            reward_mode=reward_mode,
            task_id=task_id,
            image=self.image,
            repo_path=self.repo_path or DEFAULT_REPO_PATH,
            test_harness=self.harness(),
            requirements=self.requirements,
        )

    def harness(self) -> str | None:
        """The runner that grades this instance: its `test_harness`, or for a SWE-bench row of a
        repository the harness runs with Django's, sympy's or another non-pytest runner, that
        harness (sandbox/swebench_harness.py); None means our pytest runner."""
        if self.test_harness is not None or self.test_command is not None:
            return self.test_harness
        return swebench_harness.harness_for_row(self.repo, self.version)
