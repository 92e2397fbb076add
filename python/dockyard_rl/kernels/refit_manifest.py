"""The refit manifest: where every named tensor lies in the flat byte buckets of a weight sync.

Covered here:

- ``DTYPES``: the dtypes a manifest may name (torch's names without ``torch.``), and the dtype
  helpers the other refit modules share (``_dtype_name``, ``_numel``, ``_itemsize``).
- ``TensorEntry``: one tensor's name, dtype, shape, bucket, byte offset and byte size.
- ``Manifest``: every entry plus every bucket's size and the alignment; plain data
  (``to_dict`` / ``from_dict``, JSON-serialisable), validated whenever one is built, so a corrupt
  or mismatched manifest fails before any byte is copied.
- The validation helpers shared by the refit modules (``_check_alignment``,
  ``_check_bucket_index``); they start with ``_`` because they are not API.

Not covered: choosing the layout (refit_planning.py), copying bytes (refit_copy.py). The layout
rules and the sender/receiver usage are in refit_packer.py, the public facade.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.utils.config import is_int

# dtype name -> torch dtype, names as torch spells them without "torch.": the dtypes a manifest
# may name, and the repository's one name -> dtype map (policy.dtype, generation.dtype).
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
# Same bounds as the C++ core (cc/refit_packer.h: kMinAlignment, kMaxAlignment).
MIN_ALIGNMENT = 16
MAX_ALIGNMENT = 1 << 30
MANIFEST_FORMAT_VERSION = 1

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DTYPES",
    "MANIFEST_FORMAT_VERSION",
    "MAX_ALIGNMENT",
    "MIN_ALIGNMENT",
    "Manifest",
    "TensorEntry",
]


# --- Helpers shared by the refit modules ---------------------------------------------------------


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``; torch's spelling for dtypes outside ``DTYPES``."""
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _check_alignment(alignment: Any, where: str) -> None:
    if (
        not is_int(alignment)
        or alignment & (alignment - 1)
        or not MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT
    ):
        raise ValueError(
            f"{where}: alignment must be a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}], "
            f"got {alignment!r}"
        )


def _check_bucket_index(manifest: Manifest, bucket_index: Any) -> None:
    if not is_int(bucket_index) or not 0 <= bucket_index < manifest.num_buckets:
        raise ValueError(
            f"bucket_index must be an int in [0, {manifest.num_buckets}), got {bucket_index!r}"
        )


def _check_keys(data: Any, expected: set[str], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
    missing = sorted(expected - set(data))
    unknown = sorted(set(data) - expected)
    if missing:
        raise ValueError(f"{where} is missing keys {missing}")
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; valid keys: {sorted(expected)}")


# --- Manifest ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor in a manifest: ``nbytes`` bytes at ``offset`` in bucket ``bucket``.

    Raises ValueError on construction for an empty name, an unknown dtype, a bad shape, a negative
    or non-int bucket, offset or size, or a size that is not what the shape and dtype hold.
    """

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
            is_int(s) and s >= 0 for s in self.shape
        ):
            raise ValueError(f"{where}: shape must be a list of ints >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        for key in ("bucket", "offset", "nbytes"):
            value = getattr(self, key)
            if not is_int(value) or value < 0:
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
            if not is_int(size) or size < 0:
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
        for b, members in enumerate(self.bucket_members):
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
    def bucket_members(self) -> tuple[tuple[int, ...], ...]:
        """Per bucket, the indices (into ``tensors``) of its tensors, in manifest order."""
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
        return tuple(self.tensors[i] for i in self.bucket_members[bucket_index])

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
            raise ValueError(
                f"manifest.tensors must be a list, got {type(data['tensors']).__name__}"
            )
        entries = []
        fields = {f.name for f in dataclasses.fields(TensorEntry)}
        for i, item in enumerate(data["tensors"]):
            _check_keys(item, fields, f"manifest.tensors[{i}]")
            entries.append(TensorEntry(**{k: item[k] for k in fields}))
        return cls(
            tensors=tuple(entries), bucket_sizes=data["bucket_sizes"], alignment=data["alignment"]
        )
