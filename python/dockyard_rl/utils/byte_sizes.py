"""Byte sizes in config files: an int of bytes or a string with a binary unit ("512MiB")."""

from __future__ import annotations

import re

from dockyard_rl.utils.config import is_int

# Binary units only: "GB" would leave open whether 10**9 or 2**30 was meant.
_BYTE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*")


def parse_byte_size(value, key: str) -> int:
    """Bytes from an int (bytes) or a string with a binary unit: "512MiB", "1GiB", "1.5 GiB".

    Raises:
        ValueError: anything else (bools, floats, unknown units, "GB"), or a size that is not
            positive; the message starts with `key`.
    """
    units = ", ".join(_BYTE_UNITS)
    if is_int(value):
        size = value
    elif (
        isinstance(value, str)
        and (match := _BYTE_SIZE.fullmatch(value))
        and match.group(2) in _BYTE_UNITS
    ):
        size = int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    else:
        raise ValueError(
            f"{key}: must be an int of bytes or a string with a unit ({units}), "
            f'e.g. "1GiB" or "512 MiB", got {value!r}'
        )
    if size <= 0:
        raise ValueError(f"{key}: must be > 0 bytes, got {value!r}")
    return size


def format_bytes(num_bytes: int | float) -> str:
    """A size as messages show it: "1.50 GiB", "64.00 MiB", "512 B" (largest unit that is >= 1)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(num_bytes) >= _BYTE_UNITS[unit]:
            return f"{num_bytes / _BYTE_UNITS[unit]:.2f} {unit}"
    return f"{int(num_bytes)} B"
