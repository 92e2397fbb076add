"""Tests of dockyard_rl.algorithms.advantages.

The extension is REQUIRED here: the Bazel build always provides it, so the parity tests fail
(not skip) when `dockyard_rl.kernels.HAS_EXTENSION` is False. Masked results are compared with
`_loop_reference`, a per-sample Python loop over the definitions, independent of the vectorised
code.

Shape suffixes: B = samples, S = tokens, G = groups, N = samples per group.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockyard_rl import kernels
from dockyard_rl.algorithms.advantages import (
    AdvantageConfig,
    broadcast_to_tokens,
    compute_advantages,
)
from dockyard_rl.utils.config import from_dict

BASELINES = ("leave_one_out", "group_mean")
ALL_CONFIGS = [
    AdvantageConfig(baseline, normalize_std, epsilon)
    for baseline in BASELINES
    for normalize_std in (False, True)
    for epsilon in (0.0, 1e-6, 0.5)
]


@pytest.fixture(scope="module")
def require_extension():
    if not kernels.HAS_EXTENSION:
        pytest.fail(
            "dockyard_rl.kernels.HAS_EXTENSION is False: _dockyard_kernels is not importable. The "
            "Bazel build provides it; outside Bazel put bazel-bin/cc on PYTHONPATH"
        )


def _loop_reference(rewards, mask, num_per_group, cfg):
    """The definitions, sample by sample, in Python floats (float64)."""
    out = [0.0] * len(rewards)
    for start in range(0, len(rewards), num_per_group):
        idx = [i for i in range(start, start + num_per_group) if mask[i]]
        values = [float(rewards[i]) for i in idx]
        if len(values) <= 1 or all(v == values[0] for v in values):
            continue
        n = len(values)
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        for i, v in zip(idx, values):
            if cfg.baseline == "leave_one_out":
                advantage = v - (sum(values) - v) / (n - 1)
            else:
                advantage = v - mean
            if cfg.normalize_std:
                advantage /= std + cfg.epsilon
            out[i] = advantage
    return torch.tensor(out, dtype=torch.float32)


def _rewards(kind, num_samples, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(num_samples, generator=gen) * 5
    if kind == "binary":  # Pass/fail: many constant groups.
        return torch.randint(0, 2, (num_samples,), generator=gen).float()
    if kind == "large":  # Large values with small differences: cancellation-prone.
        return 1e7 + torch.randint(0, 3, (num_samples,), generator=gen).float()
    if kind == "huge":
        return torch.randn(num_samples, generator=gen) * 1e30
    raise AssertionError(kind)


# --- Config. -------------------------------------------------------------------------------


def test_config_defaults_are_the_deepswe_recipe():
    cfg = from_dict(AdvantageConfig, None, "grpo.advantage")
    assert cfg == AdvantageConfig("leave_one_out", False, 1e-6)


def test_config_from_yaml_dict_and_int_epsilon():
    cfg = from_dict(
        AdvantageConfig,
        {"baseline": "group_mean", "normalize_std": True, "epsilon": 0},
        "grpo.advantage",
    )
    assert cfg.baseline == "group_mean" and cfg.normalize_std
    assert cfg.epsilon == 0.0 and isinstance(cfg.epsilon, float)


@pytest.mark.parametrize(
    "data, pattern",
    [
        (
            {"baseline": "mean"},
            r"^grpo\.advantage\.baseline: must be one of leave_one_out, group_mean",
        ),
        ({"normalize_std": "yes"}, r"^grpo\.advantage\.normalize_std: must be true or false"),
        ({"epsilon": "1e-6"}, r"^grpo\.advantage\.epsilon: .*write 1\.0e-6"),
        ({"epsilon": True}, r"^grpo\.advantage\.epsilon: must be a number"),
        ({"epsilon": -1.0}, r"^grpo\.advantage\.epsilon: must be finite and >= 0"),
        ({"epsilon": math.inf}, r"^grpo\.advantage\.epsilon: must be finite and >= 0"),
        ({"baselin": "group_mean"}, r"unknown key\(s\) 'baselin'; valid keys: baseline, epsilon"),
    ],
)
def test_bad_config(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_dict(AdvantageConfig, data, "grpo.advantage")


# --- Extension vs torch: identical. ---------------------------------------------------------


def _assert_paths_identical(rewards_B, num_per_group, cfg):
    ext_B = compute_advantages(rewards_B, num_per_group, cfg, use_extension=True)
    torch_B = compute_advantages(rewards_B, num_per_group, cfg, use_extension=False)
    assert ext_B.dtype == torch.float32 and ext_B.shape == rewards_B.shape
    assert torch.isfinite(ext_B).all()
    assert torch.equal(ext_B, torch_B), (ext_B, torch_B)
    # And both are the definitions (tolerance: float32 rounding of the float64 results).
    all_valid = [True] * rewards_B.shape[0]
    expected_B = _loop_reference(rewards_B.tolist(), all_valid, num_per_group, cfg)
    torch.testing.assert_close(ext_B, expected_B, rtol=1e-5, atol=1e-5)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    num_groups=st.integers(0, 12),
    num_per_group=st.integers(1, 12),
    kind=st.sampled_from(["normal", "binary", "large"]),
    seed=st.integers(0, 2**31 - 1),
    cfg=st.sampled_from(ALL_CONFIGS),
)
def test_extension_and_torch_identical_random(
    require_extension, num_groups, num_per_group, kind, seed, cfg
):
    _assert_paths_identical(_rewards(kind, num_groups * num_per_group, seed), num_per_group, cfg)


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=str)
@pytest.mark.parametrize(
    "rewards, num_per_group",
    [
        ([0.5, -2.0, 3.0], 1),  # Group size 1: all zero.
        ([1.0, 0.0, 0.0, 0.0, 2.0, 5.0], 2),  # Group size 2, one constant group.
        ([1.0] * 8, 4),  # Equal rewards everywhere.
        ([1e7, 1e7 + 1, 1e7, 1e7 + 2], 4),  # Large values, small differences.
        ([1e30, -1e30, 3e30, 0.0], 2),  # Huge values: squares overflow float32.
        ([], 4),  # Empty batch.
    ],
    ids=["size1", "size2", "equal", "large", "huge", "empty"],
)
def test_extension_and_torch_identical_edges(require_extension, rewards, num_per_group, cfg):
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    _assert_paths_identical(rewards_B, num_per_group, cfg)
    advantages_B = compute_advantages(rewards_B, num_per_group, cfg, use_extension=True)
    rewards_GN = rewards_B.reshape(-1, num_per_group)
    constant_B = (rewards_GN == rewards_GN[:, :1]).all(dim=1).repeat_interleave(num_per_group)
    assert bool((advantages_B[constant_B] == 0).all()), "constant groups must be exactly 0"


def test_hand_example_both_baselines(require_extension):
    rewards_B = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0])
    loo = compute_advantages(rewards_B, 4, AdvantageConfig("leave_one_out"))
    # Group 0: r - mean(others); group 1: N/(N-1) * (r - 0.5) = +-2/3.
    torch.testing.assert_close(
        loo, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3])
    )
    mean = compute_advantages(rewards_B, 4, AdvantageConfig("group_mean"))
    torch.testing.assert_close(mean, torch.tensor([-2.0, -1.0, 0.0, 3.0, -0.5, -0.5, 0.5, 0.5]))


def test_default_path_uses_the_extension(require_extension, monkeypatch):
    calls = []
    real = kernels.group_advantages

    def spy(*args, **kwargs):
        calls.append(kwargs.get("use_extension"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "group_advantages", spy)
    compute_advantages(torch.tensor([0.0, 1.0]), 2, AdvantageConfig())
    compute_advantages(torch.tensor([0.0, 1.0]), 2, AdvantageConfig(), torch.tensor([True, True]))
    # None lets the kernel module pick the extension; an all-valid mask keeps that path.
    assert calls == [None, None]


# --- Masking. -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    num_groups=st.integers(1, 8),
    num_per_group=st.integers(1, 8),
    kind=st.sampled_from(["normal", "binary", "large"]),
    seed=st.integers(0, 2**31 - 1),
    cfg=st.sampled_from(ALL_CONFIGS),
    mask_seed=st.integers(0, 2**31 - 1),
)
def test_masked_matches_loop_reference(num_groups, num_per_group, kind, seed, cfg, mask_seed):
    num_samples = num_groups * num_per_group
    rewards_B = _rewards(kind, num_samples, seed)
    gen = torch.Generator().manual_seed(mask_seed)
    mask_B = torch.rand(num_samples, generator=gen) < 0.7
    actual_B = compute_advantages(rewards_B, num_per_group, cfg, mask_B)
    expected_B = _loop_reference(rewards_B.tolist(), mask_B.tolist(), num_per_group, cfg)
    torch.testing.assert_close(actual_B, expected_B, rtol=1e-5, atol=1e-5)
    assert bool((actual_B[~mask_B] == 0).all())


def test_masked_group_equals_group_without_the_excluded_samples(require_extension):
    # Excluding samples must be the same as never having sampled them.
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.0, 1.0, 1.0, 0.2, 0.9])
    mask_B = torch.tensor([True, False, True, True, True, True, True, True, False, True])
    for cfg in ALL_CONFIGS:
        actual_B = compute_advantages(rewards_B, 5, cfg, mask_B)
        for g in range(2):
            group = slice(g * 5, (g + 1) * 5)
            kept = rewards_B[group][mask_B[group]]
            alone = compute_advantages(kept, kept.shape[0], cfg, use_extension=True)
            torch.testing.assert_close(actual_B[group][mask_B[group]], alone, rtol=1e-6, atol=1e-6)


def test_masking_edge_cases():
    cfg = AdvantageConfig("leave_one_out", normalize_std=True, epsilon=0.0)
    rewards_B = torch.tensor([float("nan"), 1.0, 0.0, 5.0, 5.0, float("inf"), 3.0, 4.0, 0.0, 1.0])
    mask_B = torch.tensor([False, True, False, True, True, False, False, False, False, True])
    actual_B = compute_advantages(rewards_B, 2, cfg, mask_B)
    # Groups: [nan x, 1] one valid -> 0; [0 x, 5] one valid -> 0; [5, inf x] one valid -> 0;
    # [3 x, 4 x] none valid -> 0; [0 x, 1] one valid -> 0. NaN/inf of excluded samples ignored.
    assert torch.equal(actual_B, torch.zeros(10))
    # Constant valid rewards with epsilon = 0 (0 / 0 if computed): exactly 0.
    constant_B = compute_advantages(
        torch.tensor([2.0, 2.0, 9.0]), 3, cfg, torch.tensor([True, True, False])
    )
    assert torch.equal(constant_B, torch.zeros(3))


def test_partial_mask_with_use_extension_true_is_an_error():
    with pytest.raises(ValueError, match="has no sample masking"):
        compute_advantages(
            torch.tensor([0.0, 1.0, 2.0]),
            3,
            AdvantageConfig(),
            torch.tensor([True, False, True]),
            True,
        )


# --- Errors. ------------------------------------------------------------------------------


NAN, INF = float("nan"), float("inf")
CFG = AdvantageConfig()


@pytest.mark.parametrize(
    "args, pattern",
    [
        ((torch.zeros(6), 4, CFG), "not a multiple of num_generations_per_prompt=4"),
        ((torch.zeros(6), 0, CFG), "must be >= 1"),
        ((torch.zeros(6), 2.0, CFG), "must be an int"),
        ((torch.zeros(6, dtype=torch.float64), 2, CFG), "must be float32"),
        ((torch.zeros(2, 3), 3, CFG), "must be 1-D"),
        (([0.0, 1.0], 2, CFG), "must be a torch.Tensor"),
        ((torch.zeros(2), 2, {"baseline": "group_mean"}), "must be an AdvantageConfig"),
        ((torch.tensor([0.0, 1.0, NAN, 2.0]), 2, CFG), r"rewards_B\[2\] is not finite \(nan\)"),
        (
            (torch.tensor([0.0, -INF]), 2, CFG, torch.tensor([True, True])),
            r"rewards_B\[1\] is not finite",
        ),
        (  # A NaN reward of a VALID sample is still an error under a mask.
            (torch.tensor([NAN, 1.0]), 2, CFG, torch.tensor([True, False])),
            r"rewards_B\[0\] is not finite",
        ),
        ((torch.zeros(2), 2, CFG, torch.tensor([1, 0])), "must be a bool tensor"),
        ((torch.zeros(2), 2, CFG, torch.tensor([True])), "must have the shape of rewards_B"),
    ],
)
def test_input_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_advantages(*args)


# --- Broadcast. ---------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_broadcast_to_tokens(mask_dtype):
    advantages_B = torch.tensor([1.5, -2.0, 0.0])
    token_mask_BS = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]]).to(mask_dtype)
    actual_BS = broadcast_to_tokens(advantages_B, token_mask_BS)
    expected_BS = torch.tensor(
        [[0.0, 1.5, 1.5, 0.0], [-2.0, -2.0, -2.0, -2.0], [0.0, 0.0, 0.0, 0.0]]
    )
    assert torch.equal(actual_BS, expected_BS)
    assert actual_BS.dtype == torch.float32


def test_broadcast_errors():
    with pytest.raises(ValueError, match=r"token_mask_BS must have shape \(B, S\) with B = 2"):
        broadcast_to_tokens(torch.zeros(2), torch.ones(3, 4))
    with pytest.raises(ValueError, match="must hold only 0 and 1"):
        broadcast_to_tokens(torch.zeros(2), torch.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="1-D floating tensor"):
        broadcast_to_tokens(torch.zeros(2, dtype=torch.int64), torch.ones(2, 4))
    with pytest.raises(ValueError, match="must be torch.Tensors"):
        broadcast_to_tokens(torch.zeros(2), [[1, 1]])
