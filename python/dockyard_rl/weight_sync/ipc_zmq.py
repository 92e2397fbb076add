"""`transport: ipc_zmq` — trainer and engine on one node: the engine maps the trainer's buckets.

CPU (what runs here): the trainer's sending rank packs every bucket straight into its own
shared-memory segment (a file in /dev/shm, one per bucket, created on the first sync of the
session and reused by every later one) and announces it over ZMQ; each engine worker maps the
segment (`torch.from_file`, a private mapping: no copy through Ray, sockets or pickles) and
vLLM's reload reads the weights from those mappings. GPU (written, not run here: no GPU): the
buckets are CUDA tensors and the announcement carries their CUDA IPC handles
(`torch.multiprocessing.reductions.reduce_tensor`, what vLLM's `ipc_engine` uses too); the
engine rebuilds them without a copy.

ZMQ protocol (trainer binds a ROUTER on the node's address, each engine worker connects a
DEALER; JSON messages):

    worker -> trainer  {"hello": <session>, "version": v}       once per sync, before buckets
    trainer -> worker  {"bucket": b, "path"|"handle": ..., "size": n}   per bucket, as packed
    trainer -> worker  {"done": num_buckets}
    worker -> trainer  {"ack": num_buckets_mapped}

The trainer waits for every worker's hello before the first announcement and for every ack at
the end; each wait is bounded by `weight_sync.peer_timeout_s` (TimeoutError: the peer died).
Segments are written only inside a sync, and a sync starts only after the previous one's reload
finished, so a mapping is never read while the trainer rewrites it.

Memory: the segments hold one packed copy of the model for the session's lifetime (counted as
shared memory of the trainer's node); the engine adds nothing beyond vLLM's reload. Segments are
unlinked when the session closes or the process exits normally. A killed trainer cannot unlink
them, so their names carry their owner (pid, start time, pid namespace; utils/shared_memory.py),
`dockyard-refit-o<pid>.<start>.<pidns>-<session>-<bucket>`, and the next sender on the node (and
the launcher at start-up) reclaims the segments whose owner is dead; a live trainer's segments,
e.g. another run's on the same node, are never touched.

Trust: the CUDA IPC handle is a pickle, unpickled by the engine worker; it comes only from the
endpoint the driver handed to the worker (the trainer's own socket on this node), as with vLLM's
`ipc_engine`. Shared-memory paths are checked to be refit segments under /dev/shm.

What is vLLM's and what is ours: vLLM's `ipc_engine` is CUDA-only and ships handles through the
engine's own RPC; the shared-memory path, the ZMQ announcements and the manifest checks are ours.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import pickle
from typing import Any

import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.utils import shared_memory
from dockyard_rl.weight_sync.interfaces import BucketSender
from dockyard_rl.weight_sync.push_synchronizer import PushWeightSynchronizer

TRANSPORT = "ipc_zmq"
SHM_DIR = shared_memory.SHM_DIR
SEGMENT_PREFIX = "dockyard-refit-"


class IpcZmqWeightSynchronizer(PushWeightSynchronizer):
    """Weight sync through shared memory (CPU) or CUDA IPC (GPU), announced over ZMQ."""

    transport = TRANSPORT

    def _open_session(self, session: str) -> list[dict[str, Any]]:
        engines = self.generation.open_weight_receiver(TRANSPORT)
        endpoint = self.policy.open_weight_sender(
            session,
            TRANSPORT,
            self.manifest.to_dict(),
            {
                "num_receivers": sum(engine["num_workers"] for engine in engines),
                "timeout_s": self.config.peer_timeout_s,
            },
        )
        return [
            {
                "transport": TRANSPORT,
                "session": session,
                **endpoint,
                "timeout_s": self.config.peer_timeout_s,
            }
            for _ in engines
        ]


def _zmq_context():
    import zmq

    return zmq.Context.instance()


class IpcZmqBucketSender(BucketSender):
    """Owns the bucket segments and the ROUTER socket of one session."""

    # Every bucket has its own segment: packing never waits for a send.
    num_buffers = 0

    def __init__(self, manifest: refit_packer.Manifest, options: dict[str, Any]):
        import zmq

        super().__init__(manifest)
        self._session = options["session"]
        self._num_receivers = int(options["num_receivers"])
        self._timeout_ms = int(float(options["timeout_s"]) * 1000)
        self._device = torch.device(options.get("device", "cpu"))
        self._socket = _zmq_context().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        address = options.get("address", "127.0.0.1")
        self._port = self._socket.bind_to_random_port(f"tcp://{address}")
        self._address = address
        self._paths: list[str] = []
        self._segments: list[torch.Tensor] = []
        self._handles: list[str] = []
        self._receivers: list[bytes] = []
        if self._device.type != "cuda":
            # What killed trainers left (their owner is dead); never a live process's segments.
            shared_memory.reclaim_stale_segments(prefixes=(SEGMENT_PREFIX,))
            owner = shared_memory.owner_tag()
        for b, size in enumerate(manifest.bucket_sizes):
            if self._device.type == "cuda":
                segment = torch.empty(size, dtype=torch.uint8, device=self._device)
            else:
                path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{owner}-{self._session}-{b}")
                with open(path, "wb") as f:
                    f.truncate(size)
                self._paths.append(path)
                segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._segments.append(segment)
        atexit.register(self.close)

    def endpoint(self) -> dict[str, Any]:
        return {"endpoint": f"tcp://{self._address}:{self._port}"}

    def begin(self, manifest: refit_packer.Manifest, version: int) -> None:
        super().begin(manifest, version)
        self._receivers = []
        while len(self._receivers) < self._num_receivers:
            identity, message = self._receive("a worker's hello")
            if message.get("hello") == self._session and message.get("version") == version:
                self._receivers.append(identity)

    def buffer(self, bucket_index: int) -> torch.Tensor:
        return self._segments[bucket_index]

    def send(self, bucket_index: int, bucket: torch.Tensor) -> None:
        size = self.manifest.bucket_sizes[bucket_index]
        announcement: dict[str, Any] = {"bucket": bucket_index, "size": size}
        if self._device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream(self._device).synchronize()  # packed before announced
            announcement["handle"] = base64.b64encode(
                pickle.dumps(reduce_tensor(self._segments[bucket_index]))
            ).decode()
        else:
            announcement["path"] = self._paths[bucket_index]
        for identity in self._receivers:
            self._socket.send_multipart([identity, _dumps(announcement)])

    def finish(self) -> None:
        for identity in self._receivers:
            self._socket.send_multipart([identity, _dumps({"done": self.manifest.num_buckets})])
        acked = set()
        while len(acked) < len(self._receivers):
            identity, message = self._receive("a worker's acknowledgement")
            if "error" in message:
                raise RuntimeError(
                    f"ipc_zmq transport: an engine worker failed to map the "
                    f"buckets: {message['error']}"
                )
            if message.get("ack") == self.manifest.num_buckets:
                acked.add(identity)

    def _receive(self, what: str) -> tuple[bytes, dict[str, Any]]:
        if not self._socket.poll(self._timeout_ms):
            raise TimeoutError(
                f"ipc_zmq transport: no message from the engine workers within "
                f"{self._timeout_ms / 1000:g}s while waiting for {what}; an "
                "engine died or stopped answering"
            )
        identity, payload = self._socket.recv_multipart()
        return identity, _loads(payload)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self._segments = []
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []


def create_sender(manifest: refit_packer.Manifest, options: dict[str, Any]) -> BucketSender:
    return IpcZmqBucketSender(manifest, options)


def receive_buckets(
    manifest: refit_packer.Manifest, spec: dict[str, Any], worker_rank: int, device: torch.device
) -> list[torch.Tensor]:
    """Engine worker side: says hello, maps every announced bucket, acknowledges.

    Raises TimeoutError when the trainer stays silent for `spec["timeout_s"]`, ValueError for an
    announcement that does not match the manifest.
    """
    import zmq

    timeout_ms = int(float(spec["timeout_s"]) * 1000)
    socket = _zmq_context().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(spec["endpoint"])
    buckets: list[torch.Tensor | None] = [None] * manifest.num_buckets
    try:
        socket.send(_dumps({"hello": spec["session"], "version": spec["version"]}))
        while True:
            if not socket.poll(timeout_ms):
                raise TimeoutError(
                    f"ipc_zmq transport: the trainer sent nothing for "
                    f"{timeout_ms / 1000:g}s; it died or stopped answering"
                )
            message = _loads(socket.recv())
            if "done" in message:
                break
            try:
                b, size = int(message["bucket"]), int(message["size"])
                if not 0 <= b < manifest.num_buckets or size != manifest.bucket_sizes[b]:
                    raise ValueError(
                        f"announced bucket {b} of {size} bytes does not match the "
                        f"manifest ({manifest.num_buckets} buckets)"
                    )
                buckets[b] = _map_bucket(message, size, device)
            except Exception as error:
                socket.send(_dumps({"error": f"{type(error).__name__}: {error}"}))
                raise
        missing = [b for b, bucket in enumerate(buckets) if bucket is None]
        if missing:
            raise ValueError(f"ipc_zmq transport: the trainer finished without buckets {missing}")
        socket.send(_dumps({"ack": manifest.num_buckets}))
    finally:
        socket.close(linger=1000)
    return buckets


def _map_bucket(message: dict[str, Any], size: int, device: torch.device) -> torch.Tensor:
    if "handle" in message:
        rebuild, args = pickle.loads(base64.b64decode(message["handle"]))
        return rebuild(*args)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    path = message["path"]
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(SEGMENT_PREFIX):
        raise ValueError(f"announced segment {path!r} is not a dockyard refit segment in {SHM_DIR}")
    # Private mapping: the pages are the trainer's until written (the engine never writes them).
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def _dumps(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def _loads(payload: bytes) -> dict[str, Any]:
    return json.loads(payload)
