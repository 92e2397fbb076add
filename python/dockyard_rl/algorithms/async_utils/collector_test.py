"""The trajectory collector actor on a real local Ray, with a scripted runner in place of the
engines and the sandbox: prompt order, stale groups redone, pausing, snapshots, failures."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch

from dockyard_rl.algorithms.async_utils.collector import split_groups, start_collector
from dockyard_rl.algorithms.async_utils.replay_buffer import AsyncGRPOConfig
from dockyard_rl.algorithms.rollouts import Rollout
from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.data.prompt_sampler import PromptSampler
from dockyard_rl.environments.interfaces import EnvironmentResult
from dockyard_rl.models.generation.interfaces import GenerationSample

# The actor unpickles the scripted runner: ship this module's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

INSTANCES = [f"task-{i}" for i in range(10)]
NUM_PROMPTS, NUM_SAMPLES, SEED = 2, 3, 7


@pytest.fixture(scope="module")
def ray_runtime():
    import ray

    from dockyard_rl.cluster.local_ray import init_local_ray

    init_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class Script:
    """What the runner reads each round: the weight version its samples get, whether to fail.
    A Ray actor, so the test can change it while the collector runs."""

    def __init__(self):
        self.version, self.fail, self.rounds = 0, False, []

    def set(self, version: int | None = None, fail: bool | None = None) -> None:
        self.version = self.version if version is None else version
        self.fail = self.fail if fail is None else fail

    def begin_round(self, instances: list[str]) -> tuple[int, bool]:
        self.rounds.append(list(instances))
        return self.version, self.fail

    def get_rounds(self) -> list[list[str]]:
        return self.rounds


class ScriptedRunner:
    """RolloutRunner's `run`, with samples at the script's weight version and reward 1."""

    def __init__(self, script):
        self.script = script

    async def run(
        self, instances, *, num_samples: int, global_step: int, prompt_keys=None
    ) -> Rollout:
        version, fail = await self.script.begin_round.remote(list(instances))
        if fail:
            raise RuntimeError("the executor is unreachable")
        samples = [
            GenerationSample(
                prompt_index=p,
                sample_index=s,
                prompt_token_ids=(1, 2),
                response_token_ids=(3,),
                response_logprobs=(-0.5,),
                response_text="x",
                finish_reason="stop",
                stop_reason=None,
                weight_versions=(version,),
                oldest_weight_version=version,
                engine_index=0,
            )
            for p in range(len(instances))
            for s in range(num_samples)
        ]
        size = len(samples)
        result = EnvironmentResult(
            rewards_B=torch.ones(size),
            sample_mask_B=torch.ones(size),
            metadata=tuple({} for _ in range(size)),
            metrics={},
        )
        return Rollout(list(instances), num_samples, samples, result, prompt_keys=prompt_keys)


def _collector(ray, script, *, sampler_state=None, max_buffer_groups=4, **kwargs):
    sampler = PromptSampler(len(INSTANCES), NUM_PROMPTS, SEED)
    handle = start_collector(
        ScriptedRunner(script),
        INSTANCES,
        sampler_state or sampler.state_dict(),
        cluster_config=ClusterConfig(),
        num_prompts=NUM_PROMPTS,
        num_samples=NUM_SAMPLES,
        seed=SEED,
        buffer_config=AsyncGRPOConfig(
            max_trajectory_age_steps=1, max_buffer_groups=max_buffer_groups
        ),
        **kwargs,
    )
    ray.get(handle.start.remote())
    return handle


def _sample(ray, handle, num_groups: int, version: int):
    records = ray.get(handle.sample.remote(num_groups, version, 30.0))
    assert records is not None, "no groups within 30 s"
    return records


def _stop(ray, handle) -> None:
    ray.get(handle.stop.remote())
    ray.kill(handle)


def test_groups_follow_the_prompt_sampler_whole(ray_runtime):
    ray = ray_runtime
    script = ray.remote(Script).remote()
    handle = _collector(ray, script)
    try:
        consumed = [r.prompt_id for _ in range(3) for r in _sample(ray, handle, NUM_PROMPTS, 0)]
        expected = PromptSampler(len(INSTANCES), NUM_PROMPTS, SEED)
        # Tickets: (instance index, draw index in the sampler's stream: what seeds derive from).
        indices = [i for _ in range(3) for i in expected.next_batch()]
        assert consumed == [(i, draw) for draw, i in enumerate(indices)]
        record = _sample(ray, handle, 1, 0)[0]
        assert record.payload.num_samples == NUM_SAMPLES and len(record.payload.samples) == 3
        index, draw = record.prompt_id
        assert record.payload.instances == [INSTANCES[index]]
        assert record.payload.prompt_keys == [draw] == [3 * NUM_PROMPTS]
    finally:
        _stop(ray, handle)


def test_stale_groups_are_dropped_and_their_prompts_redone_first(ray_runtime):
    ray = ray_runtime
    script = ray.remote(Script).remote()
    handle = _collector(ray, script)
    try:
        # Let version-0 groups fill the buffer (4 groups), then train at version 5: all stale.
        deadline = time.monotonic() + 30
        while len(ray.get(handle.snapshot.remote())["buffer"]) < 4:
            assert time.monotonic() < deadline, "the buffer did not fill"
            time.sleep(0.2)
        stale = [r["prompt_id"] for r in ray.get(handle.snapshot.remote())["buffer"]]
        ray.get(script.set.remote(version=5))
        records = _sample(ray, handle, 4, 5)
        assert all(r.weight_version >= 4 for r in records)
        assert [r.prompt_id for r in records] == stale
        assert ray.get(handle.metrics.remote())["num_groups_dropped_stale"] >= 4
    finally:
        _stop(ray, handle)


def test_pause_generation_holds_new_rounds_until_resumed(ray_runtime):
    ray = ray_runtime
    script = ray.remote(Script).remote()
    handle = _collector(ray, script, max_buffer_groups=64)
    try:
        _sample(ray, handle, 2, 0)
        ray.get(handle.pause_generation.remote())
        paused_rounds = len(ray.get(script.get_rounds.remote()))
        time.sleep(1.5)
        assert len(ray.get(script.get_rounds.remote())) == paused_rounds
        ray.get(handle.resume_generation.remote())
        deadline = time.monotonic() + 30
        while len(ray.get(script.get_rounds.remote())) == paused_rounds:
            assert time.monotonic() < deadline, "no round after resume_generation"
            time.sleep(0.1)
    finally:
        _stop(ray, handle)


def test_a_snapshot_resumes_the_same_prompt_order(ray_runtime):
    ray = ray_runtime
    script = ray.remote(Script).remote()
    first = _collector(ray, script)
    try:
        _sample(ray, first, 2, 0)
        snapshot = ray.get(first.snapshot.remote())
        continued = [r.prompt_id for _ in range(4) for r in _sample(ray, first, 2, 0)]
    finally:
        _stop(ray, first)
    resumed = _collector(
        ray,
        script,
        sampler_state=snapshot["sampler"],
        redo=snapshot["in_flight"],
        buffered=snapshot["buffer"],
    )
    try:
        assert [r.prompt_id for _ in range(4) for r in _sample(ray, resumed, 2, 0)] == continued
    finally:
        _stop(ray, resumed)


def test_a_failed_round_surfaces_in_sample(ray_runtime):
    ray = ray_runtime
    script = ray.remote(Script).remote()
    ray.get(script.set.remote(fail=True))
    handle = _collector(ray, script)
    try:
        with pytest.raises(
            Exception,
            match="trajectory collector failed: RuntimeError: the executor is unreachable",
        ):
            ray.get(handle.sample.remote(1, 0, 30.0))
    finally:
        _stop(ray, handle)


def test_split_groups_keeps_each_prompt_whole():
    samples = [
        GenerationSample(
            prompt_index=p,
            sample_index=s,
            prompt_token_ids=(1,),
            response_token_ids=(2,),
            response_logprobs=(-1.0,),
            response_text=f"{p}{s}",
            finish_reason="stop",
            stop_reason=None,
            weight_versions=(0,),
            oldest_weight_version=0,
            engine_index=0,
        )
        for p in range(2)
        for s in range(2)
    ]
    result = EnvironmentResult(
        rewards_B=torch.tensor([1.0, 0.0, -1.0, 1.0]),
        sample_mask_B=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        metadata=tuple({"i": i} for i in range(4)),
        metrics={},
    )
    groups = split_groups(Rollout(["a", "b"], 2, samples, result, generate_seconds=2.0))
    assert [g.instances for g in groups] == [["a"], ["b"]]
    assert [s.response_text for s in groups[1].samples] == ["10", "11"]
    assert groups[1].rewards_B.tolist() == [-1.0, 1.0]
    assert groups[1].sample_mask_B.tolist() == [0.0, 1.0]
    assert groups[1].result.metadata == ({"i": 2}, {"i": 3})
    assert groups[0].generate_seconds == 1.0
