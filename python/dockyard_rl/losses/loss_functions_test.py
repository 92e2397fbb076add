"""Tests of the clipped policy-gradient loss.

The loss and its gradient are checked against `reference_loss_and_grad`, a token-by-token
implementation in plain python floats whose gradient is derived by hand per branch (it shares
no code with the module). Shape legend as in the module: B = samples, S = token positions.
"""

import dataclasses
import math

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from dockyard_rl.losses.loss_functions import (
    MAX_METRICS,
    ClippedPGLossConfig,
    ClippedPGLossFn,
    combine_metrics,
    count_valid,
)
from dockyard_rl.utils.config import from_dict

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Independent reference: python loops over tokens, hand-derived derivatives w.r.t. logp.
# ---------------------------------------------------------------------------------------------


def _reference_kl(estimator, logp, logp_ref):
    """(value, d value / d logp) of the per-token KL estimator."""
    d = logp - logp_ref
    if estimator == "k1":
        return d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, d
    # k3 = exp(ref - logp) - (ref - logp) - 1
    return math.exp(logp_ref - logp) - (logp_ref - logp) - 1.0, 1.0 - math.exp(logp_ref - logp)


def reference_loss_and_grad(cfg, inputs, num_tokens, num_seqs):
    """Returns (loss, grad as nested lists, metrics subset) computed token by token."""
    logp, prev, gen, ref = inputs["logp"], inputs["prev"], inputs["gen"], inputs["ref"]
    adv, token_mask, sample_mask = inputs["adv"], inputs["token_mask"], inputs["sample_mask"]
    num_b, num_s = len(logp), len(logp[0]) if logp else 0
    lo, hi = 1.0 - cfg.ratio_clip_low, 1.0 + cfg.ratio_clip_high
    loss = 0.0
    grad = [[0.0] * num_s for _ in range(num_b)]
    clipped = ratio_sum = kl_ref_sum = kl_old_sum = truncated = w_sum = 0.0
    for b in range(num_b):
        valid = [sample_mask[b] == 1 and token_mask[b][s] == 1 for s in range(num_s)]
        n_b = sum(valid)
        for s in range(num_s):
            if not valid[s]:
                continue
            r = math.exp(logp[b][s] - prev[b][s])
            a = adv[b][s]
            # Textbook case analysis of the pessimistic PPO term; d/dlogp(-a*r) = -a*r.
            if a > 0:
                value, d_value = (-a * hi, 0.0) if r > hi else (-a * r, -a * r)
            elif a < 0:
                value, d_value = (-a * lo, 0.0) if r < lo else (-a * r, -a * r)
                if cfg.dual_clip_c is not None and value > -cfg.dual_clip_c * a:
                    value, d_value = -cfg.dual_clip_c * a, 0.0
            else:
                value, d_value = 0.0, 0.0
            if cfg.use_importance_sampling_correction:
                w_raw = math.exp(prev[b][s] - gen[b][s])
                w = min(w_raw, cfg.importance_sampling_cap)
                value, d_value = w * value, w * d_value
                w_sum += w_raw
                truncated += w_raw > cfg.importance_sampling_cap
            kl, d_kl = _reference_kl(cfg.kl_estimator, logp[b][s], ref[b][s])
            value += cfg.reference_kl_coef * kl
            d_value += cfg.reference_kl_coef * d_kl
            scale = 1.0 / num_tokens if cfg.aggregation == "token" else 1.0 / (n_b * num_seqs)
            loss += value * scale
            grad[b][s] = d_value * scale
            clipped += r < lo or r > hi
            ratio_sum += r
            kl_ref_sum += kl
            kl_old_sum += math.exp(prev[b][s] - logp[b][s]) - (prev[b][s] - logp[b][s]) - 1.0
    n = max(num_tokens, 1)
    metrics = {
        "loss": loss,
        "clip_fraction": clipped / n,
        "ratio_mean": ratio_sum / n,
        "reference_kl": kl_ref_sum / n,
        "approx_kl_old": kl_old_sum / n,
    }
    if cfg.use_importance_sampling_correction:
        metrics["is_weight_mean"] = w_sum / n
        metrics["is_truncated_fraction"] = truncated / n
    return loss, grad, metrics


