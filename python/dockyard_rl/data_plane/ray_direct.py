"""The Ray Direct Transport data plane: batches go from a producer actor's memory straight into
a trainer actor's memory; neither the driver nor Ray's object store ever holds their bytes.

Which transport moves what, and why:

- Tensors: Ray Direct Transport (RDT, `tensor_transport=` on an actor method; alpha in Ray
  2.60). The producer stages the batch's tensors and calls a method ON ITSELF with
  `tensor_transport=gloo|nccl|nixl`; the ObjectRef it gets back is owned by the producer and
  points at tensors that stay in the producer's process. Passing that ref to the receiver's
  `_deliver` task makes Ray run a send task on the producer and a receive task on the receiver
  (`_ray_system` concurrency group on both): a point-to-point gloo (CPU, TCP) / NCCL (GPU) send,
  or a NIXL one-sided read. Chosen over a socket or shared-memory protocol of our own because
  it is Ray's supported path, the same code moves CUDA tensors over NCCL/NIXL on GPU clusters,
  and across nodes. (On one CPU node gloo goes through loopback TCP; a shared-memory transport
  would copy less. The benchmark tests/benchmarks/data_plane_benchmark.py measures this path
  against the object store.)
- Control (slot reservation, sequence numbers, acknowledgements, list fields, metadata):
  ordinary Ray actor calls with small arguments and results, which Ray inlines in its task
  messages (< 100 KiB; `max_metadata_bytes` keeps it so), so they do not use the object store
  either. No ZMQ or shared memory was needed: RDT's alpha limits were worked around instead
  (next list).

RDT alpha limits met, and what this module does about them:

1. A collective group (gloo/NCCL) is known only to the process that created it (Ray keeps
   groups in a per-process registry), but the RDT send is started by whoever owns the ref —
   here the producer. `connect` creates ONE group with every receiver and producer on the
   driver, then registers the same communicator handle in each producer's registry
   (`ray.experimental.collective.collective.RemoteCommunicatorManager`, an internal class:
   the one private API used here; remove when Ray shares groups).
2. An actor can be in one RDT group per backend, so one plane covers all producers and
   receivers (several receivers = several trainer ranks) and an actor cannot be in two planes
   with the same backend: `connect` raises ValueError.
3. A collective transfer cannot be aborted: when an RDT send/recv fails or exceeds
   RAY_rdt_fetch_fail_timeout_milliseconds (60 s), Ray kills BOTH actors and destroys the
   group. The sender's own deadline (`transfer_timeout_s`, 30 s by default) surfaces a
   DataPlaneTransportError first; the run should treat it as fatal for that channel.
4. Membership is fixed at `connect` (gloo/NCCL world sizes are static).

Requirements on the actor classes (checked at `connect` where Ray allows):
declare both producer and receiver classes with `@ray.remote(**data_plane_actor_options())`:
`enable_tensor_transport=True` (gives them the `_ray_system` thread RDT transfers run on) and a
`data_plane` concurrency group. The producer's `send` blocks the thread that calls it while the
producer's `_emit` and the receiver's `_reserve`/`_deliver` run on their `data_plane` threads,
so a trainer whose loop blocks in `receive()` on its main thread still takes deliveries. Ray
cannot tell whether an actor declared that group, and a call into a missing group kills the
actor: `connect` installs the plane through that group, so a class without it fails there,
at setup, with a ValueError naming the fix.

Protocol per batch (flow_control.py decides, this module moves): reserve a slot on the receiver
(inline call; polled with backoff while FULL) -> stage tensors, `_emit` on self with RDT ->
`_deliver(ref, seq, lists, metadata)` on the receiver (its argument resolution waits for the
RDT receive) -> acknowledgement -> the ref is dropped and Ray frees the producer's copy. `send`
returns after the acknowledgement, so the receiver has its own copy by then: the producer may
reuse its tensors afterwards (RDT keeps a reference, not a copy, until then).

Not covered / tested: NCCL and NIXL run only on GPU machines (the code path is the same; not
exercised on these CPU machines), async (asyncio) actors, adding producers after `connect`.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch

from dockyard_rl.data_plane.config import DataPlaneConfig
from dockyard_rl.data_plane.flow_control import (
    ReceiverState,
    Reply,
    SequencedSender,
    StateReceiver,
    Verdict,
    transport_error,
)
from dockyard_rl.data_plane.interfaces import (
    DataPlane,
    DataPlaneClosedError,
    DataPlaneEndpoints,
    DataPlaneError,
    Delivery,
    EndpointSpec,
)
from dockyard_rl.data_plane.payload import PackedBatch, assemble_batch

DATA_PLANE_CONCURRENCY_GROUP = "data_plane"
# Tensor transports that need a collective group (NIXL is one-sided: no group).
_COLLECTIVE_BACKENDS = ("gloo", "nccl")


def data_plane_actor_options(num_threads: int = 4) -> dict[str, Any]:
    """Options for `@ray.remote(**...)` of every producer and receiver actor class.

    `num_threads`: threads of the `data_plane` concurrency group (deliveries from several
    producers are accepted concurrently). Merge by hand if the class has other groups.
    """
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
    return {
        "enable_tensor_transport": True,
        "concurrency_groups": {DATA_PLANE_CONCURRENCY_GROUP: num_threads},
    }


# --------------------------------------------------------------- per-process endpoint registry
# Filled by the install functions below, which `connect` runs in every actor of a plane.

_registry_lock = threading.Lock()
_receiver_states: dict[tuple[str, int], ReceiverState] = {}  # (plane, receiver index)
_receivers: dict[tuple[str, int], StateReceiver] = {}
_senders: dict[tuple[str, int, int], RayDirectSender] = {}  # (plane, producer, receiver)
_producer_planes: dict[str, str | None] = {}  # plane -> communicator name
_staged: dict[str, dict[str, torch.Tensor]] = {}  # transfer key -> tensors


def _register_communicator(communicator: Any) -> None:
    """Makes a driver-created collective group usable for RDT sends started in this process
    (alpha limit 1 of the module docstring)."""
    from ray.experimental.collective.collective import RemoteCommunicatorManager

    RemoteCommunicatorManager.get().add_remote_communicator(communicator)


def _unregister_communicator(name: str) -> None:
    from ray.experimental.collective.collective import RemoteCommunicatorManager

    RemoteCommunicatorManager.get().remove_remote_communicator(name)


# Functions run inside the actors through `actor.__ray_call__` (`_actor` is the actor instance,
# unused): module-level so Ray pickles them by reference.


def _install_receiver(_actor: Any, plane: str, index: int, capacity: int) -> None:
    with _registry_lock:
        _receiver_states[(plane, index)] = ReceiverState(
            capacity, name=f"data plane {plane} receiver {index}"
        )


def _install_producer(_actor: Any, plane: str, communicator: Any | None) -> None:
    if communicator is not None:
        _register_communicator(communicator)
    with _registry_lock:
        _producer_planes[plane] = None if communicator is None else communicator.name


def _uninstall(_actor: Any, plane: str) -> None:
    with _registry_lock:
        states = [s for key, s in _receiver_states.items() if key[0] == plane]
        senders = [s for key, s in _senders.items() if key[0] == plane]
        for table in (_receiver_states, _receivers, _senders):
            for key in [key for key in table if key[0] == plane]:
                del table[key]
        communicator_name = _producer_planes.pop(plane, None)
    for state in states:
        state.close()
    for sender in senders:
        sender.close()
    if communicator_name is not None:
        _unregister_communicator(communicator_name)


def _expected_seq(_actor: Any, plane: str, index: int, producer_id: str) -> int | None:
    state = _receiver_states.get((plane, index))
    return None if state is None else state.expected_seq(producer_id)


def _reserve(_actor: Any, plane: str, index: int, producer_id: str, seq: int) -> Reply:
    state = _receiver_states.get((plane, index))
    return Reply(Verdict.CLOSED, 0) if state is None else state.reserve(producer_id, seq)


def _deliver(
    _actor: Any,
    plane: str,
    index: int,
    producer_id: str,
    seq: int,
    tensors: dict[str, torch.Tensor],
    field_order: list[str],
    lists: dict[str, list],
    metadata: dict[str, Any],
) -> Reply:
    # `tensors` arrived by RDT: Ray resolved the producer's ref into this process's memory.
    state = _receiver_states.get((plane, index))
    if state is None:
        return Reply(Verdict.CLOSED, 0)
    return state.deliver(
        Delivery(producer_id, seq, assemble_batch(field_order, tensors, lists), metadata)
    )


def _emit(_actor: Any, key: str) -> dict[str, torch.Tensor]:
    # Returned through `tensor_transport=...`: the tensors stay here until the receiver pulls.
    return _staged.pop(key)


def _current_actor_id() -> str | None:
    return ray.get_runtime_context().get_actor_id()


def _require_actor(expected_actor_id: str, what: str) -> None:
    actual = _current_actor_id()
    if actual != expected_actor_id:
        raise ValueError(
            f"open this {what} inside the actor it was made for ({expected_actor_id}, "
            f"the one passed to connect() at this position); this process is "
            f"{'actor ' + actual if actual else 'not an actor (the driver?)'}"
        )


# ------------------------------------------------------------------------------------ endpoints


class RayDirectSender(SequencedSender):
    """One channel from this producer actor to one receiver actor (module docstring)."""

    def __init__(self, spec: RayDirectSenderSpec, start_seq: int):
        config = spec.config
        super().__init__(
            spec.producer_id,
            start_seq,
            backpressure_timeout_s=config.backpressure_timeout_s,
            max_metadata_bytes=config.max_metadata_bytes,
            tensor_transport=config.tensor_transport,
            contiguous=config.tensor_transport in _COLLECTIVE_BACKENDS,
        )
        self._spec = spec
        self._self_handle = ray.get_runtime_context().current_actor

    def _check_open(self) -> None:
        super()._check_open()
        if self._spec.plane not in _producer_planes:
            raise DataPlaneClosedError(f"data plane {self._spec.plane} is closed")

    def _call_receiver(self, function: Any, *args: Any) -> Any:
        ref = self._spec.receiver.__ray_call__.options(
            concurrency_group=DATA_PLANE_CONCURRENCY_GROUP
        ).remote(function, *args)
        return ray.get(ref, timeout=self._spec.config.transfer_timeout_s)

    def _reserve(self, seq: int, wait_s: float) -> Reply:
        spec = self._spec
        try:
            return self._call_receiver(
                _reserve, spec.plane, spec.receiver_index, self._producer_id, seq
            )
        except ray.exceptions.RayError as error:
            raise transport_error(
                f"{self._producer_id}: slot request for seq {seq}", error
            ) from error

    def _transfer(self, seq: int, packed: PackedBatch) -> Reply:
        spec = self._spec
        key = f"{spec.plane}/{self._producer_id}/{spec.receiver_index}/{seq}/{uuid.uuid4().hex}"
        tensors_ref: Any = {}
        try:
            if packed.tensors:
                _staged[key] = packed.tensors
                tensors_ref = self._self_handle.__ray_call__.options(
                    tensor_transport=spec.config.tensor_transport,
                    concurrency_group=DATA_PLANE_CONCURRENCY_GROUP,
                ).remote(_emit, key)
            # The ref must be a top-level argument: only those trigger the RDT transfer.
            return self._call_receiver(
                _deliver,
                spec.plane,
                spec.receiver_index,
                self._producer_id,
                seq,
                tensors_ref,
                list(packed.field_order),
                packed.lists,
                packed.metadata,
            )
        except ray.exceptions.RayError as error:
            raise transport_error(f"{self._producer_id}: transfer of seq {seq}", error) from error
        finally:
            _staged.pop(key, None)
            del tensors_ref  # the last reference: Ray frees the producer-side RDT copy


@dataclasses.dataclass(frozen=True)
class RayDirectSenderSpec(EndpointSpec):
    """Producer `producer_index`'s channel to receiver `receiver_index`; pickles into actors."""

    plane: str
    producer_index: int
    receiver_index: int
    producer_actor_id: str
    receiver: Any  # ray.actor.ActorHandle of the receiver
    config: DataPlaneConfig

    @property
    def producer_id(self) -> str:
        return f"producer-{self.producer_index}"

    def open(self) -> RayDirectSender:
        _require_actor(self.producer_actor_id, f"sender ({self.producer_id})")
        key = (self.plane, self.producer_index, self.receiver_index)
        with _registry_lock:
            if self.plane not in _producer_planes:
                raise DataPlaneClosedError(
                    f"data plane {self.plane} is not installed in this "
                    f"actor (closed, or the actor restarted)"
                )
            if key in _senders:
                return _senders[key]
        try:
            start_seq = ray.get(
                self.receiver.__ray_call__.options(
                    concurrency_group=DATA_PLANE_CONCURRENCY_GROUP
                ).remote(_expected_seq, self.plane, self.receiver_index, self.producer_id),
                timeout=self.config.transfer_timeout_s,
            )
        except ray.exceptions.RayError as error:
            raise transport_error(
                f"{self.producer_id}: asking the receiver where to start", error
            ) from error
        if start_seq is None:
            raise DataPlaneClosedError(
                f"data plane {self.plane}: receiver {self.receiver_index} is closed"
            )
        with _registry_lock:
            return _senders.setdefault(key, RayDirectSender(self, start_seq))


