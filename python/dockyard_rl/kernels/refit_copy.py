"""Refit copies: named tensors <-> a manifest's byte buckets, validated, in one copy path.

Covered here:

- ``PackPlan`` (sender) and ``UnpackPlan`` (receiver). Built from the tensors (the refit hot
  path: everything validated once, then one native call per step) or from the manifest alone
  (``from_manifest``: the tensors come one bucket at a time, ``PackPlan.pack_bucket_from`` /
  ``UnpackPlan.unpack_bucket_to``, each call validating that bucket's tensors).
- The functional API (``pack``, ``iter_pack``, ``pack_bucket``, ``unpack``, ``unpack_bucket``,
  ``unpack_into``, ``unpack_bucket_into``): thin wrappers that build a plan for one call and run
  it, so every copy goes through the same checks and the same copy code.

ONE copy implementation, ``_CopyPlan._run``, behind every call: after the checks it makes

1. one call of the plan's native ``RefitCopyPlan`` (a plan built from its tensors, with the
   extension: prepared once, then only the buckets' addresses cross into C++; ONE kernel launch
   on CUDA for all buckets), or
2. one native call per bucket with the tensors converted for that call
   (``_dockyard_kernels.refit_pack_bucket`` / ``refit_unpack_bucket``): plans for one call and
   per-bucket tensors. They do not prepare a ``RefitCopyPlan`` because on CUDA preparing one
   uploads its descriptors synchronously and dropping it waits for the GPU, which would make a
   one-off copy synchronous; or
3. without the extension (or for a device it was not built for), the torch loop: ``copy_``
   through typed views of the bucket, padding zeroed.

All three give identical bytes. Every check comes before the first byte is written: names,
shapes, dtypes and devices (``_validated``, the one validation of tensors), bucket tensors
(``_checked_bucket``), and no tensor sharing memory with a bucket (``_MemoryRanges``, exact byte
ranges, the C++ plan's own check in Python, so that the message names the tensor).

Not covered: the manifest (refit_manifest.py), the layout (refit_planning.py), the transport
(python/dockyard_rl/weight_sync/). Destinations that share memory with each other (tied weights
under two names) are not detected and receive the bytes of one of them.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self, TypeVar

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels.refit_manifest import (
    MIN_ALIGNMENT,
    Manifest,
    TensorEntry,
    _check_bucket_index,
    _dtype_name,
)
from dockyard_rl.utils.config import is_int

# The extension this module calls (None outside the build); tests replace it.
_ext = _extension.EXTENSION

# Same bound as the C++ core (cc/refit_packer.h: kMaxThreads).
MAX_THREADS = 1024
ON_REALLOCATION = ("rebuild", "error")

# The extension copies bytes, so each tensor travels as a same-size integer view (DLPack exports
# these whatever the original dtype; bfloat16, bool and float8 are not portable across versions).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_DATA_PTR = torch.Tensor.data_ptr  # Mapped over the tensors: cheaper than a comprehension.

__all__ = [
    "MAX_THREADS",
    "ON_REALLOCATION",
    "PackPlan",
    "UnpackPlan",
    "iter_pack",
    "pack",
    "pack_bucket",
    "unpack",
    "unpack_bucket",
    "unpack_bucket_into",
    "unpack_into",
]


# --- Plans ---------------------------------------------------------------------------------------


class _CopyPlan:
    """What ``PackPlan`` and ``UnpackPlan`` share: validation, the tensors, the one copy path.

    A plan built from tensors keeps, in manifest order, the tensor OBJECTS it was given (so a
    ``Parameter`` whose values change in place, as an optimizer step does, is packed with its new
    values) and a view of each, which keeps the memory the plan copies from or to alive: while the
    plan holds it, the allocator cannot hand that address to another tensor, so a tensor that is
    re-allocated (``p.data = ...``, ``model.to(...)``, a resized storage) always shows a new
    ``data_ptr()``, and one list comparison per call detects it exactly.

    A plan built by ``from_manifest`` holds no tensors; each call brings one bucket's.
    """

    _unpack = False
    _role = "tensor"  # What the named tensors are called in messages.

    def __init__(
        self,
        manifest: Manifest,
        named: Mapping[str, torch.Tensor] | None,
        *,
        where: str,
        device: torch.device | str | None = None,
        use_extension: bool | None = None,
        num_threads: int = 0,
        on_reallocation: str = "rebuild",
        one_call: bool = False,
    ) -> None:
        # where: starts every message ("PackPlan", or the functional call's name). one_call: the
        # plan serves one call of the functional API (no native plan; see the module docstring).
        self._where = where
        self._one_call = one_call
        _check_manifest(manifest, where)
        _check_num_threads(num_threads)
        if on_reallocation not in ON_REALLOCATION:
            raise ValueError(
                f"{where}: on_reallocation must be one of {ON_REALLOCATION}, got "
                f"{on_reallocation!r}"
            )
        self.manifest = manifest
        self.on_reallocation = on_reallocation
        self.num_threads = num_threads
        self.num_rebuilds = 0
        self._use_extension = use_extension
        self._requested_device = None
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:  # Tensors report an index.
                device = torch.device("cuda", torch.cuda.current_device())
            self._requested_device = device
        # Per bucket, filled when first used (a functional call touches one bucket of many).
        self._buckets: list[_BucketInfo | None] = [None] * manifest.num_buckets
        self._native = None
        if named is None:  # from_manifest: the device (None = each call's) and no tensors.
            self._tensors: list[torch.Tensor] | None = None
            self.device = self._requested_device
            if self.device is None:
                self.uses_extension = None
                if use_extension:
                    _extension.require_extension(f"{where}(use_extension=True)", _ext)
            else:
                self.uses_extension = _resolve_extension(use_extension, self.device, where)
            return
        self._tensors, self.device = self._validated(
            named, manifest.tensors, self._requested_device, exact=not self._unpack
        )
        self.uses_extension = _resolve_extension(use_extension, self.device, where)
        self._build()

    @classmethod
    def from_manifest(
        cls,
        manifest: Manifest,
        *,
        device: torch.device | str | None = None,
        use_extension: bool | None = None,
        num_threads: int = 0,
    ) -> Self:
        """A plan that holds no tensors: each call passes one bucket's (see the subclasses).

        Args:
            manifest: from ``plan_buckets`` (sender) or ``Manifest.from_dict`` (receiver).
            device: where every call's tensors and buckets live; None = each call's own (``out``'s
                or the bucket's when given, else the tensors'; CPU for a bucket without tensors).
            use_extension: None = the extension when it supports the device, else torch; True =
                the extension or RuntimeError; False = torch.
            num_threads: CPU copy workers for the extension, 0 = automatic.

        Raises:
            ValueError: a bad argument. RuntimeError: ``use_extension=True`` without the extension.
        """
        return cls._create(
            manifest,
            None,
            cls.__name__,
            device=device,
            use_extension=use_extension,
            num_threads=num_threads,
        )

    @classmethod
    def _create(
        cls, manifest: Manifest, named: Mapping[str, torch.Tensor] | None, where: str, **kwargs: Any
    ) -> Self:
        """A plan built past the subclass's ``__init__`` (whose signature requires tensors)."""
        plan = cls.__new__(cls)
        _CopyPlan.__init__(plan, manifest, named, where=where, **kwargs)
        return plan

    # -- Validation -------------------------------------------------------------------------------

    def _bucket(self, bucket_index: int) -> _BucketInfo:
        info = self._buckets[bucket_index]
        if info is None:
            info = self._buckets[bucket_index] = _BucketInfo(self.manifest, bucket_index)
        return info

    def _label(self, method: str) -> str:
        """Message prefix for ``method``: "PackPlan.pack", or the functional call's name."""
        return self._where if self._one_call else f"{self._where}.{method}"

    def _validated(
        self,
        named: Any,
        entries: Sequence[TensorEntry],
        device: torch.device | None,
        *,
        exact: bool,
        bucket_index: int | None = None,
    ) -> tuple[list[torch.Tensor], torch.device]:
        """``named``'s tensors for ``entries`` (in their order), and their common device.

        The one validation of tensors: each entry's name present with the entry's shape and
        dtype, all on ``device`` (None = the first tensor's; CPU without tensors); destinations
        whose elements share memory rejected; with ``exact``, no name beyond ``entries``.
        """
        where, role = self._where, self._role
        if not isinstance(named, Mapping):
            raise ValueError(
                f"{where}: expected a mapping name -> tensor, got {type(named).__name__}"
            )
        tensors = [_get_matching(named, e, where, role) for e in entries]
        if exact and len(named) != len(entries):  # Every entry's name is there: which are extra?
            self._raise_extra(named, entries, bucket_index)
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        for e, t in zip(entries, tensors):
            if t.device != device:
                whose = "the buckets'" if self._one_call else "the plan's"
                raise ValueError(
                    f"{where}: {role} {e.name!r}: expected device {device} ({whose}), "
                    f"got {t.device}"
                )
            if self._unpack and e.nbytes > 0 and _overlaps_itself(t):
                raise ValueError(
                    f"{where}: {role} {e.name!r} has elements that share memory (strides "
                    f"{tuple(t.stride())}, e.g. from expand()); pass a tensor that owns its "
                    "elements"
                )
        return tensors, device

    def _raise_extra(
        self, named: Mapping[str, Any], entries: Sequence[TensorEntry], bucket_index: int | None
    ) -> None:
        wanted = {e.name for e in entries}
        extra = [name for name in named if name not in wanted]
        name = extra[0]
        bucket_of = {e.name: e.bucket for e in self.manifest.tensors}
        if bucket_index is None or name not in bucket_of:
            raise ValueError(
                f"{self._where}: {self._role} {name!r} is not in the manifest ({len(extra)} such); "
                "plan the manifest from the same tensors"
            )
        owner = bucket_of[name]
        raise ValueError(
            f"{self._where}: {self._role} {name!r} belongs to bucket {owner}, not bucket "
            f"{bucket_index} ({len(extra)} names beyond the bucket's); pass exactly the bucket's "
            "tensors (manifest.bucket_entries(b))"
        )

    # -- Tensors the plan holds -------------------------------------------------------------------

    def _build(self) -> None:
        entries = self.manifest.tensors
        self._memory = None  # Built when a bucket is first checked against the tensors.
        self._native = None
        if self._one_call:  # Nothing to keep alive or to track: only what the copy needs.
            self._views = (
                list(map(_same_size_int_view, self._tensors)) if self.uses_extension else []
            )
            return
        # Views keep the memory alive (see the class docstring); detach: DLPack refuses tensors
        # that require grad, and the plan never records autograd history.
        self._views = [_same_size_int_view(t) for t in self._tensors]
        self._data_ptrs = list(map(_DATA_PTR, self._tensors))
        if self.uses_extension:
            self._native = _ext.RefitCopyPlan(
                self._views,
                [e.bucket for e in entries],
                [e.offset for e in entries],
                list(self.manifest.bucket_sizes),
                self._unpack,
                _cuda_index(self.device),
            )

    def rebuild(self, named: Mapping[str, torch.Tensor] | None = None) -> None:
        """Re-validates and re-plans, from ``named`` or the tensor objects the plan holds.

        Needed only with ``on_reallocation="error"`` (else calls rebuild by themselves) or after
        changing a tensor's strides in place at the same address (``as_strided_``, ``set_``), the
        one change the per-call check cannot see. A ``from_manifest`` plan given ``named`` holds
        those tensors from then on.
        """
        if named is None:
            if self._tensors is None:
                raise ValueError(f"{self._where}.rebuild: {self._holds_nothing()}")
            named = dict(zip(self.manifest.names, self._tensors))
        self._tensors, device = self._validated(
            named, self.manifest.tensors, self._requested_device, exact=not self._unpack
        )
        if device != self.device:  # Only when no device was requested: the tensors moved.
            self.device = device
            # As at construction for a from_manifest plan; else keep the torch path, or pick the
            # extension again if it supports the new device.
            request = (
                self._use_extension
                if self.uses_extension is None
                else (None if self.uses_extension else False)
            )
            self.uses_extension = _resolve_extension(request, device, self._where)
        self._build()
        self.num_rebuilds += 1

    def _holds_nothing(self) -> str:
        method = "unpack_bucket_to" if self._unpack else "pack_bucket_from"
        return (
            f"this plan was built by from_manifest and holds no {self._role}s; pass each bucket's "
            f"to {method}(), or build the plan from the {self._role}s"
        )

    def _refresh(self, named: Mapping[str, torch.Tensor] | None) -> None:
        """The per-call check: are the held tensors still where the plan copies them?"""
        if self._tensors is None:
            raise ValueError(f"{self._where}: {self._holds_nothing()}")
        if self._one_call:  # Validated just now.
            return
        if named is not None:
            if not isinstance(named, Mapping):
                raise ValueError(
                    f"{self._where}: expected a mapping name -> tensor, got {type(named).__name__}"
                )
            try:
                current = [named[name] for name in self.manifest.names]
            except KeyError as e:
                raise ValueError(
                    f"{self._where}: {self._role} {e.args[0]!r} of the manifest is missing"
                ) from None
            if not all(map(operator.is_, current, self._tensors)):
                # Other objects (e.g. a fresh state_dict()): full checks, then keep the plan if
                # they describe the same memory the same way.
                tensors, device = self._validated(
                    named, self.manifest.tensors, self._requested_device, exact=not self._unpack
                )
                same = device == self.device and all(
                    t.data_ptr() == p and t.stride() == v.stride()
                    for t, p, v in zip(tensors, self._data_ptrs, self._views)
                )
                if not same:
                    self._reallocated(named, tensors)
                    return
                self._tensors = tensors
        # One pass over 272 tensors costs ~15 us; anything cheaper would need allocator hooks.
        if list(map(_DATA_PTR, self._tensors)) != self._data_ptrs:
            self._reallocated(None, self._tensors)

    def _reallocated(
        self, named: Mapping[str, torch.Tensor] | None, tensors: list[torch.Tensor]
    ) -> None:
        if self.on_reallocation == "error":
            names = [
                e.name
                for e, t, p in zip(self.manifest.tensors, tensors, self._data_ptrs)
                if t.data_ptr() != p
            ]
            what = f"{names[0]!r} ({len(names)} such)" if names else "a tensor's layout"
            raise ValueError(
                f"{self._where}: {what} was re-allocated or replaced since the plan was built; "
                "call plan.rebuild() (or build the plan with on_reallocation='rebuild')"
            )
        self.rebuild(named)

    # -- The copy ---------------------------------------------------------------------------------

    def _run(
        self,
        buckets: Sequence[torch.Tensor],
        first_bucket: int,
        given: list[torch.Tensor] | None = None,
        device: torch.device | None = None,
        *,
        fresh: bool = False,
    ) -> None:
        """THE copy between buckets ``first_bucket, ...`` and their tensors.

        ``buckets``: already checked (``_checked_bucket``), exactly their sizes. ``given``: None =
        the tensors the plan holds; else ONE bucket's tensors in manifest order, validated, on
        ``device``. Raises ValueError, before writing anything, when a tensor shares memory with
        a bucket; ``fresh``: the caller allocated the buckets or the tensors just now, so they
        cannot share memory and the check is skipped.
        """
        addresses = [b.data_ptr() for b in buckets]
        if not fresh:
            if given is not None:
                memory = _MemoryRanges(given, [e.name for e in self._bucket(first_bucket).entries])
            else:
                if self._memory is None:
                    self._memory = _MemoryRanges(self._tensors, self.manifest.names)
                memory = self._memory
            for k, (bucket, address) in enumerate(zip(buckets, addresses)):
                name = memory.overlapping(address, bucket.numel())
                if name is not None:
                    raise ValueError(
                        f"{self._where}: {self._role} {name!r} shares memory with bucket "
                        f"{first_bucket + k}"
                    )
        if given is None:
            device, uses_extension = self.device, self.uses_extension
            if self._native is not None:  # 1. The prepared native plan: addresses only.
                self._native.run(addresses, first_bucket, self.num_threads, _stream_of(device))
                return
        elif device == self.device:
            uses_extension = self.uses_extension
        else:  # A from_manifest plan without a device: decided per call.
            uses_extension = _resolve_extension(self._use_extension, device, self._where)
        members = self.manifest.bucket_members
        if uses_extension:  # 2. One native call per bucket.
            copy_bucket = _ext.refit_unpack_bucket if self._unpack else _ext.refit_pack_bucket
            stream = _stream_of(device)
            for k, bucket in enumerate(buckets):
                b = first_bucket + k
                if given is None:
                    views = [self._views[i] for i in members[b]]
                else:
                    views = [_same_size_int_view(t) for t in given]
                copy_bucket(bucket, views, self._bucket(b).offsets, self.num_threads, stream)
            return
        with torch.no_grad():  # 3. The torch loop; destinations may be parameters.
            for k, bucket in enumerate(buckets):
                b = first_bucket + k
                info = self._bucket(b)
                entries = info.entries
                tensors = given if given is not None else [self._tensors[i] for i in members[b]]
                if self._unpack:
                    for e, d in zip(entries, tensors):
                        if e.nbytes > 0:
                            d.copy_(_typed_view(bucket, e))
                    continue
                covered = 0
                for i in info.by_offset:
                    e = entries[i]
                    if e.nbytes == 0:
                        continue
                    bucket[covered : e.offset].zero_()  # Padding: never ship stale memory.
                    _typed_view(bucket, e).copy_(tensors[i])
                    covered = e.offset + e.nbytes
                bucket[covered:].zero_()


