"""Tests of step_timer.py: the per-stage breakdown of a step, and what the timer refuses."""

import pytest

from dockyard_rl.utils.metric_names import STAGES
from dockyard_rl.utils.step_timer import StepTimer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_step_timer_breakdown():
    clock = FakeClock()
    timer = StepTimer(clock)
    with timer.stage("generate"):
        clock.now += 3.0
    clock.now += 0.5  # between stages: "other"
    with timer.stage("score"):
        clock.now += 1.0
    with timer.stage("generate"):  # a repeated stage adds up
        clock.now += 1.0
    timer.add("buffer_wait", 0.25)
    breakdown = timer.pop()
    assert set(STAGES) <= set(breakdown)
    assert breakdown["generate"] == 4.0 and breakdown["score"] == 1.0
    assert breakdown["buffer_wait"] == 0.25 and breakdown["train"] == 0.0
    assert breakdown["total"] == 5.5 and breakdown["other"] == pytest.approx(0.25)
    clock.now += 2.0  # the next step starts where the last pop ended
    assert timer.pop() == {**{stage: 0.0 for stage in STAGES}, "total": 2.0, "other": 2.0}


def test_step_timer_rejects_nesting_and_bad_input():
    timer = StepTimer(FakeClock())
    with pytest.raises(RuntimeError, match="must not nest"):
        with timer.stage("train"):
            with timer.stage("logprobs"):
                pass
    with pytest.raises(ValueError, match="seconds must be a number >= 0"):
        timer.add("score", -1)
    with pytest.raises(ValueError, match="stage 'a/b'"):
        timer.add("a/b", 1)
    with timer.stage("train"):  # usable again after the error
        pass
