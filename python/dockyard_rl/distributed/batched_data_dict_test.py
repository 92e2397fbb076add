"""Tests of dockyard_rl.distributed.batched_data_dict.

Batches are built so that every row is identifiable (`row_id_B` holds the original position,
`tags` a per-row string), which lets tests check orders and coverage exactly. Hypothesis tests
are derandomized (deterministic).

Shape suffixes: B = batch (samples), S = sequence (tokens).
"""

from __future__ import annotations

import pickle
import random
import typing
from typing import NotRequired, TypedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockyard_rl.distributed.batched_data_dict import (
    BatchedDataDict,
    ShardedBatch,
    invert_permutation,
    pad_sequences,
)

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=150)


class RolloutSpec(TypedDict):
    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    prompts: list[str]
    rewards: NotRequired[torch.Tensor]


def make_batch(num_samples: int, seq_len: int = 5, seed: int = 0) -> BatchedDataDict[RolloutSpec]:
    generator = torch.Generator().manual_seed(seed)
    return BatchedDataDict[RolloutSpec](
        row_id=torch.arange(num_samples),
        input_ids=torch.randint(0, 100, (num_samples, seq_len), generator=generator),
        input_lengths=torch.randint(1, seq_len + 1, (num_samples,), generator=generator),
        prompts=[f"prompt-{i}" for i in range(num_samples)],
    )


def assert_batches_equal(actual: BatchedDataDict, expected: BatchedDataDict) -> None:
    assert list(actual) == list(expected)
    for key in expected:
        if isinstance(expected[key], torch.Tensor):
            assert isinstance(actual[key], torch.Tensor), key
            assert actual[key].dtype == expected[key].dtype, key
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)
        else:
            assert actual[key] == expected[key], key


# ------------------------------------------------------------------ construction and validation


def test_batch_size_and_generic_annotation():
    batch = make_batch(6)
    assert batch.batch_size == 6
    assert isinstance(batch, dict)
    assert typing.get_args(batch.__orig_class__) == (RolloutSpec,)


def test_ragged_construction_names_every_field_and_length():
    with pytest.raises(ValueError) as error:
        BatchedDataDict(a=torch.zeros(4, 2), b=[1, 2, 3], c=torch.zeros(4))
    message = str(error.value)
    assert "'a' has 4" in message and "'b' has 3" in message and "'c' has 4" in message


def test_ragged_setitem_rejected_and_batch_unchanged():
    batch = make_batch(4)
    with pytest.raises(ValueError, match="'rewards' has 3"):
        batch["rewards"] = torch.zeros(3)
    assert "rewards" not in batch
    batch["rewards"] = torch.ones(4)
    assert batch.batch_size == 4


def test_replacing_the_only_field_may_change_length():
    batch = BatchedDataDict(a=[1, 2])
    batch["a"] = [1, 2, 3]
    assert batch.batch_size == 3


def test_update_setdefault_and_or_are_validated_atomically():
    batch = make_batch(3)
    with pytest.raises(ValueError, match="differ in length"):
        batch.update(x=torch.zeros(3), y=[1])
    assert "x" not in batch and "y" not in batch
    with pytest.raises(ValueError, match="'z' has 2"):
        batch.setdefault("z", [1, 2])
    with pytest.raises(ValueError, match="differ in length"):
        batch |= {"w": [0]}
    merged = batch | {"w": [0, 1, 2]}
    assert isinstance(merged, BatchedDataDict) and "w" in merged and "w" not in batch


def test_in_place_resize_is_caught_by_operations():
    batch = BatchedDataDict(a=[1, 2, 3], b=torch.zeros(3))
    batch["a"].append(4)  # bypasses __setitem__
    with pytest.raises(ValueError, match="'a' has 4, 'b' has 3"):
        batch.slice(0, 1)


@pytest.mark.parametrize(
    "value, fix",
    [
        (torch.tensor(1.0), "0-dim"),
        ((1, 2), "list\\(...\\)"),
        ("abc", "torch.as_tensor"),
        (3, "torch.as_tensor"),
    ],
)
def test_bad_field_types(value, fix):
    with pytest.raises(ValueError, match=fix):
        BatchedDataDict(x=value)


def test_non_str_key_rejected():
    with pytest.raises(ValueError, match="str field names"):
        BatchedDataDict({1: [1]})