def to_batch(inputs):
    return {
        "prev_logprobs": torch.tensor(inputs["prev"], dtype=F64),
        "generation_logprobs": torch.tensor(inputs["gen"], dtype=F64),
        "reference_policy_logprobs": torch.tensor(inputs["ref"], dtype=F64),
        "advantages": torch.tensor(inputs["adv"], dtype=F64),
        "token_mask": torch.tensor(inputs["token_mask"], dtype=F64),
        "sample_mask": torch.tensor(inputs["sample_mask"], dtype=F64),
    }


def run_loss(cfg, logp_BS, batch, num_tokens=None, num_seqs=None):
    """Loss, metrics and d loss / d logp for a leaf copy of logp_BS."""
    if num_tokens is None:
        num_tokens, num_seqs = count_valid(batch)
    logp_BS = logp_BS.detach().clone().requires_grad_(True)
    loss, metrics = ClippedPGLossFn(cfg)(logp_BS, batch, num_tokens, num_seqs)
    loss.backward()
    return loss, metrics, logp_BS.grad


def random_batch(generator, num_b, num_s, valid_p=0.7):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64)

    logp_BS = -torch.rand(num_b, num_s, generator=generator, dtype=F64) * 4
    prev_BS = logp_BS - 0.6 * randn(num_b, num_s)
    batch = {
        "prev_logprobs": prev_BS,
        "generation_logprobs": prev_BS - 0.8 * randn(num_b, num_s),
        "reference_policy_logprobs": logp_BS - randn(num_b, num_s),
        "advantages": randn(num_b, num_s),
        "token_mask": (torch.rand(num_b, num_s, generator=generator) < valid_p).to(F64),
        "sample_mask": (torch.rand(num_b, generator=generator) < 0.8).to(F64),
    }
    return logp_BS, batch


# ---------------------------------------------------------------------------------------------
# 1. First-step identities.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_first_step_identities(estimator, aggregation):
    generator = torch.Generator().manual_seed(0)
    logp_BS, batch = random_batch(generator, 5, 7)
    batch["token_mask"][0, :] = 0  # a sequence with no valid tokens
    batch["sample_mask"][:] = 1
    batch["sample_mask"][1] = 0
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        batch[key] = logp_BS.clone()
    cfg = ClippedPGLossConfig(
        kl_estimator=estimator,
        reference_kl_coef=0.5,
        use_importance_sampling_correction=True,
        dual_clip_c=3.0,
        aggregation=aggregation,
    )
    loss, metrics, grad_BS = run_loss(cfg, logp_BS, batch)

    num_tokens, num_seqs = count_valid(batch)
    valid_BS = batch["token_mask"] * batch["sample_mask"][:, None]
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-15)
    assert metrics["ratio_max"] == 1.0
    assert metrics["clip_fraction"] == 0.0
    assert metrics["dual_clip_fraction"] == 0.0
    assert metrics["approx_kl_old"] == 0.0
    assert metrics["reference_kl"] == 0.0
    assert metrics["reference_kl_loss"] == 0.0
    assert metrics["is_weight_max"] == 1.0
    assert metrics["is_truncated_fraction"] == 0.0
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-15)

    # Loss = -mean advantage; k1's gradient is 1 even at d = 0 (k2, k3 have zero gradient there).
    kl_grad = 0.5 if estimator == "k1" else 0.0
    if aggregation == "token":
        weight_BS = valid_BS / num_tokens
    else:
        weight_BS = valid_BS / valid_BS.sum(dim=1, keepdim=True).clamp(min=1) / num_seqs
    expected_grad_BS = (-batch["advantages"] + kl_grad) * weight_BS
    torch.testing.assert_close(grad_BS, expected_grad_BS, rtol=0, atol=1e-15)
    assert bool((grad_BS[valid_BS == 0] == 0).all())
    torch.testing.assert_close(loss, (-batch["advantages"] * weight_BS).sum(), rtol=0, atol=1e-14)


