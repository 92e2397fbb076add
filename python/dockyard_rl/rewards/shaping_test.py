"""Tests of dockyard_rl.rewards.shaping: each stage's math, composition order, config parsing."""

import pytest
import yaml

from dockyard_rl.rewards.outcome import SampleOutcome
from dockyard_rl.rewards.shaping import (
    STAGE_TYPES,
    IntegrityStageConfig,
    InvalidActionStageConfig,
    OverlongStageConfig,
    RewardPipeline,
    RewardShapingConfig,
    ScaleStageConfig,
    ScreeningStageConfig,
)
from dockyard_rl.utils.config import from_dict


def outcome(reward=1.0, length=100, max_length=4096, **kwargs):
    return SampleOutcome(
        reward=reward, response_length=length, max_response_length=max_length, **kwargs
    )


def pipeline(*stages):
    return RewardPipeline(from_dict(RewardShapingConfig, {"stages": list(stages)}, "rewards"))


# --- reference_similarity. ---------------------------------------------------------------


def _diff(removed: str, added: str) -> str:
    return f"--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1,1 +1,1 @@\n-{removed}\n+{added}\n"


GOLD = _diff("    total -= value", "    total += value")
NEAR = _diff("    total -= value", "    total *= value")


def similar(reward=0.0, **kwargs):
    fields = dict(
        patch_parsed=True,
        patch_applied=True,
        patch_text=NEAR,
        reference_patch=GOLD,
        touched_files=["pkg/m.py"],
        held_out_files=["tests/test_m.py"],
    )
    return outcome(reward=reward, **{**fields, **kwargs})


def test_reference_similarity_pays_an_applied_unresolved_patch_by_its_nearness():
    stages = pipeline({"type": "reference_similarity", "weight": 0.5})
    near, meta = stages.shape(similar())
    exact, _ = stages.shape(similar(patch_text=GOLD))  # the gold edit that still fails
    far, _ = stages.shape(similar(patch_text=_diff("def f():", "def f(x):")))
    assert 0.45 < near < 0.5 and meta["reference_similarity/similarity"] == pytest.approx(2 * near)
    assert exact == 0.5 and far < near
    resolved, meta = stages.shape(similar(reward=1.0))
    assert resolved == 1.0 and meta["reference_similarity/similarity"] is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"patch_applied": False},  # did not apply
        {"patch_parsed": False, "patch_applied": None, "patch_text": ""},  # no patch
        {"touched_files": ["pkg/m.py", "a/tests/test_m.py"]},  # touched a held-out test
        {"screening_flags": ["forced_exit: os._exit"]},  # flagged by the static screening
        {"reference_patch": ""},  # the task has no reference
    ],
)
def test_reference_similarity_pays_nothing_to_unclean_or_unapplied_patches(kwargs):
    # Listed first, so no later stage can be what keeps these at 0.
    stages = pipeline({"type": "reference_similarity", "weight": 0.9})
    reward, meta = stages.shape(similar(**kwargs))
    assert reward == 0.0 and meta["reference_similarity/triggered"] is False


def test_reference_similarity_baseline_makes_a_far_edit_worth_less_than_none():
    stages = pipeline({"type": "reference_similarity", "weight": 0.5, "baseline": 0.3})
    near, near_meta = stages.shape(similar())
    far, far_meta = stages.shape(similar(patch_text=_diff("def f():", "def f(x):")))
    assert near == pytest.approx(0.5 * (near_meta["reference_similarity/similarity"] - 0.3))
    assert far == pytest.approx(0.5 * (far_meta["reference_similarity/similarity"] - 0.3))
    assert far < 0.0 < near and far_meta["reference_similarity/triggered"]
    unapplied, _ = stages.shape(similar(patch_applied=False))
    assert unapplied == 0.0  # the baseline is charged only to patches it scores


def test_reference_similarity_metrics_average_over_the_paid_samples():
    result = pipeline({"type": "reference_similarity"})(
        [similar(), similar(patch_text=GOLD), similar(reward=1.0)]
    )
    assert result.metrics["reference_similarity/num_triggered"] == 2.0
    mean = result.metrics["reference_similarity/mean_similarity"]
    assert mean == pytest.approx((result.rewards[0] / 0.5 + 1.0) / 2)


