"""Tests of the executor's task/verdict contract."""

import json

import pytest

from dockyard_rl.sandbox.task import (
    ApplyMethod,
    RewardMode,
    TaskSpec,
    TaskValidationError,
    TestOutcome,
    Verdict,
)

BODY = {
    "instance_id": "repo__1",
    "repo": "/srv/repo",
    "base_commit": "abc123",
    "patch": "",
    "test_patch": "diff --git a/t.py b/t.py\n",
    "FAIL_TO_PASS": ["t.py::test_a"],
    "PASS_TO_PASS": '["t.py::test_b", "t.py::test_c[x y]"]',
    "problem_statement": "ignored",
}


def test_lists_accepted_as_json_lists_or_json_strings():
    spec = TaskSpec.from_request(BODY)
    assert spec.fail_to_pass == ("t.py::test_a",)
    assert spec.pass_to_pass == ("t.py::test_b", "t.py::test_c[x y]")
    assert spec.reward_mode is RewardMode.BINARY and spec.patch == ""


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("repo", None, "repo: is required"),
        ("base_commit", "  ", "base_commit: must not be empty"),
        ("patch", 3, "patch: must be a string"),
        ("FAIL_TO_PASS", "not json", "FAIL_TO_PASS: is a string but not a JSON list"),
        ("PASS_TO_PASS", [1, 2], "PASS_TO_PASS: must be a list of test-id strings"),
        ("timeout_s", -1, "timeout_s: must be a number"),
        ("reward_mode", "partial", "reward_mode: must be one of"),
        ("image", "ubuntu:22.04", "image: 'ubuntu:22.04' is not an image reference"),
        ("image", "oci-archive:images/x.tar", "image: .* must be absolute"),
        ("repo_path", "/testbed", "repo_path: is only meaningful with an image"),
    ],
)
def test_bad_fields_are_named(field, value, message):
    body = dict(BODY)
    if value is None:
        del body[field]
    else:
        body[field] = value
    with pytest.raises(TaskValidationError, match=message) as info:
        TaskSpec.from_request(body)
    assert info.value.field == field


def test_body_must_be_an_object():
    with pytest.raises(TaskValidationError, match="body"):
        TaskSpec.from_request(["not", "a", "dict"])


def test_spec_round_trips_through_its_request_form():
    spec = TaskSpec.from_request(
        {**BODY, "timeout_s": 30, "reward_mode": "pass_rate", "task_id": "client-1"}
    )
    assert TaskSpec.from_request(json.loads(json.dumps(spec.to_dict()))) == spec


def test_verdict_round_trips_through_json():
    verdict = Verdict(
        resolved=False,
        reward=0.5,
        fail_to_pass={"t::a": TestOutcome.PASSED},
        pass_to_pass={"t::b": TestOutcome.MISSING},
        apply_method=ApplyMethod.GIT_APPLY_3WAY,
        integrity_violation=("conftest.py",),
        test_exit_code=1,
        timed_out=False,
        timings_s={"total": 1.5},
        log_tail="x",
    )
    assert Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))) == verdict


def test_image_and_repo_path():
    spec = TaskSpec.from_request({**BODY, "image": "oci-archive:/data/x.tar:v1"})
    assert spec.image == "oci-archive:/data/x.tar:v1" and spec.repo_path == "/testbed"
    assert TaskSpec.from_request(spec.to_dict()) == spec  # what the store keeps reads back
    assert (
        TaskSpec.from_request(
            {**BODY, "image": "docker://ghcr.io/o/x:1", "repo_path": "/srv/repo"}
        ).repo_path
        == "/srv/repo"
    )
    for bad in ("relative", "/", "//x", "/tmp/repo", "/proc", "/a/../b", "/.dockyard/src"):
        with pytest.raises(TaskValidationError, match="repo_path: must be a normalized") as info:
            TaskSpec.from_request({**BODY, "image": "/data/x.tar", "repo_path": bad})
        assert info.value.field == "repo_path"
