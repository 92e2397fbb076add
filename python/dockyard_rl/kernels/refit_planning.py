"""Refit layout: which bucket and byte offset every named tensor gets (``Manifest`` of a sync).

Covered here:

- ``describe_tensors(named_tensors)``: ``name -> (shape, dtype)`` of live tensors.
- ``plan_buckets(named_shapes_dtypes, bucket_size_bytes, alignment)``: the layout, as a validated
  ``Manifest``. Placement (the same rules as cc/refit_packer.h, which has the full text): tensors
  in the mapping's order; a new bucket starts when the next tensor does not fit in the current
  one; a tensor larger than a bucket gets a bucket of its own; every offset and every bucket size
  is a multiple of ``alignment``. The C++ planner (``_dockyard_kernels.refit_plan_buckets``) runs
  when the extension is importable, else the same placement in Python; both give identical
  manifests.

Planning needs only names, shapes and dtypes (e.g. a policy's ``prepare_refit_info()``), never
tensor memory, so a receiver can plan too. Not covered: the manifest's data model and validation
(refit_manifest.py) and copying (refit_copy.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels.refit_manifest import (
    _DTYPE_NAMES,
    DEFAULT_ALIGNMENT,
    DTYPES,
    Manifest,
    TensorEntry,
    _check_alignment,
    _itemsize,
    _numel,
)
from dockyard_rl.utils.config import is_int

# The extension this module calls (None outside the build); tests replace it.
_ext = _extension.EXTENSION

__all__ = ["describe_tensors", "plan_buckets"]


def describe_tensors(
    named_tensors: Mapping[str, torch.Tensor],
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``name -> (shape, dtype)`` of ``named_tensors``, in order: ``plan_buckets``'s input."""
    return {name: (tuple(t.shape), t.dtype) for name, t in named_tensors.items()}


def plan_buckets(
    named_shapes_dtypes: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
    bucket_size_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
    *,
    use_extension: bool | None = None,
) -> Manifest:
    """Places the tensors, in the mapping's order, into buckets (rules in the module docstring).

    Args:
        named_shapes_dtypes: ``name -> (shape, dtype)``, e.g. ``describe_tensors(state_dict)`` or
            a policy's ``prepare_refit_info()``; dtype as a torch dtype or a ``DTYPES`` name.
        bucket_size_bytes: the largest bucket (except one holding a single larger tensor); a
            positive multiple of ``alignment``.
        alignment: byte alignment of every offset; a power of two in [16, 2**30].
        use_extension: None = the C++ planner when importable, else Python (same result);
            True = the C++ planner or RuntimeError; False = Python.

    Raises:
        ValueError: a bad bucket size, alignment, name, shape or dtype.
        RuntimeError: ``use_extension=True`` without the extension.
    """
    if not isinstance(named_shapes_dtypes, Mapping):
        raise ValueError(
            "named_shapes_dtypes must be a mapping name -> (shape, dtype), got "
            f"{type(named_shapes_dtypes).__name__}"
        )
    _check_alignment(alignment, "plan_buckets")
    if not is_int(bucket_size_bytes) or bucket_size_bytes <= 0 or bucket_size_bytes % alignment:
        raise ValueError(
            "plan_buckets: bucket_size_bytes must be a positive multiple of the alignment "
            f"({alignment}), got {bucket_size_bytes!r}; round it up to a multiple of {alignment}"
        )
    names, shapes, dtype_names, sizes = [], [], [], []
    for name, spec in named_shapes_dtypes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(f"tensor {name!r}: expected (shape, dtype), got {spec!r}")
        shape, dtype = spec
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        if not isinstance(shape, (tuple, list)) or not all(is_int(s) and s >= 0 for s in shape):
            raise ValueError(
                f"tensor {name!r}: shape must be a sequence of ints >= 0, got {shape!r}"
            )
        dtype_name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype)
        if dtype_name not in DTYPES:
            raise ValueError(
                f"tensor {name!r}: unsupported dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}"
            )
        names.append(name)
        shapes.append(tuple(shape))
        dtype_names.append(dtype_name)
        sizes.append(_numel(shape) * _itemsize(DTYPES[dtype_name]))

    # Planning runs on the host whatever device the tensors will live on.
    what = "plan_buckets(use_extension=True)"
    if _extension.resolve_use_extension(use_extension, torch.device("cpu"), what, _ext):
        bucket_of, offset_of, bucket_sizes = _ext.refit_plan_buckets(
            sizes, bucket_size_bytes, alignment
        )
    else:
        bucket_of, offset_of, bucket_sizes = _plan_python(sizes, bucket_size_bytes, alignment)
    entries = tuple(
        TensorEntry(name=n, dtype=d, shape=s, bucket=b, offset=o, nbytes=nb)
        for n, d, s, b, o, nb in zip(names, dtype_names, shapes, bucket_of, offset_of, sizes)
    )
    return Manifest(tensors=entries, bucket_sizes=tuple(bucket_sizes), alignment=alignment)


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _plan_python(
    sizes: Sequence[int], bucket_size_bytes: int, alignment: int
) -> tuple[list[int], list[int], list[int]]:
    """The C++ planner (cc/refit_packer.cc: plan_buckets) in Python: same placements."""
    bucket_of, offset_of, bucket_sizes = [], [], []
    end = 0  # The current bucket's end, without tail padding.
    for nbytes in sizes:
        if not bucket_sizes:
            bucket_sizes.append(0)
        offset = _align_up(end, alignment)
        if nbytes > 0 and offset + nbytes > bucket_size_bytes and end > 0:
            bucket_sizes[-1] = offset  # Close the bucket at its aligned end.
            bucket_sizes.append(0)
            offset = end = 0
        bucket_of.append(len(bucket_sizes) - 1)
        offset_of.append(offset)
        end = max(end, offset + nbytes)
    if bucket_sizes:
        bucket_sizes[-1] = _align_up(end, alignment)
    return bucket_of, offset_of, bucket_sizes