# --- overlong. ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, penalty",
    [
        (0, 0.0),
        (3000, 0.0),
        (3072, 0.0),  # At the threshold: no penalty yet.
        (3073, -1.0 / 1024),
        (3584, -0.5),  # Midpoint.
        (3840, -0.75),
        (4096, -1.0),  # At max_length: the full penalty.
        (5000, -1.0),  # Beyond: clamped.
    ],
)
def test_overlong_ramp(length, penalty):
    shaper = pipeline(
        {"type": "overlong", "threshold": 3072, "max_length": 4096, "max_penalty": 1.0}
    )
    result = shaper([outcome(0.25, length, max_length=8192)])
    assert result.rewards[0] == pytest.approx(0.25 + penalty, abs=1e-12)
    assert result.metadata[0]["overlong/penalty"] == pytest.approx(penalty, abs=1e-12)
    assert result.metadata[0]["overlong/triggered"] is (penalty != 0.0)


def test_overlong_defaults_to_the_samples_max_length_and_scales_with_max_penalty():
    shaper = pipeline({"type": "overlong", "threshold": 100, "max_penalty": 0.5})
    result = shaper([outcome(1.0, 150, max_length=200), outcome(1.0, 150, max_length=300)])
    assert result.rewards == pytest.approx((1.0 - 0.25, 1.0 - 0.125))


def test_overlong_threshold_at_or_above_the_samples_limit_is_an_error():
    shaper = pipeline({"type": "overlong", "threshold": 4096})
    with pytest.raises(
        ValueError,
        match=r"overlong\.threshold \(4096\) must be below the sample's max_response_length "
        r"\(4096\)",
    ):
        shaper([outcome(1.0, 10, max_length=4096)])


def test_overlong_zero_penalty_never_triggers():
    shaper = pipeline({"type": "overlong", "threshold": 10, "max_length": 20, "max_penalty": 0.0})
    result = shaper([outcome(1.0, 30)])
    assert result.rewards == (1.0,) and result.metadata[0]["overlong/triggered"] is False


# --- scale. ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reward, expected, clipped",
    [
        (1.0, 1.0, False),
        (0.0, -1.0, False),
        (0.75, 0.5, False),
        (2.0, 1.0, True),
        (-3.0, -1.0, True),
    ],
)
def test_scale_shift_clip(reward, expected, clipped):
    shaper = pipeline({"type": "scale", "scale": 2.0, "shift": -1.0, "clip_min": -1, "clip_max": 1})
    result = shaper([outcome(reward)])
    assert result.rewards == (expected,)
    assert result.metadata[0]["scale/clipped"] is clipped
    assert result.metadata[0]["scale/triggered"] is clipped


def test_scale_without_clip_and_one_sided_clip():
    assert pipeline({"type": "scale", "scale": -3.0, "shift": 0.5})([outcome(10.0)]).rewards == (
        -29.5,
    )
    one_sided = pipeline({"type": "scale", "clip_max": 0.5})
    assert one_sided([outcome(-7.0), outcome(0.9)]).rewards == (-7.0, 0.5)


# --- invalid_action. ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parsed, applied, expected, reason",
    [
        (False, None, -1.0, "no_patch"),
        (True, False, -1.0, "patch_not_applied"),
        (True, True, 1.0, None),
        (True, None, 1.0, None),  # Not tried: not penalised.
    ],
)
def test_invalid_action(parsed, applied, expected, reason):
    shaper = pipeline({"type": "invalid_action"})
    result = shaper([outcome(1.0, patch_parsed=parsed, patch_applied=applied)])
    assert result.rewards == (expected,)
    assert result.metadata[0]["invalid_action/reason"] == reason
    assert result.metadata[0]["invalid_action/triggered"] is (reason is not None)


def test_invalid_action_penalty_replaces_the_reward():
    shaper = pipeline({"type": "invalid_action", "penalty": -0.3})
    assert shaper([outcome(5.0, patch_parsed=False)]).rewards == (-0.3,)


# --- malformed_thinking. --------------------------------------------------------------------


