"""The jax port's "no prev_logprobs" path (the batch's single on-policy optimizer step): the same
loss, gradient and metrics as explicit prev_logprobs equal to the current log-probs, and as the
torch loss given the same batch without them. (The full torch/jax comparison on random batches
is models/policy/jax_policy_test.py.) Shape suffixes: B = samples, S = token positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dockyard_rl.losses.jax_loss_functions import clipped_pg_loss
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, count_valid


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_missing_prev_logprobs_is_the_on_policy_step(aggregation):
    gen = torch.Generator().manual_seed(3)
    num_b, num_s = 4, 6
    logp_BS = -torch.rand(num_b, num_s, generator=gen) * 3
    batch = {
        "advantages": torch.randn(num_b, num_s, generator=gen),
        "token_mask": (torch.rand(num_b, num_s, generator=gen) < 0.7).float(),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "generation_logprobs": logp_BS - 0.3 * torch.randn(num_b, num_s, generator=gen),
    }
    cfg = ClippedPGLossConfig(aggregation=aggregation, use_importance_sampling_correction=True)
    num_tokens, num_seqs = count_valid(batch)
    norms = (jnp.float32(max(num_tokens, 1)), jnp.float32(max(num_seqs, 1)))
    jbatch = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}

    def loss(logp, with_prev):
        b = dict(jbatch, prev_logprobs=logp) if with_prev else jbatch
        return clipped_pg_loss(cfg, logp, b, *norms)

    jlogp = jnp.asarray(logp_BS.numpy())
    (loss_s, metrics_s), grad_s = jax.value_and_grad(lambda x: loss(x, False), has_aux=True)(jlogp)
    explicit = dict(jbatch, prev_logprobs=jlogp)  # a constant: what a separate pass gives
    (loss_e, metrics_e), grad_e = jax.value_and_grad(
        lambda x: clipped_pg_loss(cfg, x, explicit, *norms), has_aux=True
    )(jlogp)
    assert float(loss_s) == float(loss_e)
    np.testing.assert_array_equal(np.asarray(grad_s), np.asarray(grad_e))
    assert {k: float(v) for k, v in metrics_s.items()} == {
        k: float(v) for k, v in metrics_e.items()
    }
    assert float(metrics_s["clip_fraction"]) == 0.0 and float(metrics_s["ratio_max"]) == 1.0

    torch_logp = logp_BS.clone().requires_grad_(True)
    torch_loss, torch_metrics = ClippedPGLossFn(cfg)(torch_logp, batch, num_tokens, num_seqs)
    torch_loss.backward()
    assert float(loss_s) == pytest.approx(torch_loss.item(), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad_s), torch_logp.grad.numpy(), rtol=1e-6, atol=1e-8)
    for key, value in torch_metrics.items():
        assert float(metrics_s[key]) == pytest.approx(value, rel=1e-6, abs=1e-7), key
