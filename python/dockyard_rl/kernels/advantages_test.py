"""Tests of dockyard_rl.kernels.advantages: the C++/CUDA extension and the torch path.

Every parity test compares with ``_expected_advantages`` below, a direct
transcription of the definitions (leave-one-out = mean of the others, summed
explicitly), independent of both implementations' closed forms. The extension
is REQUIRED: the build always provides it, so a missing one fails these tests
rather than skipping them. CUDA tests skip with a reason when there is no GPU.

Shape suffixes: G = groups, N = samples per group.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockyard_rl.kernels import advantages as kernels
from dockyard_rl.kernels import testing_extension

# The shared fixture: the compiled extension, failing (not skipping) when it is missing.
ext = testing_extension.ext

BASELINES = ["leave_one_out", "group_mean"]


def _expected_advantages(
    rewards_GN: torch.Tensor, baseline: str, normalize_std: bool, epsilon: float
) -> torch.Tensor:
    """The definitions, written out plainly in float64."""
    r_GN = rewards_GN.detach().cpu().double()
    num_groups, group_size = r_GN.shape
    out_GN = torch.zeros(num_groups, group_size, dtype=torch.float64)
    for g in range(num_groups):
        row_N = r_GN[g]
        if group_size <= 1 or bool((row_N == row_N[0]).all()):
            continue  # Empty, no other sample, or no reward difference: 0.
        if baseline == "leave_one_out":
            # Mean of the other samples: (sum of all - own) / (N - 1).
            baseline_N = (row_N.sum() - row_N) / (group_size - 1)
        else:
            baseline_N = row_N.sum() / group_size
        adv_N = row_N - baseline_N
        if normalize_std:
            mean = row_N.sum() / group_size
            std = math.sqrt(float(((row_N - mean) ** 2).sum()) / (group_size - 1))
            adv_N = adv_N / (std + epsilon)
        out_GN[g] = adv_N
    return out_GN.float()


def _random_rewards(kind: str, num_groups: int, group_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_groups, group_size)
    if kind == "normal":
        return torch.randn(shape, generator=gen) * 10
    if kind == "binary":  # Pass/fail rewards: many all-equal groups.
        return torch.randint(0, 2, shape, generator=gen).float()
    if kind == "small_ints":  # Ties inside groups.
        return torch.randint(-3, 4, shape, generator=gen).float()
    if kind == "negative":
        return -torch.rand(shape, generator=gen) * 100 - 1
    raise AssertionError(kind)


def _assert_matches_expected(actual_GN, rewards_GN, baseline, normalize_std, epsilon):
    expected_GN = _expected_advantages(rewards_GN, baseline, normalize_std, epsilon)
    assert actual_GN.dtype == torch.float32
    assert actual_GN.shape == rewards_GN.shape
    assert actual_GN.device == rewards_GN.device
    actual_GN = actual_GN.cpu()
    assert torch.isfinite(actual_GN).all()
    torch.testing.assert_close(actual_GN, expected_GN, rtol=1e-5, atol=1e-5)
    # Constant groups (and single samples) are exactly zero, not just close.
    if rewards_GN.shape[1] > 0:
        r_GN = rewards_GN.cpu()
        constant_G = (r_GN == r_GN[:, :1]).all(dim=1)
        assert bool((actual_GN[constant_G] == 0).all())


def test_extension_is_built(ext):
    assert kernels.HAS_EXTENSION
    assert isinstance(ext.with_cuda, bool)


@settings(max_examples=300, deadline=None)
@given(
    num_groups=st.integers(0, 40),
    group_size=st.integers(1, 40),
    kind=st.sampled_from(["normal", "binary", "small_ints", "negative"]),
    seed=st.integers(0, 2**31 - 1),
    baseline=st.sampled_from(BASELINES),
    normalize_std=st.booleans(),
    epsilon=st.sampled_from([0.0, 1e-6, 0.1]),
)
def test_parity_random(ext, num_groups, group_size, kind, seed, baseline, normalize_std, epsilon):
    rewards_GN = _random_rewards(kind, num_groups, group_size, seed)
    before_GN = rewards_GN.clone()
    for use_extension in (True, False):
        actual_GN = kernels.group_advantages(
            rewards_GN, baseline, normalize_std, epsilon, use_extension=use_extension
        )
        _assert_matches_expected(actual_GN, rewards_GN, baseline, normalize_std, epsilon)
    assert torch.equal(rewards_GN, before_GN), "the input must not be modified"


@pytest.mark.parametrize(
    "num_groups, group_size",
    [
        (0, 4),
        (4, 0),
        (1, 1),
        (3, 1),
        (5, 2),
        (64, 8),
        (2, 1000),  # Large groups.
        (5000, 3),  # Above the C++ core's serial threshold: threaded path.
    ],
)
@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("normalize_std", [False, True])
def test_parity_shapes(ext, num_groups, group_size, baseline, normalize_std):
    for kind in ("normal", "binary"):
        rewards_GN = _random_rewards(kind, num_groups, group_size, seed=num_groups * 7 + group_size)
        actual_GN = kernels.group_advantages(
            rewards_GN, baseline, normalize_std, 1e-6, use_extension=True
        )
        _assert_matches_expected(actual_GN, rewards_GN, baseline, normalize_std, 1e-6)


def test_default_uses_extension_on_cpu(ext, monkeypatch):
    calls = []

    class Spy:
        with_cuda = ext.with_cuda

        def group_advantages(self, *args):
            calls.append(args)
            return ext.group_advantages(*args)

    monkeypatch.setattr(kernels, "_ext", Spy())
    rewards_GN = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    kernels.group_advantages(rewards_GN)
    assert len(calls) == 1
    kernels.group_advantages(rewards_GN, use_extension=False)
    assert len(calls) == 1


def test_use_extension_true_without_extension_raises(monkeypatch):
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "HAS_EXTENSION", False)
    rewards_GN = torch.tensor([[1.0, 2.0]])
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        kernels.group_advantages(rewards_GN, use_extension=True)
    # The default falls back to torch.
    torch.testing.assert_close(kernels.group_advantages(rewards_GN), torch.tensor([[-1.0, 1.0]]))


# --- Edge cases: exact values, for both implementations. ---------------------

both_paths = pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "torch"])


@both_paths
def test_leave_one_out_hand_example(ext, use_extension):
    # Baselines: (2+3+6)/3, (1+3+6)/3, (1+2+6)/3, (1+2+3)/3.
    actual = kernels.group_advantages(
        torch.tensor([[1.0, 2.0, 3.0, 6.0]]), "leave_one_out", use_extension=use_extension
    )
    torch.testing.assert_close(actual, torch.tensor([[-8 / 3, -4 / 3, 0.0, 4.0]]))


@both_paths
def test_group_mean_and_std(ext, use_extension):
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    actual = kernels.group_advantages(rewards, "group_mean", use_extension=use_extension)
    torch.testing.assert_close(actual, torch.tensor([[-2.0, -1.0, 0.0, 3.0]]))
    std = math.sqrt(14 / 3)
    actual = kernels.group_advantages(
        rewards, "group_mean", normalize_std=True, epsilon=0.5, use_extension=use_extension
    )
    torch.testing.assert_close(actual, torch.tensor([[-2.0, -1.0, 0.0, 3.0]]) / (std + 0.5))


@both_paths
@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_size_one_is_zero(ext, use_extension, baseline, normalize_std):
    rewards = torch.tensor([[5.0], [-2.0], [0.0], [1e30]])
    actual = kernels.group_advantages(
        rewards, baseline, normalize_std, epsilon=0.0, use_extension=use_extension
    )
    assert torch.equal(actual, torch.zeros(4, 1))


@both_paths
def test_group_size_two(ext, use_extension):
    rewards = torch.tensor([[0.0, 1.0], [3.0, -1.0]])
    s = math.sqrt(0.5)
    cases = {
        ("leave_one_out", False): [[-1.0, 1.0], [4.0, -4.0]],
        ("group_mean", False): [[-0.5, 0.5], [2.0, -2.0]],
        ("leave_one_out", True): [[-1 / s, 1 / s], [math.sqrt(2), -math.sqrt(2)]],
        ("group_mean", True): [[-0.5 / s, 0.5 / s], [1 / math.sqrt(2), -1 / math.sqrt(2)]],
    }
    for (baseline, normalize_std), expected in cases.items():
        actual = kernels.group_advantages(
            rewards, baseline, normalize_std, epsilon=0.0, use_extension=use_extension
        )
        torch.testing.assert_close(
            actual, torch.tensor(expected), msg=f"{baseline} normalize_std={normalize_std}"
        )


@both_paths
@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -7.25, 1e30, -3e38])
def test_equal_rewards_give_exact_zeros(ext, use_extension, baseline, normalize_std, value):
    rewards = torch.full((3, 7), value)
    actual = kernels.group_advantages(
        rewards, baseline, normalize_std, epsilon=0.0, use_extension=use_extension
    )
    assert not torch.isnan(actual).any()
    assert torch.equal(actual, torch.zeros(3, 7))


@both_paths
def test_large_values(ext, use_extension):
    rewards = torch.tensor([[1e30, -1e30, 0.0]])
    # 1e30 squared overflows float32; the std must still come out as 1e30.
    normalized = kernels.group_advantages(
        rewards, "group_mean", normalize_std=True, epsilon=0.0, use_extension=use_extension
    )
    torch.testing.assert_close(normalized, torch.tensor([[1.0, -1.0, 0.0]]))
    loo = kernels.group_advantages(rewards, "leave_one_out", use_extension=use_extension)
    assert torch.isfinite(loo).all()
    torch.testing.assert_close(loo, torch.tensor([[1.5e30, -1.5e30, 0.0]]))


@both_paths
def test_large_rewards_with_small_differences(ext, use_extension):
    # float32's spacing at 1e7 is 1: a float32 sum (4e7, spacing 4) would lose
    # these differences.
    rewards = torch.tensor([[1e7, 1e7 + 1, 1e7 + 2, 1e7 + 3]])
    actual = kernels.group_advantages(rewards, "group_mean", use_extension=use_extension)
    assert torch.equal(actual, torch.tensor([[-1.5, -0.5, 0.5, 1.5]]))
    actual = kernels.group_advantages(
        rewards, "leave_one_out", normalize_std=True, epsilon=0.0, use_extension=use_extension
    )
    std = math.sqrt(5 / 3)
    torch.testing.assert_close(
        actual, torch.tensor([[-2.0, -2 / 3, 2 / 3, 2.0]]) / std, rtol=1e-6, atol=1e-6
    )


@both_paths
def test_negative_rewards(ext, use_extension):
    rewards = torch.tensor([[-1.0, -3.0, -5.0]])
    actual = kernels.group_advantages(rewards, "leave_one_out", use_extension=use_extension)
    # Baselines: -4, -3, -2.
    torch.testing.assert_close(actual, torch.tensor([[3.0, 0.0, -3.0]]))


@both_paths
def test_non_contiguous_and_grad_inputs(ext, use_extension):
    base = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [6.0, 60.0]], requires_grad=True)
    rewards_GN = base.t()  # (2, 4), not contiguous, requires grad.
    actual = kernels.group_advantages(rewards_GN, "group_mean", use_extension=use_extension)
    assert not actual.requires_grad
    torch.testing.assert_close(
        actual, torch.tensor([[-2.0, -1.0, 0.0, 3.0], [-20.0, -10.0, 0.0, 30.0]])
    )


# --- Errors ------------------------------------------------------------------


@both_paths
@pytest.mark.parametrize("shape", [(4,), (2, 3, 4), ()])
def test_wrong_dims_raise(ext, use_extension, shape):
    with pytest.raises(ValueError, match="must be 2-D"):
        kernels.group_advantages(torch.zeros(shape), use_extension=use_extension)


@both_paths
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64, torch.bool])
def test_wrong_dtype_raises(ext, use_extension, dtype):
    with pytest.raises(ValueError, match="must be float32"):
        kernels.group_advantages(torch.zeros(2, 3, dtype=dtype), use_extension=use_extension)


@both_paths
def test_not_a_tensor_raises(ext, use_extension):
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        kernels.group_advantages([[1.0, 2.0]], use_extension=use_extension)


@both_paths
def test_bad_baseline_raises(ext, use_extension):
    with pytest.raises(ValueError, match="valid names: leave_one_out, group_mean"):
        kernels.group_advantages(torch.zeros(2, 3), "rloo", use_extension=use_extension)


@both_paths
@pytest.mark.parametrize("epsilon", [-1e-9, math.nan, math.inf])
def test_bad_epsilon_raises(ext, use_extension, epsilon):
    with pytest.raises(ValueError, match="epsilon must be finite and >= 0"):
        kernels.group_advantages(torch.zeros(2, 3), epsilon=epsilon, use_extension=use_extension)


@both_paths
@pytest.mark.parametrize("bad, text", [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_non_finite_rewards_raise(ext, use_extension, bad, text):
    rewards = torch.zeros(3, 4)
    rewards[1, 2] = bad
    rewards[2, 0] = math.nan  # Later in row-major order: not the one reported.
    with pytest.raises(ValueError, match=rf"group 1, index 2 is not finite \({text}\)"):
        kernels.group_advantages(rewards, use_extension=use_extension)


def test_raw_binding_checks(ext):
    rewards = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"rewards has shape \(2, 3\) but out has shape \(3, 2\)"):
        ext.group_advantages(rewards, torch.empty(3, 2), "group_mean", False, 0.0)
    with pytest.raises(ValueError, match="valid names"):
        ext.group_advantages(rewards, torch.empty(2, 3), "mean", False, 0.0)
    # No silent conversion: a float64 out would be a copy that swallows results.
    with pytest.raises(TypeError):
        out64 = torch.empty(2, 3, dtype=torch.float64)
        ext.group_advantages(rewards, out64, "group_mean", False, 0.0)
    with pytest.raises(TypeError):
        ext.group_advantages(rewards, torch.empty(3, 2).t(), "group_mean", False, 0.0)
    # In place (out is rewards) is allowed.
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    ext.group_advantages(r, r, "group_mean", False, 0.0)
    torch.testing.assert_close(r, torch.tensor([[-2.0, -1.0, 0.0, 3.0]]))


# --- CUDA --------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine"
)


@requires_gpu
@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("normalize_std", [False, True])
def test_cuda_parity(ext, baseline, normalize_std):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    shapes = [(0, 4), (3, 1), (5, 2), (64, 8), (7, 33), (3, 1000), (5000, 16)]
    for num_groups, group_size in shapes:
        for kind in ("normal", "binary", "negative"):
            rewards_GN = _random_rewards(kind, num_groups, group_size, seed=group_size).cuda()
            for use_extension in (True, False):
                actual_GN = kernels.group_advantages(
                    rewards_GN, baseline, normalize_std, 1e-6, use_extension=use_extension
                )
                _assert_matches_expected(actual_GN, rewards_GN, baseline, normalize_std, 1e-6)
    # Edge cases on the device.
    big = torch.tensor([[1e30, -1e30, 0.0], [1e7, 1e7 + 1, 1e7 + 2], [0.1, 0.1, 0.1]]).cuda()
    actual = kernels.group_advantages(big, baseline, normalize_std, 0.0, use_extension=True)
    _assert_matches_expected(actual, big, baseline, normalize_std, 0.0)


@requires_gpu
def test_cuda_side_stream_and_errors(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produced on the side stream; the kernel must run after it there.
        rewards_GN = torch.arange(4000 * 8, device="cuda", dtype=torch.float32).view(4000, 8) % 5
        actual_GN = kernels.group_advantages(rewards_GN, "leave_one_out", True, 1e-6)
    torch.cuda.synchronize()
    _assert_matches_expected(actual_GN, rewards_GN, "leave_one_out", True, 1e-6)

    rewards = torch.zeros(3, 300, device="cuda")
    rewards[1, 257] = math.inf
    rewards[2, 3] = math.nan
    with pytest.raises(ValueError, match=r"group 1, index 257 is not finite \(inf\)"):
        kernels.group_advantages(rewards, use_extension=True)


@requires_gpu
def test_cuda_without_cuda_build(ext):
    if ext.with_cuda:
        pytest.skip("_dockyard_kernels has CUDA; test_cuda_parity covers it")
    rewards_GN = torch.tensor([[1.0, 2.0]], device="cuda")
    with pytest.raises(RuntimeError, match="built without CUDA; rebuild with --config=cuda"):
        kernels.group_advantages(rewards_GN, use_extension=True)
    # The default falls back to torch on the device.
    actual = kernels.group_advantages(rewards_GN)
    torch.testing.assert_close(actual.cpu(), torch.tensor([[-1.0, 1.0]]))
