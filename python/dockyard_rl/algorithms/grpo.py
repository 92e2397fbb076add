"""GRPO for coding agents: the synchronous and the asynchronous training loop.

    run(config)            # what `tools/bazel run //python/launch:grpo_swe` calls

One synchronous step (`grpo_train`), each line below one call:

    1. prompts    the next `grpo.num_prompts_per_step` tasks (PromptSampler: seeded epochs)
                  and their draw indices, from which every sample's seed derives (utils/seeding)
    2. weights    if the trainer stepped since the engines last synced: sync_weights + wake
    3. rollouts   `grpo.num_generations_per_prompt` samples per prompt from the engines
    4. rewards    each sample's patch scored by the sandbox (the repository's real tests)
    5. batch      leave-one-out advantages per group; all-masked groups dropped (rollouts.py)
    6. logprobs   the old policy's log-probs of the samples, when the step makes more than one
                  optimizer step (and the reference's for a KL term)
    7. train      ClippedPGLossFn optimizer steps: `grpo.train_mini_batch_size` samples each,
                  `grpo.num_epochs` passes (mini_batches.py); then the synchronizer marks the
                  weights stale once (a weight version is a trainer step, not an optimizer step)
    8. record     metrics and stage times logged; validation and checkpoints on their periods

A fresh run with a `warm_start` section first trains on gold answers to other tasks
(warm_start.py) and checkpoints that as step 0.

`async_grpo_train` runs 1-4 continuously in a trajectory collector actor (async_utils/collector.py)
that pushes scored groups into the age-bounded replay buffer; the trainer samples groups no older
than `async_grpo.max_trajectory_age_steps` and does 5-8 (module docstring there).

The steps both loops run (2, 5-8, validation, checkpoints) are grpo_steps.py's; this module
composes them, and async_grpo.py imports them from there, not from here.
Setup, resume and shutdown: grpo_setup.py. Validation: validation.py. What a resumed run
reproduces (the same prompts; the same samples, seeded per prompt draw and sample):
docs/algorithms.md, "Resume".
Every step logs its trained samples (`log_samples`: prompt, seed, weight versions, token digest).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from dockyard_rl.algorithms.agent_rollouts import AgentRolloutRunner, agent_user_message
from dockyard_rl.algorithms.async_grpo import async_grpo_train
from dockyard_rl.algorithms.async_utils.event_loops import close_loop
from dockyard_rl.algorithms.grpo_config import MasterConfig
from dockyard_rl.algorithms.grpo_setup import GRPORun, setup
from dockyard_rl.algorithms.grpo_steps import (
    finish_step,
    maybe_validate,
    refresh_engine_weights,
    save_checkpoint,
    train_on_rollouts,
)
from dockyard_rl.algorithms.warm_start import (
    agent_warm_start_examples,
    run_warm_start,
    warm_start_examples,
)

logger = logging.getLogger(__name__)


def run(config: MasterConfig) -> None:
    """Sets up (or resumes) the run, trains in `grpo.mode`, shuts everything down."""
    training = setup(config)
    try:
        maybe_warm_start(training)
        if config.grpo.mode == "async":
            async_grpo_train(training)
        else:
            grpo_train(training)
    finally:
        training.close()


def grpo_train(run: GRPORun) -> None:
    """The synchronous loop (module docstring), from `run.step + 1` to `grpo.max_num_steps`."""
    config, loop = run.config.grpo, asyncio.new_event_loop()
    try:
        maybe_validate(run, loop, at_start=True)
        while run.step < config.max_num_steps:
            step = run.step + 1
            first_draw = run.sampler.num_consumed  # the seeds' prompt keys (utils/seeding.py)
            instances = [run.train[i] for i in run.sampler.next_batch()]  # 1
            logger.info("step %d: prompts %s", step, json.dumps([i.instance_id for i in instances]))
            with run.logger.timer("weight_sync"):  # 2
                refresh_engine_weights(run)
            rollout = loop.run_until_complete(
                run.runner.run(  # 3, 4
                    instances,
                    num_samples=config.num_generations_per_prompt,
                    global_step=step,
                    prompt_keys=range(first_draw, first_draw + len(instances)),
                )
            )
            run.logger.add_time("generate", rollout.generate_seconds)
            run.logger.add_time("score", rollout.score_seconds)
            metrics = train_on_rollouts(run, [rollout], step)  # 5-7
            finish_step(run, loop, step, metrics)  # 8
        maybe_validate(run, loop, at_end=True)
    finally:
        run.logger.finish()
        close_loop(loop)


def maybe_warm_start(run: GRPORun) -> None:
    """The supervised warm start (warm_start.py) of a fresh run, checkpointed as step 0."""
    config = run.config.warm_start
    if config is None or run.resumed is not None:
        return
    start = time.monotonic()
    if isinstance(run.runner, AgentRolloutRunner):
        examples, skipped = agent_warm_start_examples(
            run.warm_start_instances,
            run.runner.environment.renderer,
            agent_user_message,
            max_tokens=run.config.env.agent.max_episode_tokens,
        )
        answer_format = "tool-use demonstration"
    else:
        examples, skipped = warm_start_examples(run.warm_start_instances, run.runner.processor)
        answer_format = f"{run.config.data.prompt.patch_format} format"
    logger.info(
        "warm start: %d examples (%d tasks skipped: their gold patch cannot be written "
        "as a %s), %d epochs",
        len(examples),
        skipped,
        answer_format,
        config.num_epochs,
    )
    history = run_warm_start(
        run.policy, examples, config, run.pad_token_id, dp_size=run.config.policy.dp_size
    )
    run.synchronizer.mark_stale()
    run.logger.log_metrics(
        0,
        {
            "num_examples": len(examples),
            "num_skipped": skipped,
            "optimizer_steps": sum(epoch["steps"] for epoch in history),
            "nll_per_token_first_epoch": history[0]["nll_per_token"],
            "nll_per_token_last_epoch": history[-1]["nll_per_token"],
            "seconds": time.monotonic() - start,
        },
        prefix="warm_start",
    )
    save_checkpoint(run)
