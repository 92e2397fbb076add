"""Bucketed refit packer: named tensors <-> flat byte buckets, for weight sync.

Weight sync sends the trainer's weights (HF names, shapes, dtypes) to the inference engine. One
transfer per tensor is slow (hundreds of small collectives); instead the sender packs the tensors
into a few flat ``uint8`` buckets of a configurable size, sends each bucket, and the receiver
unpacks it. The :class:`Manifest` is the only thing the receiver needs for that: per tensor its
name, dtype (a string), shape, bucket index, byte offset and byte size, plus every bucket's size.
It is plain data (``to_dict`` / ``from_dict``, JSON-serialisable) and is validated whenever one is
built, so a corrupt or mismatched manifest fails before any byte is copied.

Layout (see cc/refit_packer.h for the full rules):

- Tensors are placed in manifest order; a new bucket starts when the next tensor does not fit in
  the current one; a tensor larger than a bucket gets a bucket of its own.
- Every offset is a multiple of ``alignment`` (a power of two >= 16, default 256), so a byte range
  of a bucket can be viewed as a typed tensor (``bucket[o:o + n].view(dtype).view(shape)``) and
  CUDA copies use 16-byte vector loads. Bucket sizes are multiples of the alignment too.
- A tensor's bytes are its elements in row-major order (what ``.contiguous()`` holds), whatever its
  strides; bytes between tensors are zeros.

Weight refit moves the SAME tensors after every optimizer step, so the hot path is a plan built
once: ``PackPlan`` (sender) and ``UnpackPlan`` (receiver) validate every tensor and prepare the
copies once (on CUDA: job descriptors uploaded to the GPU once); each call then only checks that
no tensor was re-allocated (one pass over ``data_ptr()``, re-planning when one was) and makes one
native call: ONE kernel launch on CUDA for all buckets. Sender::

    manifest = plan_buckets(describe_tensors(params), bucket_size_bytes=256 << 20)
    send(manifest.to_dict())
    plan = PackPlan(params, manifest)  # once; params: e.g. dict(model.named_parameters())
    buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
    for bucket in plan.iter_pack(buffers):  # every step; double buffering: pack b while b - 1
        send(bucket)                        # is in flight

Receiver: ``manifest = Manifest.from_dict(received)``, ``plan = UnpackPlan(manifest,
model_params)`` once, then per step ``plan.unpack_into(buckets)`` (or per bucket
``plan.unpack_bucket_into(bucket, b)``).

The functional API (``pack``, ``iter_pack``, ``pack_bucket``, ``unpack``, ``unpack_into``,
``unpack_bucket_into``) does the same copies with every check on every call (milliseconds of host
work for a few hundred tensors, whatever their size); use it for one-off copies.

Implementations: the C++/CUDA extension ``_dockyard_kernels`` (cc/refit_packer.cc: multi-threaded
strided byte copies, no contiguous temporaries; cc/cuda/refit_packer_cuda.cu: batched kernel
launches with 16-byte vector copies, asynchronous on torch's current stream) when importable and
built for the tensors' device, else plain torch (``copy_`` through typed views of the bucket).
Both give identical bytes.

Covered dtypes: ``DTYPES`` (floating point incl. bfloat16 and float8, signed ints, uint8, bool).
Non-contiguous sources and destinations are supported (transposes, slices with steps);
destinations whose elements share memory (``expand``-ed tensors) are rejected with ValueError.
Not covered: sparse, quantized or complex tensors; moving tensors between devices (all tensors of
a bucket live on the bucket's device); destinations that share memory with each other (e.g. tied
weights listed under two names) are not detected and receive the bytes of one of them; the
transport itself (python/dockyard_rl/weight_sync/).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels._extension import HAS_EXTENSION

# The extension this module calls (None outside the build); tests replace it.
_ext = _extension.EXTENSION

# dtype name in the manifest -> torch dtype. Names are torch's without the "torch." prefix.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

DEFAULT_ALIGNMENT = 256
# Same bounds as the C++ core (cc/refit_packer.h: kMinAlignment, kMaxAlignment, kMaxThreads).
MIN_ALIGNMENT = 16
MAX_ALIGNMENT = 1 << 30
MAX_THREADS = 1024
MANIFEST_FORMAT_VERSION = 1

# The extension copies bytes, so each tensor travels as a same-size integer view (DLPack exports
# these whatever the original dtype; bfloat16, bool and float8 are not portable across versions).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DTYPES",
    "HAS_EXTENSION",
    "Manifest",
    "ON_REALLOCATION",
    "PackPlan",
    "TensorEntry",
    "UnpackPlan",
    "describe_tensors",
    "iter_pack",
    "pack",
    "pack_bucket",
    "plan_buckets",
    "unpack",
    "unpack_bucket",
    "unpack_bucket_into",
    "unpack_into",
]


# --- Manifest ------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor in a manifest: ``nbytes`` bytes at ``offset`` in bucket ``bucket``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        where = f"tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"{where}: unknown dtype {self.dtype!r}; valid dtypes: {', '.join(DTYPES)}"
            )
        if not isinstance(self.shape, (tuple, list)) or not all(
            _is_int(s) and s >= 0 for s in self.shape
        ):
            raise ValueError(f"{where}: shape must be a list of ints >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        for key in ("bucket", "offset", "nbytes"):
            value = getattr(self, key)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{where}: {key} must be an int >= 0, got {value!r}")
        expected = _numel(self.shape) * _itemsize(DTYPES[self.dtype])
        if self.nbytes != expected:
            raise ValueError(
                f"{where}: nbytes is {self.nbytes} but shape {self.shape} of {self.dtype} "
                f"holds {expected} bytes"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Where every tensor lies in the buckets; all a receiver needs to unpack.

    Validated on construction (so also by ``from_dict``): ValueError for an unknown dtype, a size
    that does not match its shape, a bucket index out of range, an offset that is not a multiple of
    ``alignment``, a range past its bucket's end, two ranges that overlap, or a duplicate name.
    """

    tensors: tuple[TensorEntry, ...]
    bucket_sizes: tuple[int, ...]
    alignment: int = DEFAULT_ALIGNMENT

    def __post_init__(self) -> None:
        _check_alignment(self.alignment, "manifest")
        if not isinstance(self.bucket_sizes, (tuple, list)):
            raise ValueError(f"bucket_sizes must be a list of ints, got {self.bucket_sizes!r}")
        object.__setattr__(self, "bucket_sizes", tuple(self.bucket_sizes))
        for b, size in enumerate(self.bucket_sizes):
            if not _is_int(size) or size < 0:
                raise ValueError(f"bucket_sizes[{b}] must be an int >= 0, got {size!r}")
        if not isinstance(self.tensors, (tuple, list)) or not all(
            isinstance(t, TensorEntry) for t in self.tensors
        ):
            raise ValueError("tensors must be a list of TensorEntry")
        object.__setattr__(self, "tensors", tuple(self.tensors))
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"duplicate tensor name {t.name!r} in the manifest")
            seen.add(t.name)
            if t.bucket >= len(self.bucket_sizes):
                raise ValueError(
                    f"tensor {t.name!r}: bucket {t.bucket} out of range "
                    f"({len(self.bucket_sizes)} buckets)"
                )
            if t.offset % self.alignment != 0:
                raise ValueError(
                    f"tensor {t.name!r}: offset {t.offset} is not a multiple of the alignment "
                    f"{self.alignment}"
                )
            if t.offset + t.nbytes > self.bucket_sizes[t.bucket]:
                raise ValueError(
                    f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) lie outside "
                    f"bucket {t.bucket} of {self.bucket_sizes[t.bucket]} bytes"
                )
        for b, members in enumerate(self._members):
            # Ties by manifest order, so the message names the earlier tensor first.
            ranges = sorted(
                (self.tensors[i].offset, i, self.tensors[i].nbytes, self.tensors[i].name)
                for i in members
                if self.tensors[i].nbytes > 0
            )
            for (o1, _, n1, name1), (o2, _, _, name2) in zip(ranges, ranges[1:]):
                if o1 + n1 > o2:
                    raise ValueError(
                        f"tensors {name1!r} and {name2!r} overlap in bucket {b} "
                        f"(bytes [{o1}, {o1 + n1}) and from {o2})"
                    )

    @functools.cached_property
    def _members(self) -> tuple[tuple[int, ...], ...]:
        """Per bucket, the indices of its tensors in manifest order."""
        members: list[list[int]] = [[] for _ in self.bucket_sizes]
        for i, t in enumerate(self.tensors):
            if t.bucket < len(members):  # Checked in __post_init__; guards its own use.
                members[t.bucket].append(i)
        return tuple(tuple(m) for m in members)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def max_bucket_size(self) -> int:
        """The largest bucket: the size of a buffer that any bucket fits in."""
        return max(self.bucket_sizes, default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def bucket_entries(self, bucket_index: int) -> tuple[TensorEntry, ...]:
        """The tensors of one bucket, in manifest order."""
        _check_bucket_index(self, bucket_index)
        return tuple(self.tensors[i] for i in self._members[bucket_index])

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable plain data; ``Manifest.from_dict`` reads it back."""
        return {
            "format_version": MANIFEST_FORMAT_VERSION,
            "alignment": self.alignment,
            "bucket_sizes": list(self.bucket_sizes),
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "bucket": t.bucket,
                    "offset": t.offset,
                    "nbytes": t.nbytes,
                }
                for t in self.tensors
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Builds and validates a manifest from ``to_dict``'s output (e.g. after JSON).

        Raises:
            ValueError: missing or unknown keys, a wrong format version, wrong types, or any
                check of the class docstring.
        """
        _check_keys(data, {"format_version", "alignment", "bucket_sizes", "tensors"}, "manifest")
        if data["format_version"] != MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"manifest.format_version is {data['format_version']!r}; this reader understands "
                f"{MANIFEST_FORMAT_VERSION}: sender and receiver run different versions"
            )
        if not isinstance(data["tensors"], list):
            raise ValueError(f"manifest.tensors must be a list, got {type(data['tensors']).__name__}")
        entries = []
        fields = {f.name for f in dataclasses.fields(TensorEntry)}
        for i, item in enumerate(data["tensors"]):
            _check_keys(item, fields, f"manifest.tensors[{i}]")
            entries.append(TensorEntry(**{k: item[k] for k in fields}))
        return cls(tensors=tuple(entries), bucket_sizes=data["bucket_sizes"], alignment=data["alignment"])