def test_first_step_ratio_and_kl_are_exactly_one_and_zero_per_token():
    # Exactness per token, not only on average: the estimators are evaluated at d = 0.
    logp_BS = torch.tensor([[-0.1, -2.5, -7.0]], dtype=F64)
    batch = {
        "prev_logprobs": logp_BS.clone(),
        "reference_policy_logprobs": logp_BS.clone(),
        "advantages": torch.tensor([[1.0, -2.0, 0.5]], dtype=F64),
        "token_mask": torch.ones(1, 3),
        "sample_mask": torch.ones(1),
    }
    for estimator in ("k1", "k2", "k3"):
        cfg = ClippedPGLossConfig(kl_estimator=estimator, reference_kl_coef=1.0)
        _, metrics, grad_BS = run_loss(cfg, logp_BS, batch)
        assert metrics["reference_kl"] == 0.0 and metrics["approx_kl_old"] == 0.0
        assert metrics["ratio_mean"] == 1.0 and metrics["ratio_max"] == 1.0
        expected = (-batch["advantages"] + (1.0 if estimator == "k1" else 0.0)) / 3
        torch.testing.assert_close(grad_BS, expected, rtol=0, atol=1e-16)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_missing_prev_logprobs_is_the_on_policy_step_exactly(aggregation, dual_clip_c):
    """Without prev_logprobs (one optimizer step per batch, no separate log-prob pass) the loss,
    its gradient and every metric are bit-identical to passing the same weights' log-probs."""
    logp_BS, batch = random_batch(torch.Generator().manual_seed(11), 5, 7)
    cfg = ClippedPGLossConfig(
        aggregation=aggregation,
        dual_clip_c=dual_clip_c,
        use_importance_sampling_correction=True,
        reference_kl_coef=0.05,
    )
    explicit = dict(batch, prev_logprobs=logp_BS.clone())
    skipped = {key: value for key, value in batch.items() if key != "prev_logprobs"}
    loss_e, metrics_e, grad_e = run_loss(cfg, logp_BS, explicit)
    loss_s, metrics_s, grad_s = run_loss(cfg, logp_BS, skipped)
    assert loss_s.item() == loss_e.item()
    assert torch.equal(grad_s, grad_e)
    assert metrics_s == metrics_e
    assert metrics_s["num_valid_tokens"] > 0 and metrics_s["ratio_mean"] == 1.0
    assert metrics_s["clip_fraction"] == 0.0 and metrics_s["ratio_max"] == 1.0


# ---------------------------------------------------------------------------------------------
# 2. Against the reference implementation.
# ---------------------------------------------------------------------------------------------


@st.composite
def configs(draw):
    return ClippedPGLossConfig(
        ratio_clip_low=draw(st.floats(0.05, 0.5)),
        ratio_clip_high=draw(st.floats(0.05, 0.6)),
        dual_clip_c=draw(st.none() | st.floats(1.05, 3.0)),
        reference_kl_coef=draw(st.sampled_from([0.0, 0.1, 1.0])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
        use_importance_sampling_correction=draw(st.booleans()),
        importance_sampling_cap=draw(st.floats(1.0, 3.0)),
        aggregation=draw(st.sampled_from(["token", "sequence"])),
    )


@st.composite
def loss_inputs(draw):
    num_b = draw(st.integers(1, 4))
    num_s = draw(st.integers(1, 6))

    def grid(low, high):
        return draw(
            st.lists(
                st.lists(st.floats(low, high), min_size=num_s, max_size=num_s),
                min_size=num_b,
                max_size=num_b,
            )
        )

    logp = grid(-6.0, 0.0)
    # Log-ratios up to +-1.5 put ratios on both sides of every clip bound and past dual-clip c.
    prev = [[lp - d for lp, d in zip(row, drow)] for row, drow in zip(logp, grid(-1.5, 1.5))]
    gen = [[p - d for p, d in zip(row, drow)] for row, drow in zip(prev, grid(-1.5, 1.5))]
    ref = [[lp - d for lp, d in zip(row, drow)] for row, drow in zip(logp, grid(-2.0, 2.0))]
    return {
        "logp": logp,
        "prev": prev,
        "gen": gen,
        "ref": ref,
        "adv": grid(-3.0, 3.0),
        "token_mask": draw(
            st.lists(
                st.lists(st.sampled_from([0, 1]), min_size=num_s, max_size=num_s),
                min_size=num_b,
                max_size=num_b,
            )
        ),
        "sample_mask": draw(st.lists(st.sampled_from([0, 1, 1]), min_size=num_b, max_size=num_b)),
    }


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None)
@hypothesis.given(cfg=configs(), inputs=loss_inputs())
def test_matches_reference_implementation(cfg, inputs):
    batch = to_batch(inputs)
    num_tokens, num_seqs = count_valid(batch)
    loss, metrics, grad_BS = run_loss(cfg, torch.tensor(inputs["logp"], dtype=F64), batch)
    ref_loss, ref_grad, ref_metrics = reference_loss_and_grad(cfg, inputs, num_tokens, num_seqs)

    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad_BS, torch.tensor(ref_grad, dtype=F64), rtol=1e-10, atol=1e-12)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert metrics["num_valid_tokens"] == num_tokens
    assert metrics["num_valid_sequences"] == num_seqs


