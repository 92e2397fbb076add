"""The data-plane seam: experience batches from producers (generation / environment side) to
receivers (trainer side), exactly once, with bounded in-flight batches.

Roles and call order:

1. Driver (controller), once at setup: `plane = create_data_plane(cfg)` (factory.py), then
   `endpoints = plane.connect(producers, receivers)`. For `ray_direct` producers and receivers
   are Ray actor handles; for `in_memory` they are labels in the driver's own process. `connect`
   is called once per plane; a second call raises DataPlaneError. Setup problems (an actor class
   declared without the data plane's options, an actor already in another group) raise
   ValueError here, never mid-loop.
2. The driver hands `endpoints.sender(p, r)` to producer p and `endpoints.receiver(r)` to
   receiver r (for Ray: as method arguments; the specs pickle). Each side calls `spec.open()`
   INSIDE its own process (actor). `open()` is idempotent per process: it returns the same
   sender (one sequence counter per channel) or receiver every time.
3. Producer: `seq = sender.send(batch, metadata)` any number of times; one channel (producer p
   -> receiver r) is one ordered stream with sequence numbers 0, 1, 2, ...
4. Receiver: `delivery = receiver.receive()` in the trainer's loop; the batch's slot frees when
   `receive` returns it (that is what "consumed" means for back-pressure).
5. Driver, at shutdown: `plane.close()` (idempotent). Endpoints raise DataPlaneClosedError
   afterwards; a receiver blocked in `receive` wakes with it.

Guarantees:

- Exactly once per channel. Each batch carries (producer_id, seq). The receiver accepts seq ==
  expected only: a lower seq is a duplicate and is dropped (counted; the sender is told
  DUPLICATE and treats it as delivered); a higher seq is a gap and is rejected with
  SequenceGapError on the sender (batches were lost in between, e.g. a sender restored from
  stale state, or a receiver whose ledger was reset). `send` returns only after the receiver
  acknowledged the batch, so a returned seq is in the receiver's buffer (or already consumed).
- Back-pressure. A receiver holds at most `max_in_flight_batches` batches: slots reserved for a
  transfer plus delivered-but-unconsumed batches. A producer reserves a slot BEFORE any tensor
  moves; when none is free it waits up to `backpressure_timeout_s` and raises
  BackpressureTimeoutError (nothing sent, its seq not used: calling `send` again is safe).
- Ambiguous failures. If a transfer fails after it may have reached the receiver (timeout, dead
  actor), `send` raises DataPlaneTransportError and the batch stays un-acknowledged: the next
  `send` raises DataPlaneError until `resend()` has retransmitted it with the SAME seq (the
  receiver drops it if it had arrived). So a retry can never deliver twice or skip a batch.
- Ownership. The batch belongs to the data plane once `send` is called: the in-memory transport
  hands the receiver the very same tensors, so the producer must not modify them in place
  afterwards (allocate new tensors per batch). Transports that copy (ray_direct) document it.

Payload: a `BatchedDataDict` (tensor fields with a leading batch dim, e.g. `input_ids_BS`
int64, `logprobs_BS` float32, `mask_BS`, `rewards_B`; list fields of JSON-able per-sample
values) plus a small JSON-able `metadata` dict (weight version, step, ...). Tensors travel by the
transport; list fields and metadata (bounded by `max_metadata_bytes`) ride in small control
messages. Shape suffixes: B = samples, S = tokens.

Thread safety: a sender may be called from several threads (calls serialize per channel); a
receiver supports one consuming thread plus `stats()` from others.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from dockyard_rl.distributed.batched_data_dict import BatchedDataDict

__all__ = [
    "BackpressureTimeoutError",
    "DataPlane",
    "DataPlaneClosedError",
    "DataPlaneEndpoints",
    "DataPlaneError",
    "DataPlaneReceiver",
    "DataPlaneSender",
    "DataPlaneTransportError",
    "Delivery",
    "DeliveryStatus",
    "EndpointSpec",
    "ReceiveTimeoutError",
    "SequenceGapError",
]


class DataPlaneError(RuntimeError):
    """Base of the data plane's runtime errors (bad config or input is ValueError instead)."""


class BackpressureTimeoutError(DataPlaneError, TimeoutError):
    """`send` found the receiver full (max_in_flight_batches unconsumed) for the whole timeout.
    Nothing was transferred and the sequence number was not used."""


class ReceiveTimeoutError(DataPlaneError, TimeoutError):
    """`receive` got no batch within its timeout."""


class SequenceGapError(DataPlaneError):
    """The receiver expects an earlier sequence number than the one sent: batches in between
    never arrived. Not retryable as is."""


class DataPlaneTransportError(DataPlaneError):
    """A transfer failed or timed out (the underlying error is the __cause__). For `send` the
    batch is left un-acknowledged; `resend()` retransmits it with the same sequence number."""


class DataPlaneClosedError(DataPlaneError):
    """The plane, the sender or the receiver was closed."""


