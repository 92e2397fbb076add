"""async_grpo's timeouts take effect: a hung collector (or a trainer that stops sampling) fails
with a TimeoutError naming the key after that many seconds, instead of hanging the run.

The generation and scoring are stand-ins (a round that never finishes, a round that finishes at
once); the collector, its replay buffer and, for the trainer's side, Ray are real. Timeouts are
a fraction of a second; nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import sys
import time

import cloudpickle
import pytest
import torch

from dockyard_rl.algorithms.async_utils.collector import (
    TrajectoryCollector,
    sample_groups,
    start_collector,
)
from dockyard_rl.algorithms.async_utils.replay_buffer import AsyncGRPOConfig
from dockyard_rl.algorithms.rollouts import Rollout
from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.data.prompt_sampler import PromptSampler
from dockyard_rl.environments.interfaces import EnvironmentResult
from dockyard_rl.models.generation.interfaces import GenerationSample

# The actor unpickles the runners: ship this module's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

INSTANCES = [f"task-{i}" for i in range(6)]
NUM_PROMPTS, NUM_SAMPLES, SEED = 2, 2, 3


class Entered:
    """A Ray actor the hung runner tells that its round began."""

    def __init__(self):
        self.rounds = 0

    def enter(self) -> None:
        self.rounds += 1

    def count(self) -> int:
        return self.rounds


class HungRunner:
    """A round whose generation never returns (an engine or executor that hangs)."""

    def __init__(self, entered):
        self.entered = entered

    async def run(self, instances, *, num_samples: int, **kwargs) -> Rollout:
        await self.entered.enter.remote()
        await asyncio.Event().wait()  # never set
        raise AssertionError("unreachable")


class InstantRunner:
    """A round that is generated and scored at once (every sample at weight version 0)."""

    async def run(self, instances, *, num_samples: int, **kwargs) -> Rollout:
        samples = [
            GenerationSample(
                prompt_index=p,
                sample_index=s,
                prompt_token_ids=(1,),
                response_token_ids=(2,),
                response_logprobs=(-1.0,),
                response_text="x",
                finish_reason="stop",
                stop_reason=None,
                weight_versions=(0,),
                oldest_weight_version=0,
                engine_index=0,
            )
            for p in range(len(instances))
            for s in range(num_samples)
        ]
        result = EnvironmentResult(
            rewards_B=torch.ones(len(samples)),
            sample_mask_B=torch.ones(len(samples)),
            metadata=tuple({} for _ in samples),
            metrics={},
        )
        return Rollout(list(instances), num_samples, samples, result)


def _sampler_state() -> dict:
    return PromptSampler(len(INSTANCES), NUM_PROMPTS, SEED).state_dict()


def test_a_hung_round_fails_sample_and_pause_with_the_key_named():
    import ray

    from dockyard_rl.cluster.local_ray import init_local_ray

    init_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    try:
        entered = ray.remote(Entered).remote()
        handle = start_collector(
            HungRunner(entered),
            INSTANCES,
            _sampler_state(),
            cluster_config=ClusterConfig(),
            num_prompts=NUM_PROMPTS,
            num_samples=NUM_SAMPLES,
            seed=SEED,
            buffer_config=AsyncGRPOConfig(max_buffer_groups=4, sample_timeout_s=0.5),
        )
        try:
            ray.get(handle.start.remote())
            # The trainer asks for a step's groups: none ever come.
            with pytest.raises(TimeoutError, match=r"async_grpo\.sample_timeout_s=0\.5: .*hung"):
                sample_groups(handle, NUM_PROMPTS, 0, 0.5)
            # A weight sync without in-flight updates waits for the round in flight: it never
            # ends. (Wait until it began, so the pause really meets a running round.)
            while ray.get(entered.count.remote()) == 0:
                time.sleep(0.05)
            with pytest.raises(TimeoutError, match=r"async_grpo\.sample_timeout_s=0\.5: .*round"):
                ray.get(handle.pause_generation.remote(0.5))
        finally:
            ray.kill(handle)
    finally:
        ray.shutdown()


def test_a_full_buffer_nobody_samples_fails_the_loop_with_the_key_named():
    # The buffer holds one round (2 groups); the trainer never samples, so the second round's
    # push finds no room. In-process: the collector's loop thread is the producer.
    collector = TrajectoryCollector(
        InstantRunner(),
        INSTANCES,
        _sampler_state(),
        num_prompts=NUM_PROMPTS,
        num_samples=NUM_SAMPLES,
        seed=SEED,
        buffer_config=AsyncGRPOConfig(max_buffer_groups=NUM_PROMPTS, push_timeout_s=0.2),
    )
    collector.start()
    collector._thread.join(60)
    # Without the timeout the loop would still be waiting for room.
    assert not collector._thread.is_alive(), "the loop still waits for room in the buffer"
    with pytest.raises(RuntimeError, match=r"TimeoutError: async_grpo\.push_timeout_s=0\.2: "):
        collector.sample(1, 0, 0)
    collector.stop(0)