def _one_token_grad(cfg, log_ratio, advantage, prev_minus_gen=0.0):
    """Gradient for a batch holding one valid token with the given ratio / advantage."""
    logp_BS = torch.tensor([[-1.0]], dtype=F64)
    prev_BS = logp_BS - log_ratio
    batch = {
        "prev_logprobs": prev_BS,
        "generation_logprobs": prev_BS - prev_minus_gen,
        "advantages": torch.tensor([[advantage]], dtype=F64),
        "token_mask": torch.ones(1, 1),
        "sample_mask": torch.ones(1),
    }
    loss, metrics, grad_BS = run_loss(cfg, logp_BS, batch)
    return loss.item(), metrics, grad_BS.item()


def test_every_clip_branch_explicitly():
    cfg = ClippedPGLossConfig(ratio_clip_low=0.1, ratio_clip_high=0.3)
    r = math.exp
    # A > 0: above 1 + eps_high clipped (no gradient), below 1 - eps_low not clipped.
    loss, metrics, grad = _one_token_grad(cfg, 0.5, 2.0)
    assert (loss, grad, metrics["clip_fraction"]) == (pytest.approx(-2.0 * 1.3), 0.0, 1.0)
    loss, _, grad = _one_token_grad(cfg, -0.5, 2.0)
    assert (loss, grad) == (pytest.approx(-2.0 * r(-0.5)), pytest.approx(-2.0 * r(-0.5)))
    # Asymmetric: ratio 1.2 is inside [0.9, 1.3] but would be clipped by a symmetric 0.1.
    _, metrics, grad = _one_token_grad(cfg, math.log(1.2), 2.0)
    assert (grad, metrics["clip_fraction"]) == (pytest.approx(-2.4), 0.0)
    # A < 0: below 1 - eps_low clipped (no gradient), above 1 + eps_high not clipped.
    loss, _, grad = _one_token_grad(cfg, -0.5, -2.0)
    assert (loss, grad) == (pytest.approx(2.0 * 0.9), 0.0)
    loss, _, grad = _one_token_grad(cfg, 1.5, -2.0)
    assert (loss, grad) == (pytest.approx(2.0 * r(1.5)), pytest.approx(2.0 * r(1.5)))
    # Dual clip caps A < 0 at c*|A| with no gradient, and leaves A > 0 and small ratios alone.
    dual = dataclasses.replace(cfg, dual_clip_c=3.0)
    loss, metrics, grad = _one_token_grad(dual, 1.5, -2.0)
    assert (loss, grad, metrics["dual_clip_fraction"]) == (pytest.approx(6.0), 0.0, 1.0)
    loss, metrics, grad = _one_token_grad(dual, 1.0, -2.0)
    assert (loss, grad, metrics["dual_clip_fraction"]) == (
        pytest.approx(2.0 * r(1.0)),
        pytest.approx(2.0 * r(1.0)),
        0.0,
    )
    loss, _, grad = _one_token_grad(dual, 1.5, 2.0)
    assert (loss, grad) == (pytest.approx(-2.0 * 1.3), 0.0)
    # TIS: weight below the cap is applied as is, above it truncated; it scales the gradient.
    tis = dataclasses.replace(
        cfg, use_importance_sampling_correction=True, importance_sampling_cap=2.0
    )
    _, metrics, grad = _one_token_grad(tis, 0.0, 1.0, prev_minus_gen=0.5)
    assert (grad, metrics["is_truncated_fraction"]) == (pytest.approx(-r(0.5)), 0.0)
    _, metrics, grad = _one_token_grad(tis, 0.0, 1.0, prev_minus_gen=1.5)
    assert (grad, metrics["is_truncated_fraction"]) == (pytest.approx(-2.0), 1.0)
    assert metrics["is_weight_max"] == pytest.approx(r(1.5))


