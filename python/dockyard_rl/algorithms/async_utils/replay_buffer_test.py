"""Tests for the age-bounded replay buffer: the strict age bound, whole groups, FIFO,
back-pressure, timeouts, close, thread safety, and running as a real threaded Ray actor."""

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dockyard_rl.algorithms.async_utils.replay_buffer import (
    AsyncGRPOConfig,
    BufferClosedError,
    ReplayBuffer,
    create_replay_buffer_actor,
)
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.utils.config import from_dict


def make_buffer(max_age=1, capacity=8, **kwargs):
    return ReplayBuffer(
        AsyncGRPOConfig(max_trajectory_age_steps=max_age, max_buffer_groups=capacity, **kwargs)
    )


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------- config


def test_config_from_yaml_dict():
    cfg = from_dict(
        AsyncGRPOConfig,
        {
            "max_trajectory_age_steps": 0,
            "max_buffer_groups": 4,
            "push_timeout_s": 2.5,
            "sample_timeout_s": None,
        },
        "async_grpo",
    )
    assert cfg.max_trajectory_age_steps == 0
    assert cfg.max_buffer_groups == 4
    assert cfg.push_timeout_s == 2.5
    assert cfg.sample_timeout_s is None


@pytest.mark.parametrize(
    "data, key",
    [
        ({"max_trajectory_age_steps": -1}, "async_grpo.max_trajectory_age_steps"),
        ({"max_trajectory_age_steps": 1.5}, "async_grpo.max_trajectory_age_steps"),
        ({"max_trajectory_age_steps": True}, "async_grpo.max_trajectory_age_steps"),
        ({"max_buffer_groups": 0}, "async_grpo.max_buffer_groups"),
        ({"in_flight_weight_updates": "yes"}, "async_grpo.in_flight_weight_updates"),
        ({"push_timeout_s": 0}, "async_grpo.push_timeout_s"),
        ({"sample_timeout_s": -3}, "async_grpo.sample_timeout_s"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        from_dict(AsyncGRPOConfig, data, "async_grpo")


def test_config_rejects_unknown_key():
    with pytest.raises(ValueError, match="max_staleness"):
        from_dict(AsyncGRPOConfig, {"max_staleness": 2}, "async_grpo")


def test_buffer_requires_its_config_type():
    with pytest.raises(ValueError, match="AsyncGRPOConfig"):
        ReplayBuffer({"max_buffer_groups": 3})


# ------------------------------------------------------------------------------------- age bound


def test_age_bound_boundary_is_inclusive_and_strict():
    buffer = make_buffer(max_age=2)
    assert buffer.push("g", weight_version=3, prompt_id="p")
    # Step 5 = 3 + 2 is the last step the group may train.
    [group] = buffer.sample(1, current_step=5, timeout=0)
    assert group.payload == "g" and group.weight_version == 3

    assert buffer.push("h", weight_version=3, prompt_id="q")
    assert buffer.advance_step(6) == 1  # 6 > 3 + 2: evicted, never returned.
    with pytest.raises(TimeoutError):
        buffer.sample(1, current_step=6, timeout=0)
    [dropped] = buffer.pop_dropped()
    assert (dropped.prompt_id, dropped.weight_version, dropped.dropped_at_step) == ("q", 3, 6)
    assert buffer.pop_dropped() == []


def test_zero_age_is_on_policy_only():
    buffer = make_buffer(max_age=0)
    buffer.push("old", weight_version=0)
    buffer.push("new", weight_version=1)
    [group] = buffer.sample(1, current_step=1, timeout=0)
    assert group.payload == "new"
    assert buffer.metrics()["num_groups_dropped_stale"] == 1


def test_push_of_an_already_stale_group_is_dropped_on_arrival():
    buffer = make_buffer(max_age=1, capacity=1)
    buffer.advance_step(4)
    assert buffer.push("fresh", weight_version=3)
    # Full, but a stale group does not need room: dropped at once instead of blocking.
    assert buffer.push("stale", weight_version=2, timeout=None) is False
    metrics = buffer.metrics()
    assert metrics["num_groups_dropped_stale"] == 1 and metrics["num_groups_buffered"] == 1


def test_in_flight_group_uses_oldest_version():
    buffer = make_buffer(max_age=1, in_flight_weight_updates=True)
    buffer.advance_step(5)
    # Oldest version 3: 5 > 3 + 1, so the group is stale although most samples are fresh.
    assert buffer.push("mixed", weight_version=[4, 3, 4, 5], prompt_id=0) is False
    assert buffer.push("mixed", weight_version=[4, 5], prompt_id=1) is True
    [group] = buffer.sample(1, current_step=5, timeout=0)
    assert group.weight_version == 4


def test_mixed_versions_rejected_without_in_flight_updates():
    buffer = make_buffer()
    with pytest.raises(ValueError, match="in_flight_weight_updates"):
        buffer.push("g", weight_version=[1, 2])
    buffer.push("g", weight_version=[2, 2])
    assert buffer.sample(1, current_step=2, timeout=0)[0].weight_version == 2


@pytest.mark.parametrize("version", [-1, 1.0, "3", [], None, True])
def test_bad_weight_versions_rejected(version):
    with pytest.raises(ValueError, match="weight_version"):
        make_buffer().push("g", weight_version=version)


def test_steps_never_go_backwards():
    buffer = make_buffer()
    buffer.advance_step(3)
    with pytest.raises(ValueError, match="never go backwards"):
        buffer.sample(1, current_step=2, timeout=0)
    with pytest.raises(ValueError, match="never go backwards"):
        buffer.advance_step(1)


def test_group_from_a_future_version_is_a_step_counting_error():
    buffer = make_buffer()
    buffer.push("g", weight_version=5)
    with pytest.raises(ValueError, match=r"newer weight version\(s\) \[5\]"):
        buffer.sample(1, current_step=4, timeout=0)
    assert buffer.num_buffered() == 1


# The property: over random interleavings of pushes, step advances and samples, every consumed
# group satisfies step <= v + max_age (never later), stale groups are never returned, groups come
# back whole and in FIFO order, and the buffer matches a plain-list reference model exactly.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 4)),  # push a group of version step - k
        st.tuples(st.just("advance"), st.integers(0, 2)),  # trainer advances by k steps
        st.tuples(st.just("sample"), st.integers(1, 3)),  # sample k groups
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(max_age=st.integers(0, 3), capacity=st.integers(3, 6), ops=_ops)
def test_property_age_bound_fifo_and_accounting(max_age, capacity, ops):
    buffer = make_buffer(max_age=max_age, capacity=capacity)
    model = []  # (push_index, version) of groups the reference model holds, FIFO.
    step = 0
    num_pushed = 0
    pushed_versions = {}
    consumed, dropped = [], []
    for op, arg in ops:
        if op == "push":
            version = max(0, step - arg)
            payload = ("group", num_pushed, tuple(range(4)))  # one group = 4 generations
            fresh = step <= version + max_age
            if fresh and len(model) >= capacity:
                with pytest.raises(TimeoutError):
                    buffer.push(payload, weight_version=version, prompt_id=num_pushed, timeout=0)
                continue
            assert (
                buffer.push(payload, weight_version=version, prompt_id=num_pushed, timeout=0)
                is fresh
            )
            pushed_versions[num_pushed] = version
            if fresh:
                model.append((num_pushed, version))
            else:
                dropped.append(num_pushed)
            num_pushed += 1
        elif op == "advance":
            step += arg
            expected_evicted = [i for i, v in model if step > v + max_age]
            model = [(i, v) for i, v in model if step <= v + max_age]
            assert buffer.advance_step(step) == len(expected_evicted)
            dropped += expected_evicted
        else:
            if arg > len(model):
                with pytest.raises(TimeoutError):
                    buffer.sample(arg, current_step=step, timeout=0)
                continue
            groups = buffer.sample(arg, current_step=step, timeout=0)
            assert [g.push_index for g in groups] == [i for i, _ in model[:arg]]
            for group in groups:
                assert step <= group.weight_version + max_age
                assert 0 <= step - group.weight_version
                assert group.payload == ("group", group.push_index, (0, 1, 2, 3))
                consumed.append(group.push_index)
            model = model[arg:]
        assert buffer.num_buffered() == len(model)
    assert sorted(d.push_index for d in buffer.pop_dropped()) == sorted(dropped)
    # A dropped group really was past the bound for a step the trainer reached.
    for index in dropped:
        assert step > pushed_versions[index] + max_age
    # Nothing lost, nothing duplicated.
    assert sorted(consumed + dropped + [i for i, _ in model]) == list(range(num_pushed))
    metrics = buffer.metrics()
    assert metrics["num_groups_pushed"] == num_pushed
    assert metrics["num_groups_consumed"] == len(consumed)
    assert metrics["num_groups_dropped_stale"] == len(dropped)
    assert sum(metrics["consumed_age_histogram"].values()) == len(consumed)
    assert metrics["consumed_age_max"] <= max_age


# ------------------------------------------------------------------------------- FIFO, metrics


def test_fifo_and_whole_groups():
    buffer = make_buffer(max_age=5)
    groups = [{"prompt": i, "generations": [f"p{i}-g{n}" for n in range(4)]} for i in range(5)]
    for i, group in enumerate(groups):
        buffer.push(group, weight_version=0, prompt_id=f"prompt-{i}")
    first = buffer.sample(2, current_step=0, timeout=0)
    rest = buffer.sample(3, current_step=0, timeout=0)
    assert [g.payload for g in first + rest] == groups
    assert [g.prompt_id for g in first + rest] == [f"prompt-{i}" for i in range(5)]
    assert [g.push_index for g in first + rest] == list(range(5))


def test_metrics_age_histogram_and_mean():
    buffer = make_buffer(max_age=2)
    buffer.push("a", weight_version=0)
    buffer.push("b", weight_version=1)
    buffer.push("c", weight_version=2)
    buffer.sample(3, current_step=2, timeout=0)
    metrics = buffer.metrics()
    assert metrics["consumed_age_histogram"] == {0: 1, 1: 1, 2: 1}
    assert metrics["consumed_age_mean"] == pytest.approx(1.0)
    assert metrics["consumed_age_max"] == 2
    assert metrics["current_step"] == 2
    assert metrics["consumed_seconds_in_buffer_mean"] >= 0.0


def test_sample_size_must_fit_capacity():
    buffer = make_buffer(capacity=4)
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="max_buffer_groups"):
            buffer.sample(bad, current_step=0, timeout=0)


def test_try_sample_is_non_blocking_and_takes_nothing_when_short():
    buffer = make_buffer()
    buffer.push("a", weight_version=0)
    start = time.monotonic()
    assert buffer.try_sample(2, current_step=0) is None
    assert time.monotonic() - start < 0.5
    assert buffer.num_buffered() == 1
    assert [g.payload for g in buffer.try_sample(1, current_step=0)] == ["a"]


# ------------------------------------------------------------------- blocking, timeouts, close


def test_sample_blocks_until_enough_groups_arrive():
    buffer = make_buffer(capacity=4)
    result = {}
    consumer = threading.Thread(
        target=lambda: result.update(groups=buffer.sample(3, current_step=0, timeout=10))
    )
    consumer.start()
    for i in range(3):
        time.sleep(0.02)
        assert "groups" not in result
        buffer.push(i, weight_version=0)
    consumer.join(5)
    assert not consumer.is_alive()
    assert [g.payload for g in result["groups"]] == [0, 1, 2]
    assert buffer.metrics()["sample_wait_seconds_total"] > 0


def test_sample_timeout_raises_and_removes_nothing():
    buffer = make_buffer()
    buffer.push("a", weight_version=0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 2 fresh groups"):
        buffer.sample(2, current_step=0, timeout=0.1)
    assert 0.1 <= time.monotonic() - start < 2
    assert buffer.num_buffered() == 1


def test_sample_default_timeout_comes_from_config():
    buffer = make_buffer(sample_timeout_s=0.05)
    with pytest.raises(TimeoutError, match="0.05s"):
        buffer.sample(1, current_step=0)


def test_back_pressure_producer_blocks_when_full_and_resumes_when_consumer_takes():
    buffer = make_buffer(capacity=2)
    buffer.push("a", weight_version=0)
    buffer.push("b", weight_version=0)
    pushed = threading.Event()

    def produce():
        buffer.push("c", weight_version=0)
        pushed.set()

    producer = threading.Thread(target=produce)
    producer.start()
    assert not pushed.wait(0.2), "push must block while the buffer is full"
    assert buffer.num_buffered() == 2
    assert [g.payload for g in buffer.sample(1, current_step=0, timeout=0)] == ["a"]
    assert pushed.wait(5), "push must resume once the consumer takes a group"
    producer.join(5)
    assert [g.payload for g in buffer.sample(2, current_step=0, timeout=0)] == ["b", "c"]
    assert buffer.metrics()["push_wait_seconds_total"] > 0.1


def test_eviction_on_step_advance_unblocks_a_producer():
    buffer = make_buffer(max_age=0, capacity=1)
    buffer.push("old", weight_version=0)
    done = threading.Event()
    producer = threading.Thread(target=lambda: (buffer.push("new", weight_version=1), done.set()))
    producer.start()
    assert not done.wait(0.1)
    assert buffer.advance_step(1) == 1
    assert done.wait(5)
    producer.join(5)
    assert [g.payload for g in buffer.sample(1, current_step=1, timeout=0)] == ["new"]


def test_push_timeout_when_full():
    buffer = make_buffer(capacity=1, push_timeout_s=0.05)
    buffer.push("a", weight_version=0)
    with pytest.raises(TimeoutError, match="stayed full"):
        buffer.push("b", weight_version=0)  # default timeout from config
    with pytest.raises(TimeoutError):
        buffer.push("b", weight_version=0, timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        buffer.push("b", weight_version=0, timeout=-1)
    # A timed-out push is not counted as pushed.
    assert buffer.metrics()["num_groups_pushed"] == 1


def test_close_wakes_blocked_producer_and_consumer():
    buffer = make_buffer(capacity=1)
    buffer.push("a", weight_version=0)
    errors = []

    def call(fn):
        try:
            fn()
        except BufferClosedError as error:
            errors.append(error)

    producer = threading.Thread(target=call, args=(lambda: buffer.push("b", 0, timeout=None),))
    consumer_buffer = make_buffer()
    consumer = threading.Thread(
        target=call, args=(lambda: consumer_buffer.sample(1, current_step=0, timeout=None),)
    )
    producer.start()
    consumer.start()
    time.sleep(0.1)
    assert producer.is_alive() and consumer.is_alive()
    buffer.close()
    consumer_buffer.close()
    producer.join(5)
    consumer.join(5)
    assert not producer.is_alive() and not consumer.is_alive()
    assert len(errors) == 2


def test_after_close_push_fails_and_sample_drains_then_fails():
    buffer = make_buffer()
    buffer.push("a", weight_version=0)
    buffer.close()
    buffer.close()  # idempotent
    assert buffer.is_closed()
    with pytest.raises(BufferClosedError, match="closed"):
        buffer.push("b", weight_version=0)
    with pytest.raises(BufferClosedError, match="holds 1 group"):
        buffer.sample(2, current_step=0, timeout=None)
    assert [g.payload for g in buffer.sample(1, current_step=0, timeout=None)] == ["a"]
    assert buffer.metrics()["closed"] is True


# ------------------------------------------------------------------------------- concurrency


def test_concurrent_producers_one_consumer_lose_and_duplicate_nothing():
    num_producers, groups_per_producer, groups_per_step, max_age = 4, 60, 5, 1
    buffer = make_buffer(max_age=max_age, capacity=6)
    # The trainer's published weight version, read by producers as the "engine" version.
    published = {"version": 0}
    version_lock = threading.Lock()
    producer_errors = []

    def produce(producer_id):
        rng = random.Random(producer_id)
        try:
            for n in range(groups_per_producer):
                with version_lock:
                    # Some groups come from an older engine (a slow generation), so drops happen.
                    version = max(0, published["version"] - rng.choice([0, 0, 0, 1, 2]))
                buffer.push(
                    {"producer": producer_id, "n": n},
                    weight_version=version,
                    prompt_id=(producer_id, n),
                    timeout=10,
                )
                if rng.random() < 0.3:
                    time.sleep(0.001)
        except Exception as error:  # surfaced by the assertion below
            producer_errors.append(error)

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(num_producers)]
    for producer in producers:
        producer.start()

    consumed = []
    step = 0
    while any(p.is_alive() for p in producers) or buffer.num_buffered() >= groups_per_step:
        groups = buffer.try_sample(groups_per_step, current_step=step)
        if groups is None:
            time.sleep(0.001)
            continue
        for group in groups:
            assert 0 <= step - group.weight_version <= max_age
            consumed.append(group.prompt_id)
        step += 1
        with version_lock:
            published["version"] = step
    for producer in producers:
        producer.join(10)
    assert not producer_errors
    remaining = buffer.num_buffered()
    if remaining:
        consumed += [g.prompt_id for g in buffer.sample(remaining, current_step=step, timeout=0)]
    dropped = [d.prompt_id for d in buffer.pop_dropped()]

    everything = consumed + dropped
    assert len(everything) == len(set(everything)), "a group was returned or dropped twice"
    assert set(everything) == {
        (p, n) for p in range(num_producers) for n in range(groups_per_producer)
    }
    assert step > 10
    metrics = buffer.metrics()
    assert metrics["num_groups_pushed"] == num_producers * groups_per_producer
    assert metrics["num_groups_consumed"] == len(consumed)
    assert metrics["num_groups_dropped_stale"] == len(dropped)


# ------------------------------------------------------------------------------------ Ray actor


@pytest.fixture(scope="module")
def ray_runtime():
    ray = pytest.importorskip("ray")
    init_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_as_threaded_ray_actor(ray_runtime):
    ray = ray_runtime
    num_producers, groups_per_producer, groups_per_step = 2, 12, 3
    buffer = create_replay_buffer_actor(
        AsyncGRPOConfig(max_trajectory_age_steps=1, max_buffer_groups=4), num_producers
    )

    @ray.remote(num_cpus=1)
    def produce(handle, producer_id):
        for n in range(groups_per_producer):
            # Blocks inside the actor whenever the buffer is full (capacity 4 < 24 groups).
            ray.get(handle.push.remote({"tokens": [producer_id, n]}, 0, (producer_id, n), 30))
        return producer_id

    producer_refs = [produce.remote(buffer, i) for i in range(num_producers)]
    # Let the producers fill the buffer and block on back-pressure.
    wait_until(lambda: ray.get(buffer.metrics.remote())["push_wait_seconds_total"] > 0, timeout=20)
    consumed = []
    for _ in range(num_producers * groups_per_producer // groups_per_step):
        groups = ray.get(buffer.sample.remote(groups_per_step, 1, 20))
        assert all(g.weight_version == 0 for g in groups)
        consumed += [g.prompt_id for g in groups]
    assert sorted(ray.get(producer_refs, timeout=20)) == list(range(num_producers))
    assert sorted(consumed) == [
        (p, n) for p in range(num_producers) for n in range(groups_per_producer)
    ]
    # Each producer's groups keep their order (FIFO per producer).
    for p in range(num_producers):
        assert [n for q, n in consumed if q == p] == list(range(groups_per_producer))

    # Step 2 > 0 + 1: nothing left to drop; a timeout surfaces as TimeoutError via Ray.
    with pytest.raises(TimeoutError):
        ray.get(buffer.sample.remote(1, 2, 0.05))
    # close() runs while a sample blocks (threaded actor) and the sample fails clearly.
    blocked = buffer.sample.remote(1, 2, None)
    time.sleep(0.2)
    ray.get(buffer.close.remote())
    with pytest.raises(BufferClosedError):
        ray.get(blocked, timeout=20)
    ray.kill(buffer)