def test_malformed_thinking():
    shaper = pipeline({"type": "malformed_thinking", "penalty": -0.5})
    result = shaper(
        [
            outcome(1.0, response_text="<think>plan</think>diff", thinking_required=True),
            outcome(1.0, response_text="<think>a<think>b</think></think>", thinking_required=True),
            outcome(1.0, response_text="no tags", thinking_required=True),
            outcome(1.0, response_text="no tags", thinking_required=False),
        ]
    )
    assert result.rewards == (1.0, -0.5, -0.5, 1.0)
    assert [m["malformed_thinking/reason"] for m in result.metadata] == [
        None,
        "nested",
        "missing_tags",
        None,
    ]
    assert result.metrics["malformed_thinking/num_nested"] == 1.0
    assert result.metrics["malformed_thinking/num_missing_tags"] == 1.0
    assert result.metrics["malformed_thinking/num_triggered"] == 2.0


def test_malformed_thinking_with_opening_tag_in_prompt_and_custom_tag():
    shaper = pipeline(
        {"type": "malformed_thinking", "tag": "reason", "opening_tag_in_prompt": True}
    )
    result = shaper(
        [
            outcome(1.0, response_text="plan</reason>answer", thinking_required=True),
            outcome(1.0, response_text="<reason>plan</reason>answer", thinking_required=True),
        ]
    )
    assert result.rewards == (1.0, -1.0)
    assert result.metadata[1]["malformed_thinking/reason"] == "unexpected_open"


# --- integrity. -----------------------------------------------------------------------------


def test_integrity_zeroes_and_reports_the_files():
    shaper = pipeline({"type": "integrity"})
    held_out = ("tests/test_a.py", "tests/test_b.py")
    result = shaper(
        [
            outcome(
                1.0, touched_files=("src/a.py", "a/./tests//test_b.py"), held_out_files=held_out
            ),
            outcome(-2.0, touched_files=("tests/test_a.py",), held_out_files=held_out),
            outcome(1.0, touched_files=("src/a.py", "tests/test_c.py"), held_out_files=held_out),
        ]
    )
    assert result.rewards == (0.0, 0.0, 1.0)
    assert result.metadata[0]["integrity/violated_files"] == ("tests/test_b.py",)
    assert result.metadata[1]["integrity/violated_files"] == ("tests/test_a.py",)
    assert result.metadata[2]["integrity/violated_files"] == ()
    assert result.metrics["integrity/num_triggered"] == 2.0


# --- screening. -----------------------------------------------------------------------------


FLAGGED = ("forced_exit: os._exit", "process_arguments: sys.argv")


def test_screening_every_category_by_default():
    shaper = pipeline({"type": "screening"})
    result = shaper(
        [
            outcome(1.0, screening_flags=FLAGGED),
            outcome(1.0, screening_flags=("binary_content: GIT binary patch",)),
            outcome(0.0),
        ]
    )
    assert result.rewards == (-1.0, -1.0, 0.0)
    assert result.metadata[0]["screening/triggered"] is True
    assert result.metadata[0]["screening/flags"] == FLAGGED
    assert result.metadata[2]["screening/triggered"] is False
    assert result.metadata[2]["screening/flags"] == ()
    assert result.metrics["screening/num_triggered"] == 2.0


def test_screening_only_the_configured_categories():
    shaper = pipeline(
        {"type": "screening", "penalty": -0.5, "categories": ["forced_exit", "exit_hook"]}
    )
    result = shaper(
        [
            outcome(1.0, screening_flags=FLAGGED),  # forced_exit matches; sys.argv is not listed
            outcome(1.0, screening_flags=("process_arguments: sys.argv",)),
            outcome(0.0, screening_flags=("exit_hook:atexit",)),  # spacing after ':' is not needed
        ]
    )
    assert result.rewards == (-0.5, 1.0, -0.5)
    assert result.metadata[0]["screening/flags"] == ("forced_exit: os._exit",)
    assert result.metadata[1]["screening/flags"] == ()
    assert result.metadata[2]["screening/flags"] == ("exit_hook:atexit",)


