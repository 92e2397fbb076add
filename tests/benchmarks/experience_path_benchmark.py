"""Benchmark: one GRPO step's training batch, collector actor -> trainer rank actors, over the
driver (`data_plane: null`) vs over the data plane (`data_plane: {transport: ray_direct}`).

    tools/bazel run //tests/benchmarks:experience_path_benchmark [-- --samples 64
        --seq-len 2048 --ranks 2 --reps 5]

One local Ray node (127.0.0.1). A "collector" actor holds a training batch with the fields and
dtypes `rollouts.assemble_train_batch` builds (input_ids int64, token_mask / advantages /
generation_logprobs float32 (B, S); input_lengths, sample_mask, weight_version (B,)); `--ranks`
"rank" actors stand for the policy's ranks. The two paths async GRPO takes, each timed on the
driver until every rank holds its shard (data_plane/experience.py's split for both):

- driver path: the collector returns the batch (`ray.get` into the driver), the driver shards
  it and passes shard r to rank r as a task argument (what `sample_groups` + DTensorPolicy do);
- data plane: the driver asks the collector to send the step (`send_step_shards`: shard r to
  rank r's inbox actor over Ray Direct Transport, gloo) and each rank to take its shard from its
  inbox (node-local object store); the driver only sees the `RemoteBatch` handle.

Reported per path: median / min / max seconds over `--reps` after `--warmup`, and the bytes
that pass through the driver (tensor bytes received + sent, or the pickled handle). Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch


def make_batch(num_samples: int, seq_len: int):
    from dockyard_rl.distributed.batched_data_dict import BatchedDataDict

    generator = torch.Generator().manual_seed(0)
    shape = (num_samples, seq_len)
    lengths_B = torch.randint(seq_len // 2, seq_len + 1, (num_samples,), generator=generator)
    return BatchedDataDict(
        input_ids=torch.randint(0, 50_000, shape, generator=generator),
        input_lengths=lengths_B,
        token_mask=(torch.arange(seq_len)[None, :] < lengths_B[:, None]).float(),
        sample_mask=torch.ones(num_samples),
        advantages=torch.randn(shape, generator=generator),
        generation_logprobs=-torch.rand(shape, generator=generator),
        weight_version=torch.zeros(num_samples, dtype=torch.int64),
    )


def tensor_bytes(batch) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


class Collector:
    """The producer: holds the step's batch."""

    def __init__(self, num_samples: int, seq_len: int):
        self._batch = make_batch(num_samples, seq_len)
        self._senders = []

    def open(self, specs) -> None:
        self._senders = [spec.open() for spec in specs]

    def batch(self):
        return self._batch

    def send_step(self, step: int):
        from dockyard_rl.data_plane.experience import send_step_shards

        return send_step_shards(self._senders, self._batch, step=step, num_valid=(1, 1))


class Rank:
    """A trainer rank: takes its shard as a task argument, or from its inbox actor (what a
    DTensor rank does: data_plane/experience.py)."""

    def take(self, shard) -> int:
        return tensor_bytes(shard)

    def take_from(self, inbox, remote) -> int:
        import ray

        return tensor_bytes(ray.get(inbox.take.remote(remote)))


def _timed(function, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        function()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    import ray

    from dockyard_rl.cluster.local_ray import init_local_ray
    from dockyard_rl.data_plane.experience import shard_for_ranks, start_inbox_actors
    from dockyard_rl.data_plane.factory import create_data_plane
    from dockyard_rl.data_plane.ray_direct import data_plane_actor_options

    init_local_ray(log_to_driver=False)
    options = data_plane_actor_options()
    collector_cls = ray.remote(**options)(Collector)
    collector = collector_cls.options(num_cpus=0).remote(args.samples, args.seq_len)
    ranks = [ray.remote(Rank).options(num_cpus=0).remote() for _ in range(args.ranks)]
    node = ray.get_runtime_context().get_node_id()
    inboxes = start_inbox_actors([node] * args.ranks, {})
    plane = create_data_plane({"transport": "ray_direct", "max_in_flight_batches": 1})
    endpoints = plane.connect([collector], inboxes)
    ray.get(
        [collector.open.remote(endpoints.senders[0])]
        + [inbox.open.remote(endpoints.receiver(r), 120.0) for r, inbox in enumerate(inboxes)]
    )
    total_bytes = tensor_bytes(make_batch(args.samples, args.seq_len))
    through_driver = {}

    def driver_path() -> None:
        batch = ray.get(collector.batch.remote())
        shards = shard_for_ranks(batch, len(ranks))
        received = ray.get([rank.take.remote(s) for rank, s in zip(ranks, shards)])
        assert sum(received) == total_bytes
        through_driver["driver path"] = tensor_bytes(batch) + sum(map(tensor_bytes, shards))

    steps = iter(range(1, 1_000_000))

    def data_plane_path() -> None:
        remote = ray.get(collector.send_step.remote(next(steps)))
        received = ray.get(
            [rank.take_from.remote(inbox, remote) for rank, inbox in zip(ranks, inboxes)]
        )
        assert sum(received) == total_bytes
        through_driver["data plane (ray_direct, gloo)"] = 2 * len(pickle.dumps(remote))

    try:
        rows = [
            ("driver path", _timed(driver_path, args.reps, args.warmup)),
            ("data plane (ray_direct, gloo)", _timed(data_plane_path, args.reps, args.warmup)),
        ]
    finally:
        plane.close()
        ray.shutdown()

    mib = total_bytes / 2**20
    print(
        f"\none step's batch: {args.samples} samples x {args.seq_len} tokens = {mib:.1f} MiB of "
        f"tensors, collector actor -> {args.ranks} rank actors, one local Ray node "
        f"({args.reps} reps after {args.warmup} warm-up)"
    )
    print(
        f"{'path':<31} {'median s':>9} {'min s':>8} {'max s':>8} "
        f"{'bytes through driver':>21} {'speed-up':>9}"
    )
    baseline = statistics.median(rows[0][1])
    for name, seconds in rows:
        median = statistics.median(seconds)
        print(
            f"{name:<31} {median:>9.4f} {min(seconds):>8.4f} {max(seconds):>8.4f} "
            f"{through_driver[name]:>21,} {baseline / median:>8.2f}x"
        )
    ratio = through_driver["driver path"] / through_driver["data plane (ray_direct, gloo)"]
    print(f"bytes through the driver, driver path / data plane: {ratio:,.0f}x")


if __name__ == "__main__":
    main()
