"""Sequencing and credits, shared by every transport: the receiver's ledger and the sender's
protocol. A transport only moves bytes; whether a batch is accepted is decided here.

Receiver side, `ReceiverState` (lives in the receiver's process):

- `expected[producer]`: the next seq it will accept from that producer (0 at first contact).
- slots: at most `capacity` batches are reserved (a transfer announced) or buffered (delivered,
  not yet taken). A producer holds at most one reservation, for its expected seq.
- `reserve(producer, seq)` answers before any tensor moves: GRANTED (a slot is held; repeated
  calls for the same seq are idempotent), DUPLICATE (seq < expected: already delivered, nothing
  to move), GAP (seq > expected), FULL, or CLOSED.
- `deliver(delivery)`: ACCEPTED for seq == expected (its reservation becomes a buffered batch;
  a delivery without one is taken only while a slot is free, else FULL), DUPLICATE for
  seq < expected (dropped), GAP for seq > expected, CLOSED.
- `take()`: the oldest buffered batch, FIFO across producers; frees its slot.

Sender side, `SequencedSender` (lives in the producer's process): assigns seqs, reserves a slot
(waiting while FULL up to the back-pressure timeout), calls the transport's `_transfer`, and
turns verdicts into the exceptions of interfaces.py. Its state machine:

    idle --send: reserve GRANTED, transfer ACCEPTED/DUPLICATE--> idle (next_seq += 1)
    idle --send: reserve FULL until timeout--> idle (BackpressureTimeoutError; seq unused)
    idle --send: transfer raised DataPlaneTransportError--> unacked (same seq kept)
    unacked --send--> DataPlaneError ("call resend()")
    unacked --resend: ACCEPTED/DUPLICATE--> idle (next_seq += 1)

Not covered: durability (the ledger and buffer live in the receiver's memory and die with
it) and reservations of a producer that dies between reserve and deliver (its slot stays held
until the plane is closed).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import enum
import threading
import time
from collections.abc import Mapping
from typing import Any

from dockyard_rl.data_plane.interfaces import (
    BackpressureTimeoutError,
    DataPlaneClosedError,
    DataPlaneError,
    DataPlaneReceiver,
    DataPlaneSender,
    DataPlaneTransportError,
    Delivery,
    DeliveryStatus,
    ReceiveTimeoutError,
    SequenceGapError,
)
from dockyard_rl.data_plane.payload import PackedBatch, pack_batch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict


class Verdict(enum.Enum):
    """A receiver's answer to `reserve` / `deliver` (module docstring)."""

    GRANTED = "granted"
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    FULL = "full"
    GAP = "gap"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class Reply:
    """A verdict plus the receiver's expected seq for that producer (for error messages)."""

    verdict: Verdict
    expected_seq: int


