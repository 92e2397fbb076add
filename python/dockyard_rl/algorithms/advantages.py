"""GRPO advantages for a flat batch of samples: config, sample masking, token broadcast.

GRPO samples N completions per prompt and scores each against the others of its group
(`dockyard_rl.kernels.advantages` holds the math and the C++/CUDA kernel). This module is the
trainer-facing layer on top of it:

- `AdvantageConfig`, the YAML section `grpo.advantage` (defaults: the DeepSWE recipe,
  leave-one-out baseline without std normalisation).
- `compute_advantages`: flat rewards of B = num_prompts * N samples, laid out group-contiguous
  (samples [g*N, (g+1)*N) belong to prompt g), to one advantage per sample. Without a sample mask
  it runs the C++ kernel when the extension is importable and torch otherwise; both give the same
  numbers. With a mask (samples excluded from the loss, e.g. a sandbox infrastructure error that
  says nothing about the patch), each group's baseline and std use only its valid samples, so an
  excluded sample cannot drag its group's baseline; the masked path is torch only.
- `broadcast_to_tokens`: the per-sample advantage on each response token of that sample.

Degenerate groups give exactly 0, never NaN: one (valid) sample or none, or valid rewards that
are all equal (all pass or all fail: nothing to learn from that group).

Shape suffixes: B = samples (num_prompts * N), S = tokens per sample, G = groups (prompts),
N = samples per group.

Not covered: gradients (advantages are constants of the loss; inputs are detached), rewards in
dtypes other than float32, groups of different sizes (pad them and mask the padding), and
whitening across the whole batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dockyard_rl import kernels
from dockyard_rl.utils.config import require, require_bool

__all__ = ["AdvantageConfig", "broadcast_to_tokens", "compute_advantages"]


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """YAML section `grpo.advantage`.

    Attributes:
        baseline: "leave_one_out" (mean of the other valid samples of the group; RLOO) or
            "group_mean" (mean of all valid samples of the group).
        normalize_std: divide by (unbiased std of the group's valid rewards + epsilon). Off in
            the DeepSWE recipe: std normalisation over-weights groups that barely differ.
        epsilon: >= 0, added to the std so tiny stds do not blow up the advantages.
    """

    baseline: str = "leave_one_out"
    normalize_std: bool = False
    epsilon: float = 1e-6

    def __post_init__(self):
        require(
            self.baseline in kernels.BASELINES,
            "baseline",
            f"must be one of {', '.join(kernels.BASELINES)}, got {self.baseline!r}",
        )
        require_bool(self, "normalize_std")
        is_number = isinstance(self.epsilon, (int, float)) and not isinstance(self.epsilon, bool)
        # PyYAML follows YAML 1.1, which reads `1e-6` (no dot) as a string: say how to fix it.
        require(
            is_number,
            "epsilon",
            f"must be a number >= 0, got {self.epsilon!r} ({type(self.epsilon).__name__}); "
            "in YAML write 1.0e-6, not 1e-6 (YAML 1.1 reads the latter as a string)",
        )
        require(
            math.isfinite(self.epsilon) and self.epsilon >= 0,
            "epsilon",
            f"must be finite and >= 0, got {self.epsilon}",
        )
        object.__setattr__(self, "epsilon", float(self.epsilon))


def compute_advantages(
    rewards_B: torch.Tensor,
    num_generations_per_prompt: int,
    cfg: AdvantageConfig,
    sample_mask_B: torch.Tensor | None = None,
    use_extension: bool | None = None,
) -> torch.Tensor:
    """Returns the (B,) float32 advantages of group-contiguous `rewards_B`, on its device.

    Args:
        rewards_B: (B,) float32 rewards; sample i belongs to group i // num_generations_per_prompt.
            Rewards of excluded samples are ignored and may be NaN (a sample whose scoring failed
            has no reward); every valid reward must be finite.
        num_generations_per_prompt: N >= 1, the group size; must divide B.
        cfg: the `grpo.advantage` section.
        sample_mask_B: None (all samples valid) or a (B,) bool tensor on the rewards' device,
            False for samples excluded from the loss. Excluded samples get advantage 0.
        use_extension: None = the C++ kernel when it is importable and supports the device and
            the batch needs no masking, else torch; True = the kernel or an error (a mask that
            excludes a sample is an error, the kernel has no masking); False = torch.

    Raises:
        ValueError: wrong type, dtype, shape or device; B not divisible by N; a NaN/inf valid
            reward (the message names its index); use_extension=True with a partial mask.
        RuntimeError: use_extension=True but the extension is not importable.
    """
    _validate_rewards(rewards_B, num_generations_per_prompt, cfg, sample_mask_B)
    num_samples = rewards_B.shape[0]
    num_groups = num_samples // num_generations_per_prompt

    if sample_mask_B is not None and bool(sample_mask_B.all()):
        # Nothing excluded: the unmasked math is identical, and it may run the kernel.
        sample_mask_B = None
    _check_finite(rewards_B, sample_mask_B)

    if sample_mask_B is None:
        rewards_GN = rewards_B.reshape(num_groups, num_generations_per_prompt)
        advantages_GN = kernels.group_advantages(
            rewards_GN, cfg.baseline, cfg.normalize_std, cfg.epsilon, use_extension=use_extension
        )
        return advantages_GN.reshape(num_samples)

    if use_extension:
        raise ValueError(
            "compute_advantages(use_extension=True): the C++ kernel has no sample masking and "
            f"sample_mask_B excludes {int((~sample_mask_B).sum())} sample(s); pass "
            "use_extension=None to use the torch path for masked batches"
        )
    advantages_GN = _masked_group_advantages(
        rewards_B.reshape(num_groups, num_generations_per_prompt),
        sample_mask_B.reshape(num_groups, num_generations_per_prompt),
        cfg,
    )
    return advantages_GN.reshape(num_samples)


def broadcast_to_tokens(advantages_B: torch.Tensor, token_mask_BS: torch.Tensor) -> torch.Tensor:
    """Returns (B, S) advantages: sample b's advantage where token_mask_BS[b] is set, else 0.

    Args:
        advantages_B: (B,) floating advantages.
        token_mask_BS: (B, S) mask on the same device, 1/True on the response tokens that the
            loss trains on (prompt and padding tokens are 0). bool, integer or floating; a
            non-bool mask must hold only 0 and 1.

    Raises:
        ValueError: wrong types, shapes, dtypes or devices, or a mask value other than 0/1.
    """
    if not isinstance(advantages_B, torch.Tensor) or not isinstance(token_mask_BS, torch.Tensor):
        raise ValueError(
            "advantages_B and token_mask_BS must be torch.Tensors, got "
            f"{type(advantages_B).__name__} and {type(token_mask_BS).__name__}"
        )
    if advantages_B.dim() != 1 or not advantages_B.is_floating_point():
        raise ValueError(
            "advantages_B must be a 1-D floating tensor (one advantage per sample), got shape "
            f"{tuple(advantages_B.shape)} and dtype {advantages_B.dtype}"
        )
    if token_mask_BS.dim() != 2 or token_mask_BS.shape[0] != advantages_B.shape[0]:
        raise ValueError(
            f"token_mask_BS must have shape (B, S) with B = {advantages_B.shape[0]} (the length "
            f"of advantages_B), got {tuple(token_mask_BS.shape)}"
        )
    if token_mask_BS.device != advantages_B.device:
        raise ValueError(
            f"token_mask_BS is on {token_mask_BS.device} but advantages_B on "
            f"{advantages_B.device}; move one with .to(device)"
        )
    if token_mask_BS.dtype == torch.bool:
        on_BS = token_mask_BS
    else:
        if token_mask_BS.is_complex():
            raise ValueError(
                f"token_mask_BS must be bool, integer or floating, got {token_mask_BS.dtype}"
            )
        # A fractional weight here would silently rescale the loss: only 0/1 are meaningful.
        if not bool(((token_mask_BS == 0) | (token_mask_BS == 1)).all()):
            raise ValueError(
                "token_mask_BS must hold only 0 and 1 (or be bool); weight tokens in the loss, "
                "not in the advantages"
            )
        on_BS = token_mask_BS != 0
    advantages_BS = advantages_B.detach().unsqueeze(1).expand(-1, token_mask_BS.shape[1])
    return torch.where(on_BS, advantages_BS, torch.zeros_like(advantages_BS))


def _masked_group_advantages(
    rewards_GN: torch.Tensor, mask_GN: torch.Tensor, cfg: AdvantageConfig
) -> torch.Tensor:
    """The kernel's math restricted to each group's valid samples; torch, float64 inside."""
    # float64 for the same reasons as the kernel: 1e30 squared overflows float32, and the
    # differences of large, close rewards vanish in a float32 sum.
    mask_GN = mask_GN.detach()
    # Excluded rewards may be NaN; zero them so they cannot reach any sum.
    r_GN = torch.where(mask_GN, rewards_GN.detach().to(torch.float64), 0.0)
    num_valid_G1 = mask_GN.sum(dim=1, keepdim=True).to(torch.float64)
    mean_G1 = r_GN.sum(dim=1, keepdim=True) / num_valid_G1.clamp(min=1)
    centered_GN = torch.where(mask_GN, r_GN - mean_G1, 0.0)
    # Denominators of degenerate groups (<= 1 valid sample) are clamped to stay finite; those
    # groups are zeroed below anyway.
    others_G1 = (num_valid_G1 - 1).clamp(min=1)
    advantages_GN = centered_GN
    if cfg.baseline == "leave_one_out":
        # r - mean(others) == n / (n - 1) * (r - mean), as in the kernel.
        advantages_GN = advantages_GN * (num_valid_G1 / others_G1)
    if cfg.normalize_std:
        std_G1 = ((centered_GN**2).sum(dim=1, keepdim=True) / others_G1).sqrt()
        advantages_GN = advantages_GN / (std_G1 + cfg.epsilon)
    # A group is constant when its valid rewards are all equal: compare their max and min.
    inf = torch.tensor(math.inf, dtype=torch.float64, device=r_GN.device)
    max_G1 = torch.where(mask_GN, r_GN, -inf).amax(dim=1, keepdim=True)
    min_G1 = torch.where(mask_GN, r_GN, inf).amin(dim=1, keepdim=True)
    informative_G1 = (num_valid_G1 > 1) & (max_G1 != min_G1)
    keep_GN = mask_GN & informative_G1
    # where, not multiply: 0 * NaN (a constant group with epsilon = 0) would stay NaN.
    advantages_GN = torch.where(keep_GN, advantages_GN, 0.0)
    return advantages_GN.to(torch.float32)


def _validate_rewards(
    rewards_B: torch.Tensor,
    num_generations_per_prompt: int,
    cfg: AdvantageConfig,
    sample_mask_B: torch.Tensor | None,
) -> None:
    if not isinstance(cfg, AdvantageConfig):
        raise ValueError(f"cfg must be an AdvantageConfig, got {type(cfg).__name__}")
    if not isinstance(rewards_B, torch.Tensor):
        raise ValueError(f"rewards_B must be a torch.Tensor, got {type(rewards_B).__name__}")
    if rewards_B.dim() != 1:
        raise ValueError(
            f"rewards_B must be 1-D (one reward per sample), got shape {tuple(rewards_B.shape)}; "
            "flatten (num_prompts, N) rewards with .reshape(-1)"
        )
    if rewards_B.dtype != torch.float32:
        raise ValueError(f"rewards_B must be float32, got {rewards_B.dtype}; convert with .float()")
    num_per_group = num_generations_per_prompt
    if isinstance(num_per_group, bool) or not isinstance(num_per_group, int):
        raise ValueError(
            "num_generations_per_prompt must be an int, got "
            f"{type(num_generations_per_prompt).__name__}"
        )
    if num_generations_per_prompt < 1:
        raise ValueError(f"num_generations_per_prompt must be >= 1, got {num_per_group}")
    if rewards_B.shape[0] % num_generations_per_prompt:
        raise ValueError(
            f"rewards_B has {rewards_B.shape[0]} samples, not a multiple of "
            f"num_generations_per_prompt={num_generations_per_prompt}; the batch must hold whole "
            "groups (pad a short group and exclude the padding with sample_mask_B)"
        )
    if sample_mask_B is None:
        return
    if not isinstance(sample_mask_B, torch.Tensor):
        raise ValueError(
            f"sample_mask_B must be a torch.Tensor, got {type(sample_mask_B).__name__}"
        )
    if sample_mask_B.dtype != torch.bool:
        raise ValueError(
            f"sample_mask_B must be a bool tensor, got {sample_mask_B.dtype}; convert a 0/1 mask "
            "with .bool()"
        )
    if sample_mask_B.shape != rewards_B.shape:
        raise ValueError(
            f"sample_mask_B must have the shape of rewards_B {tuple(rewards_B.shape)}, got "
            f"{tuple(sample_mask_B.shape)}"
        )
    if sample_mask_B.device != rewards_B.device:
        raise ValueError(
            f"sample_mask_B is on {sample_mask_B.device} but rewards_B on {rewards_B.device}; "
            "move it with .to(rewards_B.device)"
        )


def _check_finite(rewards_B: torch.Tensor, sample_mask_B: torch.Tensor | None) -> None:
    """Raises ValueError naming the first NaN/inf reward among the valid samples."""
    bad_B = ~torch.isfinite(rewards_B)
    if sample_mask_B is not None:
        bad_B &= sample_mask_B
    if not bool(bad_B.any()):
        return
    index = int(bad_B.nonzero()[0])
    raise ValueError(
        f"rewards_B[{index}] is not finite ({float(rewards_B[index])}); a sample without a "
        "usable reward must be excluded with sample_mask_B"
    )
