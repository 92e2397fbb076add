"""Reward shaping: an ordered list of stages, configured from YAML, turns raw verdicts into rewards.

    rewards:
      stages:
        - {type: integrity}
        - {type: invalid_action, penalty: -1.0}
        - {type: screening, penalty: -1.0, categories: [forced_exit, exit_hook, report_path]}
        - {type: malformed_thinking, penalty: -1.0}
        - {type: overlong, threshold: 3072, max_length: 4096, max_penalty: 1.0}
        - {type: scale, scale: 2.0, shift: -1.0, clip_min: -1.0, clip_max: 1.0}

(`reference_similarity` is not in that list: it is an opt-in learning aid, below.)

Stages run in list order; each receives the reward the previous one produced (the first gets the
sandbox's raw reward, `SampleOutcome.reward`), so the order is part of the recipe. The order above
is the usual one: verdict-level judgements first (integrity, invalid action, screening, format),
then length shaping, then the affine map into the trainer's range. Each type may appear once, so
metadata and metric keys are unambiguous. An empty list leaves the raw rewards unchanged.

Stage types and their keys (defaults in brackets):

- `integrity` (no keys): the patch touches a held-out test file -> reward 0.0. Paths are
  normalised first (see `dockyard_rl.rewards.held_out_tests`), so "a/", "./" or "//" cannot hide
  a file. Metadata: `integrity/violated_files` (the held-out files it touched).
- `invalid_action`: `penalty` [-1.0]. No parsable patch (`patch_parsed` False) or a patch that did
  not apply (`patch_applied` False; None = not tried, not penalised) -> the reward BECOMES
  `penalty`. Metadata: `invalid_action/reason` ("no_patch" | "patch_not_applied" | None).
- `screening`: `penalty` [-1.0], `categories` [null = every category; else a non-empty list of
  names from `SCREENING_CATEGORIES`: runner_internals, report_path, process_arguments, exit_hook,
  forced_exit, introspection, binary_content]. A patch the sandbox's static screening flagged
  (`screening_flags`, "category: token") in one of `categories` -> the reward BECOMES `penalty`,
  whatever the tests said (reaching for the runner's internals, the report or a forced exit is an
  attempt on the verdict even when the executor's runtime checks saw nothing). The flags are
  static matches and can hit honest code (a CLI fix reads sys.argv; `binary_content` is every
  binary hunk): choose `categories` for the task set. Metadata: `screening/flags` (the flags that
  matched `categories`).
- `malformed_thinking`: `penalty` [-1.0], `tag` ["think"], `opening_tag_in_prompt` [false]. When
  `thinking_required`, a malformed thinking block (see `dockyard_rl.rewards.thinking`) -> the
  reward BECOMES `penalty`. Metadata: `malformed_thinking/reason`.
- `overlong` (DAPO's soft overlong punishment): `threshold` [required], `max_length` [null = the
  sample's `max_response_length`], `max_penalty` [1.0, >= 0]. ADDS
  `-max_penalty * clip((length - threshold) / (max_length - threshold), 0, 1)`: 0 up to
  `threshold`, linear down to `-max_penalty` at `max_length`, `-max_penalty` beyond.
  Metadata: `overlong/penalty` (<= 0).
- `turn_limit` (multi-turn episodes): `penalty` [-0.5, <= 0]. An episode that ended without the
  agent's `submit` (out of turns, tokens or session budget: `episode_end` not "submit") ADDS
  `penalty`; its final diff was still scored, so a fix left unsubmitted keeps most of its reward
  but less than a submitted one. Single-shot samples (`episode_end` None) are untouched.
  Metadata: `turn_limit/episode_end`.
- `scale`: `scale` [1.0], `shift` [0.0], `clip_min` [null], `clip_max` [null].
  reward -> clip(scale * reward + shift, clip_min, clip_max). Metadata: `scale/clipped`.
- `reference_similarity` (SWE-RL's similarity reward, as partial credit): `weight` [0.5, in (0, 1)],
  `baseline` [0.0, in [0, 1)]. A patch that applied (`patch_applied` True) and did NOT resolve its
  task (raw reward <= 0), touches no held-out file and carries no screening flag ADDS `weight *
  (patch_similarity(patch_text, reference_patch) - baseline)`
  (`dockyard_rl.rewards.patch_similarity`: the changed lines' SequenceMatcher ratio, in [0, 1]).
  With `baseline` > 0 an edit further from the fix than `baseline` (a rewritten function scores
  ~0.1-0.3) earns less than 0, which is what an unchanged copy (a NO_CHANGE answer) earns when
  `invalid_action`'s penalty is 0; so GRPO does not trade a faithful copy for any change that
  applies. Everything else is untouched: a resolved sample keeps its verdict, so with `weight` < 1
  it always out-earns every unresolved one; a patch that did not apply, touched held-out tests or
  was flagged earns nothing from it, in any stage order; a task without a reference patch gets
  nothing. It pays for nearness to the fix, not for the fix, so it is off unless a recipe lists it
  (none of the shipped ones does yet; docs/learning_run.md has what it was tried on); validation's
  resolve rate and pass@k count verdicts, not shaped rewards. Metadata:
  `reference_similarity/similarity` (None when not paid). Metric:
  `reference_similarity/mean_similarity` (over the samples it paid).

Per-sample metadata (a flat dict, JSON-friendly): `raw_reward`, `reward` (final), and for each
stage `<type>/triggered` (the stage acted: penalised, zeroed, clipped) plus the keys above.
Aggregate metrics: `num_samples`, `raw_reward/mean`, `reward/mean`, `<type>/num_triggered`,
`<type>/fraction_triggered`, per-reason counts `<type>/num_<reason>`, `overlong/mean_penalty`.

Not covered: producing the `SampleOutcome`s (the environment does), group-level shaping (that is
the advantage computation's job), and masking samples out of the loss.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from dockyard_rl.rewards.held_out_tests import held_out_violations
from dockyard_rl.rewards.outcome import SCREENING_CATEGORIES, SampleOutcome, screening_category
from dockyard_rl.rewards.patch_similarity import patch_similarity
from dockyard_rl.rewards.thinking import check_thinking_format, validate_tag
from dockyard_rl.utils.config import from_dict, is_int, require, require_bool

__all__ = [
    "STAGE_TYPES",
    "IntegrityStageConfig",
    "InvalidActionStageConfig",
    "MalformedThinkingStageConfig",
    "OverlongStageConfig",
    "ReferenceSimilarityStageConfig",
    "RewardPipeline",
    "RewardShapingConfig",
    "ScaleStageConfig",
    "ScreeningStageConfig",
    "ShapingResult",
    "StageResult",
    "TurnLimitStageConfig",
]


def _require_number(value: Any, key: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    require(
        is_number and math.isfinite(value),
        key,
        f"must be a finite number{' or null' if optional else ''}, got {value!r}",
    )


def _require_int(value: Any, key: str, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    require(
        is_int(value) and value >= minimum,
        key,
        f"must be an integer >= {minimum}{' or null' if optional else ''}, got {value!r}",
    )


# --- Stage configs: one frozen dataclass per `type`. ----------------------------------------


@dataclasses.dataclass(frozen=True)
class IntegrityStageConfig:
    """`{type: integrity}`: zero the reward of a patch that touches a held-out test file."""

    stage_type: ClassVar[str] = "integrity"


@dataclasses.dataclass(frozen=True)
class InvalidActionStageConfig:
    """`{type: invalid_action, penalty}`: no parsable patch / patch not applied -> `penalty`."""

    stage_type: ClassVar[str] = "invalid_action"
    penalty: float = -1.0

    def __post_init__(self):
        _require_number(self.penalty, "penalty")


@dataclasses.dataclass(frozen=True)
class ScreeningStageConfig:
    """`{type: screening, penalty, categories}`: a flagged patch -> `penalty`."""

    stage_type: ClassVar[str] = "screening"
    penalty: float = -1.0
    categories: tuple[str, ...] | None = None  # None: every category

    def __post_init__(self):
        _require_number(self.penalty, "penalty")
        if self.categories is None:
            return
        valid = ", ".join(SCREENING_CATEGORIES)
        require(
            not isinstance(self.categories, (str, Mapping))
            and isinstance(self.categories, Sequence),
            "categories",
            f"must be a list of screening categories ({valid}) or null for every category, got "
            f"{type(self.categories).__name__} ({self.categories!r})",
        )
        require(
            len(self.categories) > 0,
            "categories",
            "must not be empty (null = every category; drop the stage to penalise none)",
        )
        unknown = [name for name in self.categories if name not in SCREENING_CATEGORIES]
        require(
            not unknown,
            "categories",
            f"unknown screening categor{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(map(repr, unknown))}; valid: {valid}",
        )
        object.__setattr__(self, "categories", tuple(self.categories))


@dataclasses.dataclass(frozen=True)
class MalformedThinkingStageConfig:
    """`{type: malformed_thinking, penalty, tag, opening_tag_in_prompt}`: bad tags -> `penalty`."""

    stage_type: ClassVar[str] = "malformed_thinking"
    penalty: float = -1.0
    tag: str = "think"
    opening_tag_in_prompt: bool = False

    def __post_init__(self):
        _require_number(self.penalty, "penalty")
        try:
            validate_tag(self.tag)
        except ValueError as error:
            raise ValueError(f"tag: {error}") from None
        require_bool(self, "opening_tag_in_prompt")


@dataclasses.dataclass(frozen=True)
class OverlongStageConfig:
    """`{type: overlong, threshold, max_length, max_penalty}`: DAPO soft overlong punishment."""

    stage_type: ClassVar[str] = "overlong"
    # Required; None only so that a missing key gets this message instead of a TypeError.
    threshold: int | None = None
    max_length: int | None = None
    max_penalty: float = 1.0

    def __post_init__(self):
        require(
            self.threshold is not None,
            "threshold",
            "is required: the response length (tokens) where the penalty starts, e.g. 3072 "
            "for a 4096-token limit",
        )
        _require_int(self.threshold, "threshold", 0)
        _require_int(self.max_length, "max_length", 1, optional=True)
        if self.max_length is not None:
            require(
                self.max_length > self.threshold,
                "max_length",
                f"must be greater than threshold ({self.threshold}), got {self.max_length}",
            )
        _require_number(self.max_penalty, "max_penalty")
        require(
            self.max_penalty >= 0,
            "max_penalty",
            f"must be >= 0 (the size of the penalty; it is subtracted), got {self.max_penalty}",
        )


@dataclasses.dataclass(frozen=True)
class TurnLimitStageConfig:
    """`{type: turn_limit, penalty}`: a multi-turn episode that ended unsubmitted -> + `penalty`."""

    stage_type: ClassVar[str] = "turn_limit"
    penalty: float = -0.5

    def __post_init__(self):
        _require_number(self.penalty, "penalty")
        require(
            self.penalty <= 0,
            "penalty",
            f"must be <= 0 (it is added to the reward), got {self.penalty}",
        )


@dataclasses.dataclass(frozen=True)
class ScaleStageConfig:
    """`{type: scale, scale, shift, clip_min, clip_max}`: clip(scale * r + shift)."""

    stage_type: ClassVar[str] = "scale"
    scale: float = 1.0
    shift: float = 0.0
    clip_min: float | None = None
    clip_max: float | None = None

    def __post_init__(self):
        _require_number(self.scale, "scale")
        _require_number(self.shift, "shift")
        _require_number(self.clip_min, "clip_min", optional=True)
        _require_number(self.clip_max, "clip_max", optional=True)
        if self.clip_min is not None and self.clip_max is not None:
            require(
                self.clip_min <= self.clip_max,
                "clip_max",
                f"must be >= clip_min ({self.clip_min}), got {self.clip_max}",
            )


@dataclasses.dataclass(frozen=True)
class ReferenceSimilarityStageConfig:
    """`{type: reference_similarity, weight, baseline}`: an applied, unresolved, clean patch ->
    + `weight` * (its similarity to the reference patch - `baseline`)."""

    stage_type: ClassVar[str] = "reference_similarity"
    weight: float = 0.5
    baseline: float = 0.0

    def __post_init__(self):
        _require_number(self.weight, "weight")
        _require_number(self.baseline, "baseline")
        require(
            0 <= self.baseline < 1,
            "baseline",
            f"must be in [0, 1) (the similarity below which an edit earns less than none), "
            f"got {self.baseline}",
        )
        require(
            0 < self.weight < 1,
            "weight",
            f"must be in (0, 1), so that a resolved sample (reward 1) out-earns every unresolved "
            f"one, got {self.weight}",
        )


StageConfig = (
    IntegrityStageConfig
    | InvalidActionStageConfig
    | ScreeningStageConfig
    | MalformedThinkingStageConfig
    | OverlongStageConfig
    | TurnLimitStageConfig
    | ScaleStageConfig
    | ReferenceSimilarityStageConfig
)


@dataclasses.dataclass(frozen=True)
class RewardShapingConfig:
    """YAML section `rewards`: `stages`, a list of `{type: <name>, <keys>...}` mappings.

    Built with `from_dict(RewardShapingConfig, yaml_dict["rewards"], "rewards")`; the mappings
    are turned into the stage config dataclasses here (already built ones are kept), so errors
    read `rewards.stages[2].max_penalty: ...`.
    """

    stages: tuple[StageConfig, ...] = ()

    def __post_init__(self):
        stages = self.stages
        if isinstance(stages, (str, Mapping)) or not isinstance(stages, Sequence):
            raise ValueError(
                "stages: must be a list of stages, each a mapping with a 'type' key (one of "
                f"{', '.join(STAGE_TYPES)}), got {type(stages).__name__}"
            )
        built = []
        first_index: dict[str, int] = {}
        for index, item in enumerate(stages):
            key = f"stages[{index}]"
            stage_cfg = _build_stage_config(item, key)
            if stage_cfg.stage_type in first_index:
                raise ValueError(
                    f"{key}.type: {stage_cfg.stage_type!r} already appears at "
                    f"stages[{first_index[stage_cfg.stage_type]}]; each stage type may appear "
                    "once, merge the two entries"
                )
            first_index[stage_cfg.stage_type] = index
            built.append(stage_cfg)
        object.__setattr__(self, "stages", tuple(built))


def _build_stage_config(item: Any, key: str) -> StageConfig:
    if isinstance(item, tuple(_STAGES[name][0] for name in STAGE_TYPES)):
        return item
    valid = ", ".join(STAGE_TYPES)
    if not isinstance(item, Mapping):
        raise ValueError(
            f"{key}: expected a mapping with a 'type' key (one of {valid}), got "
            f"{type(item).__name__} ({item!r})"
        )
    if "type" not in item:
        raise ValueError(f"{key}.type: missing; set it to one of {valid}")
    stage_type = item["type"]
    if stage_type not in _STAGES:
        raise ValueError(f"{key}.type: unknown stage type {stage_type!r}; valid types: {valid}")
    params = {name: value for name, value in item.items() if name != "type"}
    return from_dict(_STAGES[stage_type][0], params, key)


# --- Stages. --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StageResult:
    """What one stage did to one sample.

    Attributes:
        reward: the reward after the stage.
        triggered: the stage acted on this sample (penalised, zeroed, clipped).
        detail: stage-specific facts, stored in the metadata as `<type>/<key>`.
    """

    reward: float
    triggered: bool
    detail: Mapping[str, Any]


class RewardStage(abc.ABC):
    """One shaping step: a pure function of (incoming reward, outcome)."""

    def __init__(self, cfg: StageConfig):
        self.cfg = cfg

    @property
    def stage_type(self) -> str:
        return self.cfg.stage_type

    @abc.abstractmethod
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        """Returns the stage's result for `outcome`, given the reward earlier stages produced."""


class IntegrityStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        violated = held_out_violations(outcome.touched_files, outcome.held_out_files)
        if violated:
            return StageResult(0.0, True, {"violated_files": violated})
        return StageResult(reward, False, {"violated_files": ()})


class InvalidActionStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        if not outcome.patch_parsed:
            reason = "no_patch"
        elif outcome.patch_applied is False:
            reason = "patch_not_applied"
        else:
            return StageResult(reward, False, {"reason": None})
        return StageResult(float(self.cfg.penalty), True, {"reason": reason})


class ScreeningStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        categories = self.cfg.categories
        flags = tuple(
            flag
            for flag in outcome.screening_flags
            if categories is None or screening_category(flag) in categories
        )
        if flags:
            return StageResult(float(self.cfg.penalty), True, {"flags": flags})
        return StageResult(reward, False, {"flags": ()})


class MalformedThinkingStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        if not outcome.thinking_required:
            return StageResult(reward, False, {"reason": None})
        reason = check_thinking_format(
            outcome.response_text, self.cfg.tag, self.cfg.opening_tag_in_prompt
        )
        if reason is None:
            return StageResult(reward, False, {"reason": None})
        return StageResult(float(self.cfg.penalty), True, {"reason": reason})


class OverlongStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        penalty = self.penalty(outcome.response_length, outcome.max_response_length)
        return StageResult(reward + penalty, penalty != 0.0, {"penalty": penalty})

    def penalty(self, response_length: int, max_response_length: int) -> float:
        """The (<= 0) amount added for a response of `response_length` tokens."""
        threshold = self.cfg.threshold
        max_length = self.cfg.max_length if self.cfg.max_length is not None else max_response_length
        if max_length <= threshold:
            raise ValueError(
                f"overlong.threshold ({threshold}) must be below the sample's "
                f"max_response_length ({max_length}); lower threshold or set overlong.max_length"
            )
        excess = min(max(response_length - threshold, 0), max_length - threshold)
        # 0.0 rather than -0.0 below the threshold, so `penalty != 0` and logs read plainly.
        return -self.cfg.max_penalty * excess / (max_length - threshold) if excess else 0.0


class TurnLimitStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        end = outcome.episode_end
        if end is None or end == "submit":
            return StageResult(reward, False, {"episode_end": end})
        return StageResult(reward + float(self.cfg.penalty), True, {"episode_end": end})


class ScaleStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        value = self.cfg.scale * reward + self.cfg.shift
        clipped = value
        if self.cfg.clip_min is not None:
            clipped = max(clipped, float(self.cfg.clip_min))
        if self.cfg.clip_max is not None:
            clipped = min(clipped, float(self.cfg.clip_max))
        return StageResult(clipped, clipped != value, {"clipped": clipped != value})


class ReferenceSimilarityStage(RewardStage):
    def apply(self, reward: float, outcome: SampleOutcome) -> StageResult:
        eligible = (
            outcome.patch_applied is True
            and outcome.reward <= 0
            and outcome.reference_patch
            and not outcome.screening_flags
            and not held_out_violations(outcome.touched_files, outcome.held_out_files)
        )
        if not eligible:
            return StageResult(reward, False, {"similarity": None})
        similarity = patch_similarity(outcome.patch_text, outcome.reference_patch)
        bonus = self.cfg.weight * (similarity - self.cfg.baseline)
        return StageResult(reward + bonus, bonus != 0, {"similarity": similarity})


# type -> (config class, stage class); STAGE_TYPES is the order error messages list them in.
_STAGES: dict[str, tuple[type, type[RewardStage]]] = {
    "integrity": (IntegrityStageConfig, IntegrityStage),
    "invalid_action": (InvalidActionStageConfig, InvalidActionStage),
    "screening": (ScreeningStageConfig, ScreeningStage),
    "malformed_thinking": (MalformedThinkingStageConfig, MalformedThinkingStage),
    "overlong": (OverlongStageConfig, OverlongStage),
    "turn_limit": (TurnLimitStageConfig, TurnLimitStage),
    "scale": (ScaleStageConfig, ScaleStage),
    "reference_similarity": (ReferenceSimilarityStageConfig, ReferenceSimilarityStage),
}
STAGE_TYPES: tuple[str, ...] = tuple(_STAGES)