class ReceiverState:
    """The receiver's ledger: expected seqs, slots, the FIFO buffer (module docstring).
    Thread-safe: one Condition guards everything; transfers and `take` may run concurrently."""

    def __init__(self, capacity: int, name: str = "receiver"):
        assert capacity >= 1, capacity
        self._capacity = capacity
        self._name = name
        self._cond = threading.Condition()
        self._expected: dict[str, int] = {}
        self._reserved: dict[str, int] = {}  # producer -> the seq its slot is held for
        self._buffer: collections.deque[Delivery] = collections.deque()
        self._closed = False
        self._counts = collections.Counter()
        self._peak_in_flight = 0

    def _in_flight(self) -> int:
        return len(self._buffer) + len(self._reserved)

    def _classify(self, producer_id: str, seq: int) -> Verdict | None:
        """CLOSED / DUPLICATE / GAP, or None when seq is the expected one. Holds the lock."""
        if self._closed:
            return Verdict.CLOSED
        expected = self._expected.setdefault(producer_id, 0)
        if seq < expected:
            self._counts["num_duplicates_dropped"] += 1
            return Verdict.DUPLICATE
        if seq > expected:
            self._counts["num_gaps_rejected"] += 1
            return Verdict.GAP
        return None

    def expected_seq(self, producer_id: str) -> int:
        """The next seq this receiver accepts from `producer_id` (registers it at 0)."""
        with self._cond:
            return self._expected.setdefault(producer_id, 0)

    def reserve(self, producer_id: str, seq: int, wait_s: float = 0.0) -> Reply:
        """Holds a slot for (producer_id, seq); waits up to `wait_s` while FULL."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                verdict = self._classify(producer_id, seq)
                if verdict is None:
                    if self._reserved.get(producer_id) == seq:
                        verdict = Verdict.GRANTED  # a repeated request after a lost reply
                    elif self._in_flight() < self._capacity:
                        self._reserved[producer_id] = seq
                        self._peak_in_flight = max(self._peak_in_flight, self._in_flight())
                        verdict = Verdict.GRANTED
                    else:
                        remaining = deadline - time.monotonic()
                        if remaining > 0:
                            self._cond.wait(remaining)
                            continue
                        self._counts["num_full_replies"] += 1
                        verdict = Verdict.FULL
                return Reply(verdict, self._expected.get(producer_id, 0))

    def deliver(self, delivery: Delivery) -> Reply:
        """Buffers `delivery` if its seq is the expected one (module docstring)."""
        producer_id, seq = delivery.producer_id, delivery.seq
        with self._cond:
            verdict = self._classify(producer_id, seq)
            if verdict is None:
                if self._reserved.get(producer_id) == seq:
                    del self._reserved[producer_id]
                elif self._in_flight() >= self._capacity:
                    self._counts["num_full_replies"] += 1
                    return Reply(Verdict.FULL, seq)
                self._buffer.append(delivery)
                self._expected[producer_id] = seq + 1
                self._counts["num_accepted"] += 1
                self._peak_in_flight = max(self._peak_in_flight, self._in_flight())
                self._cond.notify_all()
                verdict = Verdict.ACCEPTED
            return Reply(verdict, self._expected.get(producer_id, 0))

    def take(self, timeout_s: float) -> Delivery:
        """Pops the oldest buffered batch, waiting up to `timeout_s`.

        Raises:
            ReceiveTimeoutError, DataPlaneClosedError.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._buffer and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReceiveTimeoutError(
                        f"{self._name}: no batch within {timeout_s:g} s ({len(self._reserved)} "
                        f"transfer(s) announced; next expected seq per producer: "
                        f"{dict(self._expected)}); is the generation side running?"
                    )
                self._cond.wait(remaining)
            if self._closed:
                raise DataPlaneClosedError(f"{self._name} is closed")
            delivery = self._buffer.popleft()
            self._counts["num_consumed"] += 1
            self._cond.notify_all()
            return delivery

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._counts["num_dropped_at_close"] += len(self._buffer)
            self._buffer.clear()
            self._reserved.clear()
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def stats(self) -> dict[str, Any]:
        with self._cond:
            stats = {
                key: self._counts[key]
                for key in (
                    "num_accepted",
                    "num_consumed",
                    "num_duplicates_dropped",
                    "num_gaps_rejected",
                    "num_full_replies",
                    "num_dropped_at_close",
                )
            }
            stats.update(
                num_buffered=len(self._buffer),
                num_reserved=len(self._reserved),
                peak_in_flight=self._peak_in_flight,
                max_in_flight_batches=self._capacity,
                expected_seq=dict(self._expected),
                closed=self._closed,
            )
            return stats


class StateReceiver(DataPlaneReceiver):
    """A receiver endpoint over a `ReceiverState` in this process (both transports)."""

    def __init__(self, state: ReceiverState, receive_timeout_s: float):
        self._state = state
        self._receive_timeout_s = receive_timeout_s

    def receive(self, timeout_s: float | None = None) -> Delivery:
        return self._state.take(self._receive_timeout_s if timeout_s is None else timeout_s)

    def stats(self) -> dict[str, Any]:
        return self._state.stats()

    def close(self) -> None:
        self._state.close()