@dataclasses.dataclass(frozen=True)
class RayDirectReceiverSpec(EndpointSpec):
    """Receiver `receiver_index`; pickles into the receiver actor."""

    plane: str
    receiver_index: int
    receiver_actor_id: str
    config: DataPlaneConfig

    def open(self) -> StateReceiver:
        _require_actor(self.receiver_actor_id, f"receiver {self.receiver_index}")
        key = (self.plane, self.receiver_index)
        with _registry_lock:
            if key not in _receiver_states:
                raise DataPlaneClosedError(
                    f"data plane {self.plane} is not installed in this "
                    f"actor (closed, or the actor restarted)"
                )
            if key not in _receivers:
                _receivers[key] = StateReceiver(
                    _receiver_states[key], self.config.receive_timeout_s
                )
            return _receivers[key]


# ----------------------------------------------------------------------------------- the plane


class RayDirectDataPlane(DataPlane):
    """Driver-side setup and teardown of an RDT data plane (module docstring)."""

    def __init__(self, config: DataPlaneConfig, name: str | None = None):
        assert config.transport == "ray_direct", config.transport
        self._config = config
        self._name = name or uuid.uuid4().hex[:8]
        self._lock = threading.Lock()
        self._actors: list[Any] = []
        self._group: Any = None
        self._connected = False
        self._closed = False

    @property
    def config(self) -> DataPlaneConfig:
        return self._config

    @property
    def name(self) -> str:
        return self._name

    def connect(self, producers: Sequence[Any], receivers: Sequence[Any]) -> DataPlaneEndpoints:
        producers, receivers = list(producers), list(receivers)
        self._check_actors(producers, receivers)
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError(f"data plane {self._name} is closed")
            if self._connected:
                raise DataPlaneError(
                    f"data plane {self._name} is already connected; create "
                    f"another plane for another set of actors"
                )
            self._connected = True
        self._actors = receivers + producers
        backend = self._config.tensor_transport
        if backend in _COLLECTIVE_BACKENDS:
            from ray.experimental.collective import create_collective_group

            try:
                # Ranks: receivers first, then producers (any order works; RDT looks them up).
                self._group = create_collective_group(
                    self._actors, backend=backend, name=f"dockyard-data-plane-{self._name}"
                )
            except RuntimeError as error:
                raise ValueError(
                    f"data plane {self._name}: cannot create the {backend} group "
                    f"({error}); Ray's RDT allows one {backend} group per actor, so "
                    f"close the other data plane these actors are in first"
                ) from None
        installs = [
            (
                f"receiver {r}",
                actor,
                _install_receiver,
                (self._name, r, self._config.max_in_flight_batches),
            )
            for r, actor in enumerate(receivers)
        ]
        installs += [
            (f"producer {p}", actor, _install_producer, (self._name, self._group))
            for p, actor in enumerate(producers)
        ]
        refs = [
            actor.__ray_call__.options(concurrency_group=DATA_PLANE_CONCURRENCY_GROUP).remote(
                function, *args
            )
            for _, actor, function, args in installs
        ]
        for (what, _, _, _), ref in zip(installs, refs):
            try:
                ray.get(ref, timeout=self._config.transfer_timeout_s)
            except ray.exceptions.RayError as error:
                self.close()
                raise ValueError(
                    f"data plane {self._name}: installing on {what} failed ({type(error).__name__}"
                    f"); a call into a concurrency group the actor does not declare kills it, so "
                    f"declare the actor class with @ray.remote(**data_plane_actor_options())"
                ) from error
        receiver_specs = tuple(
            RayDirectReceiverSpec(self._name, r, actor._actor_id.hex(), self._config)
            for r, actor in enumerate(receivers)
        )
        sender_specs = tuple(
            tuple(
                RayDirectSenderSpec(
                    self._name, p, r, producer._actor_id.hex(), receiver, self._config
                )
                for r, receiver in enumerate(receivers)
            )
            for p, producer in enumerate(producers)
        )
        return DataPlaneEndpoints(senders=sender_specs, receivers=receiver_specs)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        refs = [
            actor.__ray_call__.options(concurrency_group=DATA_PLANE_CONCURRENCY_GROUP).remote(
                _uninstall, self._name
            )
            for actor in self._actors
        ]
        for ref in refs:
            try:
                ray.get(ref, timeout=self._config.transfer_timeout_s)
            except ray.exceptions.RayError:
                pass  # a dead actor has nothing left to uninstall
        if self._group is not None:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(self._group)
            except (ValueError, ray.exceptions.RayError):
                pass  # already destroyed (Ray does it after a failed transfer)
            self._group = None

    def _check_actors(self, producers: list[Any], receivers: list[Any]) -> None:
        if not producers or not receivers:
            raise ValueError(
                f"connect needs at least one producer and one receiver actor, got "
                f"{len(producers)} producer(s) and {len(receivers)} receiver(s)"
            )
        for role, actors in (("producer", producers), ("receiver", receivers)):
            for index, actor in enumerate(actors):
                if not isinstance(actor, ray.actor.ActorHandle):
                    raise ValueError(
                        f"{role} {index} is {type(actor).__name__}, not a Ray actor "
                        f"handle; data_plane.transport ray_direct connects actors "
                        f"(data_plane: null for the in-process path)"
                    )
                if not actor._ray_enable_tensor_transport:
                    raise ValueError(
                        f"{role} {index} ({actor!r}) was declared without "
                        f"enable_tensor_transport; declare its class with "
                        f"@ray.remote(**data_plane_actor_options())"
                    )
        ids = [actor._actor_id for actor in producers + receivers]
        if len(set(ids)) != len(ids):
            raise ValueError(
                "every producer and receiver must be a distinct actor (an actor "
                "cannot appear twice, nor be both producer and receiver)"
            )
