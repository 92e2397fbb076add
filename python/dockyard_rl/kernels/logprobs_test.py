"""Tests of dockyard_rl.kernels.logprobs: the C++/CUDA extension and the torch path.

Parity tests compare with ``_expected`` below: torch's ``log_softmax`` + ``gather`` in
float64 (and float64 autograd for the gradients), which is independent of both
implementations' float32 arithmetic. The extension is REQUIRED: the build always
provides it, so a missing one fails these tests rather than skipping them. CUDA tests
skip with a reason when there is no GPU.

Shape suffixes: N = tokens (rows), V = vocabulary, B = batch, S = sequence positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from dockyard_rl.kernels import logprobs as kernels
from dockyard_rl.kernels import testing_extension

# The shared fixture: the compiled extension, failing (not skipping) when it is missing.
ext = testing_extension.ext

both_paths = pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "torch"])
# Float32 tolerances vs the float64 reference: the extension accumulates in float64; the
# torch path is plain float32 log_softmax.
RTOL = {True: 1e-6, False: 1e-5}


def _expected(logits_NV, targets_N, temperature, grad_N=None, grad_entropy_N=None):
    """(logprobs, entropy, d(sum g*lp + gH*H)/d logits) in float64 via torch autograd."""
    x_NV = logits_NV.detach().cpu().double().requires_grad_()
    logp_NV = torch.log_softmax(x_NV / temperature, dim=-1)
    lp_N = logp_NV.gather(-1, targets_N.cpu().unsqueeze(-1)).squeeze(-1)
    p_NV = logp_NV.exp()
    ent_N = -(p_NV * torch.where(p_NV > 0, logp_NV, torch.zeros_like(logp_NV))).sum(-1)
    grad = None
    if grad_N is not None:
        objective = (lp_N * grad_N.cpu().double()).sum()
        if grad_entropy_N is not None:
            objective = objective + (ent_N * grad_entropy_N.cpu().double()).sum()
        (grad,) = torch.autograd.grad(objective, x_NV)
    return lp_N.detach(), ent_N.detach(), grad


def _random(num_rows, vocab_size, seed, scale=4.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits_NV = (torch.randn(num_rows, vocab_size, generator=gen) * scale).to(dtype)
    targets_N = torch.randint(0, vocab_size, (num_rows,), generator=gen)
    return logits_NV, targets_N


def _run(logits_NV, targets_N, temperature, use_extension, grad_N, grad_entropy_N=None):
    """Forward + backward; returns (logprobs, entropy, grad_logits) detached."""
    x_NV = logits_NV.detach().clone().requires_grad_()
    lp_N, ent_N = kernels.gather_logprobs(
        x_NV, targets_N, temperature, return_entropy=True, use_extension=use_extension
    )
    objective = (lp_N * grad_N).sum()
    if grad_entropy_N is not None:
        objective = objective + (ent_N * grad_entropy_N).sum()
    objective.backward()
    return lp_N.detach(), ent_N.detach(), x_NV.grad


def test_extension_is_built(ext):
    assert kernels.HAS_EXTENSION
    assert hasattr(ext, "gather_logprobs") and hasattr(ext, "gather_logprobs_backward")


# --- Parity with torch -------------------------------------------------------


@both_paths
@pytest.mark.parametrize("num_rows, vocab_size", [(1, 1), (7, 3), (16, 1000), (9, 2049), (3, 5003)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_float32_parity(ext, use_extension, num_rows, vocab_size, temperature):
    logits_NV, targets_N = _random(num_rows, vocab_size, seed=vocab_size)
    grad_N = torch.randn(num_rows, generator=torch.Generator().manual_seed(1))
    grad_entropy_N = torch.randn(num_rows, generator=torch.Generator().manual_seed(2))
    lp_N, ent_N, grad_NV = _run(
        logits_NV, targets_N, temperature, use_extension, grad_N, grad_entropy_N
    )
    want_lp, want_ent, want_grad = _expected(
        logits_NV, targets_N, temperature, grad_N, grad_entropy_N
    )
    assert lp_N.dtype == ent_N.dtype == torch.float32
    assert grad_NV.dtype == torch.float32 and grad_NV.shape == logits_NV.shape
    rtol = RTOL[use_extension]
    torch.testing.assert_close(lp_N.double(), want_lp, rtol=rtol, atol=rtol)
    torch.testing.assert_close(ent_N.double(), want_ent, rtol=rtol, atol=rtol)
    torch.testing.assert_close(grad_NV.double(), want_grad, rtol=10 * rtol, atol=rtol)


@pytest.mark.parametrize("upstream", ["ones", "zeros", "random", "large", "negative"])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradient_with_upstream_values(ext, upstream, with_entropy):
    logits_NV, targets_N = _random(12, 300, seed=5)
    gen = torch.Generator().manual_seed(6)
    grad_N = {
        "ones": torch.ones(12),
        "zeros": torch.zeros(12),
        "random": torch.randn(12, generator=gen),
        "large": torch.full((12,), 1e4),
        "negative": -torch.rand(12, generator=gen) * 3,
    }[upstream]
    grad_entropy_N = torch.randn(12, generator=gen) if with_entropy else None
    _, _, grad_NV = _run(logits_NV, targets_N, 0.9, True, grad_N, grad_entropy_N)
    _, _, want = _expected(logits_NV, targets_N, 0.9, grad_N, grad_entropy_N)
    scale = float(grad_N.abs().max()) + 1.0
    torch.testing.assert_close(grad_NV.double(), want, rtol=1e-5, atol=1e-6 * scale)
    if upstream == "zeros" and not with_entropy:
        assert torch.equal(grad_NV, torch.zeros_like(grad_NV))


def test_entropy_only_gradient(ext):
    # Only the entropy is used: the logprob's grad arrives as None / zeros.
    logits_NV, targets_N = _random(5, 64, seed=8)
    x_NV = logits_NV.clone().requires_grad_()
    _, ent_N = kernels.gather_logprobs(x_NV, targets_N, 1.3, return_entropy=True)
    ent_N.sum().backward()
    _, _, want = _expected(logits_NV, targets_N, 1.3, torch.zeros(5), torch.ones(5))
    torch.testing.assert_close(x_NV.grad.double(), want, rtol=1e-5, atol=1e-7)


@both_paths
def test_bfloat16_parity(ext, use_extension):
    logits_NV, targets_N = _random(8, 3001, seed=3, dtype=torch.bfloat16)
    grad_N = torch.randn(8, generator=torch.Generator().manual_seed(4))
    lp_N, ent_N, grad_NV = _run(logits_NV, targets_N, 0.8, use_extension, grad_N, grad_N)
    # The reference sees the same bf16 values, exactly, in float64.
    want_lp, want_ent, want_grad = _expected(logits_NV, targets_N, 0.8, grad_N, grad_N)
    torch.testing.assert_close(lp_N.double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_N.double(), want_ent, rtol=1e-5, atol=1e-5)
    assert grad_NV.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits: one rounding of the gradient is 2^-9 relative.
    torch.testing.assert_close(grad_NV.double(), want_grad, rtol=2**-7, atol=1e-6)


def test_bfloat16_gradient_is_the_rounded_float32_gradient(ext):
    # Same values as float32 and bfloat16 logits: the bf16 gradient is exactly the
    # float32 gradient rounded to nearest even.
    logits_NV, targets_N = _random(6, 777, seed=9, dtype=torch.bfloat16)
    grad_N = torch.randn(6, generator=torch.Generator().manual_seed(10))
    _, _, grad_bf16 = _run(logits_NV, targets_N, 1.0, True, grad_N)
    _, _, grad_f32 = _run(logits_NV.float(), targets_N, 1.0, True, grad_N)
    assert torch.equal(grad_bf16, grad_f32.to(torch.bfloat16))


def test_threaded_path(ext):
    # 512 x 3000 logits: above the C++ core's threshold for threads.
    logits_NV, targets_N = _random(512, 3000, seed=11)
    grad_N = torch.randn(512, generator=torch.Generator().manual_seed(12))
    lp_N, ent_N, grad_NV = _run(logits_NV, targets_N, 1.0, True, grad_N, grad_N)
    want_lp, want_ent, want_grad = _expected(logits_NV, targets_N, 1.0, grad_N, grad_N)
    torch.testing.assert_close(lp_N.double(), want_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_N.double(), want_ent, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_NV.double(), want_grad, rtol=1e-5, atol=1e-6)


# --- Edge cases --------------------------------------------------------------


@both_paths
def test_vocab_one(ext, use_extension):
    logits_NV = torch.tensor([[3.0], [-1e30], [0.0]])
    lp_N, ent_N, grad_NV = _run(
        logits_NV,
        torch.zeros(3, dtype=torch.int64),
        0.5,
        use_extension,
        torch.ones(3),
        torch.ones(3),
    )
    assert torch.equal(lp_N, torch.zeros(3))
    assert torch.equal(ent_N, torch.zeros(3))
    assert torch.equal(grad_NV, torch.zeros(3, 1))


@both_paths
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_huge_logits_do_not_overflow(ext, use_extension, temperature):
    logits_NV = torch.tensor([[1e30, 1e30, -1e30, 0.0], [1e30, 0.0, 1e30 * 0.999, 3e37]])
    targets_N = torch.tensor([1, 3])
    grad_N = torch.tensor([1.0, 2.0])
    lp_N, ent_N, grad_NV = _run(logits_NV, targets_N, temperature, use_extension, grad_N)
    assert torch.isfinite(lp_N).all() and torch.isfinite(ent_N).all()
    assert torch.isfinite(grad_NV).all()
    torch.testing.assert_close(lp_N[0], torch.tensor(-math.log(2)))
    torch.testing.assert_close(ent_N, torch.tensor([math.log(2), 0.0]))
    torch.testing.assert_close(lp_N[1], torch.tensor(0.0))
    want_lp, _, want_grad = _expected(logits_NV, targets_N, temperature, grad_N)
    torch.testing.assert_close(lp_N.double(), want_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_NV.double(), want_grad, rtol=1e-6, atol=1e-6)


@both_paths
def test_masked_logits(ext, use_extension):
    inf = math.inf
    logits_NV = torch.tensor(
        [
            [0.0, -inf, 0.0, -inf],  # Two equal survivors.
            [1.0, 2.0, -inf, 0.5],  # Masked entry, unmasked target.
            [2.0, -inf, 1.0, 0.0],  # Masked target: logprob -inf.
        ]
    )
    targets_N = torch.tensor([0, 3, 1])
    grad_N = torch.tensor([1.0, -2.0, 0.5])
    grad_entropy_N = torch.tensor([0.5, 1.0, -1.0])
    lp_N, ent_N, grad_NV = _run(logits_NV, targets_N, 0.7, use_extension, grad_N, grad_entropy_N)
    want_lp, want_ent, want_grad = _expected(logits_NV, targets_N, 0.7, grad_N, grad_entropy_N)
    torch.testing.assert_close(lp_N[0], torch.tensor(-math.log(2)))
    assert lp_N[2] == -inf
    torch.testing.assert_close(lp_N.double(), want_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_N.double(), want_ent, rtol=1e-6, atol=1e-6)
    # Masked entries: probability 0, gradient exactly 0 (except a masked target's g/T).
    assert grad_NV[0, 1] == 0 and grad_NV[0, 3] == 0 and grad_NV[1, 2] == 0
    torch.testing.assert_close(grad_NV[2, 1], torch.tensor(0.5 / 0.7))
    assert torch.isfinite(grad_NV).all()
    torch.testing.assert_close(grad_NV.double(), want_grad, rtol=1e-5, atol=1e-6)


@both_paths
def test_fully_masked_row_is_nan(ext, use_extension):
    logits_NV = torch.tensor([[-math.inf, -math.inf], [0.0, 1.0]])
    lp_N, ent_N, grad_NV = _run(logits_NV, torch.tensor([0, 1]), 1.0, use_extension, torch.ones(2))
    assert torch.isnan(lp_N[0]) and torch.isnan(ent_N[0]) and torch.isnan(grad_NV[0]).all()
    assert torch.isfinite(lp_N[1]) and torch.isfinite(grad_NV[1]).all()


@both_paths
def test_batch_sequence_input(ext, use_extension):
    gen = torch.Generator().manual_seed(13)
    logits_BSV = torch.randn(2, 5, 40, generator=gen)
    targets_BS = torch.randint(0, 40, (2, 5), generator=gen)
    x_BSV = logits_BSV.clone().requires_grad_()
    lp_BS, ent_BS = kernels.gather_logprobs(
        x_BSV, targets_BS, 1.2, return_entropy=True, use_extension=use_extension
    )
    assert lp_BS.shape == ent_BS.shape == (2, 5)
    lp_BS.sum().backward()
    want_lp, want_ent, want_grad = _expected(
        logits_BSV.view(10, 40), targets_BS.view(10), 1.2, torch.ones(10)
    )
    torch.testing.assert_close(lp_BS.double(), want_lp.view(2, 5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_BS.double(), want_ent.view(2, 5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_BSV.grad.double(), want_grad.view(2, 5, 40), rtol=1e-5, atol=1e-6)


def test_non_contiguous_logits(ext):
    gen = torch.Generator().manual_seed(14)
    wide_NV = torch.randn(6, 50, generator=gen)
    targets_N = torch.randint(0, 30, (6,), generator=gen)
    cases = {
        # Row stride 50 with unit vocab stride: read in place.
        "row stride": wide_NV[:, 10:40],
        # Vocab stride 6: copied with .contiguous().
        "transposed": wide_NV[:, :30].t().contiguous().t(),
        # (B, S, V) slice whose flatten cannot be a view: reshape copies.
        "sliced (B, S, V)": wide_NV.view(2, 3, 50)[:, :2, :30],
    }
    for name, logits in cases.items():
        x = logits.detach().requires_grad_()
        t = targets_N if x.dim() == 2 else targets_N[:4].view(2, 2)
        lp = kernels.gather_logprobs(x, t, use_extension=True)
        lp.sum().backward()
        flat = x.detach().reshape(-1, 30)
        want_lp, _, want_grad = _expected(flat, t.reshape(-1), 1.0, torch.ones(flat.shape[0]))
        torch.testing.assert_close(lp.reshape(-1).double(), want_lp, rtol=1e-6, atol=1e-6, msg=name)
        assert x.grad.shape == x.shape
        torch.testing.assert_close(
            x.grad.reshape(-1, 30).double(), want_grad, rtol=1e-5, atol=1e-6, msg=name
        )


def test_no_grad_and_input_untouched(ext):
    logits_NV, targets_N = _random(4, 100, seed=15)
    before = logits_NV.clone()
    with torch.no_grad():
        lp_N = kernels.gather_logprobs(logits_NV, targets_N)
    assert not lp_N.requires_grad
    assert torch.equal(logits_NV, before)
    want_lp, _, _ = _expected(logits_NV, targets_N, 1.0)
    torch.testing.assert_close(lp_N.double(), want_lp, rtol=1e-6, atol=1e-6)


def test_default_uses_extension_on_cpu(ext, monkeypatch):
    calls = []

    class Spy:
        with_cuda = ext.with_cuda

        def gather_logprobs(self, *args, **kwargs):
            calls.append(args)
            return ext.gather_logprobs(*args, **kwargs)

        def gather_logprobs_backward(self, *args, **kwargs):
            return ext.gather_logprobs_backward(*args, **kwargs)

    monkeypatch.setattr(kernels, "_ext", Spy())
    logits_NV, targets_N = _random(2, 5, seed=16)
    kernels.gather_logprobs(logits_NV, targets_N)
    assert len(calls) == 1
    kernels.gather_logprobs(logits_NV, targets_N, use_extension=False)
    assert len(calls) == 1


def test_use_extension_true_without_extension_raises(monkeypatch):
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "HAS_EXTENSION", False)
    logits_NV = torch.tensor([[0.0, 0.0]])
    targets_N = torch.tensor([1])
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        kernels.gather_logprobs(logits_NV, targets_N, use_extension=True)
    # The default falls back to torch.
    torch.testing.assert_close(
        kernels.gather_logprobs(logits_NV, targets_N), torch.tensor([-math.log(2)])
    )


# --- Errors ------------------------------------------------------------------


@both_paths
def test_out_of_range_targets_raise_index_error(ext, use_extension):
    logits_NV = torch.zeros(4, 5)
    for bad, row in ((5, 2), (-1, 1), (10**12, 3)):
        targets_N = torch.tensor([0, 4, 1, 3])
        targets_N[row] = bad
        with pytest.raises(
            IndexError, match=rf"target id {bad} at row {row} is out of range \[0, 5\)"
        ):
            kernels.gather_logprobs(logits_NV, targets_N, use_extension=use_extension)
    # (B, S, V): the row is counted in the flattened view.
    with pytest.raises(IndexError, match=r"target id 7 at row 4 "):
        kernels.gather_logprobs(
            torch.zeros(2, 3, 5), torch.tensor([[0, 0, 0], [0, 7, 0]]), use_extension=use_extension
        )


def test_targets_modified_after_forward_raise_in_backward(ext):
    # The extension's backward does not check the ids again (on CUDA that saves a stream
    # synchronization): it relies on autograd refusing saved targets modified in place.
    logits_NV, targets_N = _random(4, 5, seed=3)
    logits_NV.requires_grad_()
    lp_N = kernels.gather_logprobs(logits_NV, targets_N, use_extension=True)
    targets_N[1] = 7  # Out of range, after the forward checked the ids.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp_N.sum().backward()


def test_raw_binding_check_targets_is_cuda_only(ext):
    # The CPU path checks the ids before writing whatever check_targets says.
    logits = torch.zeros(2, 3)
    targets = torch.tensor([0, 3])
    mx, ls = torch.zeros(2), torch.full((2,), math.log(3), dtype=torch.float64)
    for check in (True, False):
        with pytest.raises(IndexError, match="gather_logprobs: target id 3 at row 1"):
            ext.gather_logprobs(
                logits, targets, 1.0, torch.empty(2), None, None, None, check_targets=check
            )
        with pytest.raises(IndexError, match="gather_logprobs_backward: target id 3 at row 1"):
            ext.gather_logprobs_backward(
                logits,
                targets,
                1.0,
                mx,
                ls,
                None,
                torch.ones(2),
                None,
                torch.empty(2, 3),
                check_targets=check,
            )


@both_paths
@pytest.mark.parametrize(
    "logits_shape, targets_shape, match",
    [
        ((5,), (5,), r"must be \(N, V\) or \(B, S, V\)"),
        ((2, 3, 4, 5), (2, 3, 4), r"must be \(N, V\) or \(B, S, V\)"),
        ((4, 5), (3,), r"targets_N must have shape \(4,\)"),
        ((4, 5), (4, 1), r"targets_N must have shape \(4,\)"),
        ((2, 3, 5), (6,), r"targets_N must have shape \(2, 3\)"),
        ((4, 0), (4,), "empty vocab dim"),
    ],
)
def test_bad_shapes_raise(ext, use_extension, logits_shape, targets_shape, match):
    with pytest.raises(ValueError, match=match):
        kernels.gather_logprobs(
            torch.zeros(logits_shape),
            torch.zeros(targets_shape, dtype=torch.int64),
            use_extension=use_extension,
        )


@both_paths
def test_bad_dtypes_raise(ext, use_extension):
    for dtype in (torch.float16, torch.float64, torch.int64):
        with pytest.raises(ValueError, match="must be float32 or bfloat16"):
            kernels.gather_logprobs(
                torch.zeros(2, 3, dtype=dtype),
                torch.zeros(2, dtype=torch.int64),
                use_extension=use_extension,
            )
    for dtype in (torch.int32, torch.float32):
        with pytest.raises(ValueError, match="targets_N must be int64"):
            kernels.gather_logprobs(
                torch.zeros(2, 3), torch.zeros(2, dtype=dtype), use_extension=use_extension
            )
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        kernels.gather_logprobs(
            [[0.0, 1.0]], torch.zeros(1, dtype=torch.int64), use_extension=use_extension
        )


@both_paths
@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf, True, "1.0"])
def test_bad_temperature_raises(ext, use_extension, temperature):
    with pytest.raises(ValueError, match="temperature must be"):
        kernels.gather_logprobs(
            torch.zeros(2, 3),
            torch.zeros(2, dtype=torch.int64),
            temperature,
            use_extension=use_extension,
        )


def test_raw_binding_checks(ext):
    logits = torch.zeros(2, 3)
    targets = torch.zeros(2, dtype=torch.int64)
    lp, mx = torch.empty(2), torch.empty(2)
    ls = torch.empty(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="targets has 3 rows but logits have 2"):
        ext.gather_logprobs(logits, torch.zeros(3, dtype=torch.int64), 1.0, lp, None, mx, ls)
    with pytest.raises(ValueError, match="must be float32 or bfloat16"):
        ext.gather_logprobs(logits.half(), targets, 1.0, lp, None, mx, ls)
    with pytest.raises(ValueError, match="unit stride along the vocab"):
        ext.gather_logprobs(torch.zeros(3, 2).t(), targets, 1.0, lp, None, mx, ls)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        ext.gather_logprobs(logits, targets, 0.0, lp, None, mx, ls)
    # No silent conversion of outputs: a float64 logprobs would be a copy.
    with pytest.raises(TypeError):
        ext.gather_logprobs(logits, targets, 1.0, torch.empty(2, dtype=torch.float64), None, mx, ls)
    ext.gather_logprobs(logits, targets, 1.0, lp, None, mx, ls)
    with pytest.raises(ValueError, match="grad_logits must have the logits' dtype"):
        ext.gather_logprobs_backward(
            logits,
            targets,
            1.0,
            mx,
            ls,
            None,
            torch.ones(2),
            None,
            torch.empty(2, 3, dtype=torch.bfloat16),
        )
    with pytest.raises(ValueError, match="grad_logits must have the logits' shape"):
        ext.gather_logprobs_backward(
            logits, targets, 1.0, mx, ls, None, torch.ones(2), None, torch.empty(3, 2)
        )
    with pytest.raises(ValueError, match="grad_entropy is given but entropy is null"):
        ext.gather_logprobs_backward(
            logits, targets, 1.0, mx, ls, None, None, torch.ones(2), torch.empty(2, 3)
        )
    with pytest.raises(IndexError, match="gather_logprobs_backward: target id 3 at row 1"):
        ext.gather_logprobs_backward(
            logits, torch.tensor([0, 3]), 1.0, mx, ls, None, torch.ones(2), None, torch.empty(2, 3)
        )


# --- CUDA --------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine"
)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_parity(ext, dtype):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    for num_rows, vocab_size, temperature in [
        (1, 1, 1.0),
        (7, 33, 0.7),
        (64, 1000, 1.0),
        (9, 49152, 1.3),
    ]:
        logits_NV, targets_N = _random(num_rows, vocab_size, seed=vocab_size, dtype=dtype)
        logits_NV[0, : vocab_size // 3] = -math.inf  # Masked entries (maybe the target).
        grad_N = torch.randn(num_rows, generator=torch.Generator().manual_seed(1))
        cpu = _run(logits_NV, targets_N, temperature, True, grad_N, grad_N)
        gpu = _run(
            logits_NV.cuda(), targets_N.cuda(), temperature, True, grad_N.cuda(), grad_N.cuda()
        )
        for name, c, g in zip(("logprobs", "entropy"), cpu[:2], gpu[:2]):
            torch.testing.assert_close(g.cpu(), c, rtol=2e-6, atol=2e-6, msg=name)
        grad_tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(gpu[2].cpu().float(), cpu[2].float(), rtol=grad_tol, atol=1e-6)


@requires_gpu
def test_cuda_side_stream_and_errors(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produced on the side stream; the kernel must run after it there.
        logits_NV = torch.arange(300 * 500, device="cuda", dtype=torch.float32).view(300, 500)
        logits_NV = (logits_NV % 17) / 3
        targets_N = torch.arange(300, device="cuda") % 500
        lp_N = kernels.gather_logprobs(logits_NV, targets_N)
    torch.cuda.synchronize()
    want_lp, _, _ = _expected(logits_NV, targets_N, 1.0)
    torch.testing.assert_close(lp_N.cpu().double(), want_lp, rtol=2e-6, atol=2e-6)
    with pytest.raises(IndexError, match=r"target id 500 at row 7 is out of range \[0, 500\)"):
        bad_N = targets_N.clone()
        bad_N[7] = 500
        kernels.gather_logprobs(logits_NV, bad_N, use_extension=True)
    with pytest.raises(ValueError, match="same device"):
        kernels.gather_logprobs(logits_NV, targets_N.cpu(), use_extension=True)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_unaligned_rows_and_odd_vocab(ext, dtype):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    # Rows off 16-byte boundaries (odd stride, slice starting at column 1) and vocab sizes
    # that leave scalar tails, on both sides of the warp-per-row / block-per-row boundary.
    for num_rows, vocab_size in [(13, 37), (5, 4099), (3, 8195), (4, 20003)]:
        base_NV, targets_N = _random(num_rows, vocab_size + 3, seed=vocab_size, dtype=dtype)
        targets_N = targets_N % vocab_size
        grad_N = torch.randn(num_rows, generator=torch.Generator().manual_seed(2))
        results = []
        for device in ("cpu", "cuda"):
            # The slice is read in place (row stride V + 3, start one element in); _run
            # would clone it into a contiguous tensor.
            x_NV = base_NV.to(device).clone().requires_grad_()
            lp_N, ent_N = kernels.gather_logprobs(
                x_NV[:, 1 : vocab_size + 1],
                targets_N.to(device),
                0.9,
                return_entropy=True,
                use_extension=True,
            )
            ((lp_N + ent_N) * grad_N.to(device)).sum().backward()
            results.append((lp_N.detach().cpu(), ent_N.detach().cpu(), x_NV.grad.cpu()))
        cpu, gpu = results
        for name, c, g in zip(("logprobs", "entropy"), cpu[:2], gpu[:2]):
            torch.testing.assert_close(g, c, rtol=2e-6, atol=2e-6, msg=name)
        grad_tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(gpu[2].float(), cpu[2].float(), rtol=grad_tol, atol=1e-6)


@requires_gpu
def test_cuda_raw_binding_check_targets(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    logits_NV = torch.randn(6, 1000, device="cuda")
    targets_N = torch.tensor([0, 1, 1000, 3, -2, 5], device="cuda")
    lp_N = torch.zeros(6, device="cuda")
    with pytest.raises(IndexError, match=r"target id 1000 at row 2 is out of range \[0, 1000\)"):
        ext.gather_logprobs(
            logits_NV,
            targets_N,
            1.0,
            lp_N,
            None,
            None,
            None,
            torch.cuda.current_stream().cuda_stream,
        )
    # Unchecked: no error, NaN in the bad rows only.
    ext.gather_logprobs(
        logits_NV,
        targets_N,
        1.0,
        lp_N,
        None,
        None,
        None,
        torch.cuda.current_stream().cuda_stream,
        check_targets=False,
    )
    nan_N = lp_N.isnan().cpu()
    assert nan_N.tolist() == [False, False, True, False, True, False]
    # A good call after the bad ones is right (the error flag was cleared).
    good_N = targets_N.clamp(0, 999)
    lp_N = kernels.gather_logprobs(logits_NV, good_N)
    want_N, _, _ = _expected(logits_NV, good_N, 1.0)
    torch.testing.assert_close(lp_N.cpu().double(), want_N, rtol=2e-6, atol=2e-6)


@requires_gpu
def test_cuda_without_cuda_build(ext):
    if ext.with_cuda:
        pytest.skip("_dockyard_kernels has CUDA; test_cuda_parity covers it")
    logits_NV = torch.zeros(2, 3, device="cuda")
    targets_N = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="built without CUDA; rebuild with --config=cuda"):
        kernels.gather_logprobs(logits_NV, targets_N, use_extension=True)
    # The default falls back to torch on the device.
    lp_N = kernels.gather_logprobs(logits_NV, targets_N)
    torch.testing.assert_close(lp_N.cpu(), torch.full((2,), -math.log(3)))
