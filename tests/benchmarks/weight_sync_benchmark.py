"""Benchmark: moving SmolLM2-135M's weights (~540 MB float32) from a trainer process to an
engine process, per weight-sync transport, against the object_store baseline and a memcpy.

    tools/bazel run //tests/benchmarks:weight_sync_benchmark [-- --repeats 3 --bucket-mb 64]

The sender runs in this process (as the trainer's rank 0 does); each receiver runs in a spawned
process (as each vLLM worker does) with the transport's real receiver (python/dockyard_rl/
weight_sync/testing_receivers.py): a gloo group, shared-memory segments announced over ZMQ, an
aiohttp endpoint. What is timed per sync: from the first bucket's packing to the last bucket
delivered (the sender's `finish`: broadcasts completed / mappings acknowledged / PUTs answered).
vLLM's reload into the model is NOT included (it is the same for every transport: ~4 s here, see
tests/weight_sync_test.py for the end-to-end figures).

Rows (median over `--repeats`, after one warm-up sync):
- memcpy: one `copy_` of the same number of bytes, in this process: the machine's limit.
- object_store: the baseline: the driver packs the buckets, `ray.put`s them, and an actor on the
  same node fetches them (`ray.get`) and copies them out of the object store, as the engine
  actor does with object_store buckets.
- collective / ipc_zmq / http with the configured bucket size, and collective with one message
  per tensor (a bucket per tensor: what a transport without bucketing would do).
Columns: seconds, GB/s, speed-up over object_store, and the fraction of memcpy bandwidth.
Nothing is asserted: a script that prints figures, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import ray
import torch

from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.kernels import refit_packer
from dockyard_rl.models import zoo
from dockyard_rl.weight_sync import sender_sessions, testing_receivers
from dockyard_rl.weight_sync.manifest_buckets import iter_manifest_buckets

TIMEOUT_S = 120.0


def load_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (path,) = zoo.resolve_model(zoo.SMOLLM2_NAME).glob("*.safetensors")
    return {name: tensor.float().contiguous() for name, tensor in load_file(str(path)).items()}


def time_push(
    transport: str, weights: dict[str, torch.Tensor], bucket_bytes: int, repeats: int
) -> list[float]:
    """Seconds per sync of `transport` to one receiver process (warm-up excluded)."""
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(weights), bucket_bytes)
    session = f"bench-{uuid.uuid4().hex[:8]}"
    num_syncs = repeats + 1
    options: dict = {"timeout_s": TIMEOUT_S}
    if transport == "collective":
        options.update(world_size=2, address="127.0.0.1")
    elif transport == "ipc_zmq":
        options.update(num_receivers=1)
    if transport == "http":
        processes, results = testing_receivers.start_receivers(
            "http", manifest, [{"timeout_s": TIMEOUT_S}], num_syncs=num_syncs, return_bytes=False
        )
        _, url, token = results.get(timeout=TIMEOUT_S)
        options["engines"] = [{"url": url, "token": token}]
    endpoint = sender_sessions.open_session(session, transport, manifest.to_dict(), options)
    if transport != "http":
        spec = {
            "transport": transport,
            "session": session,
            **endpoint,
            "world_size": 2,
            "rank_offset": 1,
            "timeout_s": TIMEOUT_S,
        }
        processes, results = testing_receivers.start_receivers(
            transport, manifest, [spec], num_syncs=num_syncs, return_bytes=False
        )
    seconds = []
    try:
        for version in range(1, num_syncs + 1):
            start = time.monotonic()
            sender_sessions.send_weights(
                session, manifest, version, iter_manifest_buckets(manifest, weights.items())
            )
            status, received, _ = results.get(timeout=TIMEOUT_S)
            seconds.append(time.monotonic() - start)
            if status != "ok" or received != manifest.total_bytes:
                raise RuntimeError(f"{transport}: the receiver reported {status}: {received}")
    finally:
        sender_sessions.close_session(session)
        for process in processes:
            process.join(30)
    return seconds[1:]


@ray.remote
class _ObjectStoreReceiver:
    """The engine actor's side of the object_store path: fetch, then copy out of the store."""

    def receive(self, buckets: list[torch.Tensor]) -> int:
        return sum(len(bytearray(bucket.numpy().data)) for bucket in buckets)


def time_object_store(
    weights: dict[str, torch.Tensor], bucket_bytes: int, repeats: int
) -> list[float]:
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(weights), bucket_bytes)
    receiver = _ObjectStoreReceiver.remote()
    seconds = []
    for _ in range(repeats + 1):
        start = time.monotonic()
        buckets = refit_packer.pack(weights, manifest)
        received = ray.get(receiver.receive.remote(ray.put(buckets)), timeout=TIMEOUT_S)
        seconds.append(time.monotonic() - start)
        assert received == manifest.total_bytes
    ray.kill(receiver)
    return seconds[1:]


def time_memcpy(num_bytes: int, repeats: int) -> list[float]:
    source = torch.ones(num_bytes, dtype=torch.uint8)
    destination = torch.empty_like(source)
    seconds = []
    for _ in range(repeats + 1):
        start = time.monotonic()
        destination.copy_(source)
        seconds.append(time.monotonic() - start)
    return seconds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument(
        "--transports",
        default="collective,ipc_zmq,http",
        help="comma-separated push transports to measure",
    )
    args = parser.parse_args()
    init_local_ray(num_cpus=2, log_to_driver=False)
    weights = load_weights()
    bucket_bytes = args.bucket_mb << 20
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(
        f"SmolLM2-135M: {len(weights)} tensors, {num_bytes / 1e6:.0f} MB float32; buckets of "
        f"{args.bucket_mb} MiB; median of {args.repeats} syncs after a warm-up"
    )
    rows = [
        ("memcpy (1 buffer)", time_memcpy(num_bytes, args.repeats)),
        ("object_store (baseline)", time_object_store(weights, bucket_bytes, args.repeats)),
    ]
    transports = [t for t in args.transports.split(",") if t]
    for transport in transports:
        rows.append((transport, time_push(transport, weights, bucket_bytes, args.repeats)))
    if "collective" in transports:
        # 256 B buckets: every tensor (all are larger) gets a bucket of its own.
        rows.append(
            ("collective, 1 msg/tensor", time_push("collective", weights, 256, args.repeats))
        )
    baseline = statistics.median(rows[1][1])
    memcpy = statistics.median(rows[0][1])
    print(f"{'row':28s} {'seconds':>8s} {'GB/s':>7s} {'vs object_store':>16s} {'of memcpy':>10s}")
    for name, seconds in rows:
        median = statistics.median(seconds)
        print(
            f"{name:28s} {median:8.3f} {num_bytes / median / 1e9:7.2f} "
            f"{baseline / median:15.2f}x {memcpy / median:9.1%}"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
