"""Tests of batch validation and splitting."""

import pytest
import torch

from dockyard_rl.data_plane.payload import assemble_batch, pack_batch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict


def _pack(batch, metadata=None, transport="gloo", max_bytes=1024, **kwargs):
    return pack_batch(
        batch, metadata, max_metadata_bytes=max_bytes, tensor_transport=transport, **kwargs
    )


def test_split_and_reassemble_in_field_order():
    ids_BS = torch.arange(12).reshape(3, 4)
    batch = BatchedDataDict(names=["a", "b", "c"], input_ids_BS=ids_BS, rewards_B=torch.zeros(3))
    packed = _pack(batch, {"weight_version": 2})
    assert packed.field_order == ("names", "input_ids_BS", "rewards_B")
    assert set(packed.tensors) == {"input_ids_BS", "rewards_B"}
    assert packed.lists == {"names": ["a", "b", "c"]}
    assert packed.tensors["input_ids_BS"] is ids_BS  # no copy
    rebuilt = assemble_batch(packed.field_order, packed.tensors, packed.lists)
    assert list(rebuilt) == list(batch) and rebuilt["input_ids_BS"] is ids_BS


def test_contiguous_for_collective_transports():
    ids_SB = torch.arange(12).reshape(4, 3).t()
    packed = _pack({"input_ids_BS": ids_SB}, contiguous=True)
    assert packed.tensors["input_ids_BS"].is_contiguous()
    assert torch.equal(packed.tensors["input_ids_BS"], ids_SB)


@pytest.mark.parametrize(
    "batch, metadata, message",
    [
        ({}, None, "no fields"),
        ({"a": torch.zeros(2), "b": torch.zeros(3)}, None, "differ in length"),
        ("tokens", None, "must be a BatchedDataDict"),
        ({"a": torch.zeros(2)}, {1: "x"}, "metadata must be a dict with str keys"),
        ({"a": torch.zeros(2)}, {"when": object()}, "must be JSON-able"),
        ({"a": [object(), 1]}, None, "must be JSON-able"),
        ({"a": ["x" * 2000]}, None, "above data_plane.max_metadata_bytes=1024"),
    ],
)
def test_invalid_batches(batch, metadata, message):
    with pytest.raises(ValueError, match=message):
        _pack(batch, metadata)


def test_device_must_match_the_tensor_transport():
    with pytest.raises(ValueError, match="'ids' is on cpu, but tensor transport 'nccl' moves cuda"):
        _pack({"ids": torch.zeros(2)}, transport="nccl")
    assert _pack({"ids": torch.zeros(2)}, transport="nixl").tensors
    assert _pack({"ids": torch.zeros(2)}, transport="in_memory").tensors