def test_screening_penalty_replaces_even_a_resolved_reward_and_composes():
    # After the flag, the affine map applies to the penalty: 2 * -1 - 1 = -3 -> clipped to -1.
    shaper = pipeline({"type": "screening"}, SCALE)
    assert shaper([outcome(1.0, screening_flags=FLAGGED)]).rewards == (-1.0,)
    # A stage placed before it cannot undo it, one placed after adds on.
    shaper = pipeline({"type": "screening", "penalty": -0.25}, OVERLONG)
    assert shaper([outcome(1.0, 100, screening_flags=FLAGGED)]).rewards == (-0.75,)


def test_screening_config_lists_become_tuples():
    cfg = from_dict(
        RewardShapingConfig,
        yaml.safe_load("stages: [{type: screening, categories: [report_path, runner_internals]}]"),
        "rewards",
    )
    assert cfg.stages == (ScreeningStageConfig(categories=("report_path", "runner_internals")),)
    hash(cfg)


# --- Composition. ---------------------------------------------------------------------------


OVERLONG = {"type": "overlong", "threshold": 50, "max_length": 150, "max_penalty": 1.0}
SCALE = {"type": "scale", "scale": 2.0, "shift": -1.0, "clip_min": -1.0, "clip_max": 1.0}


def test_order_matters():
    sample = outcome(1.0, 100)  # Overlong penalty -0.5.
    # overlong then scale: 2 * (1 - 0.5) - 1 = 0.
    assert pipeline(OVERLONG, SCALE)([sample]).rewards == (0.0,)
    # scale then overlong: (2 * 1 - 1) - 0.5 = 0.5.
    assert pipeline(SCALE, OVERLONG)([sample]).rewards == (0.5,)
    # A replacing stage after an adding one wins, and the other way round the penalty adds on.
    no_patch = outcome(1.0, 100, patch_parsed=False)
    assert pipeline(OVERLONG, {"type": "invalid_action"})([no_patch]).rewards == (-1.0,)
    assert pipeline({"type": "invalid_action"}, OVERLONG)([no_patch]).rewards == (-1.5,)


@pytest.mark.parametrize(
    "end, expected, triggered",
    [
        (None, 1.0, False),  # single-shot: never touched
        ("submit", 1.0, False),
        ("turn_limit", 0.75, True),
        ("context_limit", 0.75, True),
        ("budget", 0.75, True),
    ],
)
def test_turn_limit_penalises_unsubmitted_episodes(end, expected, triggered):
    shaper = pipeline({"type": "turn_limit", "penalty": -0.25})
    result = shaper([outcome(1.0, 10, patch_applied=True, episode_end=end)])
    assert result.rewards == (expected,)
    assert result.metadata[0]["turn_limit/triggered"] is triggered
    assert result.metadata[0]["turn_limit/episode_end"] == end


def test_turn_limit_adds_to_the_no_patch_penalty_and_checks_its_config():
    no_change = outcome(0.0, 10, patch_parsed=False, episode_end="turn_limit")
    shaper = pipeline({"type": "invalid_action"}, {"type": "turn_limit"})
    assert shaper([no_change]).rewards == (-1.5,)
    with pytest.raises(ValueError, match=r"stages\[0\].penalty: must be <= 0"):
        pipeline({"type": "turn_limit", "penalty": 0.5})
    with pytest.raises(ValueError, match="episode_end: must be one of"):
        outcome(0.0, 10, episode_end="gave_up")


