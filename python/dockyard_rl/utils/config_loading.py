"""Reading a YAML config into a tree of config dataclasses, and printing it back; knows no schema.

A config is a root dataclass whose fields are sections, each a config dataclass (utils/config.py:
defaults and per-key checks live in the section) or an optional one (`X | None`: null = off).
The schema module (algorithms/grpo_config.py for a GRPO recipe) composes these steps:

    raw = read_yaml_mapping(path)                       # ConfigError: unreadable, not YAML
    raw = apply_overrides(Root, raw, ["a.b.c=1"], path) # ConfigError: not a key of Root
    resolve_paths(raw, ("data.train_path",), workspace_root(path))
    root = Root(**sections_from_dict(Root, raw))        # ValueError naming the dotted key
    to_plain_data(root); describe_sections(Root)        # back to YAML; every key (--help)

YAML: PyYAML's safe loader plus one fix: `1e-6` (no dot) is a float, as in YAML 1.2 (YAML 1.1
reads it as a string). `sections_from_dict` type-checks values against the dataclass annotations
before a section validates them, so `lr: "fast"` fails with the key named instead of deep inside
a comparison; only scalar annotations (bool, int, float, str, None and unions of them) are
checked, containers are left to the sections.

Relative paths are resolved against the workspace root (`workspace_root`):
$BUILD_WORKSPACE_DIRECTORY under `bazel run`, else the nearest folder above the config file
holding WORKSPACE or MODULE.bazel, else the current directory. `~` is expanded. Nothing checks
that a path exists.

Every error a caller should show is a `ConfigError` (a ValueError) of one line that starts with
the source (the file, or the file and the override) and names the full dotted key;
`sections_from_dict` raises plain ValueErrors naming the key, for the schema module to prefix.
Not covered: list indices in overrides (`a.list=[...]` replaces the whole list).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import yaml

from dockyard_rl.utils.config import from_dict, is_int, is_number, optional_dataclass

__all__ = [
    "ConfigError",
    "apply_overrides",
    "blame_override",
    "check_types",
    "describe_sections",
    "one_line",
    "parse_yaml",
    "read_yaml_mapping",
    "resolve_paths",
    "section_hints",
    "sections_from_dict",
    "to_plain_data",
    "workspace_root",
]


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line: `<file>: <dotted.key>: <why, fix>`."""


# ---------------------------------------------------------------------------------------------
# YAML


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading `1e-6` (no dot) as a float as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str) -> Any:
    """The YAML value of `text`; ConfigError `<source>: not valid YAML (line, column): ...`."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{source}: not valid YAML{where}: {one_line(problem)}") from None


def read_yaml_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping of sections the YAML file at `path` holds; an empty file is `{}`.

    Raises:
        ConfigError: the file cannot be read, is not YAML, or holds something else than a mapping.
    """
    source = str(path)
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(
            f"{source}: cannot read the config file: {error.strerror or error}"
        ) from None
    raw = parse_yaml(text, source)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: the file must hold a mapping of sections, got {type(raw).__name__}"
        )
    return raw


def one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines too) made one space: messages are one line."""
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------
# Building the sections


def section_hints(root: type) -> dict[str, Any]:
    """The root dataclass's sections: field name -> its (resolved) annotation."""
    hints = typing.get_type_hints(root)
    return {f.name: hints[f.name] for f in dataclasses.fields(root)}


