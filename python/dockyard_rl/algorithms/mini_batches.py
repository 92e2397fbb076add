"""PPO-style mini-batches and epochs: how one rollout batch becomes several optimizer steps.

    plan = mini_batch_plan(num_samples, grpo.train_mini_batch_size, grpo.num_epochs,
                           mini_batch_seed(grpo.seed, step))
    metrics = train_mini_batches(policy, batch, loss_fn, plan, dp_size)

The contract, for every path that trains: the driver's batch (`train_on_rollouts`) and a
`RemoteBatch` whose shards wait in the policy's ranks (async GRPO with a data plane) get the
SAME plan over the global rows 0..B-1; for a RemoteBatch each optimizer step is
`policy.train(remote.select(rows, last=...))` and the ranks map the rows onto their shards
(data_plane/experience.py, "Mini-batches"):

- `mini_batch_plan` is a pure function: per epoch a seeded permutation of the batch's rows, cut
  into consecutive mini-batches of `train_mini_batch_size` rows (the last one of an epoch smaller
  when the batch does not divide, e.g. after masked groups were dropped). One rollout batch gives
  ceil(B / mini) * num_epochs optimizer steps. The seed derives from `grpo.seed` and the trainer
  step (`mini_batch_seed`), so a resumed run draws the same mini-batches as an uninterrupted one.
  One mini-batch per epoch (null size) keeps the rows in order: no shuffle is needed.
- The old policy's log-probs (`prev_logprobs`) are taken ONCE, before the first optimizer step,
  with the weights that start the step; every mini-batch of every epoch is scored against them,
  so the later ones are off-policy and the PPO clip (and dual clip) binds (a RemoteBatch's are
  taken and kept rank-side, beside the shard). When the plan has a
  single optimizer step the separate log-prob pass is skipped: the loss uses the training
  forward's own log-probs (loss_functions.py, "Old policy"), the same loss and gradient for
  one forward pass less; the metric `logprobs_pass_skipped` says so.
- Each mini-batch is one `PolicyInterface.train` call, i.e. one optimizer step and one
  LR-scheduler step; its loss is normalised by the MINI-batch's own valid-token / sequence counts
  (the policy computes them with `count_valid` on what it is given; the dtensor ranks sum their
  rows' counts for a RemoteBatch). Rows padded for data parallelism carry sample_mask 0 and
  count nowhere.
- The weight version (weight_sync: `mark_stale`, `trainer_version`, sample ages in async mode)
  counts trainer STEPS, i.e. weight publications, not optimizer steps: the caller marks the
  weights stale once after all of a step's optimizer steps. The LR schedule counts optimizer
  steps (policy.scheduler).

Not covered: mini-batches that keep a prompt's group together (advantages are computed over the
whole batch before the split, so a split group is correct), early stopping on approx-KL.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dockyard_rl.algorithms.rollouts import pad_to_dp_multiple
from dockyard_rl.data_plane.experience import PREV_LOGPROBS, RemoteBatch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.losses.loss_functions import MAX_METRICS
from dockyard_rl.models.policy.interfaces import LossFunction, PolicyInterface

_SEED_DOMAIN = "dockyard_rl.mini_batch_seed/v1"
# Per-step figures that add up over a step's optimizer steps; the rest are averaged (MAX_METRICS:
# the max), so `loss`, `clip_fraction`, `ratio_mean` are means over the step's mini-batches.
_SUM_METRICS = frozenset({"num_tokens"})


def num_optimizer_steps(num_samples: int, mini_batch_size: int | None, num_epochs: int) -> int:
    """ceil(num_samples / mini_batch_size) * num_epochs (null size: one mini-batch per epoch)."""
    per_epoch = 1 if mini_batch_size is None else math.ceil(num_samples / mini_batch_size)
    return per_epoch * num_epochs


def mini_batch_seed(run_seed: int, step: int) -> int:
    """The shuffle seed of trainer step `step`: BLAKE2b of (run seed, step), as utils/seeding
    derives sample seeds, so every process and every resume draws the same permutation."""
    text = json.dumps([_SEED_DOMAIN, int(run_seed), int(step)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def mini_batch_plan(
    num_samples: int, mini_batch_size: int | None, num_epochs: int, seed: int
) -> list[torch.Tensor]:
    """The rows (int64 index tensors into the batch) of each optimizer step, in order.

    Every epoch covers each row exactly once. Raises ValueError for num_samples < 1,
    num_epochs < 1 or mini_batch_size < 1.
    """
    if num_samples < 1 or num_epochs < 1 or (mini_batch_size is not None and mini_batch_size < 1):
        raise ValueError(
            f"mini_batch_plan needs num_samples >= 1, num_epochs >= 1 and mini_batch_size >= 1 "
            f"or None; got {num_samples}, {num_epochs}, {mini_batch_size}"
        )
    if mini_batch_size is None or mini_batch_size >= num_samples:
        return [torch.arange(num_samples) for _ in range(num_epochs)]
    generator = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(num_epochs):
        order = torch.randperm(num_samples, generator=generator)
        plan.extend(order.split(mini_batch_size))
    return plan


def train_mini_batches(
    policy: PolicyInterface,
    batch: BatchedDataDict[Any] | RemoteBatch,
    loss_fn: LossFunction,
    plan: Sequence[torch.Tensor],
    dp_size: int,
) -> dict[str, float]:
    """Runs `plan`'s optimizer steps on `batch` (module docstring) and returns the step's metrics.

    `batch`: the unpadded rollout batch with the loss's keys except `prev_logprobs` (taken here
    when the plan has more than one step; a caller-supplied one is used as is), optionally
    `reference_policy_logprobs`. Each mini-batch is padded to a multiple of `dp_size`.
    Or a `RemoteBatch` (a dtensor policy's ranks hold it): the same, with the log-probs rank-side
    (`rank_side_keys` says which the caller had taken); the ranks pad, and drop the shard after
    the last optimizer step.

    Returns the loss and policy metrics combined over the optimizer steps (means; MAX_METRICS:
    max; num_tokens: sum) plus `optimizer_steps` and `logprobs_pass_skipped` (1.0 when the
    separate old-policy log-prob pass was not needed). Raises what `policy.train` raises; a
    ValueError for a malformed batch comes before the first weight change.
    """
    if not plan:
        raise ValueError("train_mini_batches needs a plan with at least one optimizer step")
    remote = isinstance(batch, RemoteBatch)
    has_prev = PREV_LOGPROBS in (batch.rank_side_keys if remote else batch)
    skipped = len(plan) == 1 and not has_prev
    if len(plan) > 1 and not has_prev:
        if remote:
            policy.get_logprobs(batch)  # kept by the ranks beside their shards
        else:
            batch = batch.copy()  # the caller's dict keeps its keys
            batch[PREV_LOGPROBS] = padded_logprobs(policy.get_logprobs, batch, dp_size)
    results = []
    for index, rows in enumerate(plan):
        if remote:
            mini = batch.select(rows, last=index == len(plan) - 1)
        else:
            mini = pad_to_dp_multiple(batch.select_indices(rows), dp_size)
        results.append(policy.train(mini, loss_fn))
    metrics = combine_optimizer_steps(results)
    metrics["optimizer_steps"] = float(len(plan))
    metrics["logprobs_pass_skipped"] = float(skipped)
    return metrics


def padded_logprobs(
    get_logprobs: Callable[[BatchedDataDict[Any]], torch.Tensor],
    batch: BatchedDataDict[Any],
    dp_size: int,
) -> torch.Tensor:
    """`get_logprobs` (a policy's, or its reference's) of the unpadded `batch`, run on the batch
    padded to a multiple of `dp_size` (the padding rows' log-probs are dropped)."""
    return get_logprobs(pad_to_dp_multiple(batch, dp_size))[: batch.batch_size]


def combine_optimizer_steps(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """One row of metrics for a trainer step's optimizer steps: MAX_METRICS by max, num_tokens
    by sum, every other key by mean (over the keys every step reported)."""
    keys = set(results[0]).intersection(*results[1:])
    combined = {}
    for key in sorted(keys):
        values = [result[key] for result in results]
        if key in MAX_METRICS:
            combined[key] = max(values)
        elif key in _SUM_METRICS:
            combined[key] = sum(values)
        else:
            combined[key] = sum(values) / len(values)
    return combined
