"""Tests of the YAML-dict -> frozen dataclass builder."""

import dataclasses

import pytest

from dockyard_rl.utils.config import from_dict, is_int, is_number, require, require_bool


@dataclasses.dataclass(frozen=True)
class Inner:
    epsilon: float = 1e-6

    def __post_init__(self):
        require(self.epsilon >= 0, "epsilon", f"must be >= 0, got {self.epsilon}")


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = "x"
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_defaults_and_nested_values():
    cfg = from_dict(Outer, {"inner": {"epsilon": 0.5}}, "section")
    assert cfg == Outer(name="x", inner=Inner(epsilon=0.5))
    assert from_dict(Outer, None, "section") == Outer()


@dataclasses.dataclass(frozen=True)
class WithOptional:
    inner: Inner | None = None


def test_an_optional_nested_section_is_built_or_stays_none():
    assert from_dict(WithOptional, {"inner": {"epsilon": 0.5}}, "s").inner == Inner(epsilon=0.5)
    assert from_dict(WithOptional, {"inner": None}, "s").inner is None
    with pytest.raises(ValueError, match=r"^s\.inner\.epsilon: must be >= 0"):
        from_dict(WithOptional, {"inner": {"epsilon": -1}}, "s")


def test_unknown_key_lists_valid_keys():
    with pytest.raises(
        ValueError, match=r"section\.inner: unknown key\(s\) 'epsilom'; valid keys: epsilon"
    ):
        from_dict(Outer, {"inner": {"epsilom": 1}}, "section")


def test_validation_errors_carry_the_full_key_path():
    with pytest.raises(ValueError, match=r"^section\.inner\.epsilon: must be >= 0, got -1"):
        from_dict(Outer, {"inner": {"epsilon": -1}}, "section")


def test_non_mapping_is_rejected():
    with pytest.raises(ValueError, match="section.inner: expected a mapping"):
        from_dict(Outer, {"inner": [1, 2]}, "section")


def test_frozen():
    cfg = from_dict(Outer, {}, "s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "y"


def test_is_int_and_is_number_reject_bool():
    assert is_int(3) and is_int(-1) and is_int(0)
    assert not is_int(True) and not is_int(False)
    assert not is_int(2.0) and not is_int("2") and not is_int(None)
    assert is_number(3) and is_number(0.5) and is_number(float("inf"))
    assert not is_number(True) and not is_number("0.5") and not is_number(None)


@dataclasses.dataclass(frozen=True)
class Switches:
    shuffle: bool = True
    verbose: bool = False

    def __post_init__(self):
        require_bool(self, "shuffle", "verbose")


def test_require_bool_refuses_what_is_not_a_bool_and_names_the_field():
    assert from_dict(Switches, {"verbose": True}, "s") == Switches(shuffle=True, verbose=True)
    for bad in (1, 0, "yes", "false", None):
        with pytest.raises(ValueError, match=rf"^s\.verbose: must be true or false, got {bad!r}$"):
            from_dict(Switches, {"verbose": bad}, "s")
