"""Config section `data_plane`: how experience moves from the generation side to the trainer.

    data_plane: null                 # the in-memory path (producer and trainer share a process)

    data_plane:
      transport: ray_direct          # in_memory | ray_direct
      tensor_transport: gloo         # ray_direct only: gloo (CPU) | nccl (CUDA) | nixl
      max_in_flight_batches: 4       # per trainer-side receiver: reserved + delivered, unconsumed
      backpressure_timeout_s: 300    # a producer's send waits this long for a free slot
      transfer_timeout_s: 30         # one transfer (reserve, tensors, acknowledgement)
      receive_timeout_s: 600         # the trainer's receive waits this long for a batch
      max_metadata_bytes: 65536      # JSON size of metadata + list fields of one batch

`parse_data_plane_config(raw)` returns None for a null/absent section (the factory then builds
the in-memory data plane with the defaults below) and a validated `DataPlaneConfig` otherwise.
Every error names the key (`data_plane.max_in_flight_batches: ...`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dockyard_rl.utils.config import from_dict, is_int, is_number, require

TRANSPORTS = ("in_memory", "ray_direct")
TENSOR_TRANSPORTS = ("gloo", "nccl", "nixl")


@dataclasses.dataclass(frozen=True)
class DataPlaneConfig:
    """YAML section `data_plane` (module docstring).

    Attributes:
        transport: `in_memory` (one process; the colocated path, and what `data_plane: null`
            selects) or `ray_direct` (producer actor -> trainer actor over Ray Direct Transport).
        tensor_transport: the RDT backend for `ray_direct`: `gloo` moves CPU tensors over TCP,
            `nccl` CUDA tensors GPU to GPU, `nixl` (one-sided RDMA/UCX) either. Ignored by
            `in_memory`.
        max_in_flight_batches: how many batches one receiver holds at most: reserved for a
            transfer plus delivered but not yet taken by `receive`. A producer whose send would
            exceed it waits (back-pressure), then raises BackpressureTimeoutError.
        backpressure_timeout_s: how long `send` waits for a free slot, seconds > 0.
        transfer_timeout_s: deadline of one transfer (slot request, tensors, acknowledgement),
            seconds > 0; a transfer that misses it raises DataPlaneTransportError. Keep it under
            Ray's own RDT limit (RAY_rdt_fetch_fail_timeout_milliseconds, 60 s), past which Ray
            kills both actors of a stuck collective transfer (ray_direct.py).
        receive_timeout_s: how long `receive` waits for a batch, seconds > 0.
        max_metadata_bytes: upper bound on the JSON size of one batch's metadata dict plus its
            list fields. Keeps the non-tensor part small enough to ride inline in Ray's task
            messages (Ray inlines up to 100 KiB), so nothing of a batch lands in the object store.
    """

    transport: str = "ray_direct"
    tensor_transport: str = "gloo"
    max_in_flight_batches: int = 4
    backpressure_timeout_s: float = 300.0
    transfer_timeout_s: float = 30.0
    receive_timeout_s: float = 600.0
    max_metadata_bytes: int = 65536

    def __post_init__(self) -> None:
        require(
            self.transport in TRANSPORTS,
            "transport",
            f"unknown transport {self.transport!r}; valid: {', '.join(TRANSPORTS)} (or set "
            f"data_plane: null for the in-memory path)",
        )
        require(
            self.tensor_transport in TENSOR_TRANSPORTS,
            "tensor_transport",
            f"unknown tensor transport {self.tensor_transport!r}; valid: "
            f"{', '.join(TENSOR_TRANSPORTS)} (gloo for CPU tensors, nccl for CUDA tensors)",
        )
        require(
            is_int(self.max_in_flight_batches) and self.max_in_flight_batches >= 1,
            "max_in_flight_batches",
            f"must be an integer >= 1 (batches a receiver holds before producers wait), got "
            f"{self.max_in_flight_batches!r}",
        )
        for key in ("backpressure_timeout_s", "transfer_timeout_s", "receive_timeout_s"):
            value = getattr(self, key)
            require(
                is_number(value) and value > 0,
                key,
                f"must be a number of seconds > 0 (the data plane never waits forever), got "
                f"{value!r}",
            )
        require(
            is_int(self.max_metadata_bytes) and 0 < self.max_metadata_bytes <= 100 * 1024,
            "max_metadata_bytes",
            f"must be an integer in [1, 102400] (Ray inlines task arguments up to 100 KiB; "
            f"larger ones would go through the object store), got "
            f"{self.max_metadata_bytes!r}",
        )


def parse_data_plane_config(
    raw: Mapping[str, Any] | None, key_path: str = "data_plane"
) -> DataPlaneConfig | None:
    """The `data_plane` YAML value -> None (null: in-memory path) or a validated config.

    Raises:
        ValueError: not a mapping, an unknown key, or an invalid value; the message names the
            key (e.g. `data_plane.max_in_flight_batches: must be an integer >= 1 ...`).
    """
    if raw is None:
        return None
    return from_dict(DataPlaneConfig, raw, key_path)