def test_empty_batch_has_no_batch_size():
    with pytest.raises(ValueError, match="no fields"):
        BatchedDataDict().batch_size  # noqa: B018


def test_validate_against_typed_spec():
    batch = make_batch(2)
    assert batch.validate(RolloutSpec) is batch  # optional 'rewards' may be absent
    del batch["prompts"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['prompts'\]"):
        batch.validate(RolloutSpec)


def test_validate_checks_tensor_vs_list_and_extra_keys():
    batch = make_batch(2)
    batch["input_lengths"] = [3, 4]
    with pytest.raises(ValueError, match="'input_lengths' should be Tensor but is list"):
        batch.validate(RolloutSpec)
    batch["input_lengths"] = torch.tensor([3, 4])
    batch["rewards"] = [1.0, 0.0]
    with pytest.raises(ValueError, match="'rewards' should be Tensor"):
        batch.validate(RolloutSpec)
    del batch["rewards"]
    with pytest.raises(ValueError, match=r"\['row_id'\] are not in the spec"):
        batch.validate(RolloutSpec, allow_extra_keys=False)
    with pytest.raises(ValueError, match="TypedDict"):
        batch.validate(dict)


def test_validate_union_annotation():
    class Spec(TypedDict):
        x: torch.Tensor | list
        y: typing.Any

    BatchedDataDict(x=[1], y=[2]).validate(Spec)
    BatchedDataDict(x=torch.ones(1), y=torch.ones(1)).validate(Spec)


def test_pickle_round_trip():
    batch = BatchedDataDict(a=torch.arange(3), b=["x", "y", "z"])
    restored = pickle.loads(pickle.dumps(batch))
    assert isinstance(restored, BatchedDataDict)
    assert_batches_equal(restored, batch)


# ---------------------------------------------------------------------------------- selection


def test_slice():
    batch = make_batch(6)
    part = batch.slice(2, 5)
    assert part.batch_size == 3
    assert part["row_id"].tolist() == [2, 3, 4]
    assert part["prompts"] == ["prompt-2", "prompt-3", "prompt-4"]
    # A view: shares the receiver's storage.
    assert (
        part["input_ids"].untyped_storage().data_ptr()
        == batch["input_ids"].untyped_storage().data_ptr()
    )
    assert batch.slice(3, 3).batch_size == 0


@pytest.mark.parametrize("start, end", [(-1, 2), (2, 1), (0, 7), (0.0, 2)])
def test_slice_out_of_range(start, end):
    with pytest.raises(ValueError, match="0 <= start <= end <= 6"):
        make_batch(6).slice(start, end)


@pytest.mark.parametrize(
    "indices",
    [[4, 0, 0, 2], torch.tensor([4, 0, 0, 2]), torch.tensor([4, 0, 0, 2], dtype=torch.int32)],
)
def test_select_indices_orders_and_repeats(indices):
    batch = make_batch(5)
    chosen = batch.select_indices(indices)
    assert chosen["row_id"].tolist() == [4, 0, 0, 2]
    assert chosen["prompts"] == ["prompt-4", "prompt-0", "prompt-0", "prompt-2"]
    torch.testing.assert_close(chosen["input_ids"], batch["input_ids"][[4, 0, 0, 2]])


def test_select_indices_bool_mask():
    batch = make_batch(4)
    assert batch.select_indices(torch.tensor([True, False, False, True]))["row_id"].tolist() == [
        0,
        3,
    ]
    with pytest.raises(ValueError, match="mask has length 3"):
        batch.select_indices(torch.tensor([True, False, True]))


@pytest.mark.parametrize(
    "indices, message",
    [
        ([0, 5], "index 5 is out of range"),
        ([-1], "index -1 is out of range"),
        ([0.5], "integer indices"),
        (torch.tensor([0.0]), "integer indices"),
        (torch.zeros(1, 1, dtype=torch.long), "1-D"),
    ],
)
def test_select_indices_errors(indices, message):
    with pytest.raises(ValueError, match=message):
        make_batch(5).select_indices(indices)


def test_select_keys():
    batch = make_batch(3)
    chosen = batch.select_keys(["prompts", "row_id"])
    assert list(chosen) == ["prompts", "row_id"]
    assert chosen["row_id"] is batch["row_id"]
    with pytest.raises(ValueError, match=r"\['nope'\] not in the batch"):
        batch.select_keys(["row_id", "nope"])


# ----------------------------------------------------------------------------------- sharding


def test_shard_contiguous():
    batch = make_batch(8)
    sharded = batch.shard_by_batch_size(4)
    assert isinstance(sharded, ShardedBatch) and len(sharded.shards) == 4
    assert [s["row_id"].tolist() for s in sharded.shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sharded.shard_indices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sharded.shards[1]["prompts"] == ["prompt-2", "prompt-3"]
    # Views: contiguous shards share the batch's storage.
    assert (
        sharded.shards[1]["input_ids"].untyped_storage().data_ptr()
        == batch["input_ids"].untyped_storage().data_ptr()
    )


@pytest.mark.parametrize("balance_by", [None, "input_lengths"])
def test_shard_unshard_round_trip(balance_by):
    batch = make_batch(16, seq_len=9, seed=3)
    sharded = batch.shard_by_batch_size(4, balance_by=balance_by)
    assert_batches_equal(sharded.unshard(sharded.shards), batch)
    # Results with other keys (as a worker returns) also come back in the original order.
    results = [BatchedDataDict(doubled=s["row_id"] * 2) for s in sharded.shards]
    assert sharded.unshard(results)["doubled"].tolist() == [2 * i for i in range(16)]


def test_unshard_pads_results_of_different_widths():
    batch = make_batch(4)
    sharded = batch.shard_by_batch_size(2)
    results = [
        BatchedDataDict(logprobs=torch.ones(2, 3)),
        BatchedDataDict(logprobs=torch.ones(2, 5)),
    ]
    merged = sharded.unshard(results, pad_values={"logprobs": 0.0})
    assert merged["logprobs"].shape == (4, 5)
    assert merged["logprobs"][:2, 3:].abs().sum() == 0


def test_unshard_errors():
    sharded = make_batch(4).shard_by_batch_size(2)
    with pytest.raises(ValueError, match="got 1 results for 2 shards"):
        sharded.unshard([sharded.shards[0]])
    with pytest.raises(ValueError, match="result 1 has 1 samples but shard 1 had 2"):
        sharded.unshard([sharded.shards[0], sharded.shards[1].slice(0, 1)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_shards=4), r"10 samples into 4 equal shards.*multiple of 4 samples first"),
        (dict(num_shards=0), "num_shards must be a positive int"),
        (dict(num_shards=2, balance_by="missing"), "length key 'missing' is not in the batch"),
        (dict(num_shards=2, balance_by="prompts"), "must hold int lengths"),
        (dict(num_shards=2, balance_by="input_ids"), "1-D integer tensor"),
    ],
)
def test_shard_errors_name_numbers_and_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_batch(10).shard_by_batch_size(**kwargs)


