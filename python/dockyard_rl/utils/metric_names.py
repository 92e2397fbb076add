"""Names in a run's metrics: the keys the GRPO loop logs and the console, the plot and the tests
read (the contract between them), the stages of a step's time breakdown, and the syntax of names.

    {"train/reward_mean": 0.4, "val/resolve_rate": 0.3, "timing/generate_s": 12.1}

A logged key is `<prefix>/<name>`: the prefix is "train" or "val" (the Logger adds "timing" for
the breakdown, `timing/<stage>_s`); a name is one or more parts of letters, digits, '_', '.' and
'-' joined by '/' ("loss", "loss/clip_fraction"). Prefixes, stages and run names are one part.
"""

from __future__ import annotations

import re
from typing import Any

# Stages of a GRPO step, always present in the breakdown (0.0 when a step had none of it).
STAGES = ("generate", "score", "logprobs", "train", "weight_sync", "buffer_wait")
REWARD_KEY = "reward_mean"  # mean training / validation reward of the step
RESOLVE_RATE_KEY = "resolve_rate"  # fraction of samples whose patch made the tests pass
APPLY_RATE_KEY = "apply_rate"  # fraction of samples whose patch applied
TIMING_PREFIX = "timing"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_METRIC_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")  # "loss", "loss/clip_frac"


def is_name(value: Any) -> bool:
    """Whether `value` is one part: a non-empty string of letters, digits, '_', '.', '-'."""
    return isinstance(value, str) and bool(_NAME_RE.match(value))


def is_metric_name(value: Any) -> bool:
    """Whether `value` is a metric name: parts joined by '/', none of them empty."""
    return isinstance(value, str) and bool(_METRIC_RE.match(value))


def check_name(name: Any, what: str) -> None:
    """Raises ValueError naming `what` (e.g. "stage", "prefix") unless `name` is one part."""
    if not is_name(name):
        raise ValueError(
            f"{what} {name!r} must be a non-empty name of letters, digits, '_', "
            f"'.', '-' (a '/' is added between prefix and name)"
        )
