"""A step's shards over the data plane (experience.py), in one process with the in-memory plane
(same contract as ray_direct; the Ray path is tests/grpo_data_plane_test.py): every rank gets
its DTensorPolicy shard once, keeps it until `drop`, and a missing or foreign shard fails with
an error naming the fix."""

import pytest
import torch

from dockyard_rl.data_plane.experience import (
    PAD_ROW,
    RemoteBatch,
    ShardInbox,
    select_shard_rows,
    send_step_shards,
    shard_for_ranks,
)
from dockyard_rl.data_plane.factory import create_data_plane
from dockyard_rl.data_plane.interfaces import DataPlaneError, ReceiveTimeoutError
from dockyard_rl.data_plane.testing_actors import batch_digest
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict

NUM_RANKS = 2


def _batch(seed: int, size: int = 4, width: int = 6) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (size,), generator=generator)
    return BatchedDataDict(
        input_ids=torch.randint(0, 100, (size, width), generator=generator),
        input_lengths=lengths,
        token_mask=(torch.arange(width)[None, :] < lengths[:, None]).float(),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0][:size]),
        weight_version=torch.tensor([3, 4, 1, 4][:size]),
    )


@pytest.fixture
def plane():
    plane = create_data_plane({"transport": "in_memory", "max_in_flight_batches": 1})
    endpoints = plane.connect(["collector"], [f"rank{r}" for r in range(NUM_RANKS)])
    senders = [endpoints.sender(0, r).open() for r in range(NUM_RANKS)]
    inboxes = [ShardInbox(endpoints.receiver(r).open(), 0.2) for r in range(NUM_RANKS)]
    yield senders, inboxes
    plane.close()


def test_each_rank_receives_its_shard_once_keeps_it_then_drops_it(plane):
    senders, inboxes = plane
    for step in (1, 2):
        batch = _batch(step)
        remote = send_step_shards(senders, batch, step=step, num_valid=(17, 3))
        sharded = batch.shard_by_batch_size(NUM_RANKS, balance_by="input_lengths")
        assert remote == RemoteBatch(
            step=step,
            seq=step - 1,
            batch_size=4,
            num_tokens=int(batch["input_lengths"].sum()),
            num_valid_tokens=17,
            num_valid_sequences=3,
            valid_weight_versions=(3, 4, 4),
            shard_rows=tuple(tuple(rows) for rows in sharded.shard_indices),
        )
        expected = shard_for_ranks(batch, NUM_RANKS)
        for inbox, shard in zip(inboxes, expected):
            received = inbox.shard(remote)
            assert batch_digest(received) == batch_digest(shard)  # DTensorPolicy's split
            received["prev_logprobs"] = torch.zeros_like(received["token_mask"])
            # Cached: a second call receives nothing and sees what the first stored.
            assert inbox.shard(remote) is received and "prev_logprobs" in received
            assert inbox.num_cached == 1
            inbox.drop(remote)
            inbox.drop(remote)  # idempotent
            assert inbox.num_cached == 0
    for inbox in inboxes:
        stats = inbox.stats()
        assert stats["received"] == [("producer-0", 0, 1), ("producer-0", 1, 2)]
        assert stats["num_duplicates_dropped"] == 0 and stats["num_buffered"] == 0


def test_a_missing_shard_times_out_naming_the_key(plane):
    senders, inboxes = plane
    remote = send_step_shards(senders, _batch(1), step=1, num_valid=(1, 1))
    inboxes[0].shard(remote)
    inboxes[0].drop(remote)
    # The next step's handle, but nothing was sent for it.
    later = RemoteBatch(2, 1, 4, 10, 1, 1, ())
    with pytest.raises(ReceiveTimeoutError, match=r"data_plane\.receive_timeout_s=0\.2.*step 2"):
        inboxes[0].shard(later)


def test_a_shard_of_another_step_is_refused(plane):
    senders, inboxes = plane
    send_step_shards(senders, _batch(1), step=1, num_valid=(1, 1))
    stale = RemoteBatch(7, 0, 4, 10, 1, 1, ())
    with pytest.raises(
        DataPlaneError, match="expected the shard of step 7 .seq 0., received seq 0 of step 1"
    ):
        inboxes[1].shard(stale)


def test_back_pressure_bounds_the_steps_in_flight(plane):
    senders, inboxes = plane
    send_step_shards(senders, _batch(1), step=1, num_valid=(1, 1))
    # max_in_flight_batches 1: the ranks hold step 1 unconsumed, so step 2 cannot be sent.
    with pytest.raises(DataPlaneError, match="seq 1 was not sent"):
        senders[0].send(shard_for_ranks(_batch(2), NUM_RANKS)[0], {"step": 2}, timeout_s=0.1)


def test_a_batch_that_does_not_split_evenly_is_refused(plane):
    senders, _ = plane
    with pytest.raises(ValueError, match="not a multiple of the 2 trainer ranks"):
        send_step_shards(senders, _batch(1, size=3), step=1, num_valid=(1, 1))


def test_a_mini_batch_maps_global_rows_onto_each_ranks_shard_padded_to_equal_length(plane):
    senders, inboxes = plane
    batch = _batch(3)
    batch["row"] = torch.arange(4)  # each row's global index, to see where it went
    remote = send_step_shards(senders, batch, step=1, num_valid=(1, 1))
    shards = [inbox.shard(remote) for inbox in inboxes]
    # The whole batch: every rank its whole shard, in shard order, unpadded.
    assert remote.rank_rows() == [[0, 1], [0, 1]]
    # Two rows on one rank's shard and one on the other's: the second is padded.
    rank0 = shards[0]["row"].tolist()
    rows = [rank0[1], shards[1]["row"][1].item(), rank0[0]]
    mini = remote.select(torch.tensor(rows), last=False)
    assert mini.rows == tuple(rows) and not mini.last and mini.key == remote.key
    assert mini.rank_rows() == [[1, 0], [1, PAD_ROW]]
    picked = [select_shard_rows(s, r) for s, r in zip(shards, mini.rank_rows())]
    assert picked[0]["row"].tolist() == [rank0[1], rank0[0]]
    # Padding: copies of the rank's first real row with sample_mask 0; the shard is untouched.
    assert picked[1]["row"].tolist() == [rows[1]] * 2
    assert picked[1]["sample_mask"].tolist() == [batch["sample_mask"][rows[1]].item(), 0.0]
    assert shards[1]["sample_mask"].tolist() == batch["sample_mask"][shards[1]["row"]].tolist()
    # A rank with none of the rows trains masked copies of its shard's row 0.
    only0 = remote.select([rank0[0]], last=True).rank_rows()
    assert only0 == [[0], [PAD_ROW]]
    assert select_shard_rows(shards[1], only0[1])["sample_mask"].tolist() == [0.0]
    with pytest.raises(ValueError, match=r"non-empty subset of \[0, 4\)"):
        remote.select([4], last=True)
    with pytest.raises(ValueError, match="carries no shard_rows"):
        RemoteBatch(1, 0, 8, 10, 1, 1, ()).rank_rows()
