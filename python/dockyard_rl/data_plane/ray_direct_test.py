"""Tests of the Ray Direct Transport data plane on a real local Ray (127.0.0.1, gloo on CPU).

One Ray instance and one set of actors (4 producers, 1 trainer) serve the whole module; each
test connects its own plane on them (a gloo group takes well under a second once the actors
run) and closes it. Nothing here is timed: back-pressure is checked through the receiver's
counters and the error a blocked producer gets.
"""

import contextlib

import pytest

ray = pytest.importorskip("ray")

from dockyard_rl.cluster.local_ray import init_local_ray  # noqa: E402
from dockyard_rl.data_plane.config import DataPlaneConfig  # noqa: E402
from dockyard_rl.data_plane.factory import create_data_plane  # noqa: E402
from dockyard_rl.data_plane.ray_direct import RayDirectDataPlane, data_plane_actor_options  # noqa: E402
from dockyard_rl.data_plane.testing_actors import (  # noqa: E402
    PATTERN_STRIDE,
    ExperienceProducer,
    ExperienceTrainer,
)

NUM_PRODUCERS = 4


@pytest.fixture(scope="module")
def actors():
    init_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    producer_cls = ray.remote(**data_plane_actor_options())(ExperienceProducer)
    trainer_cls = ray.remote(**data_plane_actor_options())(ExperienceTrainer)
    # num_cpus=0: five actors on a 2-core machine; they mostly wait on each other.
    producers = [producer_cls.options(num_cpus=0).remote(p) for p in range(NUM_PRODUCERS)]
    trainer = trainer_cls.options(num_cpus=0).remote()
    try:
        yield producers, trainer
    finally:
        ray.shutdown()


@contextlib.contextmanager
def connected(actors, **config):
    """A plane over the module's actors with every endpoint opened in its actor."""
    producers, trainer = actors
    plane = create_data_plane({"transport": "ray_direct", **config})
    endpoints = plane.connect(producers, [trainer])
    ray.get(trainer.open.remote(endpoints.receiver(0)))
    opened = ray.get([p.open.remote(endpoints.sender(i)) for i, p in enumerate(producers)])
    assert opened == [(f"producer-{i}", 0) for i in range(len(producers))]
    try:
        yield plane, endpoints
    finally:
        plane.close()


