"""The transports by name: `weight_sync.transport` -> the module that implements it.

A leaf: it imports no other module of the project, so every process that needs a transport's
half (the trainer's sending rank: `sender_sessions`; an engine worker: `receive_buckets`; the
driver: the synchronizer, factory.py) resolves it here without importing the others' halves or
the factory. Modules are imported on first use, by name (as vLLM's `WeightTransferEngineFactory`
does): a process imports only the transport it runs, and a transport's heavy dependencies (ZMQ,
aiohttp, process groups) stay out of processes that never use them.

What a transport module provides:
  TRANSPORT                   its name, the key here
  <Transport>WeightSynchronizer  the driver side (a `push_synchronizer.PushWeightSynchronizer`)
  create_sender(manifest, options) -> BucketSender      the trainer side (push transports)
  receive_buckets(manifest, spec, rank, device) -> list[torch.Tensor]   the engine side
`object_store` has no sender or receiver: its buckets travel through the driver.
"""

from __future__ import annotations

import importlib
import types

# transport -> (module, synchronizer class). The order is the one config errors list.
TRANSPORTS = {
    "collective": ("dockyard_rl.weight_sync.collective", "CollectiveWeightSynchronizer"),
    "ipc_zmq": ("dockyard_rl.weight_sync.ipc_zmq", "IpcZmqWeightSynchronizer"),
    "http": ("dockyard_rl.weight_sync.http_transport", "HttpWeightSynchronizer"),
    "object_store": ("dockyard_rl.weight_sync.object_store", "ObjectStoreWeightSynchronizer"),
}


def transport_module(transport: str) -> types.ModuleType:
    """The module implementing `transport` (its synchronizer, sender and receiver).

    Raises:
        ValueError: an unknown transport; the message lists the valid ones.
    """
    if transport not in TRANSPORTS:
        raise ValueError(
            f"weight_sync.transport: unknown transport {transport!r}; valid: "
            f"{', '.join(TRANSPORTS)} (or auto)"
        )
    return importlib.import_module(TRANSPORTS[transport][0])