class SequencedSender(DataPlaneSender):
    """The sender protocol of the module docstring over two transport hooks.

    Subclasses implement `_reserve(seq, wait_s)` (ask the receiver for a slot; may block up to
    `wait_s` when `_reserve_blocks`, else answer at once and the loop polls with backoff) and
    `_transfer(seq, packed)` (move the batch, return the receiver's Reply; raise
    DataPlaneTransportError when it may or may not have arrived).
    """

    # Polling backoff while the receiver is FULL (transports whose reserve does not block).
    _POLL_START_S = 0.002
    _POLL_MAX_S = 0.05
    _reserve_blocks = False

    def __init__(
        self,
        producer_id: str,
        start_seq: int,
        *,
        backpressure_timeout_s: float,
        max_metadata_bytes: int,
        tensor_transport: str,
        contiguous: bool,
    ):
        self._producer_id = producer_id
        self._next_seq = start_seq
        self._backpressure_timeout_s = backpressure_timeout_s
        self._max_metadata_bytes = max_metadata_bytes
        self._tensor_transport = tensor_transport
        self._contiguous = contiguous
        self._lock = threading.RLock()
        self._closed = False
        # The last batch sent and its seq (kept for `resend`), and whether it is acknowledged.
        self._last: tuple[int, PackedBatch] | None = None
        self._unacked = False

    # ----------------------------------------------------------------------- transport hooks

    @abc.abstractmethod
    def _reserve(self, seq: int, wait_s: float) -> Reply:
        """Asks the receiver for a slot for `seq`."""

    @abc.abstractmethod
    def _transfer(self, seq: int, packed: PackedBatch) -> Reply:
        """Moves the batch; the receiver's `deliver` verdict."""

    def _check_open(self) -> None:
        """Raises DataPlaneClosedError when this sender (or its plane) is closed."""
        if self._closed:
            raise DataPlaneClosedError(f"sender {self._producer_id} is closed")

    # ------------------------------------------------------------------------------ public

    @property
    def producer_id(self) -> str:
        return self._producer_id

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq

    def send(
        self,
        batch: BatchedDataDict | Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> int:
        packed = pack_batch(
            batch,
            metadata,
            max_metadata_bytes=self._max_metadata_bytes,
            tensor_transport=self._tensor_transport,
            contiguous=self._contiguous,
        )
        with self._lock:
            self._check_open()
            if self._unacked:
                assert self._last is not None
                raise DataPlaneError(
                    f"{self._producer_id}: seq {self._last[0]} was never acknowledged (its "
                    f"transfer failed); call resend() to complete it before sending more, or "
                    f"the receiver would see a gap"
                )
            seq = self._next_seq
            self._deliver(seq, packed, timeout_s)
            return seq

    def resend(self, *, timeout_s: float | None = None) -> DeliveryStatus:
        with self._lock:
            self._check_open()
            if self._last is None:
                raise DataPlaneError(
                    f"{self._producer_id}: nothing was sent yet, so there is nothing to resend"
                )
            seq, packed = self._last
            return self._deliver(seq, packed, timeout_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._last = None

    # --------------------------------------------------------------------------- protocol

    def _deliver(self, seq: int, packed: PackedBatch, timeout_s: float | None) -> DeliveryStatus:
        """Reserve, transfer, acknowledge `seq`; holds the lock."""
        timeout_s = self._backpressure_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if self._acquire_slot(seq, deadline, timeout_s) is Verdict.DUPLICATE:
                self._acknowledge(seq, packed)
                return DeliveryStatus.DUPLICATE
            previous = self._last, self._unacked
            self._last, self._unacked = (seq, packed), True
            reply = self._transfer(seq, packed)  # DataPlaneTransportError leaves it unacked
            if reply.verdict in (Verdict.ACCEPTED, Verdict.DUPLICATE):
                self._acknowledge(seq, packed)
                return (
                    DeliveryStatus.ACCEPTED
                    if reply.verdict is Verdict.ACCEPTED
                    else DeliveryStatus.DUPLICATE
                )
            self._last, self._unacked = previous  # definitely not taken: nothing changed
            if reply.verdict is Verdict.FULL:
                # Our reservation was lost between the two calls (it cannot be with a
                # well-behaved receiver): ask again; the deadline still holds.
                continue
            self._raise_for(reply, seq)

    def _acquire_slot(self, seq: int, deadline: float, timeout_s: float) -> Verdict:
        """GRANTED or DUPLICATE; waits while FULL until `deadline`."""
        delay = self._POLL_START_S
        while True:
            self._check_open()
            remaining = deadline - time.monotonic()
            reply = self._reserve(seq, max(0.0, remaining) if self._reserve_blocks else 0.0)
            if reply.verdict in (Verdict.GRANTED, Verdict.DUPLICATE):
                return reply.verdict
            if reply.verdict is not Verdict.FULL:
                self._raise_for(reply, seq)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BackpressureTimeoutError(
                    f"{self._producer_id}: the receiver held max_in_flight_batches unconsumed "
                    f"batches for {timeout_s:g} s, so seq {seq} was not sent (safe to retry); "
                    f"the trainer is not keeping up: raise "
                    f"data_plane.backpressure_timeout_s / max_in_flight_batches or slow the "
                    f"generation side"
                )
            if not self._reserve_blocks:
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, self._POLL_MAX_S)

    def _raise_for(self, reply: Reply, seq: int) -> None:
        """Raises for GAP / CLOSED verdicts (and asserts nothing else is unexpected)."""
        if reply.verdict is Verdict.GAP:
            raise SequenceGapError(
                f"{self._producer_id}: the receiver expects seq {reply.expected_seq} but this "
                f"sender is at seq {seq}: batches {reply.expected_seq}..{seq - 1} never arrived "
                f"(was the sender restored from stale state?); the data plane cannot recover "
                f"them: close the plane and connect a new one"
            )
        if reply.verdict is Verdict.CLOSED:
            raise DataPlaneClosedError(f"{self._producer_id}: the receiver is closed")
        assert reply.verdict in (Verdict.ACCEPTED, Verdict.DUPLICATE), reply

    def _acknowledge(self, seq: int, packed: PackedBatch) -> None:
        self._last, self._unacked = (seq, packed), False
        self._next_seq = max(self._next_seq, seq + 1)


def transport_error(what: str, error: BaseException) -> DataPlaneTransportError:
    """A DataPlaneTransportError describing `error` (`raise transport_error(...) from error`)."""
    return DataPlaneTransportError(f"{what}: {type(error).__name__}: {error}")
