"""Fused log-prob gather (and entropy), computed by the C++/CUDA extension or torch.

For logits ``x`` of a token, its target id ``t`` and a temperature ``T > 0``, with
``z = x / T``:

- ``logprob = z[t] - logsumexp(z)`` (= ``log_softmax(z)[t]``)
- ``entropy = logsumexp(z) - sum_k softmax(z)_k * z_k`` (optional)

The extension reads each row of logits once (online logsumexp: running max and rescaled
sums) and never materialises an (N, V) log-softmax; its backward recomputes the softmax
row by row from two saved per-row statistics and writes the gradient straight into ONE
(N, V) buffer in the logits' dtype. Peak extra memory is that gradient (which autograd
needs anyway), where torch eager keeps the (N, V) log-softmax for backward and then
creates further (N, V) temporaries (the scattered gradient, the softmax-backward output).

Gradients (both outputs are differentiable w.r.t. the logits):

- ``d logprob / d x = (onehot(t) - p) / T``
- ``d entropy / d x = -p * (log p + entropy) / T``
  (from ``dH/dz_k = -p_k (z_k - E_p[z])`` and ``z_k - E_p[z] = log p_k + H``).

Shape suffixes: N = tokens (rows), V = vocabulary, B = batch (sequences), S = sequence
positions. ``(B, S, V)`` logits with ``(B, S)`` targets are accepted and flattened to
``(B*S, V)``; the results come back as ``(B, S)``. The flatten is a view when the logits
allow one (contiguous), else a copy (e.g. ``logits[:, :-1]``); 2-D logits with any row
stride are read in place as long as the vocab dim has unit stride, else they are copied
with ``.contiguous()``.

Implementations:

- ``_dockyard_kernels`` (cc/logprobs.cc, cc/cuda/logprobs_cuda.cu), used by default
  when importable: CPU tensors run multi-threaded with the GIL released; CUDA tensors
  run on torch's current stream when the extension was built with ``--config=cuda``.
  On CUDA the forward waits for that stream once (the kernel flags bad target ids, and
  the call raises them as IndexError); the backward does not wait: it reads the same
  saved targets, which the forward checked, and autograd raises if they were modified
  in place since.
- ``gather_logprobs_reference``: plain torch (``log_softmax`` + ``gather``), used when
  the extension is absent or lacks CUDA; differentiable through torch's autograd.

Dtypes: logits float32 or bfloat16, targets int64; logprobs and entropy are always
float32 (accumulated in float64 in the kernels); the logits' gradient has the logits'
dtype.

Special values (both implementations):

- ``-inf`` logits (a masked vocabulary) have probability 0 and get gradient 0;
- a target whose logit is ``-inf`` has logprob ``-inf`` (its gradient stays finite,
  ``g / T`` at the target, as torch's);
- a row of all ``-inf``, or holding NaN or ``+inf``, gives NaN (as torch);
- huge logits (e.g. 1e30 in float32) do not overflow; V = 1 gives logprob 0.

Not covered: an ``ignore_index`` (every target must be in ``[0, V)``; mask padding in the
loss instead), float16/float64 logits, gradients w.r.t. the temperature.
"""

from __future__ import annotations

import math

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels._extension import HAS_EXTENSION

# The extension this module calls (None outside the build); tests replace it.
_ext = _extension.EXTENSION
LOGITS_DTYPES = (torch.float32, torch.bfloat16)

__all__ = [
    "HAS_EXTENSION",
    "LOGITS_DTYPES",
    "gather_logprobs",
    "gather_logprobs_reference",
]


