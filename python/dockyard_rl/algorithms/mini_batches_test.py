"""Tests of PPO-style mini-batches and epochs (mini_batches.py) and their config keys.

The training tests run the real DTensor policy on tiny-llama (one rank each, real Ray on
127.0.0.1): two policies built from the same weights take the same batch through the old path
(a separate log-prob pass, one optimizer step) and the new one (the pass skipped), and several
mini-batches make the clip bind. Shape suffixes: B = samples, S = token positions.
"""

from __future__ import annotations

import pytest
import ray
import torch

from dockyard_rl.algorithms.grpo_config import master_config_from_dict
from dockyard_rl.algorithms.mini_batches import (
    combine_optimizer_steps,
    mini_batch_plan,
    mini_batch_seed,
    num_optimizer_steps,
    train_mini_batches,
)
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
from dockyard_rl.models.policy.config import OptimizerConfig, PolicyConfig, SchedulerConfig
from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy
from dockyard_rl.utils.config_loading import ConfigError

# ---------------------------------------------------------------------------------------------
# The plan (pure).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_samples, mini, epochs",
    [(16, 4, 1), (16, 4, 3), (10, 4, 2), (8, None, 2), (8, 8, 1), (3, 16, 1)],
)
def test_plan_covers_every_row_once_per_epoch(num_samples, mini, epochs):
    plan = mini_batch_plan(num_samples, mini, epochs, seed=7)
    assert len(plan) == num_optimizer_steps(num_samples, mini, epochs)
    per_epoch = len(plan) // epochs
    for epoch in range(epochs):
        rows = torch.cat(plan[epoch * per_epoch : (epoch + 1) * per_epoch])
        assert sorted(rows.tolist()) == list(range(num_samples))
    assert all(len(rows) <= (mini or num_samples) for rows in plan)


def test_plan_is_seeded_shuffled_and_whole_batches_keep_their_order():
    a = mini_batch_plan(32, 8, 2, seed=mini_batch_seed(0, 5))
    b = mini_batch_plan(32, 8, 2, seed=mini_batch_seed(0, 5))
    c = mini_batch_plan(32, 8, 2, seed=mini_batch_seed(0, 6))
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a resumed step draws the same
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert torch.cat(a[:4]).tolist() != list(range(32))  # shuffled
    assert torch.cat(a[:4]).tolist() != torch.cat(a[4:]).tolist()  # each epoch its own order
    assert mini_batch_seed(0, 5) != mini_batch_seed(1, 5)
    assert [p.tolist() for p in mini_batch_plan(4, None, 2, seed=1)] == [[0, 1, 2, 3]] * 2


def test_plan_rejects_bad_arguments():
    for args in [(0, 4, 1), (8, 0, 1), (8, 4, 0)]:
        with pytest.raises(ValueError, match="mini_batch_plan needs"):
            mini_batch_plan(*args, seed=0)


def test_combine_optimizer_steps():
    combined = combine_optimizer_steps(
        [
            {"loss": 1.0, "clip_fraction": 0.0, "ratio_max": 1.0, "num_tokens": 10.0},
            {"loss": 3.0, "clip_fraction": 0.5, "ratio_max": 1.7, "num_tokens": 12.0},
        ]
    )
    assert combined == {"loss": 2.0, "clip_fraction": 0.25, "ratio_max": 1.7, "num_tokens": 22.0}


# ---------------------------------------------------------------------------------------------
# Config: grpo.train_mini_batch_size, grpo.num_epochs.
# ---------------------------------------------------------------------------------------------


def _config(grpo: dict, dp_size: int = 1):
    return master_config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, **grpo},
            "policy": {"dp_size": dp_size},
            "data": {"train_path": "/data/tasks.jsonl", "prompt": {"max_context_tokens": 1024}},
        }
    )


def test_config_keys_and_optimizer_steps_per_step():
    assert _config({}).grpo.optimizer_steps_per_step == 1  # default: today's one step
    cfg = _config({"train_mini_batch_size": 4, "num_epochs": 2}, dp_size=2)
    assert cfg.grpo.optimizer_steps_per_step == 8
    assert _config({"num_epochs": 3}).grpo.optimizer_steps_per_step == 3


