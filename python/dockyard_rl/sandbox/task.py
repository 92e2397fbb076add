"""The executor's data contract: what a task is (`TaskSpec`) and what scoring it says (`Verdict`).

Shared by the HTTP service (http_app.py), the scoring pipeline (pipeline.py), the task store and
the client, so each side agrees on field names. Both are plain frozen dataclasses with
`to_dict()` / `from_dict()` for JSON; `TaskSpec.from_request` validates a submitted JSON body and
raises `TaskValidationError` naming the field (the service answers 400 with that message).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import posixpath
from typing import Any

from dockyard_rl.sandbox import images, repo_envs


class RewardMode(str, enum.Enum):
    BINARY = "binary"  # 1.0 when resolved (every F2P and every P2P test passes), else 0.0
    PASS_RATE = "pass_rate"  # fraction of F2P + P2P tests that pass; 0.0 on integrity violation


class TaskStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"  # a verdict exists (resolved or not)
    INFRA_ERROR = "infra_error"  # scoring could not finish for reasons outside the patch


class TestOutcome(str, enum.Enum):
    __test__ = False  # not a pytest test class despite its name

    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    MISSING = "missing"  # the test id never appeared in the results: counts as failed


class ApplyMethod(str, enum.Enum):
    EMPTY = "empty"  # empty patch: nothing to apply
    GIT_APPLY = "git_apply"
    GIT_APPLY_3WAY = "git_apply_3way"
    PATCH_FUZZ = "patch_fuzz"
    FAILED = "failed"  # no method applied it
    NOT_ATTEMPTED = "not_attempted"  # integrity violation: the patch was never applied


class FailureKind(str, enum.Enum):
    """Why a verdict is not resolved (`Verdict.failure_kind`); NONE when it is resolved.

    Everything here is the patch's own outcome and scores like any unresolved patch; what a patch
    cannot cause is an infrastructure error instead (no verdict, retried by the service).
    """

    NONE = "none"  # resolved
    TESTS_FAILED = "tests_failed"  # trusted report; some F2P/P2P test did not pass
    INTEGRITY_VIOLATION = "integrity_violation"  # protected files, runner config, symlinks, ...
    PATCH_NOT_APPLIED = "patch_not_applied"  # no applier could apply it
    PATCH_TOO_LARGE = "patch_too_large"  # binary content over the executor's caps
    BREAKS_TEST_PATCH = "breaks_test_patch"  # the gold test patch no longer applies after it
    TAMPERING = "tampering"  # the test process altered its own results
    REPORT_UNTRUSTED = "report_untrusted"  # report missing, malformed or inconsistent
    TIMEOUT = "timeout"  # the wall-clock limit killed the test run
    DISK_LIMIT = "disk_limit"  # the worktree outgrew its size-capped filesystem
    CPU_LIMIT = "cpu_limit"  # a test process was killed at the CPU-time rlimit (SIGXCPU)
    # The patched tree uses a capability that only tampering needs (import hooks, builtins or
    # compile replacement, frames/gc/ctypes/code objects, signals/rlimits/exits, writes to test
    # paths, run-time conftest/plugin creation), or hides its source from screening (binary
    # hunks to text files, non-UTF-8 source encodings). Found by capability_screen.py.
    UNSAFE_CAPABILITY = "unsafe_capability"
    PATCH_INVALID = "patch_invalid"  # the patch text cannot be parsed as a diff


class TaskValidationError(ValueError):
    """A submitted task is malformed; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


DEFAULT_REPO_PATH = "/testbed"  # SWE-bench's images keep the repository here
# Where the sandbox itself mounts things: a repository there would hide them or be hidden.
_RESERVED_ROOTS = ("/proc", "/dev", "/tmp", "/sys", "/run", "/etc", "/.dockyard")


