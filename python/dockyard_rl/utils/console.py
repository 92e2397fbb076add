"""The console of a training run: a tqdm progress bar on a terminal, one plain line per logged
step when stderr is not one (a log file), each with the step's reward, resolve rate and stage
times, and messages (validation rows, warnings) between them.

    step 12: reward=0.400 resolve=0.250 | gen 12.3s lp 1.2s train 4.0s sync 0.5s
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from dockyard_rl.utils.metric_names import RESOLVE_RATE_KEY, REWARD_KEY, STAGES, TIMING_PREFIX

_STAGE_ABBREVIATIONS = {
    "generate": "gen",
    "score": "score",
    "logprobs": "lp",
    "train": "train",
    "weight_sync": "sync",
    "buffer_wait": "wait",
}


class Console:
    """A tqdm bar on a terminal; one plain line per logged step when stderr is not a terminal."""

    def __init__(self, total_steps: int | None, initial_step: int):
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
        self._step = initial_step

    def update(self, step: int, text: str) -> None:
        if self._bar is not None:
            self._bar.update(max(0, step - self._step))
            self._bar.set_postfix_str(text, refresh=True)
        else:
            print(f"step {step}: {text}", file=sys.stderr, flush=True)
        self._step = max(self._step, step)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_text(row: Mapping[str, float], nonfinite: Mapping[str, str]) -> str:
    parts = []
    for label, key in (
        ("reward", f"train/{REWARD_KEY}"),
        ("resolve", f"train/{RESOLVE_RATE_KEY}"),
        ("val_resolve", f"val/{RESOLVE_RATE_KEY}"),
    ):
        if isinstance(row.get(key), float):
            parts.append(f"{label}={row[key]:.3f}")
    times = [
        f"{_STAGE_ABBREVIATIONS[stage]} {row[key]:.1f}s"
        for stage in STAGES
        if row.get(key := f"{TIMING_PREFIX}/{stage}_s")
    ]
    if times:
        parts.append("| " + " ".join(times))
    if nonfinite:
        parts.append(f"| NONFINITE: {', '.join(sorted(nonfinite))}")
    return " ".join(parts)
