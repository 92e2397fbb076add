"""Splitting a batch into what a transport moves: tensors apart, small JSON-able rest apart.

A `BatchedDataDict` field is either a tensor with a leading batch dim (moved by the tensor
transport: RDT, or by reference in memory) or a list of per-sample values. Lists and the
metadata dict must be JSON-able and together at most `max_metadata_bytes` as JSON: they ride in
control messages, which Ray inlines only while small (under 100 KiB) — a larger one would be
stored in the object store, which the data plane exists to avoid. JSON-ability also keeps the
non-tensor part plain data (no pickled objects from the producer's code on the trainer side).

Checked here (ValueError naming the field): the batch is a valid BatchedDataDict with at least
one field, metadata is a dict with str keys, lists and metadata are JSON-able and small,
tensors live on a device the tensor transport can move (gloo: cpu, nccl: cuda).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch

from dockyard_rl.distributed.batched_data_dict import BatchedDataDict

# Which tensor device types each tensor transport can move; None = any.
DEVICE_TYPES_BY_TRANSPORT: dict[str, tuple[str, ...] | None] = {
    "in_memory": None,
    "gloo": ("cpu",),
    "nccl": ("cuda",),
    "nixl": None,
}


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A validated batch, split for transport.

    Attributes:
        field_order: every field name in the batch's order (restored on the receiver).
        tensors: the tensor fields (contiguous when `pack_batch(contiguous=True)`).
        lists: the list fields.
        metadata: the caller's metadata (a new dict; values are not copied).
    """

    field_order: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    lists: dict[str, list]
    metadata: dict[str, Any]

    def to_batch(self) -> BatchedDataDict:
        return assemble_batch(self.field_order, self.tensors, self.lists)


def assemble_batch(
    field_order: tuple[str, ...] | list[str],
    tensors: Mapping[str, torch.Tensor],
    lists: Mapping[str, list],
) -> BatchedDataDict:
    """The BatchedDataDict with fields in `field_order`, taken from `tensors` or `lists`."""
    return BatchedDataDict(
        {name: tensors[name] if name in tensors else lists[name] for name in field_order}
    )


def pack_batch(
    batch: BatchedDataDict | Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    *,
    max_metadata_bytes: int,
    tensor_transport: str,
    contiguous: bool = False,
) -> PackedBatch:
    """Validates `batch` and `metadata` (module docstring) and splits them.

    Args:
        contiguous: make every tensor contiguous (collective transports send raw buffers).

    Raises:
        ValueError: see the module docstring.
    """
    if not isinstance(batch, BatchedDataDict):
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"batch must be a BatchedDataDict (or a mapping of fields), got "
                f"{type(batch).__name__}"
            )
        batch = BatchedDataDict(batch)
    if not batch:
        raise ValueError("batch has no fields; send at least one tensor or list field")
    batch.batch_size  # noqa: B018 -- raises ValueError naming the fields if they are ragged
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise ValueError(f"metadata must be a dict with str keys, got {metadata!r:.200}")
    allowed_devices = DEVICE_TYPES_BY_TRANSPORT[tensor_transport]
    tensors: dict[str, torch.Tensor] = {}
    lists: dict[str, list] = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            if allowed_devices is not None and value.device.type not in allowed_devices:
                raise ValueError(
                    f"field {name!r} is on {value.device}, but tensor transport "
                    f"{tensor_transport!r} moves {'/'.join(allowed_devices)} "
                    f"tensors; move it with .to(...) or pick another "
                    f"data_plane.tensor_transport"
                )
            tensors[name] = value.contiguous() if contiguous else value
        else:
            lists[name] = value
    try:
        encoded = json.dumps({"metadata": dict(metadata), "lists": lists})
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"metadata and list fields must be JSON-able (str/int/float/bool/None "
            f"in lists and dicts): {error}; send numbers as tensor fields"
        ) from None
    num_bytes = len(encoded.encode())
    if num_bytes > max_metadata_bytes:
        raise ValueError(
            f"metadata + list fields take {num_bytes} bytes as JSON, above "
            f"data_plane.max_metadata_bytes={max_metadata_bytes}; move bulky "
            f"per-sample data into tensor fields (e.g. token ids) or raise the limit"
        )
    return PackedBatch(
        field_order=tuple(batch), tensors=tensors, lists=lists, metadata=dict(metadata)
    )
