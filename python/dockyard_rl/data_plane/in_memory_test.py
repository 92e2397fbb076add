"""Tests of the in-memory data plane (the `data_plane: null` path) with real threads."""

import pickle
import threading

import pytest
import torch

from dockyard_rl.data_plane.factory import create_data_plane
from dockyard_rl.data_plane.interfaces import (
    BackpressureTimeoutError,
    DataPlaneClosedError,
    DataPlaneError,
    DeliveryStatus,
)
from dockyard_rl.data_plane.testing_actors import PATTERN_STRIDE, pattern_batch


def test_four_producer_threads_exactly_once_with_duplicates():
    num_producers, num_batches, capacity = 4, 25, 2
    plane = create_data_plane({"transport": "in_memory", "max_in_flight_batches": capacity})
    endpoints = plane.connect([f"gen{p}" for p in range(num_producers)], ["trainer"])
    receiver = endpoints.receiver().open()
    errors = []

    def produce(p):
        try:
            sender = endpoints.sender(p).open()
            for number in range(num_batches):
                assert sender.send(pattern_batch(p, number, 2, 3), {"n": number}) == number
                assert sender.resend() is DeliveryStatus.DUPLICATE
        except Exception as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(num_producers)]
    for thread in threads:
        thread.start()
    received = [receiver.receive(timeout_s=30) for _ in range(num_producers * num_batches)]
    for thread in threads:
        thread.join(30)
    assert not errors
    keys = [(d.producer_id, d.seq) for d in received]
    assert sorted(keys) == [
        (f"producer-{p}", n) for p in range(num_producers) for n in range(num_batches)
    ]
    for d in received:  # the content under (producer, seq) is that batch
        p = int(d.producer_id.split("-")[1])
        assert int(d.batch["input_ids_BS"][0, 0]) == p * PATTERN_STRIDE + d.seq
        assert d.metadata == {"n": d.seq}
    for p in range(num_producers):  # per-producer order is kept
        seqs = [seq for producer, seq in keys if producer == f"producer-{p}"]
        assert seqs == sorted(seqs)
    stats = receiver.stats()
    assert stats["num_accepted"] == num_producers * num_batches
    assert stats["num_duplicates_dropped"] == num_producers * num_batches
    assert stats["peak_in_flight"] <= capacity


def test_backpressure_blocks_until_the_trainer_consumes():
    plane = create_data_plane({"transport": "in_memory", "max_in_flight_batches": 1})
    endpoints = plane.connect(["gen"], ["trainer"])
    sender, receiver = endpoints.sender(0).open(), endpoints.receiver(0).open()
    sender.send(pattern_batch(0, 0, 1, 1))
    with pytest.raises(BackpressureTimeoutError):
        sender.send(pattern_batch(0, 1, 1, 1), timeout_s=0.05)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (sender.send(pattern_batch(0, 1, 1, 1)), done.set()))
    thread.start()
    assert not done.wait(0.1)  # blocked: one batch unconsumed
    assert receiver.receive(1).seq == 0
    thread.join(30)
    assert done.is_set() and receiver.receive(1).seq == 1
    assert receiver.stats()["peak_in_flight"] == 1


def test_batches_are_handed_over_by_reference():
    endpoints = create_data_plane(None).connect(["gen"], ["trainer"])
    batch = pattern_batch(0, 0, 2, 2)
    endpoints.sender(0).open().send(batch)
    assert endpoints.receiver(0).open().receive(1).batch["input_ids_BS"] is batch["input_ids_BS"]


def test_each_receiver_has_its_own_sequence_per_producer():
    endpoints = create_data_plane(None).connect(["gen"], ["rank0", "rank1"])
    to_0, to_1 = endpoints.sender(0, 0).open(), endpoints.sender(0, 1).open()
    assert endpoints.sender(0, 1).open() is to_1  # open is idempotent
    assert [to_0.send({"x": torch.zeros(1)}) for _ in range(2)] == [0, 1]
    assert to_1.send({"x": torch.ones(1)}) == 0
    assert [endpoints.receiver(1).open().receive(1).seq] == [0]


def test_setup_errors_and_close():
    plane = create_data_plane(None)
    with pytest.raises(ValueError, match="at least one producer and one receiver"):
        plane.connect([], ["trainer"])
    endpoints = plane.connect(["gen"], ["trainer"])
    with pytest.raises(DataPlaneError, match="already connected"):
        plane.connect(["gen"], ["trainer"])
    with pytest.raises(ValueError, match="producer index 1 out of range"):
        endpoints.sender(1)
    with pytest.raises(TypeError, match="only inside the process that connected them"):
        pickle.dumps(endpoints.sender(0))
    sender, receiver = endpoints.sender(0).open(), endpoints.receiver(0).open()
    outcome = []

    def wait_for_a_batch():
        try:
            receiver.receive(30)
        except DataPlaneClosedError:
            outcome.append("closed")

    waiter = threading.Thread(target=wait_for_a_batch)
    waiter.start()
    plane.close()
    plane.close()
    waiter.join(30)
    assert outcome == ["closed"]
    with pytest.raises(DataPlaneClosedError):
        sender.send({"x": torch.zeros(1)})
    with pytest.raises(DataPlaneClosedError):
        endpoints.receiver(0).open()
