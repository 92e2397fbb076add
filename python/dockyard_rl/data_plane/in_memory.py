"""The in-memory data plane: producers and receivers in ONE process (`data_plane: null`).

This is the colocated path: generation, scoring and training driven from one process (the CPU
smoke runs, tests), typically a producer thread and the trainer loop. Batches are handed over
by reference — no copy, no serialization — with the same contract as every transport:
sequence numbers, duplicate drop, gap detection, `max_in_flight_batches` back-pressure (a
sender blocks on a condition variable, no polling), and the same payload checks as
`ray_direct` (JSON-able, small metadata), so switching transports changes nothing for callers.

Because the receiver gets the producer's very tensors, the producer must not modify a batch in
place after `send` (interfaces.py, "Ownership").

Not covered: crossing a process boundary. The endpoint specs refuse to be pickled, so handing
one to a Ray actor fails at once with a message instead of silently splitting the ledger.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

from dockyard_rl.data_plane.config import DataPlaneConfig
from dockyard_rl.data_plane.flow_control import ReceiverState, Reply, SequencedSender, StateReceiver
from dockyard_rl.data_plane.interfaces import (
    DataPlane,
    DataPlaneClosedError,
    DataPlaneEndpoints,
    DataPlaneError,
    Delivery,
    EndpointSpec,
)
from dockyard_rl.data_plane.payload import PackedBatch


class InMemorySender(SequencedSender):
    """One channel into a `ReceiverState` of this process."""

    _reserve_blocks = True  # waits on the receiver's condition variable instead of polling

    def __init__(self, producer_id: str, state: ReceiverState, config: DataPlaneConfig):
        super().__init__(
            producer_id,
            state.expected_seq(producer_id),
            backpressure_timeout_s=config.backpressure_timeout_s,
            max_metadata_bytes=config.max_metadata_bytes,
            tensor_transport="in_memory",
            contiguous=False,
        )
        self._state = state

    def _reserve(self, seq: int, wait_s: float) -> Reply:
        return self._state.reserve(self._producer_id, seq, wait_s)

    def _transfer(self, seq: int, packed: PackedBatch) -> Reply:
        return self._state.deliver(
            Delivery(self._producer_id, seq, packed.to_batch(), packed.metadata)
        )


class _InMemorySpec(EndpointSpec):
    """Base of the in-memory specs: usable only in the process that made them."""

    def __reduce__(self):
        raise TypeError(
            "in-memory data plane endpoints work only inside the process that "
            "connected them; to reach Ray actors set data_plane.transport: "
            "ray_direct"
        )


class InMemorySenderSpec(_InMemorySpec):
    def __init__(self, plane: InMemoryDataPlane, producer: int, receiver: int):
        self._plane, self._producer, self._receiver = plane, producer, receiver

    def open(self) -> InMemorySender:
        return self._plane._open_sender(self._producer, self._receiver)


class InMemoryReceiverSpec(_InMemorySpec):
    def __init__(self, plane: InMemoryDataPlane, receiver: int):
        self._plane, self._receiver = plane, receiver

    def open(self) -> StateReceiver:
        return self._plane._open_receiver(self._receiver)


class InMemoryDataPlane(DataPlane):
    """See the module docstring. `producers`/`receivers` given to `connect` are labels only."""

    def __init__(self, config: DataPlaneConfig | None = None, name: str | None = None):
        self._config = DataPlaneConfig(transport="in_memory") if config is None else config
        self._name = name or uuid.uuid4().hex[:8]
        self._lock = threading.Lock()
        self._states: list[ReceiverState] | None = None
        self._num_producers = 0
        self._senders: dict[tuple[int, int], InMemorySender] = {}
        self._receivers: dict[int, StateReceiver] = {}
        self._closed = False

    @property
    def config(self) -> DataPlaneConfig:
        return self._config

    def connect(self, producers: Sequence[Any], receivers: Sequence[Any]) -> DataPlaneEndpoints:
        if len(producers) == 0 or len(receivers) == 0:
            raise ValueError(
                f"connect needs at least one producer and one receiver, got "
                f"{len(producers)} producer(s) and {len(receivers)} receiver(s)"
            )
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError(f"data plane {self._name} is closed")
            if self._states is not None:
                raise DataPlaneError(
                    f"data plane {self._name} is already connected; create "
                    f"another plane for another set of endpoints"
                )
            self._states = [
                ReceiverState(
                    self._config.max_in_flight_batches, name=f"data plane {self._name} receiver {r}"
                )
                for r in range(len(receivers))
            ]
            self._num_producers = len(producers)
        return DataPlaneEndpoints(
            senders=tuple(
                tuple(InMemorySenderSpec(self, p, r) for r in range(len(receivers)))
                for p in range(len(producers))
            ),
            receivers=tuple(InMemoryReceiverSpec(self, r) for r in range(len(receivers))),
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for state in self._states or ():
                state.close()
            for sender in self._senders.values():
                sender.close()

    def _open_sender(self, producer: int, receiver: int) -> InMemorySender:
        with self._lock:
            self._check_usable()
            key = (producer, receiver)
            if key not in self._senders:
                self._senders[key] = InMemorySender(
                    f"producer-{producer}", self._states[receiver], self._config
                )
            return self._senders[key]

    def _open_receiver(self, receiver: int) -> StateReceiver:
        with self._lock:
            self._check_usable()
            if receiver not in self._receivers:
                self._receivers[receiver] = StateReceiver(
                    self._states[receiver], self._config.receive_timeout_s
                )
            return self._receivers[receiver]

    def _check_usable(self) -> None:
        if self._closed:
            raise DataPlaneClosedError(f"data plane {self._name} is closed")
        assert self._states is not None, "specs exist only after connect"
