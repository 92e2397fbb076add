"""Group-relative advantages for GRPO, computed by the C++/CUDA extension or torch.

GRPO samples N completions per prompt; a completion's advantage is its reward
minus a baseline from its group, optionally divided by the group's reward std:

- ``leave_one_out`` (RLOO): baseline = mean of the OTHER N - 1 rewards of the
  group, i.e. ``adv = N / (N - 1) * (r - mean)``.
- ``group_mean``: baseline = mean of the whole group, ``adv = r - mean``.
- ``normalize_std=True``: divide by ``(std + epsilon)``, std being the unbiased
  (N - 1) std of the group's rewards, as ``torch.std``.

Degenerate groups give exactly 0, never NaN: a group of one sample, or one whose
rewards are all exactly equal (all pass / all fail: no signal to learn from).

Shape suffixes: G = groups (prompts), N = samples (completions) per group.

Implementations:

- ``_dockyard_kernels`` (cc/advantages.cc, cc/cuda/advantages_cuda.cu), used
  by default when importable; the build puts it on ``sys.path`` as a top-level
  module. CPU tensors run with the GIL released; CUDA tensors run on torch's
  current stream when the extension was built with ``--config=cuda``.
- ``group_advantages_reference``: plain torch in float64, on any device torch
  supports; the fallback when the extension is absent or lacks CUDA.

Both accumulate in float64, so rewards up to float32's range (e.g. 1e30) and
large rewards with small differences (1e7 + 1) stay exact enough; the results
agree to float32 rounding.

Not covered: gradients (advantages are constants in the policy loss; inputs are
detached), dtypes other than float32, masking of individual samples (a group is
always N samples; drop or pad them before calling).
"""

from __future__ import annotations

import math

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels._extension import HAS_EXTENSION

# The extension this module calls (None outside the build); tests replace it.
_ext = _extension.EXTENSION
BASELINES = ("leave_one_out", "group_mean")

__all__ = [
    "BASELINES",
    "HAS_EXTENSION",
    "group_advantages",
    "group_advantages_reference",
]


def group_advantages(
    rewards_GN: torch.Tensor,
    baseline: str = "leave_one_out",
    normalize_std: bool = False,
    epsilon: float = 1e-6,
    use_extension: bool | None = None,
) -> torch.Tensor:
    """Returns the (G, N) float32 advantages of ``rewards_GN`` on its device.

    Args:
        rewards_GN: (num_groups, group_size) float32 rewards, any layout.
        baseline: one of ``BASELINES``.
        normalize_std: divide by (unbiased group std + epsilon).
        epsilon: finite, >= 0; keeps the division finite for tiny stds.
        use_extension: None = the extension when it is importable and supports
            the tensor's device (CUDA needs a ``--config=cuda`` build), else
            torch; True = the extension or an error; False = torch.

    Raises:
        ValueError: bad shape, dtype, baseline name or epsilon, or a NaN/inf
            reward (the message names the first bad group and index).
        RuntimeError: ``use_extension=True`` but the extension is not
            importable, or was built without CUDA and the tensor is on CUDA.
    """
    _validate(rewards_GN, baseline, epsilon)
    if not _extension.resolve_use_extension(
        use_extension, rewards_GN.device, "group_advantages(use_extension=True)", _ext
    ):
        return group_advantages_reference(rewards_GN, baseline, normalize_std, epsilon)

    # DLPack cannot export tensors that require grad; the kernel wants C order.
    rewards_GN = rewards_GN.detach().contiguous()
    out_GN = torch.empty_like(rewards_GN)
    # The kernel must run after the work that produced the rewards: use the
    # stream torch is issuing to on that device (0 = default stream on CPU).
    stream = 0
    if rewards_GN.is_cuda:
        stream = torch.cuda.current_stream(rewards_GN.device).cuda_stream
    _ext.group_advantages(rewards_GN, out_GN, baseline, bool(normalize_std), float(epsilon), stream)
    return out_GN


def group_advantages_reference(
    rewards_GN: torch.Tensor,
    baseline: str = "leave_one_out",
    normalize_std: bool = False,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Plain-torch ``group_advantages`` (same contract, any torch device)."""
    _validate(rewards_GN, baseline, epsilon)
    _check_finite(rewards_GN)
    num_groups, group_size = rewards_GN.shape
    if num_groups == 0 or group_size <= 1:
        # Empty, or one sample per group: no other sample to compare with.
        return torch.zeros_like(rewards_GN, memory_format=torch.contiguous_format)

    # float64: 1e30 squared overflows float32, and 1e7 + small deltas would
    # lose the deltas in a float32 sum.
    r_GN = rewards_GN.detach().to(torch.float64)
    adv_GN = r_GN - r_GN.mean(dim=1, keepdim=True)
    if baseline == "leave_one_out":
        # r - (sum - r) / (N - 1) == N / (N - 1) * (r - mean), without the
        # cancellation of (sum - r) for large, close rewards.
        adv_GN = adv_GN * (group_size / (group_size - 1))
    if normalize_std:
        adv_GN = adv_GN / (r_GN.std(dim=1, keepdim=True) + epsilon)
    # Constant groups: exactly 0 (also replaces 0 / 0 when epsilon is 0).
    constant_G1 = (r_GN == r_GN[:, :1]).all(dim=1, keepdim=True)
    adv_GN = torch.where(constant_G1, torch.zeros_like(adv_GN), adv_GN)
    return adv_GN.to(torch.float32)


def _validate(rewards_GN: torch.Tensor, baseline: str, epsilon: float) -> None:
    if not isinstance(rewards_GN, torch.Tensor):
        raise ValueError(f"rewards_GN must be a torch.Tensor, got {type(rewards_GN).__name__}")
    if rewards_GN.dim() != 2:
        raise ValueError(
            "rewards_GN must be 2-D (num_groups, group_size), got shape "
            f"{tuple(rewards_GN.shape)}; reshape flat rewards with "
            "rewards.view(num_prompts, num_generations_per_prompt)"
        )
    if rewards_GN.dtype != torch.float32:
        raise ValueError(
            f"rewards_GN must be float32, got {rewards_GN.dtype}; convert with .float()"
        )
    if baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; valid names: {', '.join(BASELINES)}")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise ValueError(f"epsilon must be a float, got {type(epsilon).__name__}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")


def _check_finite(rewards_GN: torch.Tensor) -> None:
    """Raises ValueError naming the first NaN/inf reward in row-major order."""
    finite_GN = torch.isfinite(rewards_GN)
    if bool(finite_GN.all()):
        return
    flat_index = int((~finite_GN).flatten().nonzero()[0])
    group, index = divmod(flat_index, rewards_GN.shape[1])
    value = float(rewards_GN[group, index])
    # Same wording as the C++ core, so both paths read alike.
    raise ValueError(
        f"group_advantages: reward at group {group}, index {index} is not finite ({value})"
    )
