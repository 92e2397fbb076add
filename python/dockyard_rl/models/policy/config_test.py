"""Tests of the `policy` config section and the shared LR schedule."""

import math

import pytest

from dockyard_rl.models.policy.config import (
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    learning_rate_at,
)
from dockyard_rl.utils.config import from_dict


def test_defaults_and_nested_sections():
    cfg = from_dict(
        PolicyConfig,
        {
            "backend": "jax",
            "optimizer": {"learning_rate": 3e-6},
            "scheduler": {"warmup_steps": 2, "total_steps": 10},
        },
        "policy",
    )
    assert cfg.backend == "jax" and cfg.optimizer.learning_rate == 3e-6
    assert cfg.scheduler.warmup_steps == 2


@pytest.mark.parametrize(
    "data,message",
    [
        ({"backend": "tf"}, r"policy\.backend: unknown backend 'tf'; valid: dtensor, jax"),
        ({"dp_size": 0}, r"policy\.dp_size"),
        ({"dtype": "float16"}, r"policy\.dtype"),
        ({"optimizer": {"learning_rate": 0}}, r"policy\.optimizer\.learning_rate"),
        ({"scheduler": {"warmup_steps": 5, "total_steps": 5}}, r"policy\.scheduler\.total_steps"),
        ({"max_grad_norm": -1}, r"policy\.max_grad_norm"),
        ({"logprob_temperature": 0}, r"policy\.logprob_temperature: must be a number > 0 or null"),
        ({"optimiser": {}}, r"unknown key\(s\) 'optimiser'"),
    ],
)
def test_bad_config_names_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(PolicyConfig, data, "policy")


def test_schedule_warmup_then_cosine():
    opt, sched = OptimizerConfig(learning_rate=1.0), SchedulerConfig(4, 14, 0.1)
    assert [learning_rate_at(s, opt, sched) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert learning_rate_at(9, opt, sched) == pytest.approx(
        0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2
    )
    assert learning_rate_at(14, opt, sched) == pytest.approx(0.1)
    assert learning_rate_at(100, opt, sched) == pytest.approx(0.1)
