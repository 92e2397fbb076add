"""The GRPO loop's batch layouts, declared once: which keys each `BatchedDataDict` holds.

Each layout is a `TypedDict`, used two ways: as the generic parameter of a batch
(`BatchedDataDict[RolloutBatch]`, for type checkers) and as the spec of `batch.validate(spec)`
(missing keys, tensor-vs-list, extra keys on request; batched_data_dict.py). Each layout extends
the one a consumer reads, so a bigger batch goes wherever a smaller one is read:

    LogprobBatch   what the policies' `get_logprobs` / `get_reference_policy_logprobs` read
    TrainBatch     what `PolicyInterface.train` reads itself (the loss function's keys come on
                   top: its `required_batch_keys`); the warm start's batches hold exactly this
    RolloutBatch   a GRPO step's batch (algorithms/rollouts.py, `build_train_batch`): what the
                   clipped PG loss (losses/loss_functions.py) reads, plus the weight versions

Every (B, S) field is aligned with `input_ids`: position s holds the value of token s.
Shape suffixes: B = samples (sequences), S = token positions (prompt + response, right-padded).

Not covered: the shapes and dtypes written in the comments are checked where the batch is
consumed (the policies' and the loss's input checks), not by `validate`.
"""

from typing import NotRequired, TypedDict

import torch


class LogprobBatch(TypedDict):
    """The token sequences a policy scores."""

    input_ids: torch.Tensor  # (B, S) int64: prompt + response tokens, right-padded
    input_lengths: torch.Tensor  # (B,) int64: number of real tokens per row, in [1, S]


class TrainBatch(LogprobBatch):
    """What `PolicyInterface.train` reads besides its loss function's keys."""

    # (B, S) float: 1 on the response tokens that count in the loss (the policy's own tokens: a
    # multi-turn sample's tool outputs are 0), 0 on prompt, padding and context tokens.
    token_mask: torch.Tensor
    # (B,) float: 0 excludes a whole sample (no verdict: a sandbox infrastructure error; the
    # masked copies that pad a batch to a multiple of the data-parallel ranks).
    sample_mask: torch.Tensor


class RolloutBatch(TrainBatch):
    """A GRPO step's batch: one or more rounds of G prompts x N samples, group-contiguous."""

    # (B, S) float: the sample's group-relative advantage on each token of token_mask, else 0.
    advantages: torch.Tensor
    # (B, S) float: the engine's log-probs of the sampled tokens, 0 off the response (read by
    # the loss's importance-sampling correction).
    generation_logprobs: torch.Tensor
    # (B,) int64: the oldest weight version that produced a token of the sample.
    weight_version: torch.Tensor
    # (B, S) float: the trainer's old-policy log-probs, added by the loop before the step's
    # first optimizer step when it makes more than one (absent: the loss uses the training
    # forward's own, detached).
    prev_logprobs: NotRequired[torch.Tensor]
    # (B, S) float: the frozen reference policy's log-probs, added by the loop when
    # loss_fn.reference_kl_coef > 0 and grpo.skip_reference_policy_logprobs is false.
    reference_policy_logprobs: NotRequired[torch.Tensor]