def test_batch_tensors_receive_no_gradient():
    generator = torch.Generator().manual_seed(1)
    logp_BS, batch = random_batch(generator, 3, 4)
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        batch[key] = batch[key].clone().requires_grad_(True)
    cfg = ClippedPGLossConfig(use_importance_sampling_correction=True, reference_kl_coef=0.1)
    run_loss(cfg, logp_BS, batch)
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        assert batch[key].grad is None, key


# ---------------------------------------------------------------------------------------------
# 3. Microbatch and data-parallel shard invariance.
# ---------------------------------------------------------------------------------------------

INVARIANCE_CONFIGS = [
    ClippedPGLossConfig(),
    ClippedPGLossConfig(aggregation="sequence"),
    ClippedPGLossConfig(
        ratio_clip_low=0.1,
        ratio_clip_high=0.28,
        dual_clip_c=2.0,
        use_importance_sampling_correction=True,
        importance_sampling_cap=1.5,
        reference_kl_coef=0.3,
        kl_estimator="k2",
        aggregation="sequence",
    ),
    ClippedPGLossConfig(
        use_importance_sampling_correction=True, reference_kl_coef=0.05, kl_estimator="k1"
    ),
]


def _slice_batch(batch, start, stop):
    return {key: value[start:stop] for key, value in batch.items()}


@pytest.mark.parametrize("cfg", INVARIANCE_CONFIGS)
def test_microbatch_and_shard_invariance(cfg):
    generator = torch.Generator().manual_seed(2)
    logp_BS, batch = random_batch(generator, 13, 9)
    batch["token_mask"][3, :] = 0  # a sample with sample_mask 1 but no valid tokens
    batch["sample_mask"][3] = 1
    loss_fn = ClippedPGLossFn(cfg)
    whole_loss, whole_metrics, whole_grad_BS = run_loss(cfg, logp_BS, batch)

    # Simulated DP: each rank counts its own shard; the "all-reduce" sums the counts.
    shards = [(0, 6), (6, 13)]
    shard_counts = [count_valid(_slice_batch(batch, a, b)) for a, b in shards]
    num_tokens = sum(c[0] for c in shard_counts)
    num_seqs = sum(c[1] for c in shard_counts)
    assert (num_tokens, num_seqs) == count_valid(batch)

    leaf_BS = logp_BS.clone().requires_grad_(True)
    total_loss = 0.0
    all_metrics = []
    for shard_start, shard_stop in shards:
        # Uneven microbatches inside each rank, one backward per microbatch (grad accumulation).
        bounds = [shard_start, shard_start + 1, shard_start + 4, shard_stop]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            loss, metrics = loss_fn(
                leaf_BS[start:stop], _slice_batch(batch, start, stop), num_tokens, num_seqs
            )
            loss.backward()
            total_loss += loss.item()
            all_metrics.append(metrics)

    assert total_loss == pytest.approx(whole_loss.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(leaf_BS.grad, whole_grad_BS, rtol=1e-12, atol=1e-15)
    combined = combine_metrics(all_metrics)
    assert set(combined) == set(whole_metrics)
    for key, value in whole_metrics.items():
        assert combined[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key
    assert MAX_METRICS & set(combined)  # the max path of combine_metrics was exercised


# ---------------------------------------------------------------------------------------------
# Masks and NaN safety.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_masked_garbage_and_empty_sequences_do_not_produce_nan(aggregation):
    generator = torch.Generator().manual_seed(3)
    logp_BS, batch = random_batch(generator, 4, 5)
    batch["token_mask"][0, :] = 0
    batch["token_mask"][1, 2:] = 0
    batch["sample_mask"][:] = 1
    batch["sample_mask"][2] = 0
    cfg = ClippedPGLossConfig(
        aggregation=aggregation,
        use_importance_sampling_correction=True,
        reference_kl_coef=0.1,
        dual_clip_c=3.0,
    )
    clean_loss, clean_metrics, clean_grad_BS = run_loss(cfg, logp_BS, batch)

    invalid_BS = (batch["token_mask"] * batch["sample_mask"][:, None]) == 0
    dirty_logp_BS = logp_BS.masked_fill(invalid_BS, float("nan"))
    dirty = dict(batch)
    for key, fill in [
        ("prev_logprobs", float("-inf")),
        ("generation_logprobs", float("inf")),
        ("reference_policy_logprobs", 1e6),
        ("advantages", float("nan")),
    ]:
        dirty[key] = batch[key].masked_fill(invalid_BS, fill)
    loss, metrics, grad_BS = run_loss(cfg, dirty_logp_BS, dirty)

    assert torch.isfinite(loss) and torch.isfinite(grad_BS).all()
    assert all(math.isfinite(v) for v in metrics.values())
    assert loss.item() == clean_loss.item()
    torch.testing.assert_close(grad_BS, clean_grad_BS, rtol=0, atol=0)
    assert metrics == clean_metrics
    assert bool((grad_BS[invalid_BS] == 0).all())


def test_nothing_valid_anywhere_gives_zero_loss_and_gradient():
    generator = torch.Generator().manual_seed(4)
    logp_BS, batch = random_batch(generator, 2, 3)
    batch["sample_mask"][:] = 0
    for aggregation in ("token", "sequence"):
        cfg = ClippedPGLossConfig(aggregation=aggregation)
        loss, metrics, grad_BS = run_loss(cfg, logp_BS, batch, 0, 0)
        assert loss.item() == 0.0 and bool((grad_BS == 0).all())
        assert all(v == 0.0 for v in metrics.values())


def test_bfloat16_logprobs_compute_in_float32():
    generator = torch.Generator().manual_seed(5)
    logp_BS, batch = random_batch(generator, 3, 4)
    logp16_BS = logp_BS.to(torch.bfloat16).requires_grad_(True)
    loss, _ = ClippedPGLossFn(ClippedPGLossConfig())(logp16_BS, batch, *count_valid(batch))
    loss.backward()
    assert loss.dtype == torch.float32 and logp16_BS.grad.dtype == torch.bfloat16


def test_count_valid():
    batch = {
        "token_mask": torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1], [1, 1, 1]]),
        "sample_mask": torch.tensor([1, 1, 1, 0]),
    }
    assert count_valid(batch) == (4, 2)