def test_balance_rejects_negative_lengths():
    batch = BatchedDataDict(input_lengths=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="negative lengths"):
        batch.shard_by_batch_size(2, balance_by="input_lengths")


def _shard_totals(sharded: ShardedBatch, key: str = "input_lengths") -> list[int]:
    return [int(s[key].sum()) for s in sharded.shards]


def test_balancing_quality_on_random_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(1, 2000) for _ in range(256)]
    batch = BatchedDataDict(input_lengths=torch.tensor(lengths))
    mean = sum(lengths) / 8
    balanced = _shard_totals(batch.shard_by_batch_size(8, balance_by="input_lengths"))
    contiguous = _shard_totals(batch.shard_by_batch_size(8))
    assert max(balanced) <= mean * 1.01, (balanced, mean)
    assert max(balanced) - min(balanced) < max(contiguous) - min(contiguous)


def test_balancing_known_case_and_order_within_shard():
    lengths = torch.tensor([1, 10, 1, 10, 5, 5])
    sharded = BatchedDataDict(input_lengths=lengths).shard_by_batch_size(
        2, balance_by="input_lengths"
    )
    assert _shard_totals(sharded) == [16, 16]
    for indices in sharded.shard_indices:
        assert indices == sorted(indices)


@DETERMINISTIC
@given(num_shards=st.integers(1, 6), per_shard=st.integers(0, 12), data=st.data())
def test_property_shards_partition_the_batch(num_shards, per_shard, data):
    size = num_shards * per_shard
    lengths = data.draw(st.lists(st.integers(0, 1000), min_size=size, max_size=size))
    batch = BatchedDataDict(
        input_lengths=torch.tensor(lengths, dtype=torch.int64), row_id=list(range(len(lengths)))
    )
    for balance_by in (None, "input_lengths"):
        sharded = batch.shard_by_batch_size(num_shards, balance_by=balance_by)
        # Nothing lost or duplicated, equal shard sizes, indices match the rows carried.
        assert sorted(sharded.permutation) == list(range(len(lengths)))
        assert len({s.batch_size for s in sharded.shards}) == 1
        for shard, indices in zip(sharded.shards, sharded.shard_indices):
            assert shard["row_id"] == indices
        assert_batches_equal(sharded.unshard(sharded.shards), batch)
        if balance_by and lengths:
            totals = [sum(lengths[i] for i in idx) for idx in sharded.shard_indices]
            # Greedy longest-first keeps shards within one longest sample of each other.
            assert max(totals) - min(totals) <= max(lengths)