def check_repo_path(repo_path: str) -> None:
    """Raises TaskValidationError unless `repo_path` is a normalized absolute folder that the
    sandbox can mount the repository on."""
    normalized = (
        repo_path.startswith("/")
        and not repo_path.startswith("//")
        and repo_path != "/"
        and "\0" not in repo_path
        and repo_path == posixpath.normpath(repo_path)
    )
    reserved = any(
        repo_path == root or repo_path.startswith(root + "/") for root in _RESERVED_ROOTS
    )
    if not normalized or reserved:
        raise TaskValidationError(
            "repo_path",
            f"must be a normalized absolute folder other than "
            f"/ and outside {', '.join(_RESERVED_ROOTS)}, got {repo_path!r}",
        )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One SWE-bench-style instance plus the agent's patch to score."""

    instance_id: str
    repo: str  # a local path, file:// URL or https URL of a git repository
    base_commit: str
    patch: str  # the agent's patch (unified diff; may be empty)
    test_patch: str  # the gold test patch (held-out tests)
    fail_to_pass: tuple[str, ...]  # test ids (pytest node ids) that must go from failing to passing
    pass_to_pass: tuple[str, ...]  # test ids that must keep passing
    test_command: str | None = None  # default: pytest on the files test_patch touches
    timeout_s: float | None = None  # wall-clock limit of the test run; default from the executor
    reward_mode: RewardMode = RewardMode.BINARY
    task_id: str | None = None  # client-supplied id: resubmitting it is idempotent
    image: str | None = None  # OCI image the tests run in (sandbox/images.py); None: the
    #                                  executor's own interpreter
    repo_path: str = DEFAULT_REPO_PATH  # where the repository sits in the image
    test_harness: str | None = None  # "swebench:<owner/name>@<version>": that runner and log
    #                                  parser (sandbox/swebench_harness.py) instead of pytest
    requirements: tuple[str, ...] = ()  # pip requirements of a per-repository venv
    #                                     (sandbox/repo_envs.py); only without an image

    @classmethod
    def from_request(cls, body: Any) -> TaskSpec:
        """Validates a POST /task/submit JSON body. Lists may be JSON lists or JSON-encoded strings
        (as in the published SWE-bench datasets). Raises TaskValidationError naming the field."""
        if not isinstance(body, dict):
            raise TaskValidationError("body", "must be a JSON object")

        def text(name: str, required: bool = True, allow_empty: bool = False) -> str | None:
            value = body.get(name)
            if value is None:
                if required:
                    raise TaskValidationError(name, "is required")
                return None
            if not isinstance(value, str):
                raise TaskValidationError(name, f"must be a string, got {type(value).__name__}")
            if not allow_empty and not value.strip():
                raise TaskValidationError(name, "must not be empty")
            return value

        def test_ids(name: str) -> tuple[str, ...]:
            value = body.get(name)
            if value is None:
                raise TaskValidationError(name, "is required (a list of test ids, may be empty)")
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise TaskValidationError(
                        name, f"is a string but not a JSON list: {error}"
                    ) from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TaskValidationError(name, "must be a list of test-id strings")
            return tuple(value)

        timeout = body.get("timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= 24 * 3600
        ):
            raise TaskValidationError(
                "timeout_s", f"must be a number of seconds in (0, 86400], got {timeout!r}"
            )
        mode = body.get("reward_mode", RewardMode.BINARY.value)
        try:
            reward_mode = RewardMode(mode)
        except ValueError:
            raise TaskValidationError(
                "reward_mode", f"must be one of {[m.value for m in RewardMode]}, got {mode!r}"
            ) from None
        image = text("image", required=False)
        if image is not None:
            try:
                images.parse_reference(image)
            except images.ImageError as error:
                raise TaskValidationError("image", str(error).removeprefix("image: ")) from None
        repo_path = text("repo_path", required=False)
        if repo_path is not None:
            if image is None:
                raise TaskValidationError("repo_path", "is only meaningful with an image")
            check_repo_path(repo_path)
        test_harness = text("test_harness", required=False)
        requirements = body.get("requirements") or ()
        if requirements:
            if isinstance(requirements, str):
                requirements = requirements.split("\n")
            if not isinstance(requirements, list) or not all(
                isinstance(line, str) for line in requirements
            ):
                raise TaskValidationError(
                    "requirements", "must be a list of pip requirement strings"
                )
            requirements = [line.strip() for line in requirements if line.strip()]
            if image is not None:
                raise TaskValidationError(
                    "requirements", "cannot be combined with an image (install them in the image)"
                )
            try:
                repo_envs.check_requirements(requirements)
            except ValueError as error:
                raise TaskValidationError(
                    "requirements", str(error).removeprefix("requirements: ")
                ) from None
        if test_harness is not None and body.get("test_command") is not None:
            raise TaskValidationError(
                "test_harness", "names the test command itself; leave test_command out"
            )
        # Other SWE-bench fields (problem_statement, hints_text, version, ...) are accepted and
        # ignored: scoring does not need them.
        return cls(
            instance_id=text("instance_id"),
            repo=text("repo"),
            base_commit=text("base_commit"),
            patch=text("patch", allow_empty=True),
            test_patch=text("test_patch"),
            fail_to_pass=test_ids("FAIL_TO_PASS"),
            pass_to_pass=test_ids("PASS_TO_PASS"),
            test_command=text("test_command", required=False),
            timeout_s=float(timeout) if timeout is not None else None,
            reward_mode=reward_mode,
            task_id=text("task_id", required=False),
            image=image,
            repo_path=repo_path or DEFAULT_REPO_PATH,
            test_harness=test_harness,
            requirements=tuple(requirements),
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reward_mode"] = self.reward_mode.value
        data["FAIL_TO_PASS"] = list(data.pop("fail_to_pass"))
        data["PASS_TO_PASS"] = list(data.pop("pass_to_pass"))
        # Tasks that use neither keep the form they always had (the store compares it).
        if self.image is None:
            del data["image"], data["repo_path"]
        if self.test_harness is None:
            del data["test_harness"]
        if self.requirements:
            data["requirements"] = list(self.requirements)
        else:
            del data["requirements"]
        return data


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What scoring one task found. `reward` follows the task's reward mode."""

    resolved: bool
    reward: float
    fail_to_pass: dict[str, TestOutcome]  # test id -> outcome
    pass_to_pass: dict[str, TestOutcome]
    apply_method: ApplyMethod
    integrity_violation: tuple[str, ...]  # files whose edit violated integrity; empty if none
    test_exit_code: int | None  # None when tests did not run (apply failure, violation)
    timed_out: bool
    timings_s: dict[str, float]  # phase -> seconds (checkout, apply, tests, total)
    log_tail: str  # bounded tail of the test run's output
    failure_kind: FailureKind = FailureKind.NONE  # why it is not resolved (NONE when resolved)
    failure_detail: str = ""  # the reason in words ("" when resolved)
    screening_flags: tuple[str, ...] = ()  # static screening of the patch ("category: token")
    # The run ended at the wall-clock or CPU-time limit AND the task's baseline (base commit with
    # the gold tests, no agent patch) hits a limit on this executor too: proven not the patch's
    # doing, so the environment masks the sample like an infra error. A limit the baseline does
    # not hit is the patch's failure (failure_kind timeout / cpu_limit) and this stays False.
    limit_outcome: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["fail_to_pass"] = {k: v.value for k, v in self.fail_to_pass.items()}
        data["pass_to_pass"] = {k: v.value for k, v in self.pass_to_pass.items()}
        data["apply_method"] = self.apply_method.value
        data["integrity_violation"] = list(self.integrity_violation)
        data["failure_kind"] = self.failure_kind.value
        data["screening_flags"] = list(self.screening_flags)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(
            resolved=bool(data["resolved"]),
            reward=float(data["reward"]),
            fail_to_pass={k: TestOutcome(v) for k, v in data["fail_to_pass"].items()},
            pass_to_pass={k: TestOutcome(v) for k, v in data["pass_to_pass"].items()},
            apply_method=ApplyMethod(data["apply_method"]),
            integrity_violation=tuple(data["integrity_violation"]),
            test_exit_code=data["test_exit_code"],
            timed_out=bool(data["timed_out"]),
            timings_s=dict(data["timings_s"]),
            log_tail=data["log_tail"],
            # Verdicts stored by an older executor lack these four.
            failure_kind=FailureKind(data.get("failure_kind", FailureKind.NONE.value)),
            failure_detail=data.get("failure_detail", ""),
            screening_flags=tuple(data.get("screening_flags", ())),
            limit_outcome=bool(data.get("limit_outcome", False)),
        )
