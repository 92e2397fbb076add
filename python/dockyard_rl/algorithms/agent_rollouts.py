"""One round of multi-turn agent rollouts (`grpo.max_rollout_turns` > 1): the counterpart of
rollouts.RolloutRunner, with the same interface, so the synchronous loop, async GRPO's
trajectory collector and validation drive either one.

    runner = AgentRolloutRunner(generation, agent_environment, tokenizer, run_seed=s)
    rollout = await runner.run(instances, num_samples=N, global_step=step, prompt_keys=keys)
    batch, stats = build_train_batch(rollout, advantage_cfg, pad_token_id)   # rollouts.py

`run`: every one of the G x N episodes runs concurrently (`environments/agent_env.py`: at most
`env.agent.max_concurrent_episodes` at once, each in its own executor session); each turn is one
engine request for one sample, so the turns of all live episodes are batched by the engines.
The episodes come back as samples whose `response_mask` marks the policy's own tokens, laid out
group-contiguous like single-shot samples (sample i belongs to prompt i // N), and are scored by
the environment. `build_train_batch` turns them into the usual (B, S) batch, with the tool
outputs masked out of the loss.

Seeds: turn t of sample i of a prompt is generated with
`utils/seeding.sample_seed(run_seed, purpose, key, instance_id, i, turn=t)`, so a resumed or
retried round replays the model's side of every episode (the tools' outputs may differ, e.g.
timings printed by pytest, and then so do the later turns).

Prompt: the chat template's system message (the tools and how to call them:
`agent_tools.ChatRenderer`) and a user message with the task's problem statement; the agent sees
the repository only through its tools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dockyard_rl.algorithms.rollouts import Rollout
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.environments.agent_env import AgentEnvironment, AgentRollout, Episode
from dockyard_rl.models.generation.interfaces import GenerationSample
from dockyard_rl.utils.seeding import sample_seed

__all__ = ["AgentRolloutRunner", "agent_user_message"]


def agent_user_message(instance: SweInstance) -> str:
    """The task as the agent's first user message: the problem statement and where it is."""
    return (
        f"{instance.problem_statement.strip()}\n\n"
        "You are in the root of the repository at the commit with the bug. Use the tools to "
        "read the code, change it and run the tests; call submit when the fix is done."
    )


class AgentRolloutRunner:
    """Prompts -> multi-turn episodes -> rewards (module docstring).

    Args:
        generation: the engines (`GenerationInterface`, or an engine client in the collector).
        environment: the `AgentEnvironment` (sessions, tools, scoring).
        max_response_tokens: the episode's policy-token budget (the overlong stage's reference).
        thinking_required: passed to the reward pipeline.
        run_seed: `grpo.seed` for per-turn seeds; None: unseeded sampling.
    """

    def __init__(
        self,
        generation,
        environment: AgentEnvironment,
        *,
        max_response_tokens: int,
        thinking_required: bool = False,
        run_seed: int | None = None,
    ):
        self.generation = generation
        self.environment = environment
        self.max_response_tokens = max_response_tokens
        self.thinking_required = thinking_required
        self.run_seed = run_seed
        self._prompts: dict[str, list[int]] = {}

    @property
    def processor(self):
        """No single-shot prompt processor: the warm start uses tool demonstrations instead."""
        return None

    def with_generation(self, generation) -> AgentRolloutRunner:
        """A runner like this one that samples from `generation` (the collector's client)."""
        return AgentRolloutRunner(
            generation,
            self.environment,
            max_response_tokens=self.max_response_tokens,
            thinking_required=self.thinking_required,
            run_seed=self.run_seed,
        )

    def prompt_ids(self, instance: SweInstance) -> list[int]:
        if instance.instance_id not in self._prompts:
            self._prompts[instance.instance_id] = self.environment.renderer.initial_prompt_ids(
                agent_user_message(instance)
            )
        return self._prompts[instance.instance_id]

    async def run(
        self,
        instances: Sequence[SweInstance],
        *,
        num_samples: int,
        global_step: int,
        sampling_overrides: Mapping[str, Any] | None = None,
        prompt_keys: Sequence[int] | None = None,
        purpose: str = "train",
    ) -> Rollout:
        """Runs and scores G x `num_samples` episodes; `RolloutRunner.run`'s contract."""
        start = time.monotonic()
        seeded = prompt_keys is not None and self.run_seed is not None
        tasks = [
            asyncio.ensure_future(
                self._episode(
                    instance,
                    prompt_index,
                    sample_index,
                    key=prompt_keys[prompt_index] if seeded else None,
                    purpose=purpose,
                    sampling_overrides=sampling_overrides,
                    session_prefix=f"s{global_step}-p{prompt_index}-n{sample_index}",
                )
            )
            for prompt_index, instance in enumerate(instances)
            for sample_index in range(num_samples)
        ]
        try:
            episodes = await asyncio.gather(*tasks)
        except BaseException:
            # An engine failure ends the round: stop the other episodes here, while the loop
            # runs, so each closes its executor session instead of leaving it to the reaper.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        generated = time.monotonic()
        rollouts = [
            AgentRollout(
                instance=instances[index // num_samples].to_task_spec(""),
                episode=episode,
                max_response_length=self.max_response_tokens,
                thinking_required=self.thinking_required,
                reference_patch=instances[index // num_samples].patch,
            )
            for index, episode in enumerate(episodes)
        ]
        result = await self.environment.step(rollouts, global_step=global_step)
        return Rollout(
            list(instances),
            num_samples,
            [episode.sample for episode in episodes],
            result,
            generate_seconds=generated - start,
            score_seconds=time.monotonic() - generated,
            prompt_keys=None if prompt_keys is None else list(prompt_keys),
        )

    async def _episode(
        self,
        instance: SweInstance,
        prompt_index: int,
        sample_index: int,
        *,
        key: int | None,
        purpose: str,
        sampling_overrides: Mapping[str, Any] | None,
        session_prefix: str,
    ) -> Episode:
        async def generate_turn(context: list[int], turn: int, max_tokens: int):
            seeds = None
            if key is not None:
                seed = sample_seed(
                    self.run_seed, purpose, key, instance.instance_id, sample_index, turn
                )
                seeds = [[seed]]
            overrides = {**(sampling_overrides or {}), "max_tokens": max_tokens}
            samples: list[GenerationSample] = [
                sample
                async for sample in self.generation.generate(
                    [context], 1, sampling_overrides=overrides, seeds=seeds
                )
            ]
            assert len(samples) == 1, f"the engine returned {len(samples)} samples for one"
            sample = samples[0]
            # The episode's sample keeps the round's layout, not the per-turn request's.
            return _relabel(sample, prompt_index, sample_index)

        return await self.environment.run_episode(
            instance.to_task_spec(""),
            self.prompt_ids(instance),
            generate_turn,
            session_prefix=session_prefix,
        )


def _relabel(sample: GenerationSample, prompt_index: int, sample_index: int) -> GenerationSample:
    return dataclasses.replace(sample, prompt_index=prompt_index, sample_index=sample_index)
