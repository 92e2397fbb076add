"""Tests of dockyard_rl.rewards.outcome: SampleOutcome's validation and normalisation."""

import math

import pytest

from dockyard_rl.rewards.outcome import SCREENING_CATEGORIES, SampleOutcome, screening_category


def test_defaults_and_list_fields_become_tuples():
    outcome = SampleOutcome(
        reward=1,
        response_length=10,
        max_response_length=20,
        touched_files=["a/x.py"],
        held_out_files=["tests/t.py"],
        screening_flags=["forced_exit: os._exit"],
    )
    assert outcome.reward == 1.0 and isinstance(outcome.reward, float)
    assert outcome.touched_files == ("a/x.py",)
    assert outcome.held_out_files == ("tests/t.py",)
    assert outcome.screening_flags == ("forced_exit: os._exit",)
    assert SampleOutcome(reward=0, response_length=0, max_response_length=1).screening_flags == ()
    assert outcome.patch_parsed is True and outcome.patch_applied is None
    assert outcome.thinking_required is False and outcome.response_text == ""
    assert outcome.patch_text == "" and outcome.reference_patch == ""
    hash(outcome)  # Frozen and hashable.


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"reward": math.nan}, "^reward: must be finite"),
        ({"reward": math.inf}, "^reward: must be finite"),
        ({"reward": True}, "^reward: must be a number"),
        ({"reward": "1"}, "^reward: must be a number"),
        ({"response_length": -1}, "^response_length: must be >= 0"),
        ({"response_length": 1.5}, "^response_length: must be an int"),
        ({"max_response_length": 0}, "^max_response_length: must be >= 1"),
        ({"response_text": None}, "^response_text: must be a str"),
        ({"patch_text": None}, "^patch_text: must be a str, got NoneType"),
        ({"reference_patch": b"diff"}, "^reference_patch: must be a str, got bytes"),
        ({"patch_parsed": 1}, "^patch_parsed: must be a bool"),
        ({"thinking_required": "yes"}, "^thinking_required: must be a bool"),
        ({"patch_applied": "no"}, "^patch_applied: must be a bool or None"),
        (
            {"patch_parsed": False, "patch_applied": True},
            "^patch_applied: is True but patch_parsed is False",
        ),
        ({"touched_files": "tests/t.py"}, "^touched_files: must be a list of paths, got str"),
        ({"held_out_files": ["ok.py", 3]}, "^held_out_files: every path must be a str"),
        (
            {"screening_flags": "forced_exit: os._exit"},
            "^screening_flags: must be a list of flags, got str",
        ),
        ({"screening_flags": [None]}, "^screening_flags: every flag must be a str, got NoneType"),
    ],
)
def test_invalid_fields(kwargs, pattern):
    base = {"reward": 0.0, "response_length": 1, "max_response_length": 8}
    with pytest.raises(ValueError, match=pattern):
        SampleOutcome(**{**base, **kwargs})


def test_screening_category_of_a_flag():
    assert screening_category("forced_exit: os._exit") == "forced_exit"
    assert screening_category(" report_path :junitxml") == "report_path"
    assert screening_category("binary_content: GIT binary patch") in SCREENING_CATEGORIES
