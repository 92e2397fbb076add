"""The environment seam: rollouts in, rewards + per-sample metadata + a loss mask out.

Shape legend: B = samples in the batch (every rollout of every prompt in one step).

An environment turns what the policy generated into rewards. For the single-shot SWE task
(`swe_env.SweEnvironment`) a rollout is one patch; the environment has it scored by the sandbox
fleet and shapes the verdict with the reward pipeline.

Covered here: the `Environment` ABC and its result type. Not covered: extracting patches from
model output (the data layer's processors do that and hand the environment a patch or a parse
failure), advantages (computed from the rewards by the algorithm). The multi-turn agent
environment (`agent_env.AgentEnvironment`) also runs the episodes it scores.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Environment", "EnvironmentResult"]


@dataclasses.dataclass(frozen=True)
class EnvironmentResult:
    """What one `Environment.step` returns, in the order of the input rollouts.

    Attributes:
        rewards_B: (B,) float32, the shaped reward of each sample; 0.0 where `sample_mask_B` is 0
            (a placeholder, never a score: the sample must not enter the loss).
        sample_mask_B: (B,) float32, 1.0 for a sample with a usable verdict, 0.0 for one without
            (infrastructure error after every retry). Multiply it into the loss mask.
        metadata: one JSON-friendly dict per sample (keys documented by the implementation).
        metrics: aggregate numbers for logging (`env/...` and the reward pipeline's keys).
    """

    rewards_B: torch.Tensor
    sample_mask_B: torch.Tensor
    metadata: tuple[dict[str, Any], ...]
    metrics: dict[str, float]

    def __post_init__(self) -> None:
        num_samples = len(self.metadata)
        for name in ("rewards_B", "sample_mask_B"):
            tensor = getattr(self, name)
            assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32, name
            assert tuple(tensor.shape) == (num_samples,), (name, tuple(tensor.shape), num_samples)


class Environment(abc.ABC):
    """Scores a batch of rollouts.

    Call order: construct once per trainer (setup errors, such as a bad config, raise
    `ValueError` there), then `await step(rollouts, global_step=k)` once per training step from
    the driver's event loop. `step` may be called again with the same `global_step` and the same
    rollouts (a retried step): implementations must not score a sample twice then.

    Which ranks call it: the driver (or the trajectory collector actor in async GRPO), never the
    policy workers.
    """

    #: Turns per episode; 1 for single-shot tasks.
    max_rollout_turns: int = 1

    @abc.abstractmethod
    async def step(self, rollouts: Sequence[Any], *, global_step: int) -> EnvironmentResult:
        """Scores `rollouts` (B samples) and returns their rewards, metadata and sample mask.

        A sample whose scoring hit infrastructure errors on every retry gets sample_mask 0, reward
        0 and `infra_error` in its metadata; it is not an exception.

        Raises:
            ValueError: a rollout is malformed (wrong type, missing fields), or `global_step` < 0.
            Implementation-specific errors for requests that retrying cannot fix (see the
            implementation), e.g. the scoring service rejecting a task as malformed.
        """