def _plasma_bytes_created() -> int:
    """Bytes ever created in Ray's object store (plasma) on this cluster."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(
        get_state_from_address(ray.get_runtime_context().gcs_address)  # ours, not another's
    ).store_stats.cumulative_created_bytes


def test_four_producers_every_batch_exactly_once(actors):
    producers, trainer = actors
    num_batches, capacity = 6, 2
    with connected(actors, max_in_flight_batches=capacity):
        # Every batch is resent right after its send: the copies must be dropped.
        sends = [p.send_patterns.remote(num_batches, 4, 16, True) for p in producers]
        received = ray.get(trainer.receive.remote(NUM_PRODUCERS * num_batches, 60, 0.005))
        results = ray.get(sends)
        stats = ray.get(trainer.stats.remote())
        leftover = ray.get(trainer.try_receive.remote(0.2))
    assert results == [[(n, "duplicate") for n in range(num_batches)]] * NUM_PRODUCERS
    keys = [(r["producer_id"], r["seq"]) for r in received]
    assert sorted(keys) == [
        (f"producer-{p}", n) for p in range(NUM_PRODUCERS) for n in range(num_batches)
    ]
    for r in received:
        p = int(r["producer_id"].split("-")[1])
        assert r["first_id"] == p * PATTERN_STRIDE + r["seq"]  # the payload is that batch
        assert r["metadata"] == {"number": r["seq"], "producer_index": p}
        assert r["lists"]["instance_ids"][0] == f"p{p}-b{r['seq']}-s0"
    for p in range(NUM_PRODUCERS):
        seqs = [seq for producer, seq in keys if producer == f"producer-{p}"]
        assert seqs == sorted(seqs)
    assert leftover.startswith("ReceiveTimeoutError")
    assert stats["num_accepted"] == NUM_PRODUCERS * num_batches
    assert stats["num_duplicates_dropped"] == NUM_PRODUCERS * num_batches
    assert stats["num_gaps_rejected"] == 0
    assert 1 <= stats["peak_in_flight"] <= capacity


def test_large_batch_arrives_bit_identical_outside_the_object_store(actors):
    producers, trainer = actors
    with connected(actors):
        plasma_before = _plasma_bytes_created()
        seq, sent_digest = ray.get(producers[1].send_random.remote(1234, 256, 4096))
        [received] = ray.get(trainer.receive.remote(1, 60))
        plasma_after = _plasma_bytes_created()
    assert (received["producer_id"], received["seq"]) == ("producer-1", seq)
    assert received["fields"] == {
        "input_ids_BS": ("torch.int64", (256, 4096)),
        "logprobs_BS": ("torch.float32", (256, 4096)),
        "token_mask_BS": ("torch.bool", (256, 4096)),
        "loss_mask_BS": ("torch.float32", (256, 4096)),
        "rewards_B": ("torch.float32", (256,)),
        "ref_logprobs_BS": ("torch.float32", (256, 4096)),
        "instance_ids": ("list", 256),
    }
    assert received["digest"] == sent_digest  # every byte, NaN payloads included
    assert received["metadata"] == {"seed": 1234, "weight_version": 7}
    # 13 MiB of tensors moved; the object store saw at most a few control bytes.
    assert plasma_after - plasma_before < 64 * 1024


def test_backpressure_bounds_in_flight_batches(actors):
    producers, trainer = actors
    with connected(actors, max_in_flight_batches=2):
        first = [ray.get(producers[0].try_send.remote(2, 8, 30))[0] for _ in range(2)]
        blocked, _ = ray.get(producers[0].try_send.remote(2, 8, 0.5))
        full_stats = ray.get(trainer.stats.remote())
        other_blocked, _ = ray.get(producers[3].try_send.remote(2, 8, 0.2))
        [oldest] = ray.get(trainer.receive.remote(1, 30))
        after_consume, _ = ray.get(producers[0].try_send.remote(2, 8, 30))
        rest = ray.get(trainer.receive.remote(2, 30))
        stats = ray.get(trainer.stats.remote())
    assert first == [0, 1]
    assert blocked.startswith("BackpressureTimeoutError") and "seq 2 was not sent" in blocked
    assert other_blocked.startswith("BackpressureTimeoutError")  # the bound is per receiver
    assert (full_stats["num_buffered"], full_stats["num_reserved"]) == (2, 0)
    assert (oldest["producer_id"], oldest["seq"]) == ("producer-0", 0)
    assert after_consume == 2  # the timed-out attempts did not use up a seq
    assert [r["seq"] for r in rest] == [1, 2]
    assert stats["peak_in_flight"] == 2 and stats["num_accepted"] == 3


def test_duplicate_resend_is_dropped(actors):
    producers, trainer = actors
    with connected(actors):
        ray.get(producers[2].try_send.remote(1, 4, 30))
        resent = ray.get(producers[2].resend.remote())
        # The same batch's tensors moved again without a slot (a retry racing its original).
        transferred_again = ray.get(producers[2].transfer_last_again.remote())
        received = ray.get(trainer.receive.remote(1, 30))
        nothing_more = ray.get(trainer.try_receive.remote(0.2))
        stats = ray.get(trainer.stats.remote())
    assert (resent, transferred_again) == ("duplicate", "duplicate")
    assert [(r["producer_id"], r["seq"]) for r in received] == [("producer-2", 0)]
    assert nothing_more.startswith("ReceiveTimeoutError")
    assert stats["num_accepted"] == 1 and stats["num_duplicates_dropped"] == 2


def test_gap_is_detected(actors):
    producers, trainer = actors
    with connected(actors):
        ray.get(producers[0].try_send.remote(1, 4, 30))
        ray.get(producers[0].skip_seq.remote())
        gap, _ = ray.get(producers[0].try_send.remote(1, 4, 30))
        stats = ray.get(trainer.stats.remote())
    assert gap.startswith("SequenceGapError") and "expects seq 1" in gap
    assert stats["num_gaps_rejected"] == 1 and stats["num_accepted"] == 1


def test_endpoints_close_with_the_plane(actors):
    producers, trainer = actors
    with connected(actors) as (plane, endpoints):
        with pytest.raises(ValueError, match="open this receiver 0 inside the actor"):
            endpoints.receiver(0).open()
        with pytest.raises(ValueError, match="open this sender .producer-0. inside the actor"):
            endpoints.sender(0).open()
        with pytest.raises(ValueError, match="one gloo group per actor"):
            create_data_plane({}).connect(producers, [trainer])
        waiting = trainer.try_receive.remote(60)
        plane.close()
        assert ray.get(waiting).startswith("DataPlaneClosedError")
        assert ray.get(producers[1].try_send.remote(1, 1, 5))[0].startswith("DataPlaneClosedError")


def test_actor_classes_without_the_options_fail_at_connect(actors):
    plain = ray.remote(ExperienceTrainer).options(num_cpus=0).remote()
    with pytest.raises(ValueError, match="without enable_tensor_transport"):
        create_data_plane({}).connect([plain], [plain])
    # Tensor transport on, but no data_plane concurrency group: Ray kills the actor on the
    # first call into that group, which connect makes at setup.
    no_group_cls = ray.remote(enable_tensor_transport=True)(ExperienceTrainer)
    receiver, producer = (no_group_cls.options(num_cpus=0).remote() for _ in range(2))
    plane = RayDirectDataPlane(DataPlaneConfig())
    with pytest.raises(
        ValueError,
        match=r"installing on receiver 0 failed.*"
        r"data_plane_actor_options",
    ):
        plane.connect([producer], [receiver])
    for actor in (plain, receiver, producer):
        ray.kill(actor)
