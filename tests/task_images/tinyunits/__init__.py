"""A stand-in third-party package that exists only inside the `tinyunits_task_image` test image."""

_METERS_PER = {"m": 1.0, "km": 1000.0, "cm": 0.01, "mi": 1609.344, "ft": 0.3048}


def convert(value: float, source: str, target: str) -> float:
    """`value` in unit `source`, expressed in unit `target` (lengths only)."""
    return value * _METERS_PER[source] / _METERS_PER[target]
