"""The `weight_sync` config section: which transport moves the trainer's weights to the engine.

    weight_sync:
      transport: auto          # auto | collective | ipc_zmq | http | object_store
      bucket_size_bytes: 256MiB
      sync_timeout_s: 300      # one whole transfer, trainer -> every engine
      wake_timeout_s: 60
      peer_timeout_s: 60       # silence from a peer after which it is taken for dead
      http_host: 127.0.0.1     # where each engine's HTTP endpoint listens (transport: http)

`auto` picks `collective` when the trainer's sending rank and an engine sit on different Ray
nodes and `ipc_zmq` when they share one (factory.py). `object_store` (buckets through Ray's
object store and the driver) is the baseline the benchmark compares against.

Defaults live here; validation names the key and the fix.
"""

from __future__ import annotations

import dataclasses

from dockyard_rl.utils.byte_sizes import parse_byte_size
from dockyard_rl.utils.config import require
from dockyard_rl.weight_sync import transport_registry

# The refit packer's default alignment: bucket sizes are multiples of it.
BUCKET_ALIGNMENT = 256
TRANSPORTS = ("auto", *transport_registry.TRANSPORTS)


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
    transport: str = "auto"
    # Bytes or a string with a binary unit ("64MiB"). Bigger buckets mean fewer round trips and
    # more memory held twice (double buffering) on the sender.
    bucket_size_bytes: int | str = "256MiB"
    sync_timeout_s: float = 300.0
    wake_timeout_s: float = 60.0
    # How long a transport waits on its peer (a connection, one bucket, an acknowledgement)
    # before it concludes the peer died: the sync then fails within this time, not at
    # sync_timeout_s.
    peer_timeout_s: float = 60.0
    http_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        require(
            self.transport in TRANSPORTS,
            "transport",
            f"must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}",
        )
        object.__setattr__(
            self, "bucket_size_bytes", parse_byte_size(self.bucket_size_bytes, "bucket_size_bytes")
        )
        require(
            self.bucket_size_bytes % BUCKET_ALIGNMENT == 0,
            "bucket_size_bytes",
            f"must be a multiple of {BUCKET_ALIGNMENT} bytes (the refit packer's alignment), "
            f"got {self.bucket_size_bytes}; e.g. 64MiB",
        )
        for key in ("sync_timeout_s", "wake_timeout_s", "peer_timeout_s"):
            value = getattr(self, key)
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                key,
                f"must be a number of seconds > 0 (a sync must never wait forever), got {value!r}",
            )
        require(
            self.peer_timeout_s <= self.sync_timeout_s,
            "peer_timeout_s",
            f"must be <= sync_timeout_s ({self.sync_timeout_s}), got {self.peer_timeout_s}",
        )
        require(
            isinstance(self.http_host, str) and bool(self.http_host.strip()),
            "http_host",
            f"must be the address the engines' HTTP endpoints bind, e.g. 127.0.0.1 or "
            f"0.0.0.0, got {self.http_host!r}",
        )