class DeliveryStatus(enum.Enum):
    """What the receiver did with a (re)transmitted batch."""

    ACCEPTED = "accepted"  # first arrival: buffered for `receive`
    DUPLICATE = "duplicate"  # already delivered earlier: dropped, nothing buffered twice


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One batch as `receive` returns it.

    Attributes:
        producer_id: the sending channel's producer (`producer-<index>` in `connect` order).
        seq: its sequence number on that channel (0, 1, 2, ... without gaps or repeats).
        batch: the payload, fields in the order they were sent.
        metadata: the JSON-able dict given to `send` (empty if none).
    """

    producer_id: str
    seq: int
    batch: BatchedDataDict[Any]
    metadata: dict[str, Any]


class DataPlaneSender(abc.ABC):
    """The producer's end of one channel (producer -> one receiver). Obtain it with
    `endpoints.sender(p, r).open()` inside the producer's process."""

    @property
    @abc.abstractmethod
    def producer_id(self) -> str:
        """This channel's producer id, as `Delivery.producer_id` reports it."""

    @property
    @abc.abstractmethod
    def next_seq(self) -> int:
        """The sequence number the next successful `send` will use."""

    @abc.abstractmethod
    def send(
        self,
        batch: BatchedDataDict[Any] | Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> int:
        """Delivers `batch` to the receiver; returns its sequence number once acknowledged.

        Args:
            batch: a BatchedDataDict (a plain mapping is converted and validated).
            metadata: JSON-able dict with str keys, small (max_metadata_bytes together with the
                batch's list fields).
            timeout_s: back-pressure wait for a free slot; default the config's
                `backpressure_timeout_s`.

        Raises:
            ValueError: the batch or metadata is invalid (message names the field).
            BackpressureTimeoutError: no free slot within the timeout (safe to call again).
            DataPlaneTransportError: the transfer failed after it may have arrived; call
                `resend()` before the next `send`.
            DataPlaneError: the previous batch is still un-acknowledged (call `resend()`).
            SequenceGapError: the receiver expects an earlier seq (it lost batches).
            DataPlaneClosedError: the sender, receiver or plane is closed.
        """

    @abc.abstractmethod
    def resend(self, *, timeout_s: float | None = None) -> DeliveryStatus:
        """Retransmits the last batch with its original seq; idempotent.

        After a DataPlaneTransportError this completes the delivery (ACCEPTED if the original
        never arrived, DUPLICATE if it did). After a successful send it returns DUPLICATE and
        the receiver drops the copy (the receiver is asked first, so no tensor moves twice).
        The sender keeps a reference to its last batch until the next `send` for this.

        Raises:
            DataPlaneError: nothing was sent on this channel yet.
            and the errors of `send` (back-pressure, transport, gap, closed).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stops this sender; later calls raise DataPlaneClosedError. Idempotent."""


class DataPlaneReceiver(abc.ABC):
    """The trainer's end: every channel into one receiver. Obtain it with
    `endpoints.receiver(r).open()` inside the receiver's process."""

    @abc.abstractmethod
    def receive(self, timeout_s: float | None = None) -> Delivery:
        """Returns the oldest delivered batch (FIFO across producers) and frees its slot.

        Args:
            timeout_s: how long to wait; default the config's `receive_timeout_s`.

        Raises:
            ReceiveTimeoutError: nothing arrived in time.
            DataPlaneClosedError: the receiver or plane was closed (buffered batches dropped).
        """

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: num_accepted, num_consumed, num_duplicates_dropped, num_gaps_rejected,
        num_buffered, num_reserved, peak_in_flight (max of buffered + reserved ever seen),
        max_in_flight_batches, expected_seq ({producer_id: next expected seq})."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drops buffered batches and refuses further transfers. Idempotent."""


class EndpointSpec(abc.ABC):
    """A handle to one end of a channel that can travel to the process that will use it."""

    @abc.abstractmethod
    def open(self) -> DataPlaneSender | DataPlaneReceiver:
        """The endpoint for this process; idempotent (the same object on every call).

        Raises:
            ValueError: called in a process other than the one the spec was made for.
            DataPlaneClosedError: the plane was closed.
        """


@dataclasses.dataclass(frozen=True)
class DataPlaneEndpoints:
    """What `DataPlane.connect` returns: senders[p][r] is producer p's channel to receiver r."""

    senders: tuple[tuple[EndpointSpec, ...], ...]
    receivers: tuple[EndpointSpec, ...]

    def sender(self, producer: int, receiver: int = 0) -> EndpointSpec:
        """The spec of producer `producer`'s channel to receiver `receiver` (connect order)."""
        if not 0 <= producer < len(self.senders):
            raise ValueError(
                f"producer index {producer} out of range: connect() got "
                f"{len(self.senders)} producer(s)"
            )
        return self.senders[producer][self._receiver_index(receiver)]

    def receiver(self, index: int = 0) -> EndpointSpec:
        """The spec of receiver `index` (connect order)."""
        return self.receivers[self._receiver_index(index)]

    def _receiver_index(self, index: int) -> int:
        if not 0 <= index < len(self.receivers):
            raise ValueError(
                f"receiver index {index} out of range: connect() got "
                f"{len(self.receivers)} receiver(s)"
            )
        return index


class DataPlane(abc.ABC):
    """Driver-side owner of a data plane: wires producers to receivers, then tears down."""

    @abc.abstractmethod
    def connect(self, producers: Sequence[Any], receivers: Sequence[Any]) -> DataPlaneEndpoints:
        """Sets up one channel per (producer, receiver) pair; once per plane.

        Producer p's id is `producer-<p>`. Receivers are ready to accept batches when this
        returns (before their process calls `open()`).

        Raises:
            ValueError: empty, repeated or overlapping producers/receivers, or actors that
                cannot take part (the message names the fix).
            DataPlaneError: already connected, or closed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Tears the plane down (receivers closed, transport resources released); idempotent."""