def test_invert_permutation():
    permutation = [2, 0, 3, 1]
    inverse = invert_permutation(permutation)
    assert [permutation[i] for i in inverse] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a permutation"):
        invert_permutation([0, 0])


# ------------------------------------------------------------------------------------ padding


def test_pad_sequences():
    sequences = [torch.tensor([1, 2, 3]), [4], torch.tensor([], dtype=torch.int64)]
    padded_BS, lengths_B = pad_sequences(sequences, pad_value=-1)
    assert padded_BS.tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]]
    assert lengths_B.tolist() == [3, 1, 0] and lengths_B.dtype == torch.int64
    wide_BS, _ = pad_sequences([[1.5], [2.5, 3.5]], pad_to_length=4)
    assert wide_BS.shape == (2, 4) and wide_BS.dtype == torch.float32


@pytest.mark.parametrize(
    "sequences, kwargs, message",
    [
        ([], {}, "at least one sequence"),
        ([torch.zeros(2, 2)], {}, "must be 1-D"),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], {}, "convert them to one dtype"),
        ([[1, 2, 3]], dict(pad_to_length=2), "length 3 > pad_to_length=2"),
    ],
)
def test_pad_sequences_errors(sequences, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pad_sequences(sequences, **kwargs)


def test_from_sequences():
    batch = BatchedDataDict.from_sequences(
        {
            "output_ids": [[5, 6], [7], [8, 9, 10]],
            "logprobs": [
                torch.tensor([-0.1, -0.2]),
                torch.tensor([-0.3]),
                torch.tensor([-0.4, -0.5, -0.6]),
            ],
        },
        pad_values={"output_ids": 0},
        lengths_key="output_lengths",
    )
    assert batch["output_ids"].tolist() == [[5, 6, 0], [7, 0, 0], [8, 9, 10]]
    assert batch["output_lengths"].tolist() == [2, 1, 3]
    assert batch["logprobs"].shape == (3, 3)


def test_from_sequences_errors():
    with pytest.raises(ValueError, match="sample 1 has length 2 in field 'b' but 1 in 'a'"):
        BatchedDataDict.from_sequences({"a": [[1], [2]], "b": [[1], [2, 3]]}, lengths_key="n")
    with pytest.raises(ValueError, match="'a' has 2, 'b' has 1"):
        BatchedDataDict.from_sequences({"a": [[1], [2]], "b": [[1]]})
    with pytest.raises(ValueError, match="field 'a': .*1-D"):
        BatchedDataDict.from_sequences({"a": [torch.zeros(1, 1)]})
    with pytest.raises(ValueError, match="also a field name"):
        BatchedDataDict.from_sequences({"a": [[1]]}, lengths_key="a")


# ------------------------------------------------------------------------------- microbatches


@pytest.mark.parametrize("batch_size, microbatch_size", [(8, 2), (8, 8), (7, 3), (1, 4), (0, 2)])
def test_microbatches_cover_every_sample_once_in_order(batch_size, microbatch_size):
    batch = make_batch(batch_size)
    microbatches = list(batch.make_microbatch_iterator(microbatch_size, allow_partial=True))
    assert [i for mb in microbatches for i in mb["row_id"].tolist()] == list(range(batch_size))
    assert all(mb.batch_size == microbatch_size for mb in microbatches[:-1])
    assert all(0 < mb.batch_size <= microbatch_size for mb in microbatches)


def test_microbatch_iterator_is_strict_by_default_and_checks_eagerly():
    with pytest.raises(ValueError, match=r"7 samples.*microbatch_size=3.*allow_partial=True"):
        make_batch(7).make_microbatch_iterator(3)  # raised before iterating
    with pytest.raises(ValueError, match="microbatch_size must be a positive int"):
        make_batch(7).make_microbatch_iterator(0)


# ----------------------------------------------------------------------------- concatenation


def test_concat_round_trip_with_slices():
    batch = make_batch(7)
    parts = [batch.slice(0, 3), batch.slice(3, 3), batch.slice(3, 7)]
    assert_batches_equal(BatchedDataDict.concat(parts), batch)


def test_concat_pads_dim_1_when_asked():
    a = BatchedDataDict(ids=torch.ones(2, 3, dtype=torch.int64), tags=["a", "b"])
    b = BatchedDataDict(ids=torch.full((1, 5), 2), tags=["c"])
    merged = BatchedDataDict.concat([a, b], pad_values={"ids": -7})
    assert merged["ids"].tolist() == [[1, 1, 1, -7, -7], [1, 1, 1, -7, -7], [2, 2, 2, 2, 2]]
    assert merged["tags"] == ["a", "b", "c"]


@pytest.mark.parametrize(
    "batches, kwargs, message",
    [
        ([], {}, "at least one batch"),
        ([{"a": [1]}, {"b": [1]}], {}, r"batch 1 has keys \['b'\].*missing: \['a'\]"),
        ([{"a": [1]}, {"a": torch.ones(1)}], {}, "tensor in some batches and a list"),
        (
            [{"a": torch.ones(1, 3)}, {"a": torch.ones(1, 4)}],
            {},
            r"'a' has shape \(1, 3\) in batch 0 but \(1, 4\) in batch 1.*pad_values=\{'a'",
        ),
        (
            [{"a": torch.ones(1, 3, 2)}, {"a": torch.ones(1, 3, 4)}],
            {"pad_values": {"a": 0}},
            "only dim 1 may differ",
        ),
        ([{"a": torch.ones(1, 3)}, {"a": torch.ones(1)}], {}, "only dim 1 may differ"),
        ([{"a": torch.ones(1)}, {"a": torch.ones(1, dtype=torch.int64)}], {}, "convert with"),
        ([{"a": [1]}], {"pad_values": {"b": 0}}, r"pad_values has key\(s\) \['b'\]"),
    ],
)
def test_concat_errors(batches, kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchedDataDict.concat(batches, **kwargs)


# ---------------------------------------------------------------------- whole-batch transforms


def test_to_moves_tensors_and_leaves_lists():
    batch = make_batch(3)
    moved = batch.to(torch.device("cpu"))
    assert moved["prompts"] is batch["prompts"]
    assert moved["input_ids"].device.type == "cpu"
    as_float = batch.to(dtype=torch.float64)
    assert as_float["row_id"].dtype == torch.float64 and as_float["prompts"] == batch["prompts"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda_and_select_indices_on_device():
    batch = make_batch(4).to("cuda")
    assert batch["input_ids"].is_cuda
    assert batch.select_indices([3, 1])["row_id"].tolist() == [3, 1]


def test_copy_is_shallow():
    batch = BatchedDataDict(x=torch.zeros(2), meta=[{"k": 1}, {"k": 2}])
    shallow = batch.copy()
    assert isinstance(shallow, BatchedDataDict) and shallow is not batch
    shallow["y"] = [0, 0]
    assert "y" not in batch
    assert shallow["x"] is batch["x"]


class PartialSpec(TypedDict, total=False):
    a: torch.Tensor
    b: typing.Required[list]


def test_validate_totality_and_required_under_string_annotations():
    # This module uses `from __future__ import annotations`, so the wrappers arrive as strings.
    BatchedDataDict(b=[1]).validate(PartialSpec)
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['b'\]"):
        BatchedDataDict(a=torch.ones(1)).validate(PartialSpec)
