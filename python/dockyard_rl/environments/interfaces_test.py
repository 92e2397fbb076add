"""The Environment ABC and the shape checks of EnvironmentResult."""

import asyncio

import pytest
import torch

from dockyard_rl.environments.interfaces import Environment, EnvironmentResult


def result(num_rewards: int, num_mask: int, num_metadata: int, dtype=torch.float32):
    return EnvironmentResult(
        rewards_B=torch.zeros(num_rewards, dtype=dtype),
        sample_mask_B=torch.ones(num_mask, dtype=torch.float32),
        metadata=tuple({} for _ in range(num_metadata)),
        metrics={},
    )


def test_result_shapes_must_match_the_batch():
    assert result(3, 3, 3).rewards_B.shape == (3,)
    with pytest.raises(AssertionError):
        result(3, 2, 3)
    with pytest.raises(AssertionError):
        result(3, 3, 2)
    with pytest.raises(AssertionError):
        result(3, 3, 3, dtype=torch.float64)


def test_environment_requires_step():
    with pytest.raises(TypeError):
        Environment()

    class Constant(Environment):
        async def step(self, rollouts, *, global_step):
            num = len(rollouts)
            return EnvironmentResult(
                torch.full((num,), 0.5),
                torch.ones(num),
                tuple({"step": global_step} for _ in rollouts),
                {},
            )

    out = asyncio.run(Constant().step(["a", "b"], global_step=4))
    assert out.rewards_B.tolist() == [0.5, 0.5] and out.metadata[1] == {"step": 4}
    assert Constant.max_rollout_turns == 1