@pytest.mark.parametrize(
    "grpo, dp_size, pattern",
    [
        ({"train_mini_batch_size": 5}, 1, r"grpo\.train_mini_batch_size: .*divides.*16"),
        ({"train_mini_batch_size": 0}, 1, r"grpo\.train_mini_batch_size: must be null"),
        ({"train_mini_batch_size": 32}, 1, r"grpo\.train_mini_batch_size: .*divides"),
        ({"train_mini_batch_size": 2}, 4, r"grpo\.train_mini_batch_size: .*multiple of polic"),
        ({"num_epochs": 0}, 1, r"grpo\.num_epochs: must be an integer >= 1"),
        ({"num_epochs": 1.5}, 1, r"grpo\.num_epochs"),
    ],
)
def test_bad_config_is_named(grpo, dp_size, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _config(grpo, dp_size)


# ---------------------------------------------------------------------------------------------
# Real training on tiny-llama.
# ---------------------------------------------------------------------------------------------

TINY_CFG = PolicyConfig(
    backend="dtensor",
    model="tiny-llama",
    dtype="float32",
    dp_size=1,
    micro_batch_size=2,
    max_grad_norm=1.0,
    seed=0,
    # eps comparable to the gradients: AdamW's first step is then a smooth function of the
    # gradient (not ~sign(g)), so equal weights after a step mean equal gradients.
    optimizer=OptimizerConfig(learning_rate=5e-3, eps=1e-3, weight_decay=0.01),
    scheduler=SchedulerConfig(warmup_steps=0, total_steps=100, min_lr_ratio=1.0),
)
LOSS_FN = ClippedPGLossFn(ClippedPGLossConfig(ratio_clip_low=0.2, ratio_clip_high=0.28))


@pytest.fixture(scope="module")
def policies():
    init_local_ray(num_cpus=2, log_to_driver=False)
    pair = (DTensorPolicy(TINY_CFG), DTensorPolicy(TINY_CFG))
    yield pair
    for policy in pair:
        policy.shutdown()
    ray.shutdown()


def _batch(num_samples: int = 8, width: int = 16) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(0, 512, (num_samples, width), generator=gen)
    lengths_B = torch.randint(6, width + 1, (num_samples,), generator=gen)
    real_BS = torch.arange(width)[None, :] < lengths_B[:, None]
    return BatchedDataDict(
        input_ids=torch.where(real_BS, ids_BS, 0),
        input_lengths=lengths_B,
        token_mask=(real_BS & (torch.arange(width)[None, :] >= 3)).float(),
        sample_mask=torch.ones(num_samples),
        advantages=torch.randn(num_samples, 1, generator=gen).expand(num_samples, width).clone(),
    )


def _weights(policy):
    return {name: tensor.clone() for name, tensor in policy.iter_refit_weights()}


def test_one_step_skips_the_logprob_pass_with_the_same_update(policies):
    old_path, new_path = policies
    batch = _batch()
    explicit = batch.copy()
    explicit["prev_logprobs"] = old_path.get_logprobs(batch)  # today's separate pass
    metrics_old = old_path.train(explicit, LOSS_FN)
    metrics_new = train_mini_batches(new_path, batch, LOSS_FN, mini_batch_plan(8, None, 1, 0), 1)
    assert "prev_logprobs" not in batch
    assert metrics_new["logprobs_pass_skipped"] == 1.0 and metrics_new["optimizer_steps"] == 1.0
    # Exactly 1 per token; the mean is a sum over microbatches, hence the float tolerance.
    assert metrics_new["ratio_max"] == 1.0 and metrics_new["clip_fraction"] == 0.0
    assert metrics_new["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for key in ("loss", "pg_loss", "grad_norm", "learning_rate", "num_valid_tokens"):
        assert metrics_new[key] == pytest.approx(metrics_old[key], rel=1e-5, abs=1e-7), key
    weights_old, weights_new = _weights(old_path), _weights(new_path)
    for name, tensor in weights_old.items():
        torch.testing.assert_close(weights_new[name], tensor, rtol=1e-5, atol=1e-7)


def test_mini_batches_and_epochs_make_the_clip_bind(policies):
    _, policy = policies
    batch = _batch()
    before = _weights(policy)
    plan = mini_batch_plan(8, 2, 3, seed=mini_batch_seed(0, 1))
    metrics = train_mini_batches(policy, batch, LOSS_FN, plan, dp_size=1)
    assert metrics["optimizer_steps"] == 12.0 and metrics["logprobs_pass_skipped"] == 0.0
    # All 12 steps score against the log-probs of the weights the step began with; a
    # log-prob pass per optimizer step would keep every ratio at 1 and clip_fraction at 0.
    print(
        f"12 optimizer steps: clip_fraction {metrics['clip_fraction']:.4f}, ratio_max "
        f"{metrics['ratio_max']:.3f}, approx_kl_old {metrics['approx_kl_old']:.4f}"
    )
    assert metrics["clip_fraction"] > 0.0, metrics
    assert metrics["ratio_max"] > 1.28 and metrics["approx_kl_old"] > 0.0
    assert any(not torch.equal(before[k], v) for k, v in _weights(policy).items())
