"""Picks the weight-sync transport: `create_weight_synchronizer(config, policy, generation)`.

`weight_sync.transport` names one of transport_registry's `TRANSPORTS`; `auto` decides from the
deployment's topology: `ipc_zmq` when every engine runs on the Ray node of the trainer's sending
rank (shared memory / CUDA IPC, no network), else `collective` (one gloo/NCCL group across
nodes). `http` is never chosen automatically: it is for layouts without a shared Ray cluster or
network fabric, which only the operator knows about.

`policy` and `generation` are typed by what weight_sync needs from them (`WeightSource`,
`WeightSink` in interfaces.py), so weight_sync imports nothing from models/.
"""

from __future__ import annotations

from collections.abc import Callable

from dockyard_rl.weight_sync import transport_registry
from dockyard_rl.weight_sync.config import WeightSyncConfig
from dockyard_rl.weight_sync.interfaces import WeightSink, WeightSource, WeightSynchronizer


def resolve_transport(
    config: WeightSyncConfig, sender_node_id: str | None, engine_node_ids: list[str]
) -> str:
    """The transport `config.transport` means for this topology (module docstring)."""
    if config.transport != "auto":
        return config.transport
    same_node = sender_node_id is not None and all(n == sender_node_id for n in engine_node_ids)
    return "ipc_zmq" if same_node else "collective"


def create_weight_synchronizer(
    config: WeightSyncConfig, policy: WeightSource, generation: WeightSink
) -> WeightSynchronizer:
    """The synchronizer of the configured (or, for auto, topology-chosen) transport.

    Raises:
        ValueError: an unknown transport, or the engine rejects the trainer's refit info.
    """
    if not isinstance(config, WeightSyncConfig):
        raise ValueError(
            f"create_weight_synchronizer needs a WeightSyncConfig, got "
            f"{type(config).__name__}; build it with from_dict(WeightSyncConfig, "
            "yaml['weight_sync'], 'weight_sync')"
        )
    transport = resolve_transport(
        config, policy.weight_sender_node_id(), generation.engine_node_ids()
    )
    module = transport_registry.transport_module(transport)
    synchronizer: Callable[..., WeightSynchronizer] = getattr(
        module, transport_registry.TRANSPORTS[transport][1]
    )
    return synchronizer(config, policy, generation)