def gather_logprobs(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    use_extension: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Returns ``log_softmax(logits / temperature)[target]`` per row (and the entropy).

    Args:
        logits_NV: (N, V) or (B, S, V) float32 or bfloat16 logits, on CPU or CUDA.
        targets_N: (N) or (B, S) int64 token ids in ``[0, V)``, on the logits' device.
        temperature: finite, > 0; the logits are divided by it.
        return_entropy: also return the entropy of ``softmax(logits / temperature)``.
        use_extension: None = the extension when it is importable and supports the
            tensors' device (CUDA needs a ``--config=cuda`` build), else torch; True = the
            extension or an error; False = torch.

    Returns:
        float32 logprobs shaped like ``targets_N``, or ``(logprobs, entropy)`` when
        ``return_entropy``; both differentiable w.r.t. ``logits_NV``.

    Raises:
        ValueError: bad shapes, dtypes, devices or temperature.
        IndexError: a target id outside ``[0, V)`` (the message names the row and id,
            counted in the flattened (N, V) view).
        RuntimeError: ``use_extension=True`` but the extension is not importable, or was
            built without CUDA and the tensors are on CUDA.
    """
    _validate(logits_NV, targets_N, temperature)
    if not _extension.resolve_use_extension(
        use_extension, logits_NV.device, "gather_logprobs(use_extension=True)", _ext
    ):
        return gather_logprobs_reference(logits_NV, targets_N, temperature, return_entropy)

    out_shape = targets_N.shape
    vocab_size = logits_NV.shape[-1]
    # (B, S, V) -> (B*S, V): a view when possible, else a copy (see the module docs).
    logits_NV = logits_NV.reshape(-1, vocab_size)
    if vocab_size > 1 and logits_NV.stride(1) != 1:
        logits_NV = logits_NV.contiguous()  # The kernels need a unit vocab stride.
    targets_N = targets_N.reshape(-1).contiguous()
    logprobs_N, entropy_N = _GatherLogprobs.apply(
        logits_NV, targets_N, float(temperature), bool(return_entropy)
    )
    if return_entropy:
        return logprobs_N.view(out_shape), entropy_N.view(out_shape)
    return logprobs_N.view(out_shape)


def gather_logprobs_reference(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``gather_logprobs`` (same contract, any torch device, torch autograd).

    Computes in float32 (bfloat16 logits are upcast first) and materialises the (N, V)
    log-softmax: this is the memory cost the extension avoids.
    """
    _validate(logits_NV, targets_N, temperature)
    _check_targets(targets_N, logits_NV.shape[-1])
    z_NV = logits_NV.float() / temperature
    logp_NV = torch.log_softmax(z_NV, dim=-1)
    logprobs_N = logp_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logprobs_N
    p_NV = logp_NV.exp()
    # p log p with p == 0 (masked logits: log p = -inf) is 0; the where keeps both the
    # value and the gradient finite (no 0 * -inf anywhere).
    safe_logp_NV = torch.where(p_NV > 0, logp_NV, torch.zeros_like(logp_NV))
    entropy_N = -(p_NV * safe_logp_NV).sum(dim=-1)
    return logprobs_N, entropy_N


class _GatherLogprobs(torch.autograd.Function):
    """The extension's forward and backward; inputs are (N, V) logits and (N) targets."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, temperature, return_entropy):
        num_rows = logits_NV.shape[0]
        device = logits_NV.device
        logprobs_N = torch.empty(num_rows, dtype=torch.float32, device=device)
        entropy_N = (
            torch.empty(num_rows, dtype=torch.float32, device=device) if return_entropy else None
        )
        # The per-row statistics the backward recomputes the softmax from: the raw max
        # logit and log sum exp((x - max) / T); together the logsumexp
        # (max / T + log_sum), kept apart so that huge logits keep their precision.
        row_max_N = torch.empty(num_rows, dtype=torch.float32, device=device)
        row_log_sum_N = torch.empty(num_rows, dtype=torch.float64, device=device)
        # DLPack cannot export tensors that require grad: pass detached views.
        logits_detached_NV = logits_NV.detach()
        _ext.gather_logprobs(
            logits_detached_NV,
            targets_N,
            temperature,
            logprobs_N,
            entropy_N,
            row_max_N,
            row_log_sum_N,
            _stream(device),
            check_targets=True,  # On CUDA: one wait for the stream, to raise IndexError.
        )
        # Saving the input costs no memory: it is the caller's tensor.
        ctx.save_for_backward(logits_NV, targets_N, row_max_N, row_log_sum_N, entropy_N)
        ctx.temperature = temperature
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        logits_NV, targets_N, row_max_N, row_log_sum_N, entropy_N = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if grad_logprobs_N is not None:
            grad_logprobs_N = grad_logprobs_N.float().contiguous()
        if grad_entropy_N is not None:
            grad_entropy_N = grad_entropy_N.float().contiguous()
        # The one (N, V) buffer of the backward: the gradient autograd needs anyway.
        grad_logits_NV = torch.empty(
            logits_NV.shape, dtype=logits_NV.dtype, device=logits_NV.device
        )
        _ext.gather_logprobs_backward(
            logits_NV.detach(),
            targets_N,
            ctx.temperature,
            row_max_N,
            row_log_sum_N,
            entropy_N if grad_entropy_N is not None else None,
            grad_logprobs_N,
            grad_entropy_N,
            grad_logits_NV,
            _stream(logits_NV.device),
            # The forward checked these ids: the saved tensor is the same, and autograd's
            # version check raises before this point if it was modified in place. Not
            # checking again saves the CUDA path a stream synchronization.
            check_targets=False,
        )
        return grad_logits_NV, None, None, None


def _stream(device: torch.device) -> int:
    # The kernel must run after the work that produced its inputs: use the stream torch
    # is issuing to on that device (0 = default stream; ignored on CPU).
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def _validate(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float) -> None:
    if not isinstance(logits_NV, torch.Tensor):
        raise ValueError(f"logits_NV must be a torch.Tensor, got {type(logits_NV).__name__}")
    if not isinstance(targets_N, torch.Tensor):
        raise ValueError(f"targets_N must be a torch.Tensor, got {type(targets_N).__name__}")
    if logits_NV.dim() not in (2, 3):
        raise ValueError(
            f"logits_NV must be (N, V) or (B, S, V), got shape {tuple(logits_NV.shape)}"
        )
    if tuple(targets_N.shape) != tuple(logits_NV.shape[:-1]):
        raise ValueError(
            f"targets_N must have shape {tuple(logits_NV.shape[:-1])} (the logits' shape "
            f"without the vocab dim), got {tuple(targets_N.shape)}"
        )
    if logits_NV.shape[-1] == 0 and targets_N.numel() > 0:
        raise ValueError("logits_NV has an empty vocab dim: no target id can be valid")
    if logits_NV.dtype not in LOGITS_DTYPES:
        raise ValueError(
            f"logits_NV must be float32 or bfloat16, got {logits_NV.dtype}; convert with .float()"
        )
    if targets_N.dtype != torch.int64:
        raise ValueError(f"targets_N must be int64, got {targets_N.dtype}; convert with .long()")
    if targets_N.device != logits_NV.device:
        raise ValueError(
            f"targets_N is on {targets_N.device} but logits_NV on {logits_NV.device}; "
            "move them to the same device"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")


def _check_targets(targets_N: torch.Tensor, vocab_size: int) -> None:
    """Raises IndexError naming the first out-of-range id (row in the flattened view)."""
    flat_N = targets_N.reshape(-1)
    bad_N = (flat_N < 0) | (flat_N >= vocab_size)
    if not bool(bad_N.any()):
        return
    row = int(bad_N.nonzero()[0])
    # Same wording as the C++ core, so both paths read alike.
    raise IndexError(
        f"gather_logprobs: target id {int(flat_N[row])} at row {row} is out of range "
        f"[0, {vocab_size})"
    )
