"""Tests of the `data` config section and load_train_validation."""

import json

import pytest

from dockyard_rl.data.config import DataConfig, load_train_validation
from dockyard_rl.data.schema import DatasetError
from dockyard_rl.utils.config import from_dict


def _row(i, repo):
    return {
        "instance_id": f"{repo}-{i}",
        "repo": repo,
        "base_commit": "a" * 40,
        "patch": "diff",
        "test_patch": "diff",
        "FAIL_TO_PASS": ["t.py::test_a"],
        "PASS_TO_PASS": [],
        "problem_statement": "broken",
    }


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def train_file(tmp_path):
    rows = [_row(i, repo) for repo in ("org/a", "org/b", "org/c", "org/d") for i in range(5)]
    return _write(tmp_path / "train.jsonl", rows)


def test_defaults_and_validation_errors_name_the_key(train_file):
    cfg = from_dict(DataConfig, {"train_path": train_file}, "data")
    assert cfg.dataset == "jsonl" and cfg.prompt.patch_format == "diff"
    cases = [
        ({}, "data.train_path: is required"),
        ({"train_path": train_file, "dataset": "nope"}, "valid: hf_local, jsonl"),
        ({"train_path": train_file, "processor": "nope"}, "swe_single_shot"),
        ({"train_path": train_file, "validation_fraction": 1.0}, "validation_fraction"),
        (
            {"train_path": train_file, "validation_path": train_file, "validation_fraction": 0.2},
            "must be 0 when validation_path is set",
        ),
        ({"train_path": train_file, "max_train_instances": 0}, "max_train_instances"),
        ({"train_path": train_file, "prompt": {"patch_format": "x"}}, "patch_format"),
        ({"train_path": train_file, "shufle": True}, "shufle"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            from_dict(DataConfig, data, "data")


def test_split_by_repository_shuffled_and_deterministic(train_file):
    cfg = from_dict(
        DataConfig, {"train_path": train_file, "validation_fraction": 0.25, "seed": 7}, "data"
    )
    train, validation = load_train_validation(cfg)
    assert len(train) + len(validation) == 20 and validation
    assert not {i.repo for i in train} & {i.repo for i in validation}
    again = load_train_validation(cfg)
    assert [i.instance_id for i in again[0]] == [i.instance_id for i in train]
    unshuffled = load_train_validation(
        from_dict(
            DataConfig,
            {"train_path": train_file, "validation_fraction": 0.25, "seed": 7, "shuffle": False},
            "data",
        )
    )[0]
    assert sorted(i.instance_id for i in unshuffled) == sorted(i.instance_id for i in train)
    assert [i.instance_id for i in unshuffled] != [i.instance_id for i in train]


def test_no_validation_and_a_cap(train_file):
    train, validation = load_train_validation(
        from_dict(DataConfig, {"train_path": train_file, "max_train_instances": 3}, "data")
    )
    assert len(train) == 3 and validation == []


def test_separate_validation_file_must_not_share_repositories(tmp_path, train_file):
    held_out = _write(tmp_path / "val.jsonl", [_row(0, "org/z")])
    train, validation = load_train_validation(
        from_dict(DataConfig, {"train_path": train_file, "validation_path": held_out}, "data")
    )
    assert len(train) == 20 and [i.repo for i in validation] == ["org/z"]
    leaking = _write(tmp_path / "leak.jsonl", [_row(9, "org/a")])
    with pytest.raises(ValueError, match="org/a"):
        load_train_validation(
            from_dict(DataConfig, {"train_path": train_file, "validation_path": leaking}, "data")
        )


def test_bad_rows_and_missing_files_fail_at_load(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [{**_row(0, "org/a"), "FAIL_TO_PASS": []}])
    with pytest.raises(DatasetError, match="row 0.*FAIL_TO_PASS"):
        load_train_validation(from_dict(DataConfig, {"train_path": bad}, "data"))
    with pytest.raises((ValueError, OSError)):
        load_train_validation(
            from_dict(DataConfig, {"train_path": str(tmp_path / "no.jsonl")}, "data")
        )


def test_validation_synthesis_needs_the_file_it_makes(train_file, tmp_path):
    synthesis = {"packages": ["bundled:pocketmath"]}
    with pytest.raises(ValueError, match="data.validation_synthesis: is set but data.validation"):
        from_dict(DataConfig, {"train_path": train_file, "validation_synthesis": synthesis}, "data")
    cfg = from_dict(
        DataConfig,
        {
            "train_path": train_file,
            "validation_path": str(tmp_path / "pocketmath" / "tasks.jsonl"),
            "validation_synthesis": synthesis,
        },
        "data",
    )
    assert cfg.validation_synthesis.packages == ("bundled:pocketmath",)