# --- Pipeline. ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShapingResult:
    """The pipeline's output for a batch, in the order of the input outcomes.

    Attributes:
        rewards: the final reward of each sample.
        metadata: per sample, `raw_reward`, `reward` and each stage's `<type>/...` keys.
        metrics: aggregate counts and means (see the module docstring for the keys).
    """

    rewards: tuple[float, ...]
    metadata: tuple[dict[str, Any], ...]
    metrics: dict[str, float]


class RewardPipeline:
    """Applies the configured stages, in order, to each sample's outcome.

    Stateless after construction; safe to call from any thread or Ray actor.
    """

    def __init__(self, cfg: RewardShapingConfig):
        if not isinstance(cfg, RewardShapingConfig):
            raise ValueError(f"cfg must be a RewardShapingConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self._stages = [_STAGES[stage_cfg.stage_type][1](stage_cfg) for stage_cfg in cfg.stages]

    @property
    def stage_types(self) -> tuple[str, ...]:
        return tuple(stage.stage_type for stage in self._stages)

    def shape(self, outcome: SampleOutcome) -> tuple[float, dict[str, Any]]:
        """Returns one sample's final reward and its metadata."""
        if not isinstance(outcome, SampleOutcome):
            raise ValueError(f"outcome must be a SampleOutcome, got {type(outcome).__name__}")
        reward = outcome.reward
        metadata: dict[str, Any] = {"raw_reward": reward}
        for stage in self._stages:
            result = stage.apply(reward, outcome)
            assert math.isfinite(result.reward), (stage.stage_type, result)
            reward = float(result.reward)
            metadata[f"{stage.stage_type}/triggered"] = result.triggered
            for name, value in result.detail.items():
                metadata[f"{stage.stage_type}/{name}"] = value
        metadata["reward"] = reward
        return reward, metadata

    def __call__(self, outcomes: Sequence[SampleOutcome]) -> ShapingResult:
        """Shapes a batch and aggregates metrics over it.

        Raises:
            ValueError: an element is not a SampleOutcome, or a stage rejects it (overlong with
                a threshold at or above the sample's max_response_length).
        """
        if isinstance(outcomes, (str, bytes)) or not isinstance(outcomes, Sequence):
            raise ValueError(
                f"outcomes must be a sequence of SampleOutcome, got {type(outcomes).__name__}"
            )
        shaped = [self.shape(outcome) for outcome in outcomes]
        rewards = tuple(reward for reward, _ in shaped)
        metadata = tuple(meta for _, meta in shaped)
        return ShapingResult(rewards, metadata, self._metrics(metadata))

    def _metrics(self, metadata: Sequence[dict[str, Any]]) -> dict[str, float]:
        num_samples = len(metadata)
        metrics: dict[str, float] = {"num_samples": float(num_samples)}
        if num_samples:
            metrics["raw_reward/mean"] = sum(m["raw_reward"] for m in metadata) / num_samples
            metrics["reward/mean"] = sum(m["reward"] for m in metadata) / num_samples
        for stage_type in self.stage_types:
            num_triggered = sum(bool(m[f"{stage_type}/triggered"]) for m in metadata)
            metrics[f"{stage_type}/num_triggered"] = float(num_triggered)
            if num_samples:
                metrics[f"{stage_type}/fraction_triggered"] = num_triggered / num_samples
            reason_key = f"{stage_type}/reason"
            reasons = collections.Counter(m[reason_key] for m in metadata if m.get(reason_key))
            for reason, count in sorted(reasons.items()):
                metrics[f"{stage_type}/num_{reason}"] = float(count)
            if stage_type == "overlong" and num_samples:
                metrics["overlong/mean_penalty"] = (
                    sum(m["overlong/penalty"] for m in metadata) / num_samples
                )
            if stage_type == "reference_similarity":
                paid = [m["reference_similarity/similarity"] for m in metadata]
                paid = [value for value in paid if value is not None]
                if paid:
                    metrics["reference_similarity/mean_similarity"] = sum(paid) / len(paid)
        return metrics
