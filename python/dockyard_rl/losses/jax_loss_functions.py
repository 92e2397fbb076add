"""The JAX port of `loss_functions.ClippedPGLossFn`: `clipped_pg_loss`, for the jax policy backend.

`ClippedPGLossFn` (torch) cannot run inside a jax trace, so this is the same math and the same
metric names written with jax.numpy, kept line for line beside the torch version on purpose: a
change to one is a change to both (models/policy/jax_policy_test.py compares them on the same
batch). The config, the metric list and the batch checks are the torch module's own.

Shape legend: B = sequences, S = token positions.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dockyard_rl.losses.loss_functions import ClippedPGLossConfig


def _kl_estimate(estimator: str, log_ratio: jax.Array) -> jax.Array:
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    assert estimator == "k3", estimator
    return jnp.expm1(-log_ratio) + log_ratio


def clipped_pg_loss(
    config: ClippedPGLossConfig,
    logprobs_BS: jax.Array,
    batch: Mapping[str, jax.Array],
    token_norm: jax.Array | float,
    seq_norm: jax.Array | float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`ClippedPGLossFn.__call__` in jax.numpy (traceable, differentiable w.r.t. logprobs_BS).

    `batch` holds float arrays `advantages`, `token_mask` (B, S), `sample_mask` (B,), plus
    `prev_logprobs` (B, S) unless this is the batch's only optimizer step (absent: the detached
    `logprobs_BS` stand in for them, ratio exactly 1, as in torch), plus `generation_logprobs`
    with IS correction and `reference_policy_logprobs` when the KL is used or reported (its
    presence decides, as in torch). `token_norm` / `seq_norm` are the normalisers, max(1, global
    count) — what ClippedPGLossFn derives from its global counts after checking them; callers
    validate the batch (masks 0/1, counts) before tracing this.
    Returns (float32 loss, metrics as 0-d arrays; the same keys as the torch function).
    """
    cfg = config
    dtype = jnp.promote_types(logprobs_BS.dtype, jnp.float32)

    def get(key: str) -> jax.Array:
        if key == "prev_logprobs" and key not in batch:
            # The only optimizer step on this batch: the old policy is the current one.
            return jax.lax.stop_gradient(logprobs_BS.astype(dtype))
        return jax.lax.stop_gradient(batch[key].astype(dtype))

    valid_BS = (batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None]
    valid_f_BS = valid_BS.astype(dtype)
    num_valid_per_seq_B = valid_f_BS.sum(axis=1)
    use_reference = cfg.reference_kl_coef > 0 or "reference_policy_logprobs" in batch

    # Zero the masked log-ratios and advantages BEFORE exp (as torch) so padding garbage cannot
    # turn into inf * 0 = nan in the forward or backward pass.
    logp_BS = logprobs_BS.astype(dtype)
    log_ratio_BS = jnp.where(valid_BS, logp_BS - get("prev_logprobs"), 0.0)
    advantages_BS = jnp.where(valid_BS, get("advantages"), 0.0)
    ratio_BS = jnp.exp(log_ratio_BS)
    clipped_ratio_BS = jnp.clip(ratio_BS, 1.0 - cfg.ratio_clip_low, 1.0 + cfg.ratio_clip_high)
    pg_BS = jnp.maximum(-advantages_BS * ratio_BS, -advantages_BS * clipped_ratio_BS)
    if cfg.dual_clip_c is not None:
        dual_bound_BS = -cfg.dual_clip_c * advantages_BS
        dual_binds_BS = (advantages_BS < 0) & (pg_BS > dual_bound_BS)
        pg_BS = jnp.where(dual_binds_BS, dual_bound_BS, pg_BS)
    if cfg.use_importance_sampling_correction:
        is_log_weight_BS = jnp.where(
            valid_BS, get("prev_logprobs") - get("generation_logprobs"), 0.0
        )
        is_weight_raw_BS = jnp.exp(is_log_weight_BS)
        pg_BS = pg_BS * jnp.minimum(is_weight_raw_BS, cfg.importance_sampling_cap)
    per_token_BS = pg_BS
    if use_reference:
        ref_log_ratio_BS = jnp.where(valid_BS, logp_BS - get("reference_policy_logprobs"), 0.0)
        kl_ref_BS = _kl_estimate(cfg.kl_estimator, ref_log_ratio_BS)
        if cfg.reference_kl_coef > 0:
            per_token_BS = per_token_BS + cfg.reference_kl_coef * kl_ref_BS

    def aggregate(values_BS: jax.Array) -> jax.Array:
        masked_BS = values_BS * valid_f_BS
        if cfg.aggregation == "token":
            return masked_BS.sum() / token_norm
        per_seq_B = masked_BS.sum(axis=1) / jnp.maximum(num_valid_per_seq_B, 1.0)
        return per_seq_B.sum() / seq_norm

    loss = aggregate(per_token_BS)

    sg = jax.lax.stop_gradient

    def token_mean(values_BS: jax.Array) -> jax.Array:
        return sg((values_BS * valid_f_BS).sum() / token_norm)

    def token_max(values_BS: jax.Array) -> jax.Array:
        return sg(jnp.where(valid_BS, values_BS, 0.0).max())

    clipped_BS = (ratio_BS < 1.0 - cfg.ratio_clip_low) | (ratio_BS > 1.0 + cfg.ratio_clip_high)
    metrics = {
        "loss": sg(loss),
        "pg_loss": sg(aggregate(pg_BS)),
        "reference_kl_loss": (
            sg(aggregate(cfg.reference_kl_coef * kl_ref_BS))
            if use_reference
            else jnp.zeros((), dtype)
        ),
        "clip_fraction": token_mean(clipped_BS.astype(dtype)),
        "approx_kl_old": token_mean(_kl_estimate("k3", log_ratio_BS)),
        "ratio_mean": token_mean(ratio_BS),
        "ratio_max": token_max(ratio_BS),
    }
    if cfg.dual_clip_c is not None:
        metrics["dual_clip_fraction"] = token_mean(dual_binds_BS.astype(dtype))
    if use_reference:
        metrics["reference_kl"] = token_mean(kl_ref_BS)
    if cfg.use_importance_sampling_correction:
        metrics["is_weight_mean"] = token_mean(is_weight_raw_BS)
        metrics["is_weight_max"] = token_max(is_weight_raw_BS)
        metrics["is_truncated_fraction"] = token_mean(
            (is_weight_raw_BS > cfg.importance_sampling_cap).astype(dtype)
        )
    metrics["num_valid_tokens"] = valid_f_BS.sum()
    metrics["num_valid_sequences"] = valid_BS.any(axis=1).astype(dtype).sum()
    return loss, metrics