def test_full_recipe_metadata_and_metrics():
    shaper = pipeline(
        {"type": "integrity"},
        {"type": "invalid_action", "penalty": -1.0},
        {"type": "screening", "categories": ["forced_exit"]},
        {"type": "malformed_thinking", "penalty": -1.0},
        OVERLONG,
        SCALE,
    )
    # Every stage but turn_limit (multi-turn only: test_turn_limit_* below) and the opt-in
    # reference_similarity (its own tests above).
    skipped = ("turn_limit", "reference_similarity")
    assert shaper.stage_types == tuple(t for t in STAGE_TYPES if t not in skipped)
    samples = [
        outcome(1.0, 10, patch_applied=True),  # Resolved, short: 2 * 1 - 1 = 1.
        outcome(1.0, 100, patch_applied=True),  # Resolved, overlong: 2 * 0.5 - 1 = 0.
        outcome(0.0, 10, patch_parsed=False),  # No patch: 2 * -1 - 1 = -3 -> clipped to -1.
        outcome(1.0, 10, touched_files=("tests/t.py",), held_out_files=("tests/t.py",)),  # -> -1.
    ]
    result = shaper(samples)
    assert result.rewards == (1.0, 0.0, -1.0, -1.0)
    meta = result.metadata[3]
    assert meta["raw_reward"] == 1.0 and meta["reward"] == -1.0
    assert meta["integrity/triggered"] is True and meta["integrity/violated_files"] == (
        "tests/t.py",
    )
    assert meta["scale/clipped"] is False
    assert result.metrics == {
        "num_samples": 4.0,
        "raw_reward/mean": 0.75,
        "reward/mean": -0.25,
        "integrity/num_triggered": 1.0,
        "integrity/fraction_triggered": 0.25,
        "invalid_action/num_triggered": 1.0,
        "invalid_action/fraction_triggered": 0.25,
        "invalid_action/num_no_patch": 1.0,
        "screening/num_triggered": 0.0,
        "screening/fraction_triggered": 0.0,
        "malformed_thinking/num_triggered": 0.0,
        "malformed_thinking/fraction_triggered": 0.0,
        "overlong/num_triggered": 1.0,
        "overlong/fraction_triggered": 0.25,
        "overlong/mean_penalty": -0.125,
        "scale/num_triggered": 1.0,
        "scale/fraction_triggered": 0.25,
    }


def test_empty_pipeline_and_empty_batch():
    identity = RewardPipeline(from_dict(RewardShapingConfig, None, "rewards"))
    assert identity.stage_types == ()
    result = identity([outcome(0.3), outcome(-2.0)])
    assert result.rewards == (0.3, -2.0)
    assert result.metadata[0] == {"raw_reward": 0.3, "reward": 0.3}
    empty = pipeline(SCALE)([])
    assert empty.rewards == () and empty.metrics == {"num_samples": 0.0, "scale/num_triggered": 0.0}


def test_pipeline_input_errors():
    with pytest.raises(ValueError, match="must be a RewardShapingConfig"):
        RewardPipeline({"stages": []})
    with pytest.raises(ValueError, match="outcome must be a SampleOutcome"):
        pipeline(SCALE)([{"reward": 1.0}])
    with pytest.raises(ValueError, match="outcomes must be a sequence"):
        pipeline(SCALE)(outcome())


# --- Config parsing. ------------------------------------------------------------------------


RECIPE_YAML = """
rewards:
  stages:
    - {type: integrity}
    - {type: invalid_action, penalty: -1.0}
    - type: overlong
      threshold: 3072
      max_length: 4096
    - {type: scale, scale: 2.0, shift: -1.0, clip_min: -1, clip_max: 1}
"""


def test_yaml_recipe_parses_with_defaults():
    cfg = from_dict(RewardShapingConfig, yaml.safe_load(RECIPE_YAML)["rewards"], "rewards")
    assert cfg.stages == (
        IntegrityStageConfig(),
        InvalidActionStageConfig(penalty=-1.0),
        OverlongStageConfig(threshold=3072, max_length=4096, max_penalty=1.0),
        ScaleStageConfig(scale=2.0, shift=-1.0, clip_min=-1, clip_max=1),
    )
    # Already built stage configs are kept as they are.
    assert RewardShapingConfig(stages=list(cfg.stages)) == cfg
    hash(cfg)


