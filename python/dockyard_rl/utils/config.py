"""Building the frozen config dataclasses from parsed YAML (plain dicts).

Every config section is a frozen dataclass whose fields hold the defaults (the one place they
live) and whose `__post_init__` validates values with `ValueError`s that name the key and the
fix. `from_dict` turns a mapping into such a dataclass, recursing into nested dataclass fields
(also optional ones, `X | None`: null keeps None), and rejects unknown keys with the valid ones
listed, so a typo fails at start-up instead of being silently ignored.

    @dataclasses.dataclass(frozen=True)
    class ClipConfig:
        ratio_clip_low: float = 0.2

    cfg = from_dict(ClipConfig, {"ratio_clip_low": 0.1}, key_path="loss_fn")

`key_path` is the dotted location of the section in the YAML file ("loss_fn"), used in messages.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any] | None, key_path: str) -> T:
    """Builds dataclass `cls` from `data`; nested dataclass fields are built recursively.

    Raises:
        ValueError: `data` is not a mapping, has keys `cls` does not define (the message lists
            the valid ones), or a field's own validation fails (prefixed with `key_path`).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{key_path}: expected a mapping of keys to values, got "
            f"{type(data).__name__} ({data!r})"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{key_path}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
            f"{', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        nested = optional_dataclass(hints[name])
        if nested is not None and value is not None and not dataclasses.is_dataclass(value):
            value = from_dict(nested, value, f"{key_path}.{name}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as error:
        message = str(error)
        raise ValueError(
            message if message.startswith(key_path) else f"{key_path}.{message}"
        ) from None


def is_int(value: Any) -> bool:
    """An `int`, not a bool (YAML's `true` is an int to Python). An integral float (2.0) is not
    an int here: counts and sizes must be written as integers."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An `int` or a `float`, not a bool (YAML's `true` is an int to Python). NaN and the
    infinities are numbers here: check `math.isfinite` where they are not allowed."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def optional_dataclass(hint: Any) -> type | None:
    """The dataclass in the type hint `X` or `X | None`, else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if (
            len(members) == 1
            and isinstance(members[0], type)
            and dataclasses.is_dataclass(members[0])
        ):
            return members[0]
    return None


def require(condition: bool, key: str, message: str) -> None:
    """Raises ValueError('<key>: <message>') when `condition` is false; for __post_init__.

    The key is relative to the section (from_dict prefixes the section's key path), e.g.
    `require(0 <= self.ratio_clip_low < 1, "ratio_clip_low", "must be in [0, 1), got 1.5")`.
    """
    if not condition:
        raise ValueError(f"{key}: {message}")


def require_bool(section: Any, *keys: str) -> None:
    """`require`s that each of `section`'s fields `keys` is a bool (not 0/1, not "yes")."""
    for key in keys:
        value = getattr(section, key)
        require(isinstance(value, bool), key, f"must be true or false, got {value!r}")