def sections_from_dict(root: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The section dataclasses of `root` built from `raw` (the keyword arguments of `root`): an
    optional section left out or null is None, any other left out is its defaults.

    Raises:
        ValueError: `<dotted.key>: <message>` for an unknown section or key, a value of the wrong
            type (`check_types`) or a section's own check.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"the file must hold a mapping of sections, got {type(raw).__name__}")
    sections = section_hints(root)
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ValueError(
            f"unknown section(s) {', '.join(map(repr, unknown))}; valid "
            f"sections: {', '.join(sections)}"
        )
    built: dict[str, Any] = {}
    for name, hint in sections.items():
        value, cls = raw.get(name), optional_dataclass(hint)
        if value is None and cls is not hint:  # an optional section left off
            built[name] = None
            continue
        assert cls is not None, f"section {name} is not a dataclass"
        check_types(cls, value, name)
        try:
            built[name] = from_dict(cls, value, name)
        except TypeError as error:  # a value the section compared without checking
            raise ValueError(f"{name}: {error}") from None
    return built


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


_SCALAR_NAMES: dict[Any, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "null",
}


def _matches(value: Any, scalar: type) -> bool:
    if scalar is bool:
        return isinstance(value, bool)
    if scalar is int:
        return is_int(value)
    if scalar is float:
        return is_number(value)
    if scalar is str:
        return isinstance(value, str)
    return value is None


def check_types(cls: type, data: Any, key_path: str) -> None:
    """Raises ValueError naming the key for a value whose type its annotation excludes.

    Only scalar annotations (bool, int, float, str, None and unions of them) are checked;
    containers and unions of dataclasses are left to the sections, as are unknown keys
    (from_dict lists the valid ones)."""
    if not isinstance(data, Mapping):
        return
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for name, value in data.items():
        if name not in names:
            continue
        key, hint = f"{key_path}.{name}", hints[name]
        nested = optional_dataclass(hint)
        if nested is not None:
            check_types(nested, value, key)
            continue
        members = typing.get_args(hint) if _is_union(hint) else (hint,)
        if not all(m in _SCALAR_NAMES for m in members) or any(_matches(value, m) for m in members):
            continue
        expected = " or ".join(_SCALAR_NAMES[m] for m in members)
        fix = ""
        if isinstance(value, str) and float in members:
            fix = " (write numbers unquoted, e.g. 1.0e-6)"
        elif isinstance(value, str) and bool in members:
            fix = " (write true or false unquoted)"
        raise ValueError(f"{key}: expected {expected}, got {type(value).__name__} {value!r}{fix}")


# ---------------------------------------------------------------------------------------------
# Overrides


def apply_overrides(
    root: type, raw: Mapping[str, Any], overrides: Sequence[str], source: str = "<config>"
) -> dict[str, Any]:
    """A deep copy of `raw` with each `a.b.c=value` applied in order (value: a YAML value); the
    keys are those of the dataclass tree under `root` (free-form mappings take any key).

    Setting a key inside a null optional section (`data_plane.transport=ray_direct`) turns the
    section on with defaults for its other keys; `data_plane=null` turns it off.

    Raises:
        ConfigError: a malformed override, or a path that is not a key (the message lists the
            valid keys at the level where it went wrong).
    """
    result: dict[str, Any] = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(
                f"{source}: override {item!r}: expected KEY=VALUE with a dotted "
                f"key, e.g. grpo.max_num_steps=10"
            )
        value = parse_yaml(text, f"{source}: override {item!r}")
        node: dict[str, Any] = result
        cls: type | None = root
        for depth, part in enumerate(parts):
            prefix = ".".join(parts[:depth]) or "the top level"
            last = depth == len(parts) - 1
            hint: Any
            if cls is not None:  # a dataclass level: only its fields are keys
                hints = typing.get_type_hints(cls)
                names = [f.name for f in dataclasses.fields(cls) if f.init]
                if part not in names:
                    raise ConfigError(
                        f"{source}: override {item!r}: {key}: no key {part!r} in "
                        f"{prefix}; valid keys: {', '.join(names)}"
                    )
                hint = hints[part]
            else:  # inside a free-form mapping (e.g. cluster.node.resources)
                hint = Any
            if last:
                node[part] = value
                break
            nested = optional_dataclass(hint)
            free_form = typing.get_origin(hint) in (Mapping, dict) or hint in (dict, Any)
            if nested is None and not free_form:
                raise ConfigError(
                    f"{source}: override {item!r}: {'.'.join(parts[: depth + 1])} "
                    f"is a value ({hint}), it has no key {parts[depth + 1]!r}"
                )
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"{source}: override {item!r}: "
                    f"{'.'.join(parts[: depth + 1])} holds {child!r}, not a mapping"
                )
            node, cls = child, nested
    return result


