"""Engine-side stand-ins for tests and benchmarks: a transport's receiver in its own process.

`start_receivers(transport, manifest, specs)` spawns one process per receive spec (as vLLM runs
each engine worker in its own process); each runs the transport's receiver `num_syncs` times
and reports ("ok", buckets as bytes | their total size, seconds) or ("error", message) on the
returned queue. For `http` the process serves an `HttpBucketReceiver` instead, expecting
versions 1 .. num_syncs, and first reports ("url", url, token).

`start_receivers` returns once every process has imported its transport and is about to
connect: a spawned process needs seconds to import torch on a loaded machine, and the sender's
peer timeout must measure the transfer, not that start-up.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from typing import Any

import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync import transport_registry

SPAWN = multiprocessing.get_context("spawn")
READY_TIMEOUT_S = 300.0  # a receiver's start-up: imports on a loaded machine


def _report(buckets: list[torch.Tensor], return_bytes: bool):
    if return_bytes:
        return [bytes(bucket.cpu().numpy()) for bucket in buckets]
    return sum(bucket.numel() for bucket in buckets)


def receiver_main(
    transport: str,
    manifest_dict: dict[str, Any],
    spec: dict[str, Any],
    num_syncs: int,
    results,
    return_bytes: bool,
    device: str = "cpu",
    ready=None,
) -> None:
    """The body of one receiver process (module docstring); puts its pid on `ready` once the
    transport is imported."""
    manifest = refit_packer.Manifest.from_dict(manifest_dict)
    try:
        # Its imports are part of the start-up.
        module = transport_registry.transport_module(transport)
        if ready is not None:
            ready.put(os.getpid())
        if transport == "http":
            asyncio.run(_serve_http(manifest, spec, num_syncs, results, return_bytes))
            return
        for version in range(1, num_syncs + 1):
            start = time.monotonic()
            buckets = module.receive_buckets(
                manifest, {**spec, "version": version}, 0, torch.device(device)
            )
            results.put(("ok", _report(buckets, return_bytes), time.monotonic() - start))
    except BaseException as error:  # reported to the parent
        results.put(("error", f"{type(error).__name__}: {error}", 0.0))


async def _serve_http(
    manifest: refit_packer.Manifest,
    spec: dict[str, Any],
    num_syncs: int,
    results,
    return_bytes: bool,
) -> None:
    from dockyard_rl.weight_sync.http_transport import HttpBucketReceiver

    buckets: dict[int, torch.Tensor] = {}

    async def deliver(index: int, data: bytes) -> None:
        buckets[index] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    receiver = HttpBucketReceiver(deliver)
    await receiver.start("127.0.0.1", manifest.max_bucket_size)
    results.put(("url", receiver.url, receiver.token))
    try:
        for version in range(1, num_syncs + 1):
            buckets.clear()
            receiver.expect(manifest, version)
            start = time.monotonic()
            await receiver.wait_complete(float(spec["timeout_s"]))
            ordered = [buckets[b] for b in range(manifest.num_buckets)]
            results.put(("ok", _report(ordered, return_bytes), time.monotonic() - start))
    finally:
        await receiver.stop()


def start_receivers(
    transport: str,
    manifest: refit_packer.Manifest,
    specs: list[dict[str, Any]],
    *,
    num_syncs: int = 1,
    return_bytes: bool = True,
    device: str = "cpu",
):
    """Spawns one receiver process per spec and waits until each is ready (module docstring);
    returns (processes, results queue)."""
    results, ready = SPAWN.Queue(), SPAWN.Queue()
    processes = [
        SPAWN.Process(
            target=receiver_main,
            daemon=True,
            args=(
                transport,
                manifest.to_dict(),
                spec,
                num_syncs,
                results,
                return_bytes,
                device,
                ready,
            ),
        )
        for spec in specs
    ]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get(timeout=READY_TIMEOUT_S)
    return processes, results