@pytest.mark.parametrize(
    "stages, pattern",
    [
        (
            [{"type": "overlength"}],
            r"^rewards\.stages\[0\]\.type: unknown stage type 'overlength'; valid types: "
            r"integrity, invalid_action, screening, malformed_thinking, overlong, turn_limit, "
            r"scale, reference_similarity$",
        ),
        (
            [SCALE, {"penalty": -1.0}],
            r"^rewards\.stages\[1\]\.type: missing; set it to one of integrity, ",
        ),
        (["integrity"], r"^rewards\.stages\[0\]: expected a mapping with a 'type' key"),
        ({"type": "scale"}, r"^rewards\.stages: must be a list of stages"),
        (
            [{"type": "scale", "factor": 2}],
            r"^rewards\.stages\[0\]: unknown key\(s\) 'factor'; valid keys: clip_max, clip_min, "
            r"scale, shift",
        ),
        (
            [{"type": "integrity", "penalty": 0}],
            r"^rewards\.stages\[0\]: unknown key\(s\) 'penalty'",
        ),
        ([{"type": "overlong"}], r"^rewards\.stages\[0\]\.threshold: is required"),
        (
            [{"type": "overlong", "threshold": 10, "max_length": 10}],
            r"^rewards\.stages\[0\]\.max_length: must be greater than threshold \(10\)",
        ),
        (
            [{"type": "overlong", "threshold": -1}],
            r"^rewards\.stages\[0\]\.threshold: must be an integer >= 0",
        ),
        (
            [{"type": "overlong", "threshold": 1.5}],
            r"^rewards\.stages\[0\]\.threshold: must be an integer",
        ),
        (
            [{"type": "overlong", "threshold": 1, "max_penalty": -1.0}],
            r"^rewards\.stages\[0\]\.max_penalty: must be >= 0",
        ),
        (
            [{"type": "scale", "clip_min": 1.0, "clip_max": 0.0}],
            r"^rewards\.stages\[0\]\.clip_max: must be >= clip_min",
        ),
        (
            [{"type": "scale", "scale": "2"}],
            r"^rewards\.stages\[0\]\.scale: must be a finite number",
        ),
        (
            [{"type": "scale", "shift": float("nan")}],
            r"^rewards\.stages\[0\]\.shift: must be a finite number",
        ),
        (
            [{"type": "invalid_action", "penalty": True}],
            r"^rewards\.stages\[0\]\.penalty: must be a finite number",
        ),
        (
            [{"type": "malformed_thinking", "tag": "<think>"}],
            r"^rewards\.stages\[0\]\.tag: tag must be a plain tag name",
        ),
        (
            [{"type": "malformed_thinking", "opening_tag_in_prompt": "no"}],
            r"^rewards\.stages\[0\]\.opening_tag_in_prompt: must be true or false",
        ),
        (
            [SCALE, OVERLONG, {"type": "scale"}],
            r"^rewards\.stages\[2\]\.type: 'scale' already appears at stages\[0\]",
        ),
        (
            [{"type": "screening", "categories": ["forced_exit", "network"]}],
            r"^rewards\.stages\[0\]\.categories: unknown screening category 'network'; valid: "
            r"runner_internals, report_path, process_arguments, exit_hook, forced_exit, "
            r"introspection, binary_content$",
        ),
        (
            [{"type": "screening", "categories": ["a", "b"]}],
            r"^rewards\.stages\[0\]\.categories: unknown screening categories 'a', 'b'",
        ),
        (
            [{"type": "screening", "categories": "forced_exit"}],
            r"^rewards\.stages\[0\]\.categories: must be a list of screening categories",
        ),
        (
            [{"type": "screening", "categories": []}],
            r"^rewards\.stages\[0\]\.categories: must not be empty",
        ),
        (
            [{"type": "reference_similarity", "weight": 1.0}],
            r"^rewards\.stages\[0\]\.weight: must be in \(0, 1\), so that a resolved sample",
        ),
        (
            [{"type": "reference_similarity", "baseline": 1.0}],
            r"^rewards\.stages\[0\]\.baseline: must be in \[0, 1\)",
        ),
        (
            [{"type": "reference_similarity", "weight": 0}],
            r"^rewards\.stages\[0\]\.weight: must be in \(0, 1\)",
        ),
        (
            [{"type": "screening", "penalty": "low"}],
            r"^rewards\.stages\[0\]\.penalty: must be a finite number",
        ),
        (
            [{"type": "screening", "categorys": None}],
            r"^rewards\.stages\[0\]: unknown key\(s\) 'categorys'; valid keys: categories, "
            r"penalty$",
        ),
    ],
)
def test_bad_config(stages, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_dict(RewardShapingConfig, {"stages": stages}, "rewards")


def test_unknown_section_key():
    with pytest.raises(ValueError, match=r"^rewards: unknown key\(s\) 'stage'; valid keys: stages"):
        from_dict(RewardShapingConfig, {"stage": []}, "rewards")
