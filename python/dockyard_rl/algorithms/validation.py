"""Validation on the held-out split: one sample per task, greedy by default.

`validate(run, loop)` generates one response per validation task (`grpo.val_num_prompts` of them,
the split's first ones, so every validation of a run sees the same tasks) at
`grpo.val_temperature` (0 = greedy), scores them in the sandbox like training samples, and
returns: resolve_rate (pass@1), reward_mean, apply_rate (patches that applied, of all samples),
parse_failure_rate, integrity_violations, response_length_mean. A sampled validation
(val_temperature > 0) is seeded per task and sample (`utils/seeding.sample_seed(grpo.seed, "val",
task index, instance id, 0)`): every validation of a run, resumed or not, draws the same noise, so
validations differ only by the weights. The caller logs them under
`val/` and hands them to the checkpoint manager, whose `checkpointing.metric_name` (e.g.
`val/resolve_rate`) ranks checkpoints for retention.
"""

from __future__ import annotations

VALIDATION_KEYS = (
    "resolve_rate",
    "reward_mean",
    "apply_rate",
    "parse_failure_rate",
    "integrity_violations",
    "response_length_mean",
)


def validate(run, loop) -> dict[str, float]:
    config = run.config.grpo
    instances = (
        run.validation[: config.val_num_prompts] if config.val_num_prompts else list(run.validation)
    )
    # Validation tasks are other instances than training ones, so their executor task ids
    # (prefix, step, index, instance) never collide with the step's training samples.
    rollout = loop.run_until_complete(
        run.runner.run(
            instances,
            num_samples=1,
            global_step=run.step,
            sampling_overrides={"temperature": config.val_temperature},
            prompt_keys=range(len(instances)),
            purpose="val",
        )
    )
    metrics = rollout.metrics()
    return {key: metrics[key] for key in VALIDATION_KEYS}
