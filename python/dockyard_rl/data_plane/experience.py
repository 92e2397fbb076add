"""A training step's experience over the data plane: one shard per trainer rank, a handle for
the driver.

    # producer (async GRPO's collector actor), once per step:
    remote = send_step_shards(senders, batch, step=s)       # shard r -> rank r; returns a handle
    # driver: only the handle travels (a few ints), never the tensors
    policy.get_logprobs(remote)                      # kept rank-side, beside the shard
    for i, rows in enumerate(plan):                  # mini_batches.mini_batch_plan(B, ...)
        policy.train(remote.select(rows, last=i == len(plan) - 1), loss_fn)
    # each trainer rank actor:
    inbox = ShardInbox(receiver_spec.open())
    shard = inbox.shard(remote)   # receives once, then cached: log-probs and train reuse it
    inbox.drop(remote)            # after the step's last optimizer step

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

Mini-batches (algorithms/mini_batches.py): the driver plans a step's optimizer steps over the
GLOBAL rows 0..B-1 exactly as for a driver-side batch, and hands the policy `remote.select(rows)`
per optimizer step. `shard_rows` (the global row of each row of each rank's shard) lets the
policy map them to each rank's own rows (`rank_rows`): rows of a mini-batch fall unevenly on the
ranks, so every rank's list is padded with masked rows (`PAD_ROW`; `select_shard_rows` makes them
copies with sample_mask 0) to the longest, and every rank runs the same number of microbatches
(FSDP's collectives need that). The loss's normalisers are the mini-batch's global valid counts
(`count_valid` of each rank's rows, summed over the ranks).

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

import torch

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
# In `rank_rows`: a padding row (a masked copy of a real row, `select_shard_rows`).
PAD_ROW = -1


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
        shard_rows: per rank, the global row of each row of its shard, in shard order
            (the `shard_indices` of `shard_for_ranks`' split); empty in a handle built without them.
        rows: the global rows one `train` call trains (one optimizer step: `select`); None is
            the whole batch.
        last: whether the ranks drop the shard after that `train` call (the step's last
            optimizer step).
        rank_side_keys: the log-probs the ranks were asked to keep beside the shard
            (`with_rank_side_key`: PREV_LOGPROBS, REFERENCE_LOGPROBS).
    """

    step: int
    seq: int
    batch_size: int
    num_tokens: int
    num_valid_tokens: int
    num_valid_sequences: int
    valid_weight_versions: tuple[int, ...]
    shard_rows: tuple[tuple[int, ...], ...] = ()
    rows: tuple[int, ...] | None = None
    last: bool = True
    rank_side_keys: frozenset[str] = frozenset()

    def select(self, rows: Sequence[int] | Any, *, last: bool) -> RemoteBatch:
        """The handle of one optimizer step on global `rows` (ints or a 1-D int tensor, e.g. a
        `mini_batch_plan` entry); `last`: the ranks drop the shard after it.

        Raises:
            ValueError: a row outside [0, batch_size), or no rows.
        """
        picked = tuple(int(row) for row in rows)
        if not picked or min(picked) < 0 or max(picked) >= self.batch_size:
            raise ValueError(
                f"RemoteBatch.select: rows must be a non-empty subset of [0, {self.batch_size})"
            )
        return dataclasses.replace(self, rows=picked, last=last)

    def with_rank_side_key(self, key: str) -> RemoteBatch:
        """This handle, recording that the ranks now keep `key` (log-probs) beside the shard."""
        return dataclasses.replace(self, rank_side_keys=self.rank_side_keys | {key})

    @property
    def key(self) -> tuple[int, int]:
        """(step, seq): the shard's identity, the same for every `select` of this batch."""
        return self.step, self.seq

    def rank_rows(self) -> list[list[int]]:
        """Per rank, its shard's rows (local indices) that `rows` names, in `rows`' order,
        padded with PAD_ROW to the same length on every rank (module docstring). The whole
        shard, unpadded, when `rows` is None.

        Raises:
            ValueError: the handle has no `shard_rows`.
        """
        if not self.shard_rows:
            raise ValueError("this RemoteBatch carries no shard_rows (send_step_shards sets them)")
        if self.rows is None:
            return [list(range(len(global_rows))) for global_rows in self.shard_rows]
        where = {
            g: (r, i)
            for r, global_rows in enumerate(self.shard_rows)
            for i, g in enumerate(global_rows)
        }
        per_rank: list[list[int]] = [[] for _ in self.shard_rows]
        for row in self.rows:
            rank, local = where[row]
            per_rank[rank].append(local)
        longest = max(len(local_rows) for local_rows in per_rank)
        return [local_rows + [PAD_ROW] * (longest - len(local_rows)) for local_rows in per_rank]


def shard_for_ranks(batch: BatchedDataDict, num_ranks: int) -> list[BatchedDataDict]:
    """The ranks' shards of `batch`, exactly as DTensorPolicy shards a driver-side batch."""
    return list(_sharded(batch, num_ranks).shards)


def _sharded(batch: BatchedDataDict, num_ranks: int) -> Any:
    return batch.shard_by_batch_size(num_ranks, balance_by="input_lengths")


def select_shard_rows(shard: BatchedDataDict, local_rows: Sequence[int]) -> BatchedDataDict:
    """The rows `local_rows` of a rank's shard (one `RemoteBatch.rank_rows` entry), new tensors.
    A PAD_ROW is a copy of the first real row (of shard row 0 when there is none) with
    sample_mask 0, as `rollouts.pad_to_dp_multiple` pads: it counts nowhere in the loss."""
    real = [row for row in local_rows if row != PAD_ROW]
    filler = real[0] if real else 0
    picked = shard.select_indices([filler if row == PAD_ROW else row for row in local_rows])
    padding = torch.tensor([row == PAD_ROW for row in local_rows])
    if bool(padding.any()):
        mask = picked["sample_mask"]
        picked["sample_mask"] = torch.where(padding, torch.zeros_like(mask), mask)
    return picked


def send_step_shards(
    senders: Sequence[DataPlaneSender],
    batch: BatchedDataDict,
    *,
    step: int,
    num_valid: tuple[int, int],
) -> RemoteBatch:
    """Sends shard r of `batch` to receiver r (`senders[r]`) and returns the handle.

    `batch` is a padded training batch (rollouts.assemble_train_batch; its keys:
    distributed/batch_layouts.RolloutBatch; size a multiple of len(senders)). `num_valid`:
    `loss_functions.count_valid(batch)`. Blocks until every rank acknowledged its shard.

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
    sharded = _sharded(batch, len(senders))
    seqs = {sender.send(shard, {"step": step}) for sender, shard in zip(senders, sharded.shards)}
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
        shard_rows=tuple(tuple(rows) for rows in sharded.shard_indices),
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
