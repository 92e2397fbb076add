"""Seconds per stage of one training step: `StepTimer`, the breakdown the Logger adds to each
training row as `timing/<stage>_s` (every stage of `metric_names.STAGES`, 0 when not measured),
`timing/total_s` and `timing/other_s`.

    timer = StepTimer()
    with timer.stage("generate"): ...
    timer.add("buffer_wait", 0.25)        # measured elsewhere (the async collector)
    breakdown = timer.pop()               # {"generate": 12.1, ..., "total": 14.0, "other": 1.6}
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from dockyard_rl.utils.metric_names import STAGES, check_name


class StepTimer:
    """Seconds spent per stage within one step.

    `stage(name)` times a block; `add(name, seconds)` records a time measured elsewhere (e.g. by
    the trajectory collector in async mode). `pop()` returns the breakdown and starts the next
    step. Stages may repeat within a step (their times add up) but must not nest (the breakdown
    would count the inner time twice). Not thread-safe: one timer belongs to one loop.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._active: str | None = None
        self._step_start = clock()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        check_name(name, "stage")
        if self._active is not None:
            raise RuntimeError(
                f"timer stage {name!r} started inside stage {self._active!r}; "
                f"stages must not nest (the time would be counted twice)"
            )
        self._active = name
        start = self._clock()
        try:
            yield
        finally:
            self._active = None
            self._add(name, self._clock() - start)

    def add(self, name: str, seconds: float) -> None:
        check_name(name, "stage")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            raise ValueError(f"stage {name!r}: seconds must be a number >= 0, got {seconds!r}")
        self._add(name, float(seconds))

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """{stage: seconds} for every STAGE and any other stage timed, plus `total` and `other`.

        `total` is the wall time since the previous pop (or the timer's creation); `other` is
        the part of it no stage covered (>= 0; stages timed by `add` may overlap the loop).
        """
        now = self._clock()
        breakdown = {stage: 0.0 for stage in STAGES}
        breakdown.update(self._seconds)
        total = now - self._step_start
        breakdown["total"] = total
        breakdown["other"] = max(0.0, total - sum(self._seconds.values()))
        self._seconds = {}
        self._step_start = now
        return breakdown