class PackPlan(_CopyPlan):
    """Packs named tensors into the manifest's buckets; validated once, run every step.

    The sender's hot path (weight refit packs the same parameters after every optimizer step)::

        plan = PackPlan(dict(model.named_parameters()), manifest)   # once
        buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device="cuda")
                   for _ in range(2)]
        for bucket in plan.iter_pack(buffers):                     # every step
            send(bucket)

    Construction checks every tensor (exactly the manifest's names, its shapes and dtypes, one
    device) and, with the extension, builds its native plan (on CUDA: the job descriptors,
    uploaded to the GPU once). Each call then costs one pass over the tensors' ``data_ptr()``
    (the re-allocation check, ~20 us for 272 tensors), a check per bucket that no tensor lies in
    it, and, with the extension, one native call: ``pack`` / ``pack_bucket`` are ONE kernel launch
    on CUDA (asynchronous on torch's current stream), one threaded copy on CPU.

    The plan holds the tensor objects it was given and packs their CURRENT values (in-place
    updates need nothing). A tensor whose memory was re-allocated since (``p.data = ...``,
    ``model.to(...)``) is detected on the next call: ``on_reallocation="rebuild"`` (default)
    re-validates and re-plans transparently (``num_rebuilds`` counts it), ``"error"`` raises
    ValueError naming the tensor. A call may also pass ``named_tensors``: other objects than the
    plan's (e.g. a fresh ``state_dict()``) are fully re-checked, which costs what the functional
    ``pack`` costs; pass the same objects to stay on the fast path. The plan keeps its tensors'
    memory alive until it is rebuilt or dropped. Not detected: changing a tensor's strides in place
    at the same address (``as_strided_``, ``set_``): call ``rebuild()`` after that.

    When the tensors only exist one bucket at a time (a trainer that all-gathers sharded weights
    bucket by bucket), build the plan from the manifest alone and hand each bucket's tensors to
    ``pack_bucket_from``::

        plan = PackPlan.from_manifest(manifest, device="cuda")     # once
        for b in range(manifest.num_buckets):                      # every step
            named_b = gather(manifest.bucket_entries(b))           # name -> full tensor
            send(plan.pack_bucket_from(named_b, b, out=buffers[b % 2]))

    Args:
        named_tensors: exactly the manifest's names with its shapes and dtypes; any strides.
        manifest: from ``plan_buckets``.
        device: the tensors' device; None = theirs (CPU when the manifest has no tensors).
        use_extension: None = the extension when it supports the device, else torch; True = the
            extension or RuntimeError; False = torch (same bytes, per-tensor ``copy_``).
        num_threads: CPU copy workers for the extension, 0 = automatic.
        on_reallocation: "rebuild" or "error" (above).

    Raises:
        ValueError: a missing or extra name, a shape, dtype or device mismatch, a bad argument.
    """

    _unpack = False
    _role = "tensor"

    def __init__(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        device: torch.device | str | None = None,
        use_extension: bool | None = None,
        num_threads: int = 0,
        on_reallocation: str = "rebuild",
    ) -> None:
        super().__init__(
            manifest,
            named_tensors,
            device=device,
            use_extension=use_extension,
            num_threads=num_threads,
            on_reallocation=on_reallocation,
            where="PackPlan",
        )

    def pack(
        self,
        out: Sequence[torch.Tensor] | None = None,
        *,
        named_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Every bucket, in one native call (one kernel launch on CUDA).

        ``out``: one 1-D contiguous ``uint8`` tensor per bucket on the plan's device, each of at
        least its bucket's size and 16-byte aligned; bucket ``b`` is ``out[b][:size]``. None = new
        tensors. No tensor may share memory with an ``out`` (ValueError before anything is written).
        """
        self._refresh(named_tensors)
        sizes = self.manifest.bucket_sizes
        if out is None:
            buckets = [torch.empty(size, dtype=torch.uint8, device=self.device) for size in sizes]
            self._run(buckets, 0, fresh=True)
            return buckets
        label = self._label("pack")
        if not isinstance(out, Sequence) or len(out) != len(sizes):
            raise ValueError(
                f"{label}: out must be a sequence of {len(sizes)} tensors (one per bucket)"
            )
        buckets = [
            _checked_bucket(o, b, sizes[b], self.device, f"{label}: out[{b}]", False, "tensor")
            for b, o in enumerate(out)
        ]
        self._run(buckets, 0)
        return buckets

    def pack_bucket(
        self,
        bucket_index: int,
        out: torch.Tensor | None = None,
        *,
        named_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Bucket ``bucket_index`` (``out[:size]`` when ``out`` is given, as in ``pack``)."""
        _check_bucket_index(self.manifest, bucket_index)
        self._refresh(named_tensors)
        return self._pack_one(bucket_index, out)

    def iter_pack(
        self,
        buffers: Sequence[torch.Tensor] = (),
        *,
        named_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yields the buckets one at a time, packing each only when asked for.

        With ``buffers`` (e.g. two ``uint8`` tensors of ``manifest.max_bucket_size`` bytes), bucket
        ``b`` is written into ``buffers[b % len(buffers)]``: a sender double-buffers by sending one
        bucket while the next is packed, and must be done with a bucket before the buffer comes
        round again. Without buffers each bucket is a new tensor. The re-allocation check runs
        once, before the first bucket; do not re-allocate tensors while iterating.
        """
        self._refresh(named_tensors)
        for b in range(self.manifest.num_buckets):
            yield self._pack_one(b, buffers[b % len(buffers)] if buffers else None)

    def _pack_one(self, bucket_index: int, out: torch.Tensor | None) -> torch.Tensor:
        bucket = self._out_bucket(bucket_index, out, self.device, "pack_bucket")
        self._run([bucket], bucket_index, fresh=out is None)
        return bucket

    def pack_bucket_from(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        bucket_index: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packs bucket ``bucket_index`` from that bucket's tensors, given for this call only.

        For senders whose tensors exist one bucket at a time (see the class docstring); works on
        any plan and never uses or changes the tensors a plan holds. Per call: the bucket's
        tensors are validated against the manifest, then one native call packs them (one kernel
        launch on CUDA, queued on torch's current stream and not waited for: a tensor produced on
        another stream must be synchronized with it first, and one freed right after the call is
        safe only if it was allocated on that stream).

        Args:
            named_tensors: exactly the names of ``manifest.bucket_entries(bucket_index)``, with
                their shapes and dtypes, on one device; any strides.
            bucket_index: the bucket to pack.
            out: as in ``pack_bucket`` (1-D contiguous ``uint8``, at least the bucket's size,
                16-byte aligned); the result is ``out[:size]``. None = a new tensor.

        Returns:
            The bucket: 1-D ``uint8`` of ``manifest.bucket_sizes[bucket_index]`` bytes.

        Raises:
            ValueError: a bad bucket index; a missing name, a name of another bucket or of no
                bucket, a shape, dtype or device mismatch (each naming the tensor); a bad ``out``
                or a tensor sharing memory with it. All before anything is written.
        """
        return self._pack_given(named_tensors, bucket_index, out, exact=True)

    def _pack_given(
        self, named: Any, bucket_index: int, out: torch.Tensor | None, *, exact: bool
    ) -> torch.Tensor:
        _check_bucket_index(self.manifest, bucket_index)
        device = self.device
        if device is None and isinstance(out, torch.Tensor):
            device = out.device
        tensors, device = self._validated(
            named,
            self._bucket(bucket_index).entries,
            device,
            exact=exact,
            bucket_index=bucket_index,
        )
        bucket = self._out_bucket(bucket_index, out, device, "pack_bucket_from")
        self._run([bucket], bucket_index, tensors, device, fresh=out is None)
        return bucket

    def _out_bucket(
        self, bucket_index: int, out: Any, device: torch.device, method: str
    ) -> torch.Tensor:
        size = self.manifest.bucket_sizes[bucket_index]
        if out is None:
            return torch.empty(size, dtype=torch.uint8, device=device)
        where = f"{self._label(method)}: out"
        return _checked_bucket(out, bucket_index, size, device, where, False, "tensor")


class UnpackPlan(_CopyPlan):
    """Unpacks the manifest's buckets into destination tensors; validated once, run every step.

    The receiver's hot path: the destinations are the engine's parameters, which stay put between
    weight syncs::

        plan = UnpackPlan(manifest, dict(engine_model.named_parameters()))   # once
        plan.unpack_into(received_buckets)                                  # every sync

    Construction checks every destination (every manifest name present with its shape and dtype
    on one device, no destination whose elements share memory; extra names are left alone). Per
    call only the buckets are checked (count, sizes, dtype, device, alignment, no overlap with a
    destination) and the destinations' ``data_ptr()`` compared; the copy is one native call (one
    kernel launch on CUDA for all buckets, asynchronous on torch's current stream). Re-allocated
    destinations are handled as in ``PackPlan`` (``on_reallocation``, ``rebuild()``,
    ``destinations=`` per call). ``UnpackPlan.from_manifest(manifest)`` builds a plan without
    destinations, for ``unpack_bucket_to`` (destinations given per bucket).

    Args:
        manifest: the sender's manifest (e.g. ``Manifest.from_dict`` of what it sent).
        destinations: ``name -> tensor`` holding at least the manifest's names; any strides.
        device, use_extension, num_threads, on_reallocation: as for ``PackPlan``.
    """

    _unpack = True
    _role = "destination"

    def __init__(
        self,
        manifest: Manifest,
        destinations: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        use_extension: bool | None = None,
        num_threads: int = 0,
        on_reallocation: str = "rebuild",
    ) -> None:
        super().__init__(
            manifest,
            destinations,
            device=device,
            use_extension=use_extension,
            num_threads=num_threads,
            on_reallocation=on_reallocation,
            where="UnpackPlan",
        )

    def unpack_into(
        self,
        buckets: Sequence[torch.Tensor],
        *,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Copies every bucket into the destinations (one kernel launch on CUDA).

        Every check comes before the first byte is written: on ValueError nothing has changed.
        """
        self._refresh(destinations)
        label = self._label("unpack_into")
        self._run(_checked_buckets(buckets, self.manifest, self.device, label, self._role), 0)

    def unpack_bucket_into(
        self,
        bucket: torch.Tensor,
        bucket_index: int,
        *,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Copies one bucket into its destinations (e.g. as each bucket arrives)."""
        _check_bucket_index(self.manifest, bucket_index)
        self._refresh(destinations)
        where = f"{self._label('unpack_bucket_into')}: bucket {bucket_index}"
        size = self.manifest.bucket_sizes[bucket_index]
        checked = _checked_bucket(bucket, bucket_index, size, self.device, where, True, self._role)
        self._run([checked], bucket_index)

    def unpack_bucket_to(
        self,
        bucket: torch.Tensor,
        bucket_index: int,
        destinations: Mapping[str, torch.Tensor],
    ) -> None:
        """Copies bucket ``bucket_index`` into destinations given for this call only.

        The receiver's counterpart of ``PackPlan.pack_bucket_from``: ``destinations`` must hold
        the bucket's names (others are left alone) with the manifest's shapes and dtypes, on the
        bucket's device, none with elements that share memory or that share memory with the
        bucket. Works on any plan and never uses or changes the destinations a plan holds.
        Raises ValueError naming the first mismatch, before anything is written.
        """
        _check_bucket_index(self.manifest, bucket_index)
        size = self.manifest.bucket_sizes[bucket_index]
        device = self.device
        if device is None and isinstance(bucket, torch.Tensor):
            device = bucket.device
        where = f"{self._label('unpack_bucket_to')}: bucket {bucket_index}"
        checked = _checked_bucket(bucket, bucket_index, size, device, where, True, self._role)
        tensors, device = self._validated(
            destinations, self._bucket(bucket_index).entries, device, exact=False
        )
        self._run([checked], bucket_index, tensors, device)


_PlanT = TypeVar("_PlanT", bound=_CopyPlan)


# --- Functional API: one plan per call -----------------------------------------------------------


def pack(
    named_tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    *,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> list[torch.Tensor]:
    """Packs every tensor of the manifest into new ``uint8`` buckets (one list entry per bucket).

    ``named_tensors`` must hold exactly the manifest's names, with its shapes and dtypes, all on
    one device (the buckets' device). Raises ValueError naming the first mismatch, before packing.
    ``use_extension`` and ``num_threads`` as for ``PackPlan``.
    """
    return _plan_for_call(
        PackPlan, "pack", manifest, named_tensors, use_extension, num_threads
    ).pack()


def iter_pack(
    named_tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    buffers: Sequence[torch.Tensor] = (),
    *,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> Iterator[torch.Tensor]:
    """Yields the buckets one at a time, packing each only when asked for (``PackPlan.iter_pack``).

    Checks as ``pack``, when the first bucket is asked for.
    """
    plan = _plan_for_call(
        PackPlan, "iter_pack", manifest, named_tensors, use_extension, num_threads
    )
    yield from plan.iter_pack(buffers)


def pack_bucket(
    named_tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    bucket_index: int,
    out: torch.Tensor | None = None,
    *,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> torch.Tensor:
    """Packs the tensors of bucket ``bucket_index`` and returns the bucket (1-D ``uint8``).

    ``PackPlan.from_manifest(manifest).pack_bucket_from(...)`` in one call (same arguments,
    checks and errors; on CUDA queued on torch's current stream), except that ``named_tensors``
    may hold other names too (e.g. every tensor): only this bucket's are read and checked. The
    bucket lives on ``out``'s device, else on the tensors'. ``use_extension`` and ``num_threads``
    as for ``PackPlan``.
    """
    plan = _plan_for_call(PackPlan, "pack_bucket", manifest, None, use_extension, num_threads)
    return plan._pack_given(named_tensors, bucket_index, out, exact=False)


def unpack(
    buckets: Sequence[torch.Tensor],
    manifest: Manifest,
    *,
    copy: bool = True,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest, from all its buckets, as ``name -> tensor`` in manifest order.

    copy=True: new contiguous tensors on the buckets' device (the buckets can then be reused).
    copy=False: views into the buckets (no copy; valid while the buckets are).
    Raises ValueError when the buckets do not match the manifest (count, size, dtype, layout).
    """
    _check_manifest(manifest, "unpack")
    _check_num_threads(num_threads)
    device = _device_of(buckets)
    checked = _checked_buckets(buckets, manifest, device, "unpack", "tensor")
    if not copy:
        return {e.name: _typed_view(checked[e.bucket], e) for e in manifest.tensors}
    plan = _plan_for_call(UnpackPlan, "unpack", manifest, None, use_extension, num_threads, device)
    destinations = _new_tensors(manifest.tensors, device)
    for b, bucket in enumerate(checked):  # New tensors from the manifest: nothing to validate.
        tensors = [destinations[e.name] for e in plan._bucket(b).entries]
        plan._run([bucket], b, tensors, device, fresh=True)
    return destinations


def unpack_bucket(
    bucket: torch.Tensor,
    manifest: Manifest,
    bucket_index: int,
    *,
    copy: bool = True,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> dict[str, torch.Tensor]:
    """The tensors of one bucket as ``name -> tensor`` (see ``unpack``)."""
    _check_manifest(manifest, "unpack_bucket")
    _check_num_threads(num_threads)
    _check_bucket_index(manifest, bucket_index)
    entries = manifest.bucket_entries(bucket_index)
    size = manifest.bucket_sizes[bucket_index]
    where = f"unpack_bucket: bucket {bucket_index}"
    checked = _checked_bucket(bucket, bucket_index, size, None, where, True, "tensor")
    if not copy:
        return {e.name: _typed_view(checked, e) for e in entries}
    device = checked.device
    plan = _plan_for_call(
        UnpackPlan, "unpack_bucket", manifest, None, use_extension, num_threads, device
    )
    destinations = _new_tensors(entries, device)  # From the manifest: nothing to validate.
    plan._run([checked], bucket_index, list(destinations.values()), device, fresh=True)
    return destinations


def unpack_into(
    buckets: Sequence[torch.Tensor],
    manifest: Manifest,
    destinations: Mapping[str, torch.Tensor],
    *,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> None:
    """Copies every tensor of the manifest into ``destinations[name]``, in place.

    Every check comes before the first byte is written, so on ValueError nothing has changed:
    every manifest name must be in ``destinations`` (extra names are left alone) with the
    manifest's shape and dtype, on the buckets' device; destinations may be non-contiguous
    (e.g. a transposed view) but no two of a destination's elements may share memory (``expand``)
    and none may share memory with a bucket. The message names the first mismatch in manifest
    order, with the expected and the actual value.
    """
    device = _device_of(buckets)
    plan = _plan_for_call(
        UnpackPlan, "unpack_into", manifest, destinations, use_extension, num_threads, device
    )
    plan.unpack_into(buckets)


def unpack_bucket_into(
    bucket: torch.Tensor,
    manifest: Manifest,
    bucket_index: int,
    destinations: Mapping[str, torch.Tensor],
    *,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> None:
    """``unpack_into`` for one bucket: only that bucket's names must be in ``destinations``."""
    device = _device_of([bucket])
    plan = _plan_for_call(
        UnpackPlan, "unpack_bucket_into", manifest, None, use_extension, num_threads, device
    )
    plan.unpack_bucket_to(bucket, bucket_index, destinations)


def _plan_for_call(
    cls: type[_PlanT],
    where: str,
    manifest: Manifest,
    named: Mapping[str, torch.Tensor] | None,
    use_extension: bool | None,
    num_threads: int,
    device: torch.device | None = None,
) -> _PlanT:
    """The plan behind one call of the functional API ``where`` (its messages start with it)."""
    kwargs = {"device": device, "use_extension": use_extension, "num_threads": num_threads}
    return cls._create(manifest, named, where, one_call=True, **kwargs)


# --- Helpers -------------------------------------------------------------------------------------


class _BucketInfo:
    """One bucket's entries (manifest order), their offsets (the native calls' argument) and the
    order of their offsets (the torch loop zeroes the gaps between them)."""

    __slots__ = ("by_offset", "entries", "offsets")

    def __init__(self, manifest: Manifest, bucket_index: int) -> None:
        self.entries = manifest.bucket_entries(bucket_index)
        self.offsets = [e.offset for e in self.entries]
        self.by_offset = sorted(range(len(self.entries)), key=self.offsets.__getitem__)


class _MemoryRanges:
    """The bytes a set of tensors occupies, for "does this bucket touch any of them?".

    The C++ plan's check (cc/refit_packer.cc: CopyPlan::check_buckets) in Python, so that every
    path rejects the same thing with the tensor's name: exact byte ranges (a tensor elsewhere in
    the same storage is fine), sorted by start with a running maximum of their ends, so a query
    is one bisection.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        spans = []
        for t, name in zip(tensors, names):
            nbytes = t.nbytes
            if nbytes == 0:
                continue
            if not t.is_contiguous():  # Strides are never negative in torch.
                last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
                nbytes = (last + 1) * t.element_size()
            start = t.data_ptr()
            spans.append((start, start + nbytes, name))
        spans.sort()
        self._spans = spans
        self._starts = [start for start, _, _ in spans]
        self._max_end = list(itertools.accumulate((end for _, end, _ in spans), max))

    def overlapping(self, address: int, nbytes: int) -> str | None:
        """The name of a tensor with a byte in ``[address, address + nbytes)``, else None."""
        if nbytes == 0:
            return None
        k = bisect.bisect_left(self._starts, address + nbytes)  # Spans starting before the end.
        if k == 0 or self._max_end[k - 1] <= address:
            return None
        return next(name for _, end, name in self._spans[:k] if end > address)  # Rare: name it.


def _check_manifest(manifest: Any, where: str) -> None:
    if not isinstance(manifest, Manifest):
        raise ValueError(f"{where}: manifest must be a Manifest, got {type(manifest).__name__}")


def _check_num_threads(num_threads: Any) -> None:
    if not is_int(num_threads) or not 0 <= num_threads <= MAX_THREADS:
        raise ValueError(
            f"num_threads must be in [0, {MAX_THREADS}] (0 = automatic), got {num_threads!r}"
        )


def _checked_buckets(
    buckets: Any, manifest: Manifest, device: torch.device | None, where: str, role: str
) -> list[torch.Tensor]:
    """One bucket tensor per manifest bucket, each exactly its size, all on ``device`` (None =
    the first bucket's)."""
    num = manifest.num_buckets
    if not isinstance(buckets, Sequence) or len(buckets) != num:
        got = len(buckets) if isinstance(buckets, Sequence) else type(buckets).__name__
        raise ValueError(f"{where}: got {got} buckets but the manifest has {num}")
    if device is None:
        device = _device_of(buckets)
    sizes = manifest.bucket_sizes
    return [
        _checked_bucket(bucket, b, sizes[b], device, f"{where}: bucket {b}", True, role)
        for b, bucket in enumerate(buckets)
    ]


def _checked_bucket(
    bucket: Any,
    bucket_index: int,
    size: int,
    device: torch.device | None,
    where: str,
    exact: bool,
    role: str,
) -> torch.Tensor:
    """``bucket`` checked for bucket ``bucket_index``: exactly ``size`` bytes, or with ``exact``
    False at least that many (the result is then its first ``size`` bytes); on ``device``."""
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
        raise ValueError(f"{where} is on {bucket.device} but the {role}s on {device}")
    return bucket if bucket.numel() == size else bucket[:size]


def _get_matching(
    named: Mapping[str, Any], entry: TensorEntry, where: str, role: str
) -> torch.Tensor:
    """``named[entry.name]`` after checking that it matches the entry's shape and dtype."""
    if entry.name not in named:
        raise ValueError(f"{where}: {role} {entry.name!r} of the manifest is missing")
    t = named[entry.name]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: {role} {entry.name!r} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != entry.shape:
        raise ValueError(
            f"{where}: {role} {entry.name!r}: expected shape {entry.shape}, got {tuple(t.shape)}"
        )
    if t.dtype != entry.torch_dtype:
        raise ValueError(
            f"{where}: {role} {entry.name!r}: expected dtype {entry.dtype}, "
            f"got {_dtype_name(t.dtype)}"
        )
    return t


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True unless each stride clears the extent of all smaller ones (as the C++ core checks)."""
    if t.is_contiguous():
        return False
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    extent = 0  # In elements, of the dims seen so far.
    for stride, size in dims:
        if stride < extent + 1:
            return True
        extent += (size - 1) * stride
    return False


def _device_of(buckets: Any) -> torch.device | None:
    """The first bucket's device, or None when there is no bucket tensor to take it from."""
    if isinstance(buckets, Sequence) and buckets and isinstance(buckets[0], torch.Tensor):
        return buckets[0].device
    return None


def _new_tensors(
    entries: Sequence[TensorEntry], device: torch.device | None
) -> dict[str, torch.Tensor]:
    return {e.name: torch.empty(e.shape, dtype=e.torch_dtype, device=device) for e in entries}


def _typed_view(bucket: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The entry's bytes of ``bucket`` as a tensor of its dtype and shape (no copy)."""
    raw = bucket[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.torch_dtype).view(entry.shape)


def _same_size_int_view(t: torch.Tensor) -> torch.Tensor:
    # detach: DLPack refuses tensors that require grad; the memory is the same.
    return t.detach().view(_SAME_SIZE_INT[t.element_size()])


def _cuda_index(device: torch.device) -> int:
    """-1 for CPU, else the CUDA device's index (the current one for a bare "cuda")."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


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
