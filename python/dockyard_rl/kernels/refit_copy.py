"""Refit copies: one bucket's named tensors -> its bytes, validated, and the receiver's views.

Covered here:

- ``PackPlan``, the sender's packer: built once per manifest, then ``pack_bucket`` per step and
  bucket, given that bucket's tensors. Every sender packs this way, because its tensors exist
  one bucket at a time: the DTensor policy all-gathers each bucket's shards, the jax policy and
  the driver's object-store path stream the weights in manifest order. Each call validates the
  bucket's tensors against the manifest, then makes one copy.
- ``pack``: every bucket of a manifest from one ``name -> tensor`` mapping, through a
  ``PackPlan`` (one-off copies: benchmarks and tests).
- ``bucket_views``, the receiver's side: a received bucket's tensors as typed views into it, no
  copy (vLLM's loader reads them and copies into its own layout).

The copy, after every check: with the extension (built for the tensors' device), ONE call of
``_dockyard_kernels.refit_pack_bucket`` per bucket (multi-threaded strided byte copies on CPU,
one kernel launch on CUDA queued on torch's current stream); without it, the torch loop
(``copy_`` through typed views of the bucket, padding zeroed). Both give identical bytes. Every
check comes before the first byte is written: the bucket index, the tensors (exactly the
bucket's names, each with the manifest's shape and dtype, all on one device: ``_validated``),
``out`` (``_checked_bucket``), and no tensor sharing a byte with ``out`` (``_sharing_memory``,
exact byte ranges, so that the message names the tensor).

Not covered: the manifest (refit_manifest.py), the layout (refit_planning.py), the transport
(python/dockyard_rl/weight_sync/); copying buckets back into existing tensors (no receiver does:
vLLM reloads from the views).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels.refit_manifest import (
    MIN_ALIGNMENT,
    Manifest,
    TensorEntry,
    _check_bucket_index,
    _dtype_name,
)

# The extension this module calls (None outside the build); tests replace it.
_ext = _extension.EXTENSION

# The extension copies bytes, so each tensor travels as a same-size integer view (DLPack exports
# these whatever the original dtype; bfloat16, bool and float8 are not portable across versions).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

__all__ = ["PackPlan", "bucket_views", "pack"]


class PackPlan:
    """Packs a manifest's buckets, one call per bucket, from that bucket's tensors.

    The sender's path (weight refit packs after every optimizer step)::

        plan = PackPlan(manifest)                                  # once
        for b in range(manifest.num_buckets):                      # every step
            named_b = gather(manifest.bucket_entries(b))           # name -> full tensor
            send(plan.pack_bucket(named_b, b, out=buffers[b % 2]))

    The plan holds the manifest and, per bucket once first used, its entries and offsets; it
    holds no tensors, so a tensor may be freed as soon as its bucket is packed (on CUDA only if
    it was allocated on torch's current stream: the copy is queued there, not waited for).

    Args:
        manifest: from ``plan_buckets`` (sender) or ``Manifest.from_dict``.
        use_extension: None = the extension when it supports the tensors' device, else torch;
            True = the extension or RuntimeError; False = torch (same bytes, per-tensor
            ``copy_``).

    Raises:
        ValueError: ``manifest`` is not a Manifest. RuntimeError: ``use_extension=True`` without
            the extension.
    """

    def __init__(self, manifest: Manifest, *, use_extension: bool | None = None) -> None:
        _check_manifest(manifest, "PackPlan")
        if use_extension:
            _extension.require_extension("PackPlan(use_extension=True)", _ext)
        self.manifest = manifest
        self.use_extension = use_extension
        # Per bucket, filled when first packed (a sender's first step fills them all).
        self._buckets: list[_BucketInfo | None] = [None] * manifest.num_buckets

    def pack_bucket(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        bucket_index: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packs bucket ``bucket_index`` from that bucket's tensors and returns the bucket.

        Args:
            named_tensors: exactly the names of ``manifest.bucket_entries(bucket_index)``, with
                their shapes and dtypes, on one device (``out``'s when given); any strides.
            bucket_index: the bucket to pack.
            out: a 1-D contiguous ``uint8`` tensor of at least the bucket's size, 16-byte
                aligned, sharing no byte with a tensor; the result is ``out[:size]`` and the
                bytes past it are left alone. None = a new tensor on the tensors' device.

        Returns:
            The bucket: 1-D ``uint8`` of ``manifest.bucket_sizes[bucket_index]`` bytes, padding
            zeroed.

        Raises:
            ValueError: a bad bucket index; a missing name, a name of another bucket or of no
                bucket, a shape, dtype or device mismatch (each naming the tensor); a bad ``out``
                or a tensor sharing memory with it. All before anything is written.
        """
        where = "PackPlan"
        _check_bucket_index(self.manifest, bucket_index)
        info = self._bucket(bucket_index)
        device, whose = None, None
        if isinstance(out, torch.Tensor):
            device, whose = out.device, "out's"
        tensors, device = _validated(
            named_tensors, info.entries, device, whose, where, self.manifest, bucket_index
        )
        size = self.manifest.bucket_sizes[bucket_index]
        if out is None:
            bucket = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            label = f"{where}.pack_bucket: out"
            bucket = _checked_bucket(out, bucket_index, size, device, label, exact=False)
            name = _sharing_memory(tensors, info.entries, bucket)
            if name is not None:
                raise ValueError(
                    f"{where}: tensor {name!r} shares memory with bucket {bucket_index}"
                )
        self._copy(bucket, bucket_index, tensors, device, where)
        return bucket

    def _bucket(self, bucket_index: int) -> _BucketInfo:
        info = self._buckets[bucket_index]
        if info is None:
            info = self._buckets[bucket_index] = _BucketInfo(self.manifest, bucket_index)
        return info

    def _copy(
        self,
        bucket: torch.Tensor,
        bucket_index: int,
        tensors: Sequence[torch.Tensor],
        device: torch.device,
        where: str,
    ) -> None:
        """THE copy of bucket ``bucket_index``'s validated ``tensors`` (manifest order, on
        ``device``) into ``bucket`` (checked, exactly the bucket's size, sharing no memory)."""
        info = self._bucket(bucket_index)
        if _resolve_extension(self.use_extension, device, where):
            views = [_same_size_int_view(t) for t in tensors]
            # num_threads 0: the extension picks the number of CPU copy workers.
            _ext.refit_pack_bucket(bucket, views, info.offsets, 0, _stream_of(device))
            return
        with torch.no_grad():  # Sources may be parameters that require grad.
            covered = 0
            for i in info.by_offset:
                e = info.entries[i]
                if e.nbytes == 0:
                    continue
                bucket[covered : e.offset].zero_()  # Padding: never ship stale memory.
                _typed_view(bucket, e).copy_(tensors[i])
                covered = e.offset + e.nbytes
            bucket[covered:].zero_()


def pack(
    named_tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    *,
    use_extension: bool | None = None,
) -> list[torch.Tensor]:
    """Packs every tensor of the manifest into new ``uint8`` buckets (one list entry per bucket).

    ``named_tensors`` must hold exactly the manifest's names, with its shapes and dtypes, all on
    one device (the buckets' device). Raises ValueError naming the first mismatch in manifest
    order, before packing. ``use_extension`` as for ``PackPlan``; each bucket is one copy as in
    ``PackPlan.pack_bucket``.
    """
    _check_manifest(manifest, "pack")
    if use_extension:
        _extension.require_extension("pack(use_extension=True)", _ext)
    plan = PackPlan(manifest, use_extension=use_extension)
    tensors, device = _validated(named_tensors, manifest.tensors, None, None, "pack", manifest)
    buckets = []
    for b, members in enumerate(manifest.bucket_members):
        bucket = torch.empty(manifest.bucket_sizes[b], dtype=torch.uint8, device=device)
        plan._copy(bucket, b, [tensors[i] for i in members], device, "pack")
        buckets.append(bucket)
    return buckets


def bucket_views(
    bucket: torch.Tensor, manifest: Manifest, bucket_index: int
) -> dict[str, torch.Tensor]:
    """The tensors of bucket ``bucket_index``, ``name -> tensor`` in manifest order, as views
    into ``bucket`` (no copy; valid while the bucket is, and changed when it is).

    Raises ValueError when the manifest or index is bad or the bucket does not match the
    manifest (not a 1-D contiguous ``uint8`` tensor of exactly the bucket's size, or not 16-byte
    aligned, which typed views need).
    """
    _check_manifest(manifest, "bucket_views")
    _check_bucket_index(manifest, bucket_index)
    size = manifest.bucket_sizes[bucket_index]
    where = f"bucket_views: bucket {bucket_index}"
    checked = _checked_bucket(bucket, bucket_index, size, None, where, exact=True)
    return {e.name: _typed_view(checked, e) for e in manifest.bucket_entries(bucket_index)}


# --- Helpers -------------------------------------------------------------------------------------


class _BucketInfo:
    """One bucket's entries (manifest order), their offsets (the native call's argument) and the
    order of their offsets (the torch loop zeroes the gaps between them)."""

    __slots__ = ("by_offset", "entries", "offsets")

    def __init__(self, manifest: Manifest, bucket_index: int) -> None:
        self.entries = manifest.bucket_entries(bucket_index)
        self.offsets = [e.offset for e in self.entries]
        self.by_offset = sorted(range(len(self.entries)), key=self.offsets.__getitem__)


def _validated(
    named: Any,
    entries: Sequence[TensorEntry],
    device: torch.device | None,
    whose: str | None,
    where: str,
    manifest: Manifest,
    bucket_index: int | None = None,
) -> tuple[list[torch.Tensor], torch.device]:
    """``named``'s tensors for ``entries`` (in their order), and their common device.

    The one validation of tensors: each entry's name present with the entry's shape and dtype,
    no name beyond ``entries``, all on ``device`` (``whose`` says whose it is; None = the first
    tensor's; CPU without tensors). ``bucket_index``: ``entries`` are that bucket's (the message
    for a name of another bucket says so).
    """
    if not isinstance(named, Mapping):
        raise ValueError(f"{where}: expected a mapping name -> tensor, got {type(named).__name__}")
    tensors = [_get_matching(named, e, where) for e in entries]
    if len(named) != len(entries):  # Every entry's name is there: which are extra?
        _raise_extra(named, entries, where, manifest, bucket_index)
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
        whose = f"tensor {entries[0].name!r}'s" if entries else None
    for e, t in zip(entries, tensors):
        if t.device != device:
            raise ValueError(
                f"{where}: tensor {e.name!r}: expected device {device} ({whose}), got {t.device}"
            )
    return tensors, device


def _raise_extra(
    named: Mapping[str, Any],
    entries: Sequence[TensorEntry],
    where: str,
    manifest: Manifest,
    bucket_index: int | None,
) -> None:
    wanted = {e.name for e in entries}
    extra = [name for name in named if name not in wanted]
    name = extra[0]
    bucket_of = {e.name: e.bucket for e in manifest.tensors}
    if bucket_index is None or name not in bucket_of:
        raise ValueError(
            f"{where}: tensor {name!r} is not in the manifest ({len(extra)} such); plan the "
            "manifest from the same tensors"
        )
    raise ValueError(
        f"{where}: tensor {name!r} belongs to bucket {bucket_of[name]}, not bucket "
        f"{bucket_index} ({len(extra)} names beyond the bucket's); pass exactly the bucket's "
        "tensors (manifest.bucket_entries(b))"
    )


def _get_matching(named: Mapping[str, Any], entry: TensorEntry, where: str) -> torch.Tensor:
    """``named[entry.name]`` after checking that it matches the entry's shape and dtype."""
    if entry.name not in named:
        raise ValueError(f"{where}: tensor {entry.name!r} of the manifest is missing")
    t = named[entry.name]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: tensor {entry.name!r} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != entry.shape:
        raise ValueError(
            f"{where}: tensor {entry.name!r}: expected shape {entry.shape}, got {tuple(t.shape)}"
        )
    if t.dtype != entry.torch_dtype:
        raise ValueError(
            f"{where}: tensor {entry.name!r}: expected dtype {entry.dtype}, "
            f"got {_dtype_name(t.dtype)}"
        )
    return t


def _checked_bucket(
    bucket: Any,
    bucket_index: int,
    size: int,
    device: torch.device | None,
    where: str,
    *,
    exact: bool,
) -> torch.Tensor:
    """``bucket`` checked for bucket ``bucket_index``: exactly ``size`` bytes, or with ``exact``
    False at least that many (the result is then its first ``size`` bytes); on ``device`` (None =
    any)."""
    if (  # The common case in a few attribute reads; the checks below word the errors.
        isinstance(bucket, torch.Tensor)
        and bucket.dtype is torch.uint8
        and bucket.dim() == 1
        and bucket.is_contiguous()
        and (device is None or bucket.device == device)
        and (bucket.numel() == size or (not exact and bucket.numel() > size))
        and (bucket.data_ptr() % MIN_ALIGNMENT == 0 or bucket.numel() == 0)
    ):
        return bucket if bucket.numel() == size else bucket[:size]
    if not isinstance(bucket, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(bucket).__name__}")
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(
            f"{where} must be a 1-D contiguous uint8 tensor, got {_dtype_name(bucket.dtype)} "
            f"of shape {tuple(bucket.shape)}"
        )
    if exact and bucket.numel() != size:
        raise ValueError(f"{where}: expected {size} bytes (the manifest's), got {bucket.numel()}")
    if bucket.numel() < size:
        raise ValueError(
            f"{where} has {bucket.numel()} bytes but bucket {bucket_index} needs {size}"
        )
    # Typed views of the bucket (and CUDA's 16-byte loads) need aligned bucket memory; every
    # allocation is, a slice at an odd offset is not.
    if bucket.numel() > 0 and bucket.data_ptr() % MIN_ALIGNMENT:
        raise ValueError(
            f"{where} must start at a {MIN_ALIGNMENT}-byte aligned address; pass a fresh "
            "allocation, not a slice at an odd offset"
        )
    if device is not None and bucket.device != device:
        raise ValueError(f"{where} is on {bucket.device} but the tensors on {device}")
    return bucket if bucket.numel() == size else bucket[:size]


def _sharing_memory(
    tensors: Sequence[torch.Tensor], entries: Sequence[TensorEntry], bucket: torch.Tensor
) -> str | None:
    """The name of a tensor with a byte inside ``bucket``, else None.

    Exact byte ranges (a tensor elsewhere in the same storage is fine), the check the C++ core
    makes too (cc/refit_packer.cc), here so that the message names the tensor.
    """
    start = bucket.data_ptr()
    end = start + bucket.numel()
    if start == end:
        return None
    for e, t in zip(entries, tensors):
        if e.nbytes == 0:
            continue
        nbytes = t.nbytes
        if not t.is_contiguous():  # Strides are never negative in torch.
            last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            nbytes = (last + 1) * t.element_size()
        first = t.data_ptr()
        if first < end and start < first + nbytes:
            return e.name
    return None


def _check_manifest(manifest: Any, where: str) -> None:
    if not isinstance(manifest, Manifest):
        raise ValueError(f"{where}: manifest must be a Manifest, got {type(manifest).__name__}")


def _typed_view(bucket: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The entry's bytes of ``bucket`` as a tensor of its dtype and shape (no copy)."""
    raw = bucket[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.torch_dtype).view(entry.shape)


def _same_size_int_view(t: torch.Tensor) -> torch.Tensor:
    # detach: DLPack refuses tensors that require grad; the memory is the same.
    return t.detach().view(_SAME_SIZE_INT[t.element_size()])


def _stream_of(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def _resolve_extension(use_extension: bool | None, device: torch.device, where: str) -> bool:
    """Whether to call the extension for tensors on ``device`` (None = when it supports it)."""
    supported = _extension.supports_device(_ext, device)
    if use_extension is None:
        return supported
    if use_extension and not supported:
        if _ext is None:
            reason = _extension.missing_reason()
        else:
            reason = f"_dockyard_kernels does not support {device.type} tensors in this build"
        raise RuntimeError(
            f"{where}(use_extension=True): {reason}; build it with Bazel (--config=cuda for CUDA) "
            "or pass use_extension=None to fall back to torch"
        )
    return bool(use_extension)
