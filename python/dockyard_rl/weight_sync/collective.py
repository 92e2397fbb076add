"""`transport: collective` — a process group spanning the trainer's sending rank and every
engine worker; the refit buckets are broadcast from the trainer one by one.

    world rank 0                trainer rank 0 (root of every broadcast)
    world ranks 1 .. N          the engines' workers: engine e, tensor-parallel rank r at
                                1 + (workers of engines before e) + r

Backend: gloo on CPU (what runs on this machine), NCCL on GPU (written, not run here: no GPU).
The group is stateless as far as torch.distributed goes: built from its own TCPStore (served by
the trainer's sending rank on a free port) with `ProcessGroupGloo` / `ProcessGroupNCCL`
directly, never through `init_process_group`, so it lives beside the trainer's FSDP group and
vLLM's own groups without touching either. It is created on the first sync of a session and
reused; a failed sync closes the session, and the retry builds a new group (new store, new port).

Double buffering: the trainer packs bucket b+1 into the second pack buffer while the
asynchronous broadcast of bucket b is in flight (gloo/NCCL run it on their own threads/stream);
a buffer is reused only after its broadcast completed. Engine workers post every bucket's
broadcast into its own receive buffer (they keep all buckets until the reload anyway) and wait.

Timeouts: the group's timeout is `weight_sync.peer_timeout_s`; a peer that dies mid-transfer
makes the others' broadcasts fail (gloo: connection closed, at once; a silent peer: at the
timeout), reported as TimeoutError.

What is vLLM's and what is ours: vLLM's `weight_transfer` NCCL engine broadcasts with PyNccl
(GPU only) and packs with its own `packed_tensor` layout, and needs the engine built with a
`weight_transfer_config`; it does not cover gloo on CPU nor our manifest checks. So the group,
the bucket broadcast and its buffering are ours (on the refit packer's manifest), and on the
engine side we use vLLM's worker-extension hook, `collective_rpc` and `Worker.reload_weights`
(see vllm_worker_extension.py).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync.interfaces import BucketSender
from dockyard_rl.weight_sync.push_synchronizer import PushWeightSynchronizer

TRANSPORT = "collective"


class CollectiveWeightSynchronizer(PushWeightSynchronizer):
    """Weight sync over a gloo (CPU) / NCCL (GPU) group of trainer rank 0 + engine workers."""

    transport = TRANSPORT

    def _open_session(self, session: str) -> list[dict[str, Any]]:
        engines = self.generation.open_weight_receiver(TRANSPORT)
        world_size = 1 + sum(engine["num_workers"] for engine in engines)
        endpoint = self.policy.open_weight_sender(
            session,
            TRANSPORT,
            self.manifest.to_dict(),
            {"world_size": world_size, "timeout_s": self.config.peer_timeout_s},
        )
        specs, rank_offset = [], 1
        for engine in engines:
            specs.append(
                {
                    "transport": TRANSPORT,
                    "session": session,
                    **endpoint,
                    "world_size": world_size,
                    "rank_offset": rank_offset,
                    "timeout_s": self.config.peer_timeout_s,
                }
            )
            rank_offset += engine["num_workers"]
        return specs


def _make_group(store, rank: int, world_size: int, timeout_s: float, device: torch.device):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(group, tensor: torch.Tensor):
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


def _peer_error(where: str, error: BaseException) -> TimeoutError:
    return TimeoutError(
        f"collective transport: {where} failed; a peer died or stopped answering "
        f"({type(error).__name__}: {error})"
    )


class CollectiveBucketSender(BucketSender):
    """World rank 0: serves the group's store, broadcasts the buckets (double-buffered)."""

    def __init__(self, manifest: refit_packer.Manifest, options: dict[str, Any]):
        from torch.distributed import PrefixStore, TCPStore

        super().__init__(manifest)
        self._world_size = int(options["world_size"])
        self._timeout_s = float(options["timeout_s"])
        self._device = torch.device(options.get("device", "cpu"))
        self._address = options.get("address") or _node_ip()
        # Port 0: the OS picks a free port, so two sessions never collide.
        self._tcp_store = TCPStore(
            self._address,
            0,
            self._world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=self._timeout_s),
            wait_for_workers=False,
        )
        self._store = PrefixStore(options["session"], self._tcp_store)
        self._group = None
        self._buffers = [
            torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device=self._device)
            for _ in range(self.num_buffers)
        ]
        self._in_flight: list[Any] = [None] * self.num_buffers

    def endpoint(self) -> dict[str, Any]:
        return {"master_addr": self._address, "master_port": self._tcp_store.port}

    def begin(self, manifest: refit_packer.Manifest, version: int) -> None:
        super().begin(manifest, version)
        if self._group is None:
            try:  # blocks until every engine worker joined (or the timeout)
                self._group = _make_group(
                    self._store, 0, self._world_size, self._timeout_s, self._device
                )
            except RuntimeError as error:
                raise _peer_error("forming the group with the engine workers", error) from error

    def buffer(self, bucket_index: int) -> torch.Tensor:
        slot = bucket_index % self.num_buffers
        self._wait(slot)
        return self._buffers[slot]

    def send(self, bucket_index: int, bucket: torch.Tensor) -> None:
        try:
            self._in_flight[bucket_index % self.num_buffers] = _broadcast(self._group, bucket)
        except RuntimeError as error:
            raise _peer_error(f"broadcasting bucket {bucket_index}", error) from error

    def finish(self) -> None:
        for slot in range(self.num_buffers):
            self._wait(slot)

    def _wait(self, slot: int) -> None:
        work, self._in_flight[slot] = self._in_flight[slot], None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as error:
                raise _peer_error("a bucket broadcast", error) from error

    def close(self) -> None:
        self._group = None
        self._in_flight = [None] * self.num_buffers


def create_sender(manifest: refit_packer.Manifest, options: dict[str, Any]) -> BucketSender:
    return CollectiveBucketSender(manifest, options)


# The engine worker's group of the current session (a worker takes part in one session).
_RECEIVER_GROUP: dict[str, Any] = {}


def receive_buckets(
    manifest: refit_packer.Manifest, spec: dict[str, Any], worker_rank: int, device: torch.device
) -> list[torch.Tensor]:
    """Engine worker side: joins the session's group (once) and receives every bucket.

    `worker_rank` is the worker's tensor-parallel rank within its engine. Raises TimeoutError
    when the trainer dies or stays silent for `spec["timeout_s"]`.
    """
    from torch.distributed import PrefixStore, TCPStore

    session = spec["session"]
    group = _RECEIVER_GROUP.get(session)
    try:
        if group is None:
            _RECEIVER_GROUP.clear()  # a new session replaces a broken one
            store = TCPStore(
                spec["master_addr"],
                int(spec["master_port"]),
                int(spec["world_size"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=float(spec["timeout_s"])),
            )
            group = _make_group(
                PrefixStore(session, store),
                int(spec["rank_offset"]) + worker_rank,
                int(spec["world_size"]),
                float(spec["timeout_s"]),
                device,
            )
            _RECEIVER_GROUP[session] = group
        buckets = [
            torch.empty(size, dtype=torch.uint8, device=device) for size in manifest.bucket_sizes
        ]
        works = [_broadcast(group, bucket) for bucket in buckets]
        for work in works:
            work.wait()
    except RuntimeError as error:
        _RECEIVER_GROUP.pop(session, None)
        raise _peer_error("receiving the buckets from the trainer", error) from error
    return buckets


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
