"""Benchmark: moving experience to the trainer, data plane vs Ray's object store via the driver.

    tools/bazel run //tests/benchmarks:data_plane_benchmark [-- --reps 10 --batch-size 256
        --seq-len 4096 --producers 4 --rounds 3]

One local Ray cluster (127.0.0.1), producer actors holding a prepared (B, S) batch of int64
token ids + float32 log-probs, one trainer actor. Two paths, measured in the same run on the
same actors and batch:

- object store via the driver (the baseline): the producer returns the batch from a task, the
  driver `ray.get`s it, then passes it to the trainer's task (Ray puts it into the object store
  again for that argument);
- data plane: `data_plane.transport: ray_direct` with gloo: the driver fires the producer's
  `send` and the trainer's `receive` and waits for both; the tensors go producer -> trainer over
  Ray Direct Transport, the driver sees a sequence number and a byte count.

Each time is the wall time, on the driver, until the trainer holds the batch. Table 1: one
producer, one batch at a time, median/min/max over `--reps` after `--warmup` untimed reps.
Table 2: `--producers` producers, `--rounds` batches each, all in flight at once (the object
store path fetches one batch per producer per round through the driver). Also reported: bytes
created in the object store per batch (Ray's cumulative plasma counter). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _plasma_bytes_created() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(
        get_state_from_address(ray.get_runtime_context().gcs_address)  # ours, not another's
    ).store_stats.cumulative_created_bytes


def _timed(function, reps: int, warmup: int) -> tuple[list[float], float]:
    """(seconds per timed rep, plasma bytes created per timed rep)."""
    for _ in range(warmup):
        function()
    seconds = []
    plasma_before = _plasma_bytes_created()
    for _ in range(reps):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return seconds, (_plasma_bytes_created() - plasma_before) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-in-flight-batches", type=int, default=4)
    args = parser.parse_args()

    import ray

    from dockyard_rl.cluster.local_ray import init_local_ray
    from dockyard_rl.data_plane.factory import create_data_plane
    from dockyard_rl.data_plane.ray_direct import data_plane_actor_options
    from dockyard_rl.data_plane.testing_actors import ExperienceProducer, ExperienceTrainer

    init_local_ray(log_to_driver=False)
    producer_cls = ray.remote(**data_plane_actor_options())(ExperienceProducer)
    trainer_cls = ray.remote(**data_plane_actor_options())(ExperienceTrainer)
    producers = [producer_cls.options(num_cpus=0).remote(p) for p in range(args.producers)]
    trainer = trainer_cls.options(num_cpus=0).remote()
    plane = create_data_plane(
        {
            "transport": "ray_direct",
            "tensor_transport": "gloo",
            "max_in_flight_batches": args.max_in_flight_batches,
        }
    )
    endpoints = plane.connect(producers, [trainer])
    ray.get(
        [trainer.open.remote(endpoints.receiver(0))]
        + [p.open.remote(endpoints.sender(i)) for i, p in enumerate(producers)]
        + [p.cache_batch.remote(args.batch_size, args.seq_len) for p in producers]
    )
    batch_bytes = args.batch_size * args.seq_len * (8 + 4)
    one = producers[0]

    def object_store_one() -> None:
        batch = ray.get(one.return_cached.remote())
        assert ray.get(trainer.take_batch.remote(batch)) == batch_bytes

    def data_plane_one() -> None:
        _, received = ray.get([one.send_cached.remote(), trainer.receive_count.remote()])
        assert received == batch_bytes

    def object_store_many() -> None:
        for _ in range(args.rounds):
            batches = ray.get([p.return_cached.remote() for p in producers])
            ray.get([trainer.take_batch.remote(b) for b in batches])
            del batches

    def data_plane_many() -> None:
        num_batches = args.rounds * len(producers)
        *_, received = ray.get(
            [p.send_cached.remote(args.rounds) for p in producers]
            + [trainer.receive_count.remote(num_batches)]
        )
        assert received == num_batches * batch_bytes

    try:
        rows = [
            ("object store via driver", *_timed(object_store_one, args.reps, args.warmup)),
            ("data plane (ray_direct, gloo)", *_timed(data_plane_one, args.reps, args.warmup)),
        ]
        many_reps = max(1, args.reps // 3)
        many = [
            ("object store via driver", *_timed(object_store_many, many_reps, 1)),
            ("data plane (ray_direct, gloo)", *_timed(data_plane_many, many_reps, 1)),
        ]
    finally:
        plane.close()
        ray.shutdown()

    mib = batch_bytes / 2**20
    print(
        f"\nexperience batch ({args.batch_size}, {args.seq_len}): int64 ids + float32 "
        f"log-probs = {mib:.1f} MiB; producer actor -> trainer actor on one local Ray node"
    )
    print(f"\n1 producer, one batch at a time ({args.reps} reps after {args.warmup} warm-up)")
    print(
        f"{'path':<31} {'median s':>9} {'min s':>8} {'max s':>8} {'MiB/s':>8} "
        f"{'plasma MiB/batch':>17} {'speed-up':>9}"
    )
    baseline = statistics.median(rows[0][1])
    for name, seconds, plasma in rows:
        median = statistics.median(seconds)
        print(
            f"{name:<31} {median:>9.4f} {min(seconds):>8.4f} {max(seconds):>8.4f} "
            f"{mib / median:>8.0f} {plasma / 2**20:>17.2f} {baseline / median:>8.2f}x"
        )
    num_batches = args.rounds * len(producers)
    print(
        f"\n{len(producers)} producers x {args.rounds} batches in flight together "
        f"({many_reps} reps after 1 warm-up; seconds for all {num_batches} batches)"
    )
    print(
        f"{'path':<31} {'median s':>9} {'min s':>8} {'max s':>8} {'MiB/s':>8} "
        f"{'plasma MiB/batch':>17} {'speed-up':>9}"
    )
    baseline = statistics.median(many[0][1])
    for name, seconds, plasma in many:
        median = statistics.median(seconds)
        print(
            f"{name:<31} {median:>9.4f} {min(seconds):>8.4f} {max(seconds):>8.4f} "
            f"{num_batches * mib / median:>8.0f} {plasma / num_batches / 2**20:>17.2f} "
            f"{baseline / median:>8.2f}x"
        )


if __name__ == "__main__":
    main()
