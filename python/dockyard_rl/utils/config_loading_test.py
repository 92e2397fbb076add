"""Tests of the generic config steps on a small schema (the GRPO recipe's: grpo_config_test)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, ClassVar

import pytest

from dockyard_rl.utils.config import require
from dockyard_rl.utils.config_loading import (
    ConfigError,
    apply_overrides,
    blame_override,
    check_types,
    describe_sections,
    parse_yaml,
    read_yaml_mapping,
    resolve_paths,
    sections_from_dict,
    to_plain_data,
    workspace_root,
)


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = 0.5
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class Stage:
    stage_type: ClassVar[str] = "clip"
    low: int = 1


@dataclasses.dataclass(frozen=True)
class Train:
    steps: int = 3
    enabled: bool = True
    inner: Inner = dataclasses.field(default_factory=Inner)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    stages: tuple[Stage, ...] = ()

    def __post_init__(self) -> None:
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")


@dataclasses.dataclass(frozen=True)
class Needed:
    path: str | None = None

    def __post_init__(self) -> None:
        require(self.path is not None, "path", "is required")


@dataclasses.dataclass(frozen=True)
class Root:
    train: Train = dataclasses.field(default_factory=Train)
    plane: Inner | None = None
    needed: Needed | None = None  # its defaults alone are not valid


def test_yaml_12_floats_and_errors_naming_the_line():
    assert parse_yaml("a: 1e-6\nb: 3E+2\nc: 1.5e-3\nd: '1e-6'\n", "f") == {
        "a": 1e-6,
        "b": 300.0,
        "c": 1.5e-3,
        "d": "1e-6",
    }
    with pytest.raises(ConfigError, match=r"^f\.yaml: not valid YAML \(line 3, column 1\): "):
        parse_yaml("a:\n  b: [1\n", "f.yaml")


def test_read_yaml_mapping(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert read_yaml_mapping(tmp_path / "empty.yaml") == {}
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="list.yaml: the file must hold a mapping of sections"):
        read_yaml_mapping(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the config file"):
        read_yaml_mapping(tmp_path / "missing.yaml")


def test_sections_from_dict_builds_checks_and_leaves_optional_sections_off():
    built = sections_from_dict(Root, {"train": {"inner": {"rate": 1}}, "plane": None})
    assert built == {"train": Train(inner=Inner(rate=1)), "plane": None, "needed": None}
    assert sections_from_dict(Root, {"plane": {}})["plane"] == Inner()
    with pytest.raises(ValueError, match=r"unknown section\(s\) 'trian'; valid sections: train"):
        sections_from_dict(Root, {"trian": {}})
    with pytest.raises(ValueError, match=r"^train\.steps: must be >= 1, got 0"):
        sections_from_dict(Root, {"train": {"steps": 0}})
    with pytest.raises(ValueError, match="must hold a mapping of sections, got list"):
        sections_from_dict(Root, [])  # type: ignore[arg-type]  # the wrong type is the test


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"steps": "3"}, "train.steps: expected an integer, got str '3'"),
        ({"steps": True}, "train.steps: expected an integer, got bool True"),
        ({"enabled": "yes"}, "train.enabled: expected true or false, got str 'yes' (write true"),
        ({"inner": {"rate": "fast"}}, "train.inner.rate: expected a number, got str 'fast' (write"),
        ({"inner": {"name": 1}}, "train.inner.name: expected a string or null, got int 1"),
    ],
)
def test_check_types_names_the_key(data, expected):
    with pytest.raises(ValueError) as info:
        check_types(Train, data, "train")
    assert str(info.value).startswith(expected)


def test_check_types_leaves_containers_and_unknown_keys_to_the_sections():
    check_types(Train, {"extra": [1], "stages": "x", "typo": 1, "inner": {"rate": 2}}, "train")
    check_types(Train, None, "train")


def test_overrides_set_keys_as_yaml_values_on_a_copy():
    raw = {"train": {"steps": 1}}
    result = apply_overrides(
        Root,
        raw,
        ["train.steps=2", "train.inner.rate=1e-3", "train.extra.any.key=[1, a]", "plane.name=p"],
    )
    assert result == {
        "train": {"steps": 2, "inner": {"rate": 1e-3}, "extra": {"any": {"key": [1, "a"]}}},
        "plane": {"name": "p"},
    }
    assert raw == {"train": {"steps": 1}}
    assert apply_overrides(Root, {"plane": {"rate": 1}}, ["plane=null"]) == {"plane": None}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stpes=1", "src: override 'train.stpes=1': train.stpes: no key 'stpes' in train; "),
        ("trian.steps=1", "no key 'trian' in the top level; valid keys: train, plane, needed"),
        ("train.steps.x=1", "train.steps is a value (<class 'int'>), it has no key 'x'"),
        ("train.steps", "expected KEY=VALUE with a dotted key"),
        ("train..steps=1", "expected KEY=VALUE with a dotted key"),
        ("train.steps=[1", "src: override 'train.steps=[1': not valid YAML"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Root, {}, [override], "src")
    assert expected in str(info.value)


def test_an_override_into_a_value_that_is_not_a_mapping():
    with pytest.raises(ConfigError, match="train.extra holds 3, not a mapping"):
        apply_overrides(Root, {"train": {"extra": 3}}, ["train.extra.a=1"])


def test_blame_override_names_the_last_override_of_the_key():
    error = ConfigError("f.yaml: train.steps: must be >= 1, got 0")
    overrides = ["train.steps=5", "train.steps=0", "train.enabled=false"]
    assert str(blame_override(error, "f.yaml", overrides)).endswith(
        "got 0 (set by the override 'train.steps=0')"
    )
    assert str(blame_override(error, "f.yaml", ["train=null"])).endswith(
        "(set by the override 'train=null')"
    )
    assert str(blame_override(error, "f.yaml", ["train.stepsx=1"])) == str(error)


def test_the_workspace_root(tmp_path, monkeypatch):
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    (tmp_path / "repo/configs").mkdir(parents=True)
    (tmp_path / "repo/MODULE.bazel").write_text("")
    assert workspace_root(tmp_path / "repo/configs/r.yaml") == tmp_path / "repo"
    monkeypatch.chdir(tmp_path)
    assert workspace_root(tmp_path / "elsewhere/r.yaml") == tmp_path
    assert workspace_root() == tmp_path
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", "/ws")
    assert workspace_root(tmp_path / "repo/configs/r.yaml") == pathlib.Path("/ws")


def test_resolve_paths_in_place_leaving_names_and_nulls():
    raw: dict[str, Any] = {"a": {"p": "data/x", "home": "~/y", "m": "zoo-name", "n": None}}
    resolve_paths(
        raw,
        ("a.p", "a.home", "a.m", "a.n", "b.missing"),
        pathlib.Path("/base"),
        is_name=lambda key, value: key == "a.m" and value == "zoo-name",
    )
    assert raw == {
        "a": {
            "p": "/base/data/x",
            "home": str(pathlib.Path.home() / "y"),
            "m": "zoo-name",
            "n": None,
        }
    }


def test_to_plain_data_round_trips_with_stage_types():
    root = Root(
        train=Train(stages=(Stage(low=2),), extra={"k": (1, pathlib.PurePath("/p"))}),
        plane=Inner(),
    )
    data = to_plain_data(root)
    assert data["train"]["stages"] == [{"type": "clip", "low": 2}]
    assert data["train"]["extra"] == {"k": [1, "/p"]}
    assert data["plane"] == {"rate": 0.5, "name": None}
    assert sections_from_dict(Root, {"plane": data["plane"]})["plane"] == root.plane


def test_describe_sections_lists_every_key():
    lines = describe_sections(Root)
    assert f"train:  (Train, {__name__})" in lines
    assert "  train.inner.rate: float = 0.5" in lines
    assert "  train.extra: dict[str, Any] = {}" in lines
    assert f"plane:  (Inner, {__name__})  null by default; a mapping turns it on" in lines
    assert "  needed.path: str | None = null" in lines  # a default of None
    assert "  (the defaults alone are not valid: needed.path: is required)" in lines
