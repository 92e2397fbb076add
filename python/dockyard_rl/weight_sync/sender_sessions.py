"""The trainer side of every push transport: one sender per session, one bucket loop for all.

A *session* is one transport connection between the trainer's sending rank and the engines,
opened once and reused for every sync (a process group, a ZMQ socket and shared-memory
segments, an HTTP client). The driver's synchronizer opens it through the policy
(`WeightSource.open_weight_sender`), which calls `open_session` in the process of the sending
rank: it creates the transport's `BucketSender` (found in transport_registry) and keeps it in
this module's table under the session id; every sync then calls `send_weights` there; a failed
sync closes the session and the retry opens a new one.

Which rank sends: trainer rank 0 only. Every trainer rank joins the all-gather of each bucket's
tensors (FSDP shards -> full tensors, inside the policy), and rank 0 packs and sends the bucket.
The engine needs full HF tensors (vLLM's loader re-shards them for its own tensor parallelism),
so the all-gather happens anyway; doing it inside the trainer (its fast interconnect) and
crossing to the engine once keeps the cross-fleet link at one model copy per engine, where
every rank sending its own shard would need the engine to re-assemble shards of a layout it
does not know.

The bucket loop (`send_weights`) double-buffers: a sender lends at most `num_buffers` pack
buffers; packing bucket b+1 (and, in the policy, gathering it) overlaps the send of bucket b,
and a buffer is handed out again only after the send that used it completed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync import transport_registry
from dockyard_rl.weight_sync.interfaces import BucketSender


@dataclasses.dataclass
class _Session:
    sender: BucketSender
    # Built once per session: validates the layout once; each bucket is then one native call.
    pack_plan: refit_packer.PackPlan


# Sessions of this process: session id -> sender and pack plan. Created by the policy in the
# sending rank's process and used by later calls into that same process.
_SESSIONS: dict[str, _Session] = {}
_SESSIONS_LOCK = threading.Lock()


def open_session(
    session: str, transport: str, manifest_dict: Mapping[str, Any], options: Mapping[str, Any]
) -> dict[str, Any]:
    """Creates the sender of `transport` for `session` (idempotent); returns its endpoint.

    Raises:
        ValueError: an unknown transport, or a bad manifest.
    """
    with _SESSIONS_LOCK:
        if session not in _SESSIONS:
            manifest = refit_packer.Manifest.from_dict(manifest_dict)
            module = transport_registry.transport_module(transport)
            _SESSIONS[session] = _Session(
                module.create_sender(manifest, {**options, "session": session}),
                refit_packer.PackPlan(manifest),
            )
        return _SESSIONS[session].sender.endpoint()


def close_session(session: str) -> None:
    """Closes and forgets `session`; unknown sessions are ignored (idempotent)."""
    with _SESSIONS_LOCK:
        closing = _SESSIONS.pop(session, None)
    if closing is not None:
        closing.sender.close()


def close_all_sessions() -> None:
    """Closes every session of this process (idempotent). For a policy worker's `shutdown`: Ray
    kills the worker's process right after, and a killed process unlinks nothing (ipc_zmq's
    shared-memory segments would stay in /dev/shm until the next run reclaims them)."""
    with _SESSIONS_LOCK:
        closing = list(_SESSIONS.values())
        _SESSIONS.clear()
    for session in closing:
        session.sender.close()


def send_weights(
    session: str,
    manifest: refit_packer.Manifest,
    version: int,
    buckets: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
) -> dict[str, float]:
    """Packs and sends every bucket through `session`'s sender; returns timing figures.

    `buckets` yields (bucket index, name -> full tensor of that bucket) in bucket order; the
    tensors may be freed once the next item is requested. Raises KeyError for an unknown
    session; anything the sender raises (the session should then be closed).
    """
    with _SESSIONS_LOCK:
        if session not in _SESSIONS:
            raise KeyError(
                f"weight-sync session {session!r} is not open in this process; "
                "open_weight_sender must run first on the sending rank"
            )
        sender, pack_plan = _SESSIONS[session].sender, _SESSIONS[session].pack_plan
    start = time.monotonic()
    sender.begin(manifest, version)
    pack_seconds = 0.0
    expected = 0
    for bucket_index, named in buckets:
        if bucket_index != expected:
            raise ValueError(f"buckets must come in order: got {bucket_index}, expected {expected}")
        out = sender.buffer(bucket_index)
        packing = time.monotonic()
        # The sender's buffers decide the device (e.g. CPU buckets for HTTP from a GPU trainer).
        named = {name: tensor.to(out.device) for name, tensor in named.items()}
        bucket = pack_plan.pack_bucket(named, bucket_index, out=out)
        pack_seconds += time.monotonic() - packing
        sender.send(bucket_index, bucket)
        expected += 1
    if expected != manifest.num_buckets:
        raise ValueError(f"got {expected} buckets but the manifest has {manifest.num_buckets}")
    sender.finish()
    return {
        "send_seconds": time.monotonic() - start,
        "pack_seconds": pack_seconds,
        "num_bytes": float(manifest.total_bytes),
    }
