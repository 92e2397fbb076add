import json

import pytest

from dockyard_rl.data.schema import DatasetError, SweInstance
from dockyard_rl.sandbox.task import RewardMode, TaskSpec


def _row(**overrides):
    row = {
        "instance_id": "octo__calc-1",
        "repo": "octo/calc",
        "base_commit": "abc123",
        "patch": "diff --git a/x b/x\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": json.dumps(["tests/test_x.py::test_a"]),
        "PASS_TO_PASS": json.dumps(["tests/test_x.py::test_b", "tests/test_x.py::test_c[1 2]"]),
        "problem_statement": "mul adds",
        "hints_text": "",
        "version": "1.0",
        "environment_setup_commit": "abc123",
        "created_at": "2025-01-01T00:00:00Z",
    }
    row.update(overrides)
    return row


def test_json_string_and_list_test_ids_give_the_same_instance():
    from_strings = SweInstance.from_row(_row(), 0, "mem")
    from_lists = SweInstance.from_row(
        _row(
            FAIL_TO_PASS=["tests/test_x.py::test_a"],
            PASS_TO_PASS=["tests/test_x.py::test_b", "tests/test_x.py::test_c[1 2]"],
        ),
        0,
        "mem",
    )
    assert from_strings == from_lists
    assert from_strings.PASS_TO_PASS == ("tests/test_x.py::test_b", "tests/test_x.py::test_c[1 2]")
    assert from_strings.test_command is None


def test_to_row_round_trips_and_optional_fields_default():
    row = _row(test_command="pytest -x tests")
    del row["hints_text"], row["created_at"]
    instance = SweInstance.from_row(row, 3, "mem")
    assert instance.hints_text == "" and instance.created_at == ""
    assert SweInstance.from_row(instance.to_row(), 0, "again") == instance


def test_numeric_version_is_kept_as_text():
    assert SweInstance.from_row(_row(version=3.1), 0, "mem").version == "3.1"


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("repo", None, "is required"),
        ("base_commit", 12, "must be a string"),
        ("problem_statement", "   ", "must not be empty"),
        ("FAIL_TO_PASS", "not json", "not a JSON list"),
        ("PASS_TO_PASS", json.dumps([1, 2]), "list of test-id strings"),
        ("FAIL_TO_PASS", "[]", "at least one test"),
        ("PASS_TO_PASS", None, "is required"),
        ("hints_text", ["a"], "must be a string"),
    ],
)
def test_errors_name_source_row_and_field(field, value, fragment):
    row = _row(**{field: value})
    if value is None:
        del row[field]
    with pytest.raises(DatasetError) as info:
        SweInstance.from_row(row, 17, "data/train.jsonl")
    message = str(info.value)
    assert message.startswith("data/train.jsonl: row 17: field " + repr(field))
    assert fragment in message
    assert (info.value.row_index, info.value.field) == (17, field)
    assert isinstance(info.value, ValueError)


def test_a_row_that_is_not_an_object_is_rejected():
    with pytest.raises(DatasetError, match="row 2: field '<row>': must be a JSON object"):
        SweInstance.from_row(["not", "a", "row"], 2, "mem")


def test_to_task_spec_carries_the_scoring_fields():
    instance = SweInstance.from_row(_row(test_command="pytest tests"), 0, "mem")
    spec = instance.to_task_spec(
        "the patch",
        repo_url="/mirrors/calc",
        timeout_s=30.0,
        reward_mode=RewardMode.PASS_RATE,
        task_id="t-1",
    )
    assert spec == TaskSpec(
        instance_id="octo__calc-1",
        repo="/mirrors/calc",
        base_commit="abc123",
        patch="the patch",
        test_patch="diff --git a/t b/t\n",
        fail_to_pass=("tests/test_x.py::test_a",),
        pass_to_pass=("tests/test_x.py::test_b", "tests/test_x.py::test_c[1 2]"),
        test_command="pytest tests",
        timeout_s=30.0,
        reward_mode=RewardMode.PASS_RATE,
        task_id="t-1",
    )
    # The executor's own validation accepts what we send it.
    assert TaskSpec.from_request(spec.to_dict()) == spec
    assert instance.to_task_spec("").repo == "octo/calc"
