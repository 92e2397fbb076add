"""The steps that both GRPO loops run, one function each: the synchronous loop (grpo.py) calls
them on rollouts it generated itself, the asynchronous trainer (async_grpo.py) on groups from
the trajectory collector. Step numbers are grpo.py's (module docstring there).

    refresh_engine_weights   2  sync the engines' weights if the trainer stepped; wake them
    train_on_rollouts        5  batch (advantages, dropped groups) and its metrics, then 6-7
    train_batch              6-7 log-probs, optimizer steps over mini-batches, mark stale
    log_samples              every trained sample named in one log line (resume checks)
    finish_step              8  metrics logged, validation and checkpoints on their periods
    maybe_validate           validation at start / end / every `grpo.val_period` steps
    save_checkpoint          an atomic checkpoint of the finished step (policy + trainer state)

Every function takes the run (`GRPORun`, grpo_setup.py) and changes it in place: the step
counter (`finish_step`), the policy's weights (`train_batch`) and the synchronizer's staleness.
What differs between the loops (where prompts and samples come from, when engines are paused) is
in the loop modules, not here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import time
from typing import Any

import torch

from dockyard_rl.algorithms.grpo_setup import (
    POLICY_DIR,
    TRAINER_STATE_DIR,
    GRPORun,
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
from dockyard_rl.data_plane.experience import RemoteBatch
from dockyard_rl.distributed.batch_layouts import RolloutBatch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.utils.training_state import save_trainer_state

logger = logging.getLogger(__name__)


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
    run: GRPORun,
    batch: BatchedDataDict[RolloutBatch] | RemoteBatch | None,
    step: int,
    metrics: dict[str, float],
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
    batch: BatchedDataDict[RolloutBatch] | RemoteBatch, key: str, logprobs_BS: torch.Tensor | None
) -> BatchedDataDict[RolloutBatch] | RemoteBatch:
    """Puts log-probs into a driver-side batch; a RemoteBatch's stay in the ranks (None): the
    returned handle records that they hold `key`."""
    if isinstance(batch, RemoteBatch):
        assert logprobs_BS is None, "log-probs of a RemoteBatch stay in the policy's ranks"
        return batch.with_rank_side_key(key)
    assert logprobs_BS is not None, "the log-probs of a driver-side batch come back to the driver"
    batch[key] = logprobs_BS
    return batch


def log_samples(step: int, rollouts: list[Rollout]) -> None:
    """One log line per step naming every trained sample (rollouts.sample_log_rows: prompt,
    prompt key, sample index, seed, weight versions, token count, token digest). What tells a
    resumed run's samples from an uninterrupted run's."""
    log_sample_rows(step, sample_log_rows(rollouts))


def log_sample_rows(step: int, rows: list[dict[str, Any]]) -> None:
    """`log_samples` from rows already made (async GRPO's collector makes them)."""
    logger.info("step %d: samples %s", step, json.dumps(rows))


def finish_step(
    run: GRPORun,
    loop: asyncio.AbstractEventLoop,
    step: int,
    metrics: dict[str, float],
    extras: dict[str, Any] | None = None,
) -> None:
    """Step 8: the step is done; log it, validate and checkpoint on their periods (`extras`:
    what else the checkpoint must hold, e.g. async GRPO's replay buffer)."""
    run.step = step
    maybe_validate(run, loop)  # first, so its time counts in this step's row
    run.logger.log_metrics(step, metrics, prefix="train")
    if run.config.checkpointing.should_save(step) or step == run.config.grpo.max_num_steps:
        save_checkpoint(run, extras)


def maybe_validate(
    run: GRPORun, loop: asyncio.AbstractEventLoop, *, at_start: bool = False, at_end: bool = False
) -> None:
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


def save_checkpoint(run: GRPORun, extras: dict[str, Any] | None = None) -> None:
    """A complete, atomic checkpoint of the finished step `run.step` (grpo_setup: resume)."""
    state = trainer_state(run, extras)

    def write(directory: pathlib.Path) -> None:
        run.policy.save_checkpoint(
            directory / POLICY_DIR, export_hf=run.config.checkpointing.export_hf
        )
        save_trainer_state(directory / TRAINER_STATE_DIR, state)

    start = time.monotonic()
    path = run.checkpoints.save(run.step, write)
    logger.info("step %d: checkpoint %s (%.1f s)", run.step, path, time.monotonic() - start)
