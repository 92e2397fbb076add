"""A training step's experience over the data plane: one shard per trainer rank, a handle for
the driver.

    # producer (async GRPO's collector actor), once per step:
    remote = send_step_shards(senders, batch, step=s)       # shard r -> rank r; returns a handle
    # driver: only the handle travels (a few ints), never the tensors
    policy.get_logprobs(remote); policy.train(remote, loss_fn)
    # each trainer rank actor:
    inbox = ShardInbox(receiver_spec.open())
    shard = inbox.shard(remote)   # receives once, then cached: log-probs and train reuse it
    inbox.drop(remote)            # after train

Where the receivers live: Ray's gloo group (the CPU tensor transport of ray_direct) is built on
torch.distributed's default process group, of which a process has one, and a policy rank's is
its FSDP group already. So each rank gets a `ShardInboxActor` of its own on its node (no
torch process group, no CPU reserved): the data plane delivers shard r into inbox r, and rank r
takes it from there with one node-local Ray call (the node's shared-memory object store; never
the driver). With NCCL on GPU the same holds (Ray's NCCL groups are separate communicators,
but one inbox per rank keeps one code path).

Shards: `batch.shard_by_batch_size(num_ranks, balance_by="input_lengths")`, the split
`DTensorPolicy` makes of a driver-side batch (equal sample counts, balanced tokens), so both
paths train on identical shards. Shard r travels on channel producer -> receiver r with the
data plane's sequence numbers; every rank's channel carries one batch per step, so all ranks see
the same seq for a step and `RemoteBatch.seq` names it. The shard's metadata holds the step.

Exactly once, bounded: the data plane's (interfaces.py). A rank takes each seq once (the inbox
checks the delivery is the handle's step and seq, so a rank never trains a stale or foreign
batch); `send` returns only after every rank acknowledged, so a handle the driver holds names
batches already in the ranks' buffers (`max_in_flight_batches` >= 1 is enough: the producer
sends a step only when the trainer asks for it).

Failures: a rank that waits longer than `data_plane.receive_timeout_s` for its shard raises
ReceiveTimeoutError naming that key; a delivery that is not the expected step raises
DataPlaneError. Both are fatal for the run (resume from the last checkpoint: the step's groups
are in its replay-buffer snapshot, so none is lost or trained twice).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from dockyard_rl.data_plane.interfaces import (
    DataPlaneError,
    DataPlaneReceiver,
    DataPlaneSender,
    ReceiveTimeoutError,
)
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict

logger = logging.getLogger(__name__)

# Written worker-side by `get_logprobs` / `get_reference_policy_logprobs` on a RemoteBatch.
PREV_LOGPROBS = "prev_logprobs"
REFERENCE_LOGPROBS = "reference_policy_logprobs"


@dataclasses.dataclass(frozen=True)
class RemoteBatch:
    """The driver's handle to a global batch whose shards wait in the trainer ranks.

    Attributes:
        step: the training step the batch is for (checked against each shard's metadata).
        seq: the data-plane sequence number of its shards (the same on every rank's channel).
        batch_size: samples in the global batch (a multiple of the number of ranks).
        num_tokens: sum of input_lengths over the global batch.
        num_valid_tokens, num_valid_sequences: `loss_functions.count_valid` of the global batch
            (the loss's global normalisers; every rank needs the totals).
        valid_weight_versions: the weight version of every sample with sample_mask 1 (the
            driver's staleness metric).
    """

    step: int
    seq: int
    batch_size: int
    num_tokens: int
    num_valid_tokens: int
    num_valid_sequences: int
    valid_weight_versions: tuple[int, ...]


def shard_for_ranks(batch: BatchedDataDict, num_ranks: int) -> list[BatchedDataDict]:
    """The ranks' shards of `batch`, exactly as DTensorPolicy shards a driver-side batch."""
    return list(batch.shard_by_batch_size(num_ranks, balance_by="input_lengths").shards)


def send_step_shards(
    senders: Sequence[DataPlaneSender],
    batch: BatchedDataDict,
    *,
    step: int,
    num_valid: tuple[int, int],
) -> RemoteBatch:
    """Sends shard r of `batch` to receiver r (`senders[r]`) and returns the handle.

    `batch` is a padded training batch (rollouts.assemble_train_batch: input_ids,
    input_lengths, token_mask, sample_mask, weight_version, ...; size a multiple of
    len(senders)). `num_valid`: `loss_functions.count_valid(batch)`. Blocks until every rank
    acknowledged its shard.

    Raises:
        DataPlaneError (and subclasses): the data plane's send errors (interfaces.py); the
            batch may then have reached some ranks only, so the caller fails the step.
    """
    if batch.batch_size % len(senders):
        raise ValueError(
            f"batch size {batch.batch_size} is not a multiple of the {len(senders)} trainer "
            "ranks (pad it with rollouts.pad_to_dp_multiple)"
        )
    num_valid_tokens, num_valid_sequences = num_valid
    valid = batch["sample_mask"] > 0
    seqs = {
        sender.send(shard, {"step": step})
        for sender, shard in zip(senders, shard_for_ranks(batch, len(senders)))
    }
    # Every channel carries one batch per step: a difference means a channel lost or repeated one.
    assert len(seqs) == 1, f"ranks' channels disagree on the sequence number: {sorted(seqs)}"
    return RemoteBatch(
        step=step,
        seq=seqs.pop(),
        batch_size=batch.batch_size,
        num_tokens=int(batch["input_lengths"].sum()),
        num_valid_tokens=num_valid_tokens,
        num_valid_sequences=num_valid_sequences,
        valid_weight_versions=tuple(int(v) for v in batch["weight_version"][valid].tolist()),
    )


class ShardInbox:
    """A trainer rank's side: receives the shard of a `RemoteBatch` once and caches it until
    `drop` (module docstring). One consuming thread (the rank's main thread).

    Args:
        receiver: this rank's opened data-plane receiver.
        receive_timeout_s: how long `shard` waits (the `data_plane.receive_timeout_s` value,
            named in the error).
    """

    def __init__(self, receiver: DataPlaneReceiver, receive_timeout_s: float):
        self._receiver = receiver
        self._receive_timeout_s = receive_timeout_s
        self._cached: tuple[RemoteBatch, BatchedDataDict] | None = None
        # (producer id, seq, step) of every shard received, in order.
        self.received: list[tuple[str, int, int]] = []

    def shard(self, remote: RemoteBatch) -> BatchedDataDict:
        """This rank's shard of `remote`: received on the first call, cached afterwards.

        Raises:
            ReceiveTimeoutError: no shard within `receive_timeout_s` (message names the key).
            DataPlaneError: the shard that arrived is not `remote`'s step and seq.
        """
        if self._cached is not None and self._cached[0] == remote:
            return self._cached[1]
        if self._cached is not None:  # an earlier step that never trained (a failed step)
            logger.warning("dropping the unused shard of step %d", self._cached[0].step)
            self._cached = None
        try:
            delivery = self._receiver.receive(self._receive_timeout_s)
        except ReceiveTimeoutError as error:
            raise ReceiveTimeoutError(
                f"data_plane.receive_timeout_s={self._receive_timeout_s:g}: this trainer rank "
                f"got no shard of step {remote.step} (seq {remote.seq}) within "
                f"{self._receive_timeout_s:g} s: the collector did not send it or the transfer "
                "hung; check the collector's log, or raise data_plane.receive_timeout_s"
            ) from error
        self.received.append((delivery.producer_id, delivery.seq, delivery.metadata.get("step")))
        if delivery.seq != remote.seq or delivery.metadata.get("step") != remote.step:
            raise DataPlaneError(
                f"expected the shard of step {remote.step} (seq {remote.seq}), received "
                f"seq {delivery.seq} of step {delivery.metadata.get('step')} from "
                f"{delivery.producer_id}: a shard was lost or sent for another step"
            )
        self._cached = (remote, delivery.batch)
        return delivery.batch

    def drop(self, remote: RemoteBatch) -> None:
        """Forgets `remote`'s shard (after train); idempotent."""
        if self._cached is not None and self._cached[0] == remote:
            self._cached = None

    @property
    def num_cached(self) -> int:
        return 0 if self._cached is None else 1

    def stats(self) -> dict[str, Any]:
        """The receiver's counters plus `received` and `num_cached`."""
        return {
            **self._receiver.stats(),
            "received": list(self.received),
            "num_cached": self.num_cached,
        }


class ShardInboxActor:
    """A trainer rank's data-plane receiver in an actor of its own (module docstring, "Where
    the receivers live"). Declare with `ray.remote(**data_plane_actor_options())`; start with
    `start_inbox_actors`. `take(remote)` hands the shard over once (the rank caches it)."""

    def __init__(self) -> None:
        self._inbox: ShardInbox | None = None

    def open(self, receiver_spec: Any, receive_timeout_s: float) -> None:
        self._inbox = ShardInbox(receiver_spec.open(), receive_timeout_s)

    def take(self, remote: RemoteBatch) -> BatchedDataDict:
        """This rank's shard of `remote` (ShardInbox.shard's errors), then forgotten here."""
        assert self._inbox is not None, "open() first"
        shard = self._inbox.shard(remote)
        self._inbox.drop(remote)
        return shard

    def stats(self) -> dict[str, Any]:
        assert self._inbox is not None, "open() first"
        return self._inbox.stats()


def start_inbox_actors(node_ids: Sequence[str], runtime_env: dict[str, Any]) -> list[Any]:
    """One `ShardInboxActor` on each node of `node_ids` (a rank's node, rank order), pinned
    there, with no CPU reserved (it only waits and copies). Ray must be running."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dockyard_rl.data_plane.ray_direct import data_plane_actor_options

    actor_cls = ray.remote(**data_plane_actor_options())(ShardInboxActor)
    return [
        actor_cls.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env=runtime_env,
        ).remote()
        for node_id in node_ids
    ]