def test_required_batch_keys():
    # prev_logprobs is optional: absent = the batch's single on-policy optimizer step.
    assert ClippedPGLossFn(ClippedPGLossConfig()).required_batch_keys == (
        "advantages",
        "token_mask",
        "sample_mask",
    )
    keys = ClippedPGLossFn(
        ClippedPGLossConfig(use_importance_sampling_correction=True, reference_kl_coef=0.1)
    ).required_batch_keys
    assert "generation_logprobs" in keys and "reference_policy_logprobs" in keys


# ---------------------------------------------------------------------------------------------
# 4. Config validation and input errors.
# ---------------------------------------------------------------------------------------------


def test_defaults():
    cfg = from_dict(ClippedPGLossConfig, {}, "loss_fn")
    assert cfg == ClippedPGLossConfig(
        ratio_clip_low=0.2,
        ratio_clip_high=0.2,
        dual_clip_c=None,
        reference_kl_coef=0.0,
        kl_estimator="k3",
        use_importance_sampling_correction=False,
        importance_sampling_cap=2.0,
        aggregation="token",
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("ratio_clip_low", 0.0),
        ("ratio_clip_low", 1.0),
        ("ratio_clip_low", -0.1),
        ("ratio_clip_low", "0.2"),
        ("ratio_clip_low", float("nan")),
        ("ratio_clip_low", True),
        ("ratio_clip_high", 0.0),
        ("ratio_clip_high", -0.2),
        ("ratio_clip_high", float("inf")),
        ("dual_clip_c", 1.0),
        ("dual_clip_c", 0.5),
        ("dual_clip_c", "3"),
        ("reference_kl_coef", -0.01),
        ("reference_kl_coef", None),
        ("kl_estimator", "k4"),
        ("kl_estimator", "K3"),
        ("use_importance_sampling_correction", "yes"),
        ("use_importance_sampling_correction", 1),
        ("importance_sampling_cap", 0.99),
        ("importance_sampling_cap", float("inf")),
        ("aggregation", "tokens"),
        ("aggregation", "seq-mean-token-mean"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^loss_fn\.{key}: must "):
        from_dict(ClippedPGLossConfig, {key: value}, "loss_fn")


def test_config_accepts_edge_values():
    cfg = from_dict(
        ClippedPGLossConfig,
        {
            "ratio_clip_high": 5,
            "dual_clip_c": 1.01,
            "importance_sampling_cap": 1,
            "kl_estimator": "k1",
            "aggregation": "sequence",
        },
        "loss_fn",
    )
    assert cfg.importance_sampling_cap == 1 and cfg.dual_clip_c == 1.01


def test_loss_fn_needs_a_config_object():
    with pytest.raises(ValueError, match="needs a ClippedPGLossConfig"):
        ClippedPGLossFn({"ratio_clip_low": 0.2})


def _valid_inputs():
    generator = torch.Generator().manual_seed(6)
    return random_batch(generator, 2, 3)


@pytest.mark.parametrize(
    "key, cfg",
    [
        ("advantages", ClippedPGLossConfig()),
        ("token_mask", ClippedPGLossConfig()),
        ("sample_mask", ClippedPGLossConfig()),
        ("generation_logprobs", ClippedPGLossConfig(use_importance_sampling_correction=True)),
        ("reference_policy_logprobs", ClippedPGLossConfig(reference_kl_coef=0.1)),
    ],
)
def test_missing_key_is_named(key, cfg):
    logp_BS, batch = _valid_inputs()
    del batch[key]
    with pytest.raises(ValueError, match=rf"batch is missing key '{key}'"):
        ClippedPGLossFn(cfg)(logp_BS, batch, 100, 100)


def test_keys_not_needed_by_the_config_may_be_absent():
    logp_BS, batch = _valid_inputs()
    del batch["generation_logprobs"], batch["reference_policy_logprobs"]
    _, metrics = ClippedPGLossFn(ClippedPGLossConfig())(logp_BS, batch, *count_valid(batch))
    assert "reference_kl" not in metrics and "is_weight_mean" not in metrics


@pytest.mark.parametrize(
    "key, shape",
    [
        ("prev_logprobs", (2, 4)),
        ("advantages", (2,)),
        ("token_mask", (3, 3)),
        ("sample_mask", (2, 3)),
        ("reference_policy_logprobs", (2, 2)),
    ],
)
def test_shape_mismatch_is_named(key, shape):
    logp_BS, batch = _valid_inputs()
    batch[key] = torch.zeros(shape, dtype=F64)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] has shape {re_shape(shape)}"):
        ClippedPGLossFn(ClippedPGLossConfig())(logp_BS, batch, 100, 100)


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_other_input_errors():
    logp_BS, batch = _valid_inputs()
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    with pytest.raises(ValueError, match="logprobs_BS must be a 2-D"):
        loss_fn(logp_BS[0], batch, 100, 100)
    with pytest.raises(ValueError, match="logprobs_BS must be a 2-D .*floating-point"):
        loss_fn(logp_BS.long(), batch, 100, 100)
    with pytest.raises(ValueError, match=r"batch\['advantages'\] must be a torch.Tensor"):
        loss_fn(logp_BS, {**batch, "advantages": [[0.0] * 3] * 2}, 100, 100)
    with pytest.raises(ValueError, match=r"batch\['token_mask'\] must contain only 0 and 1"):
        loss_fn(logp_BS, {**batch, "token_mask": torch.full((2, 3), 0.5)}, 100, 100)
    num_tokens, num_seqs = count_valid(batch)
    assert num_tokens > 1 and num_seqs > 0
    with pytest.raises(ValueError, match="global_num_valid_tokens is .* but this microbatch"):
        loss_fn(logp_BS, batch, num_tokens - 1, num_seqs)
    with pytest.raises(ValueError, match="global_num_valid_sequences is .* but this microbatch"):
        loss_fn(logp_BS, batch, num_tokens, num_seqs - 1)
    with pytest.raises(ValueError, match="global_num_valid_tokens must be a number"):
        loss_fn(logp_BS, batch, "many", num_seqs)
    with pytest.raises(ValueError, match="batch is missing key 'token_mask'"):
        count_valid({"sample_mask": torch.ones(2)})
    # A 0-d tensor (e.g. the result of an all-reduce) is accepted as a global count.
    loss, _ = loss_fn(logp_BS, batch, torch.tensor(num_tokens), torch.tensor(num_seqs))
    assert torch.isfinite(loss)


def test_combine_metrics_rejects_mismatched_keys():
    with pytest.raises(ValueError, match="different keys"):
        combine_metrics([{"loss": 1.0}, {"loss": 1.0, "reference_kl": 0.0}])
    with pytest.raises(ValueError, match="at least one"):
        combine_metrics([])