def _check_keys(data: Any, expected: set[str], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
    missing = sorted(expected - set(data))
    unknown = sorted(set(data) - expected)
    if missing:
        raise ValueError(f"{where} is missing keys {missing}")
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; valid keys: {sorted(expected)}")


# --- Planning ------------------------------------------------------------------------------------


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
    """
    if not isinstance(named_shapes_dtypes, Mapping):
        raise ValueError(
            "named_shapes_dtypes must be a mapping name -> (shape, dtype), got "
            f"{type(named_shapes_dtypes).__name__}"
        )
    _check_alignment(alignment, "plan_buckets")
    if not _is_int(bucket_size_bytes) or bucket_size_bytes <= 0 or bucket_size_bytes % alignment:
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
        if not isinstance(shape, (tuple, list)) or not all(_is_int(s) and s >= 0 for s in shape):
            raise ValueError(f"tensor {name!r}: shape must be a sequence of ints >= 0, got {shape!r}")
        dtype_name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype)
        if dtype_name not in DTYPES:
            raise ValueError(
                f"tensor {name!r}: unsupported dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}"
            )
        names.append(name)
        shapes.append(tuple(shape))
        dtype_names.append(dtype_name)
        sizes.append(_numel(shape) * _itemsize(DTYPES[dtype_name]))

    if _resolve_extension(use_extension, torch.device("cpu"), "plan_buckets"):
        bucket_of, offset_of, bucket_sizes = _ext.refit_plan_buckets(sizes, bucket_size_bytes, alignment)
    else:
        bucket_of, offset_of, bucket_sizes = _plan_python(sizes, bucket_size_bytes, alignment)
    entries = tuple(
        TensorEntry(name=n, dtype=d, shape=s, bucket=b, offset=o, nbytes=nb)
        for n, d, s, b, o, nb in zip(names, dtype_names, shapes, bucket_of, offset_of, sizes)
    )
    return Manifest(tensors=entries, bucket_sizes=tuple(bucket_sizes), alignment=alignment)


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


# --- Packing -------------------------------------------------------------------------------------


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
    """
    _check_named_tensors(named_tensors, manifest)
    return [
        pack_bucket(named_tensors, manifest, b, use_extension=use_extension, num_threads=num_threads)
        for b in range(manifest.num_buckets)
    ]


def iter_pack(
    named_tensors: Mapping[str, torch.Tensor],
    manifest: Manifest,
    buffers: Sequence[torch.Tensor] = (),
    *,
    use_extension: bool | None = None,
    num_threads: int = 0,
) -> Iterator[torch.Tensor]:
    """Yields the buckets one at a time, packing each only when asked for.

    With ``buffers`` (e.g. two ``uint8`` tensors of ``manifest.max_bucket_size`` bytes), bucket
    ``b`` is written into ``buffers[b % len(buffers)]``: a sender double-buffers by sending one
    bucket while the next is packed, and must be done with a bucket before the buffer comes round
    again. Without buffers each bucket is a new tensor.
    """
    _check_named_tensors(named_tensors, manifest)
    for b in range(manifest.num_buckets):
        out = buffers[b % len(buffers)] if buffers else None
        yield pack_bucket(
            named_tensors, manifest, b, out=out, use_extension=use_extension, num_threads=num_threads
        )


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

    Args:
        named_tensors: must hold this bucket's names (others are ignored) with the manifest's
            shapes and dtypes, on one device; any strides.
        out: a 1-D contiguous ``uint8`` tensor of at least the bucket's size on that device,
            16-byte aligned (any fresh allocation is); the result is ``out[:size]``. None = a new
            tensor.
        use_extension: None = the extension when it supports the device, else torch; True = the
            extension or RuntimeError; False = torch.
        num_threads: CPU copy workers for the extension, 0 = automatic.

    On CUDA the copy is queued on torch's current stream (not waited for).

    Raises:
        ValueError: a missing name, a shape, dtype or device mismatch, a bad ``out``, or a tensor
            sharing memory with ``out``; all checked before anything is written.
    """
    _check_bucket_index(manifest, bucket_index)
    _check_num_threads(num_threads)
    entries = manifest.bucket_entries(bucket_index)
    size = manifest.bucket_sizes[bucket_index]
    sources = [_get_matching(named_tensors, e, "pack", "tensor") for e in entries]
    if out is not None:
        device = out.device
    elif sources:
        device = sources[0].device
    else:
        device = torch.device("cpu")
    for e, t in zip(entries, sources):
        if t.device != device:
            raise ValueError(
                f"pack: tensor {e.name!r}: expected device {device} (the bucket's), got {t.device}"
            )
    if out is None:
        bucket = torch.empty(size, dtype=torch.uint8, device=device)
    else:
        _check_bucket_tensor(out, None, "pack: out")
        if out.numel() < size:
            raise ValueError(
                f"pack: out has {out.numel()} bytes but bucket {bucket_index} needs {size}"
            )
        bucket = out[:size]
        for e, t in zip(entries, sources):
            if _shares_memory(t, bucket):
                raise ValueError(f"pack: tensor {e.name!r} shares memory with out")

    if _resolve_extension(use_extension, device, "pack"):
        _ext.refit_pack_bucket(
            bucket,
            [_same_size_int_view(t) for t in sources],
            [e.offset for e in entries],
            num_threads,
            _stream_of(device),
        )
        return bucket
    with torch.no_grad():
        covered = 0
        for e, t in sorted(zip(entries, sources), key=lambda pair: pair[0].offset):
            if e.nbytes == 0:
                continue
            bucket[covered : e.offset].zero_()  # Padding: never ship stale memory.
            _typed_view(bucket, e).copy_(t)
            covered = e.offset + e.nbytes
        bucket[covered:].zero_()
    return bucket


# --- Unpacking -----------------------------------------------------------------------------------


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
    _check_buckets(buckets, manifest, "unpack")
    out: dict[str, torch.Tensor] = {}
    for b, bucket in enumerate(buckets):
        out.update(
            unpack_bucket(
                bucket, manifest, b, copy=copy, use_extension=use_extension, num_threads=num_threads
            )
        )
    return {name: out[name] for name in manifest.names}


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
    _check_bucket_index(manifest, bucket_index)
    _check_num_threads(num_threads)
    _check_bucket_tensor(bucket, manifest.bucket_sizes[bucket_index], f"bucket {bucket_index}")
    entries = manifest.bucket_entries(bucket_index)
    if not copy:
        return {e.name: _typed_view(bucket, e) for e in entries}
    dests = {
        e.name: torch.empty(e.shape, dtype=e.torch_dtype, device=bucket.device) for e in entries
    }
    _copy_out(bucket, entries, dests, use_extension, num_threads)
    return dests


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
    _check_buckets(buckets, manifest, "unpack_into")
    device = buckets[0].device if buckets else None
    for e in manifest.tensors:
        _check_destination(destinations, e, device, buckets[e.bucket], "unpack_into")
    for b, bucket in enumerate(buckets):
        entries = manifest.bucket_entries(b)
        _copy_out(bucket, entries, destinations, use_extension, num_threads)


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
    _check_bucket_index(manifest, bucket_index)
    _check_num_threads(num_threads)
    _check_bucket_tensor(bucket, manifest.bucket_sizes[bucket_index], f"bucket {bucket_index}")
    entries = manifest.bucket_entries(bucket_index)
    for e in entries:
        _check_destination(destinations, e, bucket.device, bucket, "unpack_bucket_into")
    _copy_out(bucket, entries, destinations, use_extension, num_threads)


def _copy_out(
    bucket: torch.Tensor,
    entries: Sequence[TensorEntry],
    destinations: Mapping[str, torch.Tensor],
    use_extension: bool | None,
    num_threads: int,
) -> None:
    """Copies already validated entries of ``bucket`` into ``destinations``."""
    _check_num_threads(num_threads)
    dests = [destinations[e.name] for e in entries]
    if _resolve_extension(use_extension, bucket.device, "unpack"):
        _ext.refit_unpack_bucket(
            bucket,
            [_same_size_int_view(d) for d in dests],
            [e.offset for e in entries],
            num_threads,
            _stream_of(bucket.device),
        )
        return
    with torch.no_grad():  # Destinations may be parameters that require grad.
        for e, d in zip(entries, dests):
            if e.nbytes > 0:
                d.copy_(_typed_view(bucket, e))


# --- Plans: validate once, copy every step -------------------------------------------------------

ON_REALLOCATION = ("rebuild", "error")


class _CopyPlan:
    """What ``PackPlan`` and ``UnpackPlan`` share: the tensors, their addresses, the native plan.

    The plan keeps, in manifest order, the tensor OBJECTS it was given (so a ``Parameter`` whose
    values change in place, as an optimizer step does, is packed with its new values) and a view
    of each, which keeps the memory the plan copies from or to alive: while the plan holds it, the
    allocator cannot hand that address to another tensor, so a tensor that is re-allocated
    (``p.data = ...``, ``model.to(...)``, a resized storage) always shows a new ``data_ptr()``,
    and one list comparison per call detects it exactly.
    """

    _where = ""  # "PackPlan" / "UnpackPlan", starts every message.
    _unpack = False

    def __init__(
        self,
        named: Mapping[str, torch.Tensor],
        manifest: Manifest,
        device: torch.device | str | None,
        use_extension: bool | None,
        num_threads: int,
        on_reallocation: str,
    ) -> None:
        if not isinstance(manifest, Manifest):
            raise ValueError(
                f"{self._where}: manifest must be a Manifest, got {type(manifest).__name__}"
            )
        _check_num_threads(num_threads)
        if on_reallocation not in ON_REALLOCATION:
            raise ValueError(
                f"{self._where}: on_reallocation must be one of {ON_REALLOCATION}, got "
                f"{on_reallocation!r}"
            )
        self.manifest = manifest
        self.on_reallocation = on_reallocation
        self.num_threads = num_threads
        self.num_rebuilds = 0
        self._requested_device = None
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:  # Tensors report an index.
                device = torch.device("cuda", torch.cuda.current_device())
            self._requested_device = device
        self._tensors, self.device = self._validated(named)
        self.uses_extension = _resolve_extension(use_extension, self.device, self._where)
        # Per bucket, its entries in manifest order, for the torch path.
        self._bucket_entries = tuple(map(manifest.bucket_entries, range(manifest.num_buckets)))
        self._build()

    # -- Subclass hooks ---------------------------------------------------------------------------

    def _check_tensor(self, entry: TensorEntry, t: torch.Tensor) -> None:
        """Per-tensor checks beyond name, shape, dtype and device (ValueError)."""

    def _check_names(self, named: Mapping[str, torch.Tensor]) -> None:
        """Checks of the mapping's names beyond "every manifest name is there" (ValueError)."""

    # -- Building ---------------------------------------------------------------------------------

    def _validated(
        self, named: Mapping[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.device]:
        """The manifest's tensors of ``named`` in manifest order, and their common device."""
        if not isinstance(named, Mapping):
            raise ValueError(
                f"{self._where}: expected a mapping name -> tensor, got {type(named).__name__}"
            )
        role = "destination" if self._unpack else "tensor"
        tensors = [_get_matching(named, e, self._where, role) for e in self.manifest.tensors]
        self._check_names(named)
        device = self._requested_device
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        for e, t in zip(self.manifest.tensors, tensors):
            if t.device != device:
                raise ValueError(
                    f"{self._where}: {role} {e.name!r}: expected device {device} (the plan's), "
                    f"got {t.device}"
                )
            self._check_tensor(e, t)
        return tensors, device

    def _build(self) -> None:
        entries = self.manifest.tensors
        # Views keep the memory alive (see the class docstring); detach: DLPack refuses tensors
        # that require grad, and the plan never records autograd history.
        self._views = [_same_size_int_view(t) for t in self._tensors]
        self._data_ptrs = list(map(_DATA_PTR, self._tensors))
        self._native = None
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
        one change the per-call check cannot see.
        """
        if named is None:
            named = dict(zip(self.manifest.names, self._tensors))
        self._tensors, device = self._validated(named)
        if device != self.device:  # Only when no device was requested: the tensors moved.
            self.device = device
            self.uses_extension = _resolve_extension(
                None if self.uses_extension else False, device, self._where
            )
        self._build()
        self.num_rebuilds += 1

    def _refresh(self, named: Mapping[str, torch.Tensor] | None) -> None:
        """The per-call check: are the tensors still where the plan copies them?"""
        if named is not None:
            if not isinstance(named, Mapping):
                raise ValueError(
                    f"{self._where}: expected a mapping name -> tensor, got {type(named).__name__}"
                )
            try:
                current = [named[name] for name in self.manifest.names]
            except KeyError as e:
                raise ValueError(
                    f"{self._where}: {'destination' if self._unpack else 'tensor'} {e.args[0]!r} "
                    "of the manifest is missing"
                ) from None
            if not all(map(operator.is_, current, self._tensors)):
                # Other objects (e.g. a fresh state_dict()): full checks, then keep the plan if
                # they describe the same memory the same way.
                tensors, device = self._validated(named)
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

    # -- Running ----------------------------------------------------------------------------------

    def _run(self, buckets: Sequence[torch.Tensor], first_bucket: int) -> None:
        """Copies between the tensors and buckets ``first_bucket ...`` (already validated)."""
        if self._native is not None:
            addresses = [b.data_ptr() for b in buckets]
            stream = _stream_of(self.device)
            self._native.run(addresses, first_bucket, self.num_threads, stream)
            return
        index = self._index_of
        work = []
        for k, bucket in enumerate(buckets):  # Every check before the first write.
            entries = self._bucket_entries[first_bucket + k]
            pairs = [(e, self._tensors[index[e.name]]) for e in entries]
            for e, t in pairs:
                if e.nbytes > 0 and _shares_memory(t, bucket):
                    raise ValueError(
                        f"{self._where}: {e.name!r} shares memory with bucket {first_bucket + k}"
                    )
            work.append((bucket, pairs))
        with torch.no_grad():  # Destinations may be parameters that require grad.
            for bucket, pairs in work:
                if self._unpack:
                    for e, d in pairs:
                        if e.nbytes > 0:
                            d.copy_(_typed_view(bucket, e))
                    continue
                covered = 0
                for e, t in sorted(pairs, key=lambda pair: pair[0].offset):
                    if e.nbytes == 0:
                        continue
                    bucket[covered : e.offset].zero_()  # Padding: never ship stale memory.
                    _typed_view(bucket, e).copy_(t)
                    covered = e.offset + e.nbytes
                bucket[covered:].zero_()

    @functools.cached_property
    def _index_of(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.manifest.names)}

    def _check_bucket(
        self, bucket: Any, bucket_index: int, where: str, exact: bool
    ) -> torch.Tensor:
        """``bucket`` checked for bucket ``bucket_index`` (its first ``size`` bytes if not exact)."""
        size = self.manifest.bucket_sizes[bucket_index]
        if (  # The common case in a few attribute reads; the checks below word the errors.
            isinstance(bucket, torch.Tensor)
            and bucket.dtype is torch.uint8
            and bucket.dim() == 1
            and bucket.is_contiguous()
            and bucket.device == self.device
            and (bucket.numel() == size or (not exact and bucket.numel() > size))
            and bucket.data_ptr() % MIN_ALIGNMENT == 0
        ):
            return bucket if bucket.numel() == size else bucket[:size]
        _check_bucket_tensor(bucket, size if exact else None, where)
        if not exact and bucket.numel() < size:
            raise ValueError(
                f"{where} has {bucket.numel()} bytes but bucket {bucket_index} needs {size}"
            )
        if bucket.device != self.device:
            raise ValueError(
                f"{where} is on {bucket.device} but the plan's tensors on {self.device}"
            )
        return bucket if exact else bucket[:size]


class PackPlan(_CopyPlan):
    """Packs the same named tensors into the manifest's buckets every step, validated once.

    The sender's hot path (weight refit packs the same parameters after every optimizer step)::

        plan = PackPlan(dict(model.named_parameters()), manifest)   # once
        buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device="cuda")
                   for _ in range(2)]
        for bucket in plan.iter_pack(buffers):                     # every step
            send(bucket)

    Construction checks everything ``pack`` checks (names, shapes, dtypes, one device) and, with
    the extension, builds its native plan (on CUDA: the job descriptors, uploaded to the GPU once).
    Each call then costs one pass over the tensors' ``data_ptr()`` (the re-allocation check, ~20 us
    for 272 tensors) plus, with the extension, one native call: ``pack`` / ``pack_bucket`` are ONE
    kernel launch on CUDA (asynchronous on torch's current stream), one threaded copy on CPU.

    The plan holds the tensor objects it was given and packs their CURRENT values (in-place
    updates need nothing). A tensor whose memory was re-allocated since (``p.data = ...``,
    ``model.to(...)``) is detected on the next call: ``on_reallocation="rebuild"`` (default)
    re-validates and re-plans transparently (``num_rebuilds`` counts it), ``"error"`` raises
    ValueError naming the tensor. A call may also pass ``named_tensors``: other objects than the
    plan's (e.g. a fresh ``state_dict()``) are fully re-checked, which costs what the functional
    ``pack`` costs; pass the same objects to stay on the fast path. The plan keeps its tensors'
    memory alive until it is rebuilt or dropped. Not detected: changing a tensor's strides in place
    at the same address (``as_strided_``, ``set_``): call ``rebuild()`` after that.

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

    _where = "PackPlan"
    _unpack = False

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
        super().__init__(named_tensors, manifest, device, use_extension, num_threads, on_reallocation)

    def _check_names(self, named: Mapping[str, torch.Tensor]) -> None:
        if len(named) != len(self.manifest.tensors):  # Every manifest name is there: any extra?
            known = set(self.manifest.names)
            extra = [name for name in named if name not in known]
            raise ValueError(
                f"PackPlan: tensor {extra[0]!r} is not in the manifest ({len(extra)} such); plan the "
                "manifest from the same tensors"
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
        else:
            if not isinstance(out, Sequence) or len(out) != len(sizes):
                raise ValueError(
                    f"PackPlan.pack: out must be a sequence of {len(sizes)} tensors (one per bucket)"
                )
            buckets = [
                self._check_bucket(o, b, f"PackPlan.pack: out[{b}]", False) for b, o in enumerate(out)
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

    def _pack_one(self, bucket_index: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            size = self.manifest.bucket_sizes[bucket_index]
            bucket = torch.empty(size, dtype=torch.uint8, device=self.device)
        else:
            bucket = self._check_bucket(out, bucket_index, "PackPlan: out", False)
        self._run([bucket], bucket_index)
        return bucket

    def iter_pack(
        self,
        buffers: Sequence[torch.Tensor] = (),
        *,
        named_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yields the buckets one at a time, as the functional ``iter_pack`` (double buffering).

        The re-allocation check runs once, before the first bucket; do not re-allocate tensors
        while iterating.
        """
        self._refresh(named_tensors)
        for b in range(self.manifest.num_buckets):
            yield self._pack_one(b, buffers[b % len(buffers)] if buffers else None)


class UnpackPlan(_CopyPlan):
    """Unpacks the manifest's buckets into the same destinations every step, validated once.

    The receiver's hot path: the destinations are the engine's parameters, which stay put between
    weight syncs::

        plan = UnpackPlan(manifest, dict(engine_model.named_parameters()))   # once
        plan.unpack_into(received_buckets)                                  # every sync

    Construction checks everything ``unpack_into`` checks up front (every manifest name present
    with its shape and dtype on one device, no destination whose elements share memory; extra
    names are left alone). Per call only the buckets are checked (count, sizes, dtype, device,
    alignment, no overlap with a destination) and the destinations' ``data_ptr()`` compared; the
    copy is one native call (one kernel launch on CUDA for all buckets, asynchronous on torch's
    current stream). Re-allocated destinations are handled as in ``PackPlan`` (``on_reallocation``,
    ``rebuild()``, ``destinations=`` per call).

    Args:
        manifest: the sender's manifest (e.g. ``Manifest.from_dict`` of what it sent).
        destinations: ``name -> tensor`` holding at least the manifest's names; any strides.
        device, use_extension, num_threads, on_reallocation: as for ``PackPlan``.
    """

    _where = "UnpackPlan"
    _unpack = True

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
        super().__init__(destinations, manifest, device, use_extension, num_threads, on_reallocation)

    def _check_tensor(self, entry: TensorEntry, t: torch.Tensor) -> None:
        if entry.nbytes > 0 and _overlaps_itself(t):
            raise ValueError(
                f"UnpackPlan: destination {entry.name!r} has elements that share memory (strides "
                f"{tuple(t.stride())}, e.g. from expand()); pass a tensor that owns its elements"
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
        if not isinstance(buckets, Sequence) or len(buckets) != self.manifest.num_buckets:
            got = len(buckets) if isinstance(buckets, Sequence) else type(buckets).__name__
            raise ValueError(
                f"UnpackPlan.unpack_into: got {got} buckets but the manifest has "
                f"{self.manifest.num_buckets}"
            )
        checked = [
            self._check_bucket(bucket, b, f"UnpackPlan.unpack_into: bucket {b}", True)
            for b, bucket in enumerate(buckets)
        ]
        self._run(checked, 0)

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
        where = f"UnpackPlan: bucket {bucket_index}"
        self._run([self._check_bucket(bucket, bucket_index, where, True)], bucket_index)


# --- Helpers -------------------------------------------------------------------------------------


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _check_alignment(alignment: Any, where: str) -> None:
    if (
        not _is_int(alignment)
        or alignment & (alignment - 1)
        or not MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT
    ):
        raise ValueError(
            f"{where}: alignment must be a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}], "
            f"got {alignment!r}"
        )


def _check_bucket_index(manifest: Manifest, bucket_index: Any) -> None:
    if not _is_int(bucket_index) or not 0 <= bucket_index < manifest.num_buckets:
        raise ValueError(
            f"bucket_index must be an int in [0, {manifest.num_buckets}), got {bucket_index!r}"
        )


def _check_num_threads(num_threads: Any) -> None:
    if not _is_int(num_threads) or not 0 <= num_threads <= MAX_THREADS:
        raise ValueError(
            f"num_threads must be in [0, {MAX_THREADS}] (0 = automatic), got {num_threads!r}"
        )


def _check_bucket_tensor(bucket: Any, size: int | None, where: str) -> None:
    if not isinstance(bucket, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(bucket).__name__}")
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(
            f"{where} must be a 1-D contiguous uint8 tensor, got {_dtype_name(bucket.dtype)} "
            f"of shape {tuple(bucket.shape)}"
        )
    if size is not None and bucket.numel() != size:
        raise ValueError(f"{where}: expected {size} bytes (the manifest's), got {bucket.numel()}")
    # Typed views of the bucket (and CUDA's 16-byte loads) need aligned bucket memory; every
    # allocation is, a slice at an odd offset is not.
    if bucket.numel() > 0 and bucket.data_ptr() % MIN_ALIGNMENT:
        raise ValueError(
            f"{where} must start at a {MIN_ALIGNMENT}-byte aligned address; pass a fresh "
            "allocation, not a slice at an odd offset"
        )


def _check_buckets(buckets: Sequence[torch.Tensor], manifest: Manifest, where: str) -> None:
    if not isinstance(buckets, Sequence):
        raise ValueError(f"{where}: buckets must be a sequence of tensors")
    if len(buckets) != manifest.num_buckets:
        raise ValueError(
            f"{where}: got {len(buckets)} buckets but the manifest has {manifest.num_buckets}"
        )
    for b, bucket in enumerate(buckets):
        _check_bucket_tensor(bucket, manifest.bucket_sizes[b], f"{where}: bucket {b}")
        if bucket.device != buckets[0].device:
            raise ValueError(
                f"{where}: bucket {b} is on {bucket.device} but bucket 0 on {buckets[0].device}"
            )


def _get_matching(
    named: Mapping[str, torch.Tensor], entry: TensorEntry, where: str, role: str
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


def _check_named_tensors(named_tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    if not isinstance(named_tensors, Mapping):
        raise ValueError(f"named_tensors must be a mapping, got {type(named_tensors).__name__}")
    for e in manifest.tensors:
        _get_matching(named_tensors, e, "pack", "tensor")
    known = set(manifest.names)
    extra = [name for name in named_tensors if name not in known]
    if extra:
        raise ValueError(
            f"pack: tensor {extra[0]!r} is not in the manifest ({len(extra)} such); plan the "
            "manifest from the same tensors"
        )


def _check_destination(
    destinations: Mapping[str, torch.Tensor],
    entry: TensorEntry,
    device: torch.device | None,
    bucket: torch.Tensor,
    where: str,
) -> None:
    if not isinstance(destinations, Mapping):
        raise ValueError(f"{where}: destinations must be a mapping name -> tensor")
    d = _get_matching(destinations, entry, where, "destination")
    if device is not None and d.device != device:
        raise ValueError(
            f"{where}: destination {entry.name!r}: expected device {device} (the buckets'), "
            f"got {d.device}"
        )
    if entry.nbytes == 0:
        return
    if _overlaps_itself(d):
        raise ValueError(
            f"{where}: destination {entry.name!r} has elements that share memory (strides "
            f"{tuple(d.stride())}, e.g. from expand()); pass a tensor that owns its elements"
        )
    if _shares_memory(d, bucket):
        raise ValueError(f"{where}: destination {entry.name!r} shares memory with its bucket")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True unless each stride clears the extent of all smaller ones (as the C++ core checks)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    extent = 0  # In elements, of the dims seen so far.
    for stride, size in dims:
        if stride < extent + 1:
            return True
        extent += (size - 1) * stride
    return False


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _typed_view(bucket: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The entry's bytes of ``bucket`` as a tensor of its dtype and shape (no copy)."""
    raw = bucket[entry.offset : entry.offset + entry.nbytes]
    return raw.view(entry.torch_dtype).view(entry.shape)


def _same_size_int_view(t: torch.Tensor) -> torch.Tensor:
    # detach: DLPack refuses tensors that require grad; the memory is the same.
    return t.detach().view(_SAME_SIZE_INT[t.element_size()])


_DATA_PTR = torch.Tensor.data_ptr  # Mapped over the tensors: cheaper than a comprehension.


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
