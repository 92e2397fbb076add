"""`SampleOutcome`: what the reward-shaping stages know about one scored sample.

The environment fills one per sample after the sandbox's verdict: the raw reward, how long the
response was, what the patch did, which test files the task holds out, and what the sandbox's
static screening of the patch flagged. The stages in
`dockyard_rl.rewards.shaping` read it and never change it.

Covered: validation of the fields (ValueError naming the field), so a wrongly filled record fails
where it is built rather than inside a stage. Not covered: how the fields are obtained (parsing
the model's output, applying the patch, running the tests — the environment and the sandbox do).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["EPISODE_ENDS", "SCREENING_CATEGORIES", "SampleOutcome", "screening_category"]

# The categories of the sandbox's static screening of a patch (dockyard_rl.sandbox.screening
# writes its flags as "category: token"). Listed here so the reward config can be checked at
# start-up without importing the sandbox.
SCREENING_CATEGORIES: tuple[str, ...] = (
    "runner_internals",  # the test runner's objects and hooks (_pytest, pluggy, TestReport...)
    "report_path",  # the results report (junitxml, its path)
    "process_arguments",  # the process's own arguments (sys.argv, /proc/self/cmdline)
    "exit_hook",  # code run at interpreter exit (atexit, sys.exitfunc)
    "forced_exit",  # exits that skip the runner (os._exit, kill of its own process)
    "introspection",  # stack frames, gc.get_objects, audit hooks
    "binary_content",  # a git binary hunk: content the screening cannot read
)


# How a multi-turn episode can end (SampleOutcome.episode_end); every one but "submit" means the
# agent stopped without deciding it was done.
EPISODE_ENDS: tuple[str, ...] = ("submit", "turn_limit", "context_limit", "budget")


def screening_category(flag: str) -> str:
    """The category of a screening flag: "forced_exit: os._exit" -> "forced_exit"."""
    return flag.partition(":")[0].strip()


@dataclasses.dataclass(frozen=True)
class SampleOutcome:
    """One sample's raw verdict and the facts the shaping stages need.

    Attributes:
        reward: the raw reward from the sandbox's verdict (e.g. 1.0 resolved, 0.0 not); finite.
        response_length: number of generated tokens, >= 0.
        max_response_length: the generation limit in tokens for this sample, >= 1.
        response_text: the decoded response (read by the thinking-format check).
        patch_parsed: a patch could be extracted from the response.
        patch_applied: whether the patch applied to the repository; None when it was not tried
            (no patch, or the sandbox could not say). Must not be True when patch_parsed is False.
        touched_files: repository paths the patch touches (any spelling: a/ b/ prefixes and
            ./ are normalised by the integrity check). A list is stored as a tuple.
        held_out_files: test files that come with the task (from its test patch), same rules.
        thinking_required: the response must hold a well-formed <think>...</think> block.
        screening_flags: what the sandbox's static screening flagged in the patch, each
            "category: token" (e.g. "forced_exit: os._exit"; categories in
            SCREENING_CATEGORIES). A list is stored as a tuple.
        episode_end: how a multi-turn episode ended: "submit" (the agent submitted),
            "turn_limit" (out of turns), "context_limit" (out of tokens) or "budget" (the
            executor session's budget was spent); None for a single-shot sample.
        patch_text: the patch the sandbox scored (a unified diff; "" when there was none).
        reference_patch: the task's reference (gold) fix as a unified diff, "" when the task
            has none; only the `reference_similarity` stage reads it, and never for a prompt.
    """

    reward: float
    response_length: int
    max_response_length: int
    response_text: str = ""
    patch_parsed: bool = True
    patch_applied: bool | None = None
    touched_files: tuple[str, ...] = ()
    held_out_files: tuple[str, ...] = ()
    thinking_required: bool = False
    screening_flags: tuple[str, ...] = ()
    episode_end: str | None = None
    patch_text: str = ""
    reference_patch: str = ""

    def __post_init__(self):
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
            raise ValueError(f"reward: must be a number, got {type(self.reward).__name__}")
        if not math.isfinite(self.reward):
            raise ValueError(
                f"reward: must be finite, got {self.reward}; exclude a sample without a usable "
                "verdict from the loss instead of shaping it"
            )
        object.__setattr__(self, "reward", float(self.reward))
        for name in ("response_length", "max_response_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an int, got {type(value).__name__}")
        if self.response_length < 0:
            raise ValueError(f"response_length: must be >= 0, got {self.response_length}")
        if self.max_response_length < 1:
            raise ValueError(f"max_response_length: must be >= 1, got {self.max_response_length}")
        for name in ("response_text", "patch_text", "reference_patch"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a str, got {type(getattr(self, name)).__name__}")
        for name in ("patch_parsed", "thinking_required"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.patch_applied is not None and not isinstance(self.patch_applied, bool):
            raise ValueError(f"patch_applied: must be a bool or None, got {self.patch_applied!r}")
        if self.patch_applied and not self.patch_parsed:
            raise ValueError(
                "patch_applied: is True but patch_parsed is False; a patch that was "
                "not parsed cannot have been applied"
            )
        for name in ("touched_files", "held_out_files"):
            object.__setattr__(self, name, _strings(name, getattr(self, name), "path"))
        object.__setattr__(
            self, "screening_flags", _strings("screening_flags", self.screening_flags, "flag")
        )
        if self.episode_end is not None and self.episode_end not in EPISODE_ENDS:
            raise ValueError(
                f"episode_end: must be one of {EPISODE_ENDS} or None, got {self.episode_end!r}"
            )


def _strings(name: str, value: Sequence[str], what: str) -> tuple[str, ...]:
    # A bare string is a Sequence[str] too; taking it letter by letter would be a silent bug.
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{name}: must be a list of {what}s, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(
                f"{name}: every {what} must be a str, got {type(item).__name__} {item!r}"
            )
    return tuple(value)
