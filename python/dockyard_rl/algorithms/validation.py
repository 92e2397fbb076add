"""Validation on the held-out split: n samples per task (one greedy sample by default), per-task
outcomes written to a file, aggregates returned for the logger.

`validate(run, loop)` generates `grpo.val_num_samples` (n) responses per validation task
(`grpo.val_num_prompts` tasks, the split's first ones, so every validation of a run sees the same
tasks) at `grpo.val_temperature` (0 = greedy, which needs n = 1: GRPOConfig refuses greedy with
n > 1, whose samples would be identical), scores them in the sandbox like training samples, and:

- writes one JSON line per task to `<run dir>/validation/step_<step:06d>.jsonl`
  (`validation_file`): {"step", "task_index", "instance_id", "num_samples", "num_resolved",
  "num_scored" (samples with a verdict), "num_applied", "reward_mean" (over the scored samples,
  null when none was scored)}. Same tasks in the same order at every step, so two steps' files
  (e.g. step 0, after the warm start, and the last step) pair task by task. A validation repeated
  at a step (a resumed run) replaces the file.
- returns the aggregates (`VALIDATION_KEYS` plus the pass@k keys), which the caller logs under
  `val/` and hands to the checkpoint manager (`checkpointing.metric_name`, e.g.
  `val/resolve_rate`, ranks checkpoints for retention):
  resolve_rate: resolved samples / all samples (over every task and sample: mean@n of
  "resolved"; an infrastructure error counts as unresolved, as in training's resolve_rate);
  reward_mean (over scored samples); apply_rate (patches that applied, of all samples);
  parse_failure_rate; integrity_violations (a count); response_length_mean;
  for a multi-turn agent, its `env/agent/...` episode metrics;
  pass_at_1 and pass_at_<n> (n > 1 only): the mean over tasks of the unbiased pass@k estimator
  of Chen et al. 2021 (`pass_at_k`), k = 1 and k = n. pass_at_1 equals resolve_rate when every
  task has n samples; pass_at_<n> is the share of tasks with at least one resolved sample.
  ("pass_at_k", not "pass@k": MLflow and the logger allow no "@" in metric names.)

Seeds: a sampled validation (val_temperature > 0) seeds sample i of task j with
`utils/seeding.sample_seed(grpo.seed, "val", j, instance id, i)` (rollouts.RolloutRunner): every
validation of a run, resumed or not, draws the same noise, so validations differ only by the
weights.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dockyard_rl.algorithms.rollouts import Rollout, patch_applied

if TYPE_CHECKING:
    from dockyard_rl.algorithms.grpo_setup import GRPORun

VALIDATION_KEYS = (
    "resolve_rate",
    "reward_mean",
    "apply_rate",
    "parse_failure_rate",
    "integrity_violations",
    "response_length_mean",
)
VALIDATION_DIR = "validation"  # under the run directory


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), the chance
    that k samples drawn without replacement from the n hold at least one correct one.

    Raises:
        ValueError: unless 1 <= k <= n and 0 <= c <= n.
    """
    n, c = num_samples, num_correct
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    # Exact integers, one float division: no overflow or cancellation for any n.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def validation_file(run_dir: pathlib.Path, step: int) -> pathlib.Path:
    """Where the per-task outcomes of the validation at `step` go (module docstring)."""
    return pathlib.Path(run_dir) / VALIDATION_DIR / f"step_{step:06d}.jsonl"


def per_task_outcomes(rollout: Rollout, step: int) -> list[dict[str, Any]]:
    """One row per task of `rollout` (samples group-contiguous), in the order of its instances
    (module docstring lists the keys)."""
    n = rollout.num_samples
    meta = rollout.result.metadata
    rewards = rollout.rewards_B.tolist()
    scored = rollout.sample_mask_B.tolist()
    rows = []
    for index, instance in enumerate(rollout.instances):
        group = range(index * n, (index + 1) * n)
        scored_rewards = [rewards[i] for i in group if scored[i] > 0]
        rows.append(
            {
                "step": step,
                "task_index": index,
                "instance_id": instance.instance_id,
                "num_samples": n,
                "num_resolved": sum(bool(meta[i].get("resolved")) for i in group),
                "num_scored": len(scored_rewards),
                "num_applied": sum(patch_applied(meta[i]) for i in group),
                "reward_mean": (
                    sum(scored_rewards) / len(scored_rewards) if scored_rewards else None
                ),
            }
        )
    return rows


def pass_at_k_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """pass_at_1 and, for n > 1, pass_at_<n>: task means of `pass_at_k` (module docstring)."""
    if not rows:
        return {}
    n = rows[0]["num_samples"]
    ks = (1,) if n == 1 else (1, n)
    return {
        f"pass_at_{k}": sum(pass_at_k(r["num_samples"], r["num_resolved"], k) for r in rows)
        / len(rows)
        for k in ks
    }


def write_outcomes(path: pathlib.Path, rows: Sequence[dict[str, Any]]) -> None:
    """Writes the rows as JSON lines, atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(partial, path)


def validate(run: GRPORun, loop: asyncio.AbstractEventLoop) -> dict[str, float]:
    """Validates `run`'s current engine weights at `run.step` (module docstring)."""
    config = run.config.grpo
    instances = (
        run.validation[: config.val_num_prompts] if config.val_num_prompts else list(run.validation)
    )
    # Validation tasks are other instances than training ones, so their executor task ids
    # (prefix, step, index, instance) never collide with the step's training samples.
    rollout = loop.run_until_complete(
        run.runner.run(
            instances,
            num_samples=config.val_num_samples,
            global_step=run.step,
            sampling_overrides={"temperature": config.val_temperature},
            prompt_keys=range(len(instances)),
            purpose="val",
        )
    )
    rows = per_task_outcomes(rollout, run.step)
    write_outcomes(validation_file(run.run_dir, run.step), rows)
    metrics = rollout.metrics()
    # A multi-turn agent's episodes also report how they went (turns, tool errors, how they
    # ended: environments/agent_env.py's agent_metrics).
    agent = {key: value for key, value in metrics.items() if key.startswith("env/agent/")}
    return {**{key: metrics[key] for key in VALIDATION_KEYS}, **agent, **pass_at_k_metrics(rows)}
