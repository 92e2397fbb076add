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
from dockyard_rl.algorithms.grpo_config import MasterConfig
from dockyard_rl.algorithms.grpo_setup import (
    POLICY_DIR,
    TRAINER_STATE_DIR,
    GRPORun,
    setup,
    trainer_state,
)
from dockyard_rl.algorithms.mini_batches import (
    mini_batch_plan,
    mini_batch_seed,
    train_mini_batches,
)
from dockyard_rl.algorithms.rollouts import (
    Rollout,
    assemble_train_batch,
    rollout_metrics,
    sample_log_rows,
    valid_weight_versions,
)
from dockyard_rl.algorithms.validation import validate
from dockyard_rl.algorithms.warm_start import (
    agent_warm_start_examples,
    run_warm_start,
    warm_start_examples,
)
from dockyard_rl.data_plane.experience import RemoteBatch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.utils.checkpoint import save_trainer_state

logger = logging.getLogger(__name__)


def run(config: MasterConfig) -> None:
    """Sets up (or resumes) the run, trains in `grpo.mode`, shuts everything down."""
    training = setup(config)
    try:
        maybe_warm_start(training)
        if config.grpo.mode == "async":
            from dockyard_rl.algorithms.async_grpo import async_grpo_train

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
        loop.close()


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


def refresh_engine_weights(run: GRPORun) -> None:
    """Gives the engines the trainer's current weights if they lack them, and wakes them."""
    if run.synchronizer.is_stale:
        run.synchronizer.sync_weights()
    run.synchronizer.prepare_for_generation()


def train_on_rollouts(run: GRPORun, rollouts: list[Rollout], step: int) -> dict[str, float]:
    """Steps 5-7 on one or more rollouts (groups of the same step); returns the step's metrics."""
    log_samples(step, rollouts)
    batch, stats = assemble_train_batch(
        rollouts, run.config.grpo.advantage, run.pad_token_id, run.config.policy.dp_size
    )
    metrics = rollout_metrics(rollouts)
    metrics["dropped_groups"] = float(sum(s.num_dropped_groups for s in stats))
    return train_batch(run, batch, step, metrics)


def train_batch(
    run: GRPORun, batch: BatchedDataDict | RemoteBatch | None, step: int, metrics: dict[str, float]
) -> dict[str, float]:
    """Steps 6-7 on a step's batch: a BatchedDataDict in the driver, or the handle of one whose
    shards wait in the policy's ranks (async GRPO with a data plane: log-probs are then stored
    rank-side, and `get_logprobs` returns None). None: every group was dropped, no update.
    Adds the training metrics to `metrics` and returns it."""
    if batch is None:
        logger.warning(
            "step %d: every group was masked (sandbox infrastructure errors); no update this step",
            step,
        )
        metrics["skipped_update"] = 1.0
        return metrics
    # The step's optimizer steps (mini_batches.py): mini-batches x epochs, shuffled by a seed a
    # resume derives again. The same plan of global rows for a RemoteBatch (the ranks map the
    # rows onto their shards).
    config = run.config.grpo
    plan = mini_batch_plan(
        batch.batch_size,
        config.train_mini_batch_size,
        config.num_epochs,
        mini_batch_seed(config.seed, step),
    )
    with run.logger.timer("logprobs"):
        # The old policy's log-probs, once before the first optimizer step; a single optimizer
        # step skips the pass (the training forward has them: loss_functions, "Old policy").
        if len(plan) > 1:
            batch = _store(batch, "prev_logprobs", run.policy.get_logprobs(batch))
        if run.config.loss_fn.reference_kl_coef > 0 and not config.skip_reference_policy_logprobs:
            batch = _store(
                batch, "reference_policy_logprobs", run.policy.get_reference_policy_logprobs(batch)
            )
    # Versions behind the weights being trained (step - 1, or step after a warm start).
    ages = run.synchronizer.trainer_version - valid_weight_versions(batch)
    with run.logger.timer("train"):
        train_metrics = train_mini_batches(
            run.policy, batch, run.loss_fn, plan, run.config.policy.dp_size
        )
    # ONE weight version per trainer step, however many optimizer steps it made: a version is a
    # publication to the engines (sample ages and max_trajectory_age_steps count trainer steps).
    run.synchronizer.mark_stale()
    for key in ("optimizer_steps", "logprobs_pass_skipped"):
        metrics[key] = float(train_metrics.pop(key))
    metrics.update({f"loss/{k}": float(v) for k, v in train_metrics.items()})
    metrics["max_sample_age_steps"] = float(ages.max()) if len(ages) else 0.0
    metrics["skipped_update"] = 0.0
    return metrics


def _store(
    batch: BatchedDataDict | RemoteBatch, key: str, logprobs_BS
) -> BatchedDataDict | RemoteBatch:
    """Puts log-probs into a driver-side batch; a RemoteBatch's stay in the ranks (None): the
    returned handle records that they hold `key`."""
    if isinstance(batch, RemoteBatch):
        assert logprobs_BS is None, "log-probs of a RemoteBatch stay in the policy's ranks"
        return batch.with_rank_side_key(key)
    batch[key] = logprobs_BS
    return batch


def log_samples(step: int, rollouts: list[Rollout]) -> None:
    """One log line per step naming every trained sample (rollouts.sample_log_rows: prompt,
    prompt key, sample index, seed, weight versions, token count, token digest). What tells a
    resumed run's samples from an uninterrupted run's."""
    log_sample_rows(step, sample_log_rows(rollouts))


def log_sample_rows(step: int, rows: list[dict]) -> None:
    """`log_samples` from rows already made (async GRPO's collector makes them)."""
    logger.info("step %d: samples %s", step, json.dumps(rows))


def finish_step(
    run: GRPORun, loop, step: int, metrics: dict[str, float], extras: dict | None = None
) -> None:
    """Step 8: the step is done; log it, validate and checkpoint on their periods (`extras`:
    what else the checkpoint must hold, e.g. async GRPO's replay buffer)."""
    run.step = step
    maybe_validate(run, loop)  # first, so its time counts in this step's row
    run.logger.log_metrics(step, metrics, prefix="train")
    if run.config.checkpointing.should_save(step) or step == run.config.grpo.max_num_steps:
        save_checkpoint(run, extras)


def maybe_validate(run: GRPORun, loop, *, at_start: bool = False, at_end: bool = False) -> None:
    config = run.config.grpo
    due = (
        (at_start and config.val_at_start and run.step == 0)
        or (at_end and config.val_at_end)
        or (
            not at_start
            and not at_end
            and config.val_period > 0
            and run.step % config.val_period == 0
        )
    )
    if not due or not run.validation:
        return
    with run.logger.timer("validation"):
        refresh_engine_weights(run)
        metrics = validate(run, loop)
    run.logger.log_metrics(run.step, metrics, prefix="val")
    run.checkpoints.record_metrics(run.step, {f"val/{k}": v for k, v in metrics.items()})


def save_checkpoint(run: GRPORun, extras: dict | None = None) -> None:
    """A complete, atomic checkpoint of the finished step `run.step` (grpo_setup: resume)."""
    state = trainer_state(run, extras)

    def write(directory):
        run.policy.save_checkpoint(
            directory / POLICY_DIR, export_hf=run.config.checkpointing.export_hf
        )
        save_trainer_state(directory / TRAINER_STATE_DIR, state)

    start = time.monotonic()
    path = run.checkpoints.save(run.step, write)
    logger.info("step %d: checkpoint %s (%.1f s)", run.step, path, time.monotonic() - start)