def blame_override(error: ConfigError, source: str, overrides: Sequence[str]) -> ConfigError:
    """`error` (`<source>: <dotted.key>: ...`) with the last override that set that key (or a key
    inside it) named: `... (set by the override 'a.b=1')`; unchanged when no override did."""
    message = str(error)[len(source) + 2 :]
    culprits = [
        item
        for item in overrides
        if message.startswith((item.partition("=")[0] + ":", item.partition("=")[0] + "."))
    ]
    suffix = f" (set by the override {culprits[-1]!r})" if culprits else ""
    return ConfigError(f"{error}{suffix}")


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Paths


def workspace_root(config_path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """What relative paths in a config are relative to (module docstring)."""
    from_bazel = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if from_bazel:
        return pathlib.Path(from_bazel)
    if config_path is not None:
        for folder in pathlib.Path(config_path).absolute().parents:
            if (folder / "WORKSPACE").is_file() or (folder / "MODULE.bazel").is_file():
                return folder
    return pathlib.Path.cwd()


def resolve_paths(
    raw: dict[str, Any],
    keys: Iterable[str],
    base_dir: pathlib.Path,
    *,
    is_name: Callable[[str, str], bool] = lambda key, value: False,
) -> None:
    """Makes each non-empty string at a dotted key of `keys` in `raw` an absolute, normalized
    path against `base_dir` (`~` expanded), in place; keys that are absent or null are left
    alone, and so are values `is_name(key, value)` says are names rather than paths."""
    for key in keys:
        *parents, leaf = key.split(".")
        node: Any = raw
        for part in parents:
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, dict) or not isinstance(node.get(leaf), str) or not node[leaf]:
            continue
        if is_name(key, node[leaf]):
            continue
        node[leaf] = os.path.normpath(os.path.join(base_dir, os.path.expanduser(node[leaf])))


# ---------------------------------------------------------------------------------------------
# Printing


def to_plain_data(config: Any) -> Any:
    """Plain YAML-ready data (dicts, lists, scalars) for a config dataclass tree; loading it back
    gives an equal config. A dataclass with a string `stage_type` class attribute (a member of a
    tagged union, e.g. the reward stages) gets its `type` key back."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        result: dict[str, Any] = {}
        stage_type = getattr(type(config), "stage_type", None)
        if isinstance(stage_type, str):
            result["type"] = stage_type
        for f in dataclasses.fields(config):
            result[f.name] = to_plain_data(getattr(config, f.name))
        return result
    if isinstance(config, Mapping):
        return {k: to_plain_data(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_plain_data(v) for v in config]
    if isinstance(config, pathlib.PurePath):
        return str(config)
    return config


def describe_sections(root: type) -> list[str]:
    """Every section of `root` and its keys with type and default, one line each: a header
    `<section>:  (<Dataclass>, <module>)` and `  <dotted.key>: <type> = <default as JSON>`.
    A default computed on this machine (a factory that is not a class) says so; a section whose
    defaults alone fail its checks says why."""
    lines: list[str] = []
    root_fields = {f.name: f for f in dataclasses.fields(root)}
    for name, hint in section_hints(root).items():
        cls = optional_dataclass(hint)
        assert cls is not None, f"section {name} is not a dataclass"
        header = f"{name}:  ({cls.__name__}, {cls.__module__})"
        if root_fields[name].default is None:
            header += "  null by default; a mapping turns it on"
        lines += ["", header]
        lines += _describe_fields(cls, None, name)
        note = _default_problem(cls)
        if note:
            lines.append(f"  (the defaults alone are not valid: {name}.{note})")
    return lines


def _describe_fields(cls: type, instance: Any, key_path: str) -> list[str]:
    lines = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{key_path}.{f.name}"
        computed = False
        default: Any
        if instance is not None:
            default = getattr(instance, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif dataclasses.is_dataclass(f.default_factory):
            lines += _describe_fields(f.default_factory, None, key)
            continue
        else:
            factory = f.default_factory
            assert callable(factory), f"{key} has neither a default nor a default factory"
            default = factory()
            computed = not isinstance(factory, type)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            lines += _describe_fields(type(default), default, key)
            continue
        lines.append(
            f"  {key}: {f.type} = {json.dumps(to_plain_data(default), default=str)}"
            + ("  (computed on this machine)" if computed else "")
        )
    return lines


def _default_problem(cls: type) -> str | None:
    try:
        cls()
    except ValueError as error:
        return one_line(error)
    return None
