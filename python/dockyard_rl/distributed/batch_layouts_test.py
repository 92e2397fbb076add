"""Tests of dockyard_rl.distributed.batch_layouts: the declared keys, their nesting, and that the
clipped PG loss trains on a batch holding exactly the declared `RolloutBatch` keys.

Shape suffixes: B = samples, S = token positions.
"""

import typing

import pytest
import torch

from dockyard_rl.distributed.batch_layouts import LogprobBatch, RolloutBatch, TrainBatch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, count_valid


def _keys(layout: type) -> set[str]:
    return set(typing.get_type_hints(layout))


def test_each_layout_extends_the_one_its_consumer_reads():
    assert _keys(LogprobBatch) == {"input_ids", "input_lengths"}
    assert _keys(TrainBatch) == _keys(LogprobBatch) | {"token_mask", "sample_mask"}
    assert _keys(RolloutBatch) == _keys(TrainBatch) | {
        "advantages",
        "generation_logprobs",
        "weight_version",
        "prev_logprobs",
        "reference_policy_logprobs",
    }
    # Only the log-probs the loop adds on demand may be absent.
    assert RolloutBatch.__optional_keys__ == {"prev_logprobs", "reference_policy_logprobs"}


def _rollout_batch(num_samples: int = 4, width: int = 6) -> BatchedDataDict[RolloutBatch]:
    gen = torch.Generator().manual_seed(0)
    token_mask_BS = (torch.arange(width)[None, :] >= 2).float().expand(num_samples, width).clone()
    return BatchedDataDict[RolloutBatch](
        input_ids=torch.randint(0, 100, (num_samples, width), generator=gen),
        input_lengths=torch.full((num_samples,), width),
        token_mask=token_mask_BS,
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        advantages=torch.randn(num_samples, 1, generator=gen) * token_mask_BS,
        generation_logprobs=-torch.rand(num_samples, width, generator=gen) * token_mask_BS,
        weight_version=torch.zeros(num_samples, dtype=torch.int64),
    )


def test_validate_against_the_layouts():
    batch = _rollout_batch()
    batch.validate(RolloutBatch, allow_extra_keys=False)
    # A bigger layout satisfies the smaller ones its consumers read.
    batch.validate(TrainBatch).validate(LogprobBatch)
    with pytest.raises(ValueError, match="are not in the spec"):
        batch.validate(TrainBatch, allow_extra_keys=False)
    del batch["weight_version"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['weight_version'\]"):
        batch.validate(RolloutBatch)


@pytest.mark.parametrize(
    "config",
    [
        ClippedPGLossConfig(),
        ClippedPGLossConfig(use_importance_sampling_correction=True, reference_kl_coef=0.1),
    ],
)
def test_the_loss_reads_only_declared_keys(config):
    loss_fn = ClippedPGLossFn(config)
    assert set(loss_fn.required_batch_keys) <= _keys(RolloutBatch)
    batch = _rollout_batch()
    gen = torch.Generator().manual_seed(1)
    logprobs_BS = -torch.rand(batch["input_ids"].shape, generator=gen)
    batch["prev_logprobs"] = logprobs_BS + 0.01
    if config.reference_kl_coef > 0:
        batch["reference_policy_logprobs"] = logprobs_BS - 0.01
    batch.validate(RolloutBatch, allow_extra_keys=False)
    loss, metrics = loss_fn(logprobs_BS.requires_grad_(), batch, *count_valid(batch))
    assert torch.isfinite(loss) and metrics["num_valid_tokens"] == 12.0
