"""The `policy` config section, shared by every policy backend (defaults live here only)."""

from __future__ import annotations

import dataclasses
import math

from dockyard_rl.utils.config import require

BACKENDS = ("dtensor", "jax")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """`policy.optimizer`: AdamW."""

    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        require(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            "beta1/beta2",
            f"must be in [0, 1), got {self.beta1}, {self.beta2}",
        )
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """`policy.scheduler`: linear warmup from 0, then cosine decay to min_lr_ratio x peak.

    lr(step) = peak * step / warmup_steps                                  for step < warmup
             = peak * (r + (1 - r) * (1 + cos(pi * progress)) / 2)        afterwards, where
    progress = min(1, (step - warmup) / (total_steps - warmup)), r = min_lr_ratio.

    `step` counts OPTIMIZER steps (every `PolicyInterface.train` call is one, the warm start's
    included), not GRPO steps: with `grpo.train_mini_batch_size` / `grpo.num_epochs` a GRPO step
    makes `grpo.optimizer_steps_per_step` of them, so size warmup_steps and total_steps in those
    units (total_steps = grpo.max_num_steps x optimizer_steps_per_step decays over the whole run).
    """

    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        require(
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
            "warmup_steps",
            f"must be an int >= 0, got {self.warmup_steps!r}",
        )
        require(
            isinstance(self.total_steps, int) and self.total_steps > self.warmup_steps,
            "total_steps",
            f"must be an int > warmup_steps ({self.warmup_steps}), got {self.total_steps!r}",
        )
        require(
            0 <= self.min_lr_ratio <= 1,
            "min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """YAML section `policy`."""

    backend: str = "dtensor"
    model: str = "smollm2-135m-instruct"  # a zoo name (models/zoo.py) or a local HF directory
    dtype: str = "float32"
    # Data-parallel ranks (FSDP2 shards / jax mesh 'data' axis). Must divide the global batch.
    dp_size: int = 1
    micro_batch_size: int = 4
    max_grad_norm: float | None = 1.0
    activation_checkpointing: bool = False
    # Keep the frozen reference policy on CPU (moved to the device only for its forward pass).
    offload_reference_policy: bool = False
    seed: int = 0
    # Log-probs are of softmax(logits / logprob_temperature): the distribution the rollouts were
    # sampled from. null = 1 alone; the GRPO loop sets it to generation.temperature.
    logprob_temperature: float | None = None
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        require(
            self.backend in BACKENDS,
            "backend",
            f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}",
        )
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(
            isinstance(self.dp_size, int) and self.dp_size >= 1,
            "dp_size",
            f"must be an int >= 1, got {self.dp_size!r}",
        )
        require(
            isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1,
            "micro_batch_size",
            f"must be an int >= 1, got {self.micro_batch_size!r}",
        )
        require(
            self.logprob_temperature is None
            or (
                isinstance(self.logprob_temperature, (int, float))
                and not isinstance(self.logprob_temperature, bool)
                and self.logprob_temperature > 0
            ),
            "logprob_temperature",
            f"must be a number > 0 or null, got {self.logprob_temperature!r}",
        )
        require(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            f"must be > 0 or null (no clipping), got {self.max_grad_norm}",
        )


def learning_rate_at(step: int, optimizer: OptimizerConfig, scheduler: SchedulerConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) under the schedule above. Both
    backends use this one definition (the jax backend checks its optax schedule against it)."""
    peak = optimizer.learning_rate
    if step < scheduler.warmup_steps:
        return peak * step / scheduler.warmup_steps
    progress = min(
        1.0, (step - scheduler.warmup_steps) / (scheduler.total_steps - scheduler.warmup_steps)
    )
    ratio = scheduler.min_lr_ratio
    return peak * (ratio + (1 - ratio) * (1 + math.cos(math.pi * progress)) / 2)
