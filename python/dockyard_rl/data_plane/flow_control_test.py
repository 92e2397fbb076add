"""Tests of the receiver ledger and the sender protocol, without any transport in between."""

import threading

import pytest
import torch

from dockyard_rl.data_plane.flow_control import ReceiverState, Reply, SequencedSender, Verdict
from dockyard_rl.data_plane.interfaces import (
    BackpressureTimeoutError,
    DataPlaneClosedError,
    DataPlaneError,
    DataPlaneTransportError,
    Delivery,
    DeliveryStatus,
    ReceiveTimeoutError,
    SequenceGapError,
)
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict


def _delivery(producer, seq):
    return Delivery(producer, seq, BatchedDataDict(x=torch.tensor([seq])), {})


def test_reserve_and_deliver_verdicts():
    state = ReceiverState(capacity=2)
    assert state.reserve("a", 1) == Reply(Verdict.GAP, 0)
    assert state.reserve("a", 0) == Reply(Verdict.GRANTED, 0)
    assert state.reserve("a", 0).verdict is Verdict.GRANTED  # idempotent: no second slot
    assert state.stats()["num_reserved"] == 1
    assert state.deliver(_delivery("a", 0)) == Reply(Verdict.ACCEPTED, 1)
    assert state.deliver(_delivery("a", 0)) == Reply(Verdict.DUPLICATE, 1)
    assert state.reserve("a", 0) == Reply(Verdict.DUPLICATE, 1)
    assert state.deliver(_delivery("a", 2)) == Reply(Verdict.GAP, 1)
    stats = state.stats()
    assert (stats["num_accepted"], stats["num_duplicates_dropped"], stats["num_gaps_rejected"]) == (
        1,
        2,
        2,
    )
    assert stats["expected_seq"] == {"a": 1}


def test_capacity_counts_reserved_and_buffered_batches():
    state = ReceiverState(capacity=2)
    assert state.reserve("a", 0).verdict is Verdict.GRANTED
    assert state.deliver(_delivery("b", 0)).verdict is Verdict.ACCEPTED  # unreserved, room left
    assert state.reserve("c", 0).verdict is Verdict.FULL
    assert state.deliver(_delivery("c", 0)).verdict is Verdict.FULL
    assert state.take(timeout_s=1).producer_id == "b"
    assert state.reserve("c", 0).verdict is Verdict.GRANTED
    assert state.stats()["peak_in_flight"] == 2


def test_take_is_fifo_and_times_out():
    state = ReceiverState(capacity=3)
    for producer in ("b", "a"):
        state.deliver(_delivery(producer, 0))
    assert [state.take(1).producer_id for _ in range(2)] == ["b", "a"]
    with pytest.raises(ReceiveTimeoutError, match="no batch within 0.01 s"):
        state.take(0.01)


def test_blocking_reserve_wakes_when_a_batch_is_taken():
    state = ReceiverState(capacity=1)
    state.deliver(_delivery("a", 0))
    threading.Timer(0.05, state.take, args=(1,)).start()
    assert state.reserve("b", 0, wait_s=30).verdict is Verdict.GRANTED


def test_close_wakes_the_consumer_and_refuses_transfers():
    state = ReceiverState(capacity=1)
    state.deliver(_delivery("a", 0))
    state.close()
    with pytest.raises(DataPlaneClosedError):
        state.take(1)
    assert state.reserve("a", 1).verdict is Verdict.CLOSED
    assert state.stats()["num_dropped_at_close"] == 1


class _LedgerSender(SequencedSender):
    """A transport that delivers straight into a ReceiverState and can lose acknowledgements
    (the ambiguous failure: the batch arrived, the sender never heard back)."""

    _reserve_blocks = True

    def __init__(self, state, producer="p"):
        super().__init__(
            producer,
            state.expected_seq(producer),
            backpressure_timeout_s=5,
            max_metadata_bytes=1024,
            tensor_transport="in_memory",
            contiguous=False,
        )
        self.state = state
        self.lose_next_ack = False
        self.fail_next_transfer = False
        self.num_transfers = 0

    def _reserve(self, seq, wait_s):
        return self.state.reserve(self._producer_id, seq, wait_s)

    def _transfer(self, seq, packed):
        if self.fail_next_transfer:
            self.fail_next_transfer = False
            raise DataPlaneTransportError("link down before the batch left")
        self.num_transfers += 1
        reply = self.state.deliver(
            Delivery(self._producer_id, seq, packed.to_batch(), packed.metadata)
        )
        if self.lose_next_ack:
            self.lose_next_ack = False
            raise DataPlaneTransportError("acknowledgement lost")
        return reply


def _batch(value):
    return {"x": torch.tensor([value])}


def test_lost_acknowledgement_is_completed_by_resend_without_a_second_copy():
    state = ReceiverState(capacity=4)
    sender = _LedgerSender(state)
    assert sender.send(_batch(0)) == 0
    sender.lose_next_ack = True
    with pytest.raises(DataPlaneTransportError, match="acknowledgement lost"):
        sender.send(_batch(1))
    with pytest.raises(DataPlaneError, match="seq 1 was never acknowledged.*call resend"):
        sender.send(_batch(2))
    assert sender.resend() is DeliveryStatus.DUPLICATE  # it had arrived: dropped at reserve
    assert sender.next_seq == 2
    assert sender.send(_batch(2)) == 2
    assert [int(state.take(1).batch["x"]) for _ in range(3)] == [0, 1, 2]
    assert sender.num_transfers == 3


def test_failed_transfer_is_completed_by_resend():
    state = ReceiverState(capacity=4)
    sender = _LedgerSender(state)
    sender.fail_next_transfer = True
    with pytest.raises(DataPlaneTransportError):
        sender.send(_batch(7))
    assert sender.next_seq == 0
    assert sender.resend() is DeliveryStatus.ACCEPTED
    assert sender.next_seq == 1
    delivery = state.take(1)
    assert (delivery.seq, int(delivery.batch["x"])) == (0, 7)


def test_backpressure_timeout_leaves_the_seq_unused():
    state = ReceiverState(capacity=1)
    sender = _LedgerSender(state)
    sender.send(_batch(0))
    with pytest.raises(BackpressureTimeoutError, match="seq 1 was not sent"):
        sender.send(_batch(1), timeout_s=0.05)
    assert sender.next_seq == 1
    state.take(1)
    assert sender.send(_batch(1)) == 1


def test_gap_and_resend_before_any_send():
    state = ReceiverState(capacity=4)
    sender = _LedgerSender(state)
    with pytest.raises(DataPlaneError, match="nothing was sent yet"):
        sender.resend()
    sender._next_seq = 3  # a sender that lost seqs 0..2
    with pytest.raises(SequenceGapError, match="expects seq 0 but this sender is at seq 3"):
        sender.send(_batch(3))
    assert state.stats()["num_buffered"] == 0


def test_closed_sender_refuses():
    sender = _LedgerSender(ReceiverState(capacity=1))
    sender.close()
    sender.close()
    with pytest.raises(DataPlaneClosedError):
        sender.send(_batch(0))
