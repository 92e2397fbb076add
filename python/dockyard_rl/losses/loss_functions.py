"""The clipped policy-gradient loss (GRPO/PPO) that every dockyard_rl training loop minimises.

Per valid token t of sample b (all quantities are per token; A is the already-broadcast advantage):

    r      = exp(logp - logp_old)                         policy ratio to the trainer's old policy
    pg     = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))      PPO's pessimistic term
    pg     = min(pg, -c * A)            only where A < 0 and dual clip is on (`dual_clip_c` = c)
    pg     = w * pg,  w = min(exp(logp_old - logp_gen), cap), detached   (optional TIS correction)
    loss_t = pg + beta * KL_est(logp, logp_ref)                          (optional reference KL)

and the per-token losses are aggregated with global normalisers (see "Aggregation").

Old policy: logp_old is `batch["prev_logprobs"]`, the trainer's log-probs taken once before the
first optimizer step on a rollout batch (algorithms/mini_batches.py); later mini-batches and
epochs are then off-policy and the clip binds. When a batch gets exactly ONE optimizer step the
old policy IS the current one, so the caller may leave `prev_logprobs` out: the loss then uses
the training forward's own log-probs, detached (r == 1 exactly; same loss value and gradient as
with a separate log-prob pass, without its cost). A missing key is the signal, in both this
module and its jax port (jax_loss_functions.py).

Shape legend (suffixes on tensor names): B = samples (sequences) in this microbatch,
S = token positions. Every (B, S) tensor must be aligned the same way: position s holds the
log-prob / advantage / mask of the same token s; shifting logits to token log-probs is the
policy worker's job, not this module's.

Aggregation, microbatching and data parallelism
-----------------------------------------------
A valid token has token_mask == 1 and sample_mask == 1 for its sample. The caller counts valid
tokens and valid sequences (those with at least one valid token) ONCE over the global batch (all
microbatches on all data-parallel ranks) with `count_valid` and passes the totals to every call:

- "token":    loss = sum of loss_t over this microbatch's valid tokens / global_num_valid_tokens
- "sequence": loss = sum over sequences of (mean of loss_t over the sequence's valid tokens)
                     / global_num_valid_sequences

Both are sums of per-microbatch pieces, so summing the losses (and gradients) of all microbatches
and all DP shards gives exactly the loss (gradient) of the whole batch. Consequence for callers:
gradients must be SUMMED across data-parallel ranks, not averaged. FSDP/DDP average by default, so
a worker using them multiplies the loss by the DP world size before backward (or sets the
reduction to sum).

Metrics
-------
`__call__` returns python floats that also combine across microbatches and DP ranks: keys in
`MAX_METRICS` combine by max (all-reduce MAX), every other key by sum (all-reduce SUM);
`combine_metrics` does this for a list of microbatch results. Means over tokens are computed as
local sums over the global valid-token count, which is why they sum correctly.

Covered: the loss above, its input checks, the global-normaliser helper and the metrics.
Not covered: entropy bonuses, value/critic losses, sequence-level (GSPO-style) ratios, and
sequence packing or context parallelism that splits one sequence across microbatches or ranks
("sequence" aggregation needs all of a sequence's tokens in one call).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.utils.config import require, require_bool

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token", "sequence")

# Metrics that combine across microbatches / DP ranks by max; every other metric combines by sum.
MAX_METRICS = frozenset({"ratio_max", "is_weight_max"})


def _is_finite_number(value: Any) -> bool:
    # bool is an int subclass; `true` in YAML for a numeric key is a mistake, not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class ClippedPGLossConfig:
    """YAML section `loss_fn`.

    Attributes:
        ratio_clip_low: eps_low; the ratio is clipped below at 1 - eps_low. In (0, 1).
        ratio_clip_high: eps_high; the ratio is clipped above at 1 + eps_high. > 0. May differ
            from eps_low ("clip-higher", e.g. 0.28, keeps low-probability tokens learnable).
        dual_clip_c: None turns dual clip off. Otherwise a constant c > 1: for tokens with A < 0
            the PPO term max(-A*r, -A*clip(r)) = |A| * max(r, clip(r)) grows without bound as r
            grows, so it is capped: term = min(max(-A*r, -A*clip(r)), -c*A), i.e. at most c*|A|,
            with zero gradient once max(r, clip(r)) > c. Tokens with A >= 0 are unaffected.
        reference_kl_coef: beta >= 0, weight of the per-token KL penalty to the reference policy
            (0 turns it off; then `reference_policy_logprobs` is not needed).
        kl_estimator: how the per-token KL to the reference is estimated, with
            d = logp - logp_ref:  "k1": d;  "k2": d^2 / 2;  "k3": exp(-d) + d - 1
            (= exp(logp_ref - logp) - (logp_ref - logp) - 1, non-negative, unbiased for
            KL(pi || pi_ref) under samples from pi). Gradients flow through logp.
        use_importance_sampling_correction: multiply each token's policy-gradient term by the
            truncated importance weight w = min(exp(logp_old - logp_gen), importance_sampling_cap)
            (TIS), detached, where logp_gen are the log-probs the inference engine sampled with
            (`generation_logprobs`). The engine's policy differs from the trainer's old policy
            (stale weights under async generation / in-flight weight updates, and numerically
            different kernels even when in sync), so without it the gradient is biased.
            Required for async GRPO (async_grpo.*): the async loop must not run with it off.
        importance_sampling_cap: truncation cap on w; >= 1 (a cap below 1 would shrink even
            on-policy tokens).
        aggregation: "token" (every valid token in the global batch weighs the same) or
            "sequence" (each sequence's mean over its valid tokens, averaged over sequences).
    """

    ratio_clip_low: float = 0.2
    ratio_clip_high: float = 0.2
    dual_clip_c: float | None = None
    reference_kl_coef: float = 0.0
    kl_estimator: str = "k3"
    use_importance_sampling_correction: bool = False
    importance_sampling_cap: float = 2.0
    aggregation: str = "token"

    def __post_init__(self):
        require(
            _is_finite_number(self.ratio_clip_low) and 0 < self.ratio_clip_low < 1,
            "ratio_clip_low",
            f"must be a number in (0, 1) (the lower clip bound 1 - ratio_clip_low must stay "
            f"positive), got {self.ratio_clip_low!r}; 0.2 is the usual value",
        )
        require(
            _is_finite_number(self.ratio_clip_high) and self.ratio_clip_high > 0,
            "ratio_clip_high",
            f"must be a finite number > 0, got {self.ratio_clip_high!r}; 0.2 is the usual "
            f"value, 0.28 for clip-higher",
        )
        require(
            self.dual_clip_c is None
            or (_is_finite_number(self.dual_clip_c) and self.dual_clip_c > 1),
            "dual_clip_c",
            f"must be null (off) or a finite number > 1 (a cap of c * |A| at or below the "
            f"unclipped value would cut on-policy gradients), got {self.dual_clip_c!r}; "
            f"3.0 is the usual value",
        )
        require(
            _is_finite_number(self.reference_kl_coef) and self.reference_kl_coef >= 0,
            "reference_kl_coef",
            f"must be a finite number >= 0 (0 disables the reference KL penalty), got "
            f"{self.reference_kl_coef!r}",
        )
        require(
            self.kl_estimator in KL_ESTIMATORS,
            "kl_estimator",
            f"must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}",
        )
        require_bool(self, "use_importance_sampling_correction")
        require(
            _is_finite_number(self.importance_sampling_cap) and self.importance_sampling_cap >= 1,
            "importance_sampling_cap",
            f"must be a finite number >= 1 (it truncates the importance weight from above), "
            f"got {self.importance_sampling_cap!r}; 2.0 is the usual value",
        )
        require(
            self.aggregation in AGGREGATIONS,
            "aggregation",
            f"must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}",
        )


def check_tensor(batch: Mapping[str, Any], key: str, shape: tuple[int, ...], what: str) -> None:
    """ValueError unless batch[key] is a torch.Tensor of exactly `shape`; `what` says what it is
    for. Shared with the jax policy's batch checks."""
    if key not in batch:
        raise ValueError(f"batch is missing key {key!r} ({what}); it has keys {sorted(batch)}")
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(
            f"batch[{key!r}] has shape {tuple(value.shape)}, expected {shape} ({what})"
        )


def _check_masks(batch: Mapping[str, Any], shape_BS: tuple[int, int]) -> None:
    check_tensor(
        batch, "token_mask", shape_BS, "(B, S), 1 on response tokens that count in the loss"
    )
    check_tensor(
        batch, "sample_mask", shape_BS[:1], "(B,), 0 excludes the whole sample from the loss"
    )
    for key in ("token_mask", "sample_mask"):
        mask = batch[key]
        # A fractional mask would silently reweight tokens and break the global normalisers.
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"batch[{key!r}] must contain only 0 and 1; got other values")


def _valid_mask_BS(batch: Mapping[str, Any]) -> torch.Tensor:
    """Bool (B, S): token_mask == 1 and its sample's sample_mask == 1."""
    return (batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None]


def count_valid(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(num_valid_tokens, num_valid_sequences) of `batch`, for the loss's global normalisers.

    A valid token has token_mask == 1 and sample_mask == 1; a valid sequence has at least one
    valid token (so a sequence whose tokens are all masked does not dilute "sequence"
    aggregation). Call it on the whole global batch, or on each DP shard and sum the results
    across ranks; then pass the totals to every microbatch's loss call.

    Raises:
        ValueError: `token_mask` / `sample_mask` missing, of the wrong shape, or not 0/1.
    """
    if "token_mask" not in batch:
        raise ValueError(
            f"batch is missing key 'token_mask' ((B, S), 1 on response tokens that "
            f"count in the loss); it has keys {sorted(batch)}"
        )
    token_mask = batch["token_mask"]
    if not isinstance(token_mask, torch.Tensor) or token_mask.dim() != 2:
        raise ValueError(
            f"batch['token_mask'] must be a 2-D (B, S) torch.Tensor, got "
            f"{getattr(token_mask, 'shape', type(token_mask).__name__)}"
        )
    _check_masks(batch, tuple(token_mask.shape))
    valid_BS = _valid_mask_BS(batch)
    return int(valid_BS.sum()), int(valid_BS.any(dim=1).sum())


def combine_metrics(metrics_list: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combines the metrics of several microbatches (or DP ranks) of one global batch.

    Keys in MAX_METRICS take the max, the others the sum; the result equals the metrics of the
    whole batch computed in one call.

    Raises:
        ValueError: the list is empty or the dicts do not have the same keys.
    """
    if not metrics_list:
        raise ValueError("combine_metrics needs at least one metrics dict")
    keys = set(metrics_list[0])
    for metrics in metrics_list[1:]:
        if set(metrics) != keys:
            raise ValueError(
                f"metrics dicts have different keys: {sorted(keys)} vs "
                f"{sorted(metrics)}; combine results of the same loss config only"
            )
    return {
        key: (max if key in MAX_METRICS else sum)(m[key] for m in metrics_list)
        for key in metrics_list[0]
    }


def _kl_estimate(estimator: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """KL estimator as a function of d = logp - logp_target (see ClippedPGLossConfig)."""
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    assert estimator == "k3", estimator
    # expm1 keeps k3 accurate for small |d|, where exp(-d) - 1 + d would cancel catastrophically.
    return torch.expm1(-log_ratio) + log_ratio


class ClippedPGLossFn:
    """The clipped policy-gradient loss; see the module docstring for the exact objective.

    Stateless apart from its config, so one instance serves every microbatch and every step.
    """

    def __init__(self, config: ClippedPGLossConfig):
        if not isinstance(config, ClippedPGLossConfig):
            raise ValueError(
                f"ClippedPGLossFn needs a ClippedPGLossConfig, got "
                f"{type(config).__name__}; build it with "
                f"from_dict(ClippedPGLossConfig, yaml['loss_fn'], 'loss_fn')"
            )
        self.config = config

    @property
    def required_batch_keys(self) -> tuple[str, ...]:
        """The batch keys `__call__` reads under this config (what workers must ship)."""
        # prev_logprobs is optional: absent = the batch's one on-policy step (module docstring).
        keys = ["advantages", "token_mask", "sample_mask"]
        if self.config.use_importance_sampling_correction:
            keys.append("generation_logprobs")
        if self.config.reference_kl_coef > 0:
            keys.append("reference_policy_logprobs")
        return tuple(keys)

    def __call__(
        self,
        logprobs_BS: torch.Tensor,
        batch: Mapping[str, Any],
        global_num_valid_tokens: int | float | torch.Tensor,
        global_num_valid_sequences: int | float | torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one microbatch and its (summable) metrics.

        Args:
            logprobs_BS: current policy's log-probs of the taken tokens; carries the gradient.
            batch: mapping (e.g. BatchedDataDict) of tensors: `advantages` (B, S),
                `token_mask` (B, S), `sample_mask` (B,); plus
                `generation_logprobs` (B, S) with importance-sampling correction and
                `reference_policy_logprobs` (B, S) with reference_kl_coef > 0 (if present
                while the coefficient is 0, the KL is still reported as a metric);
                `prev_logprobs` (B, S), the old policy's log-probs, or absent when this is the
                batch's only optimizer step (then logprobs_BS.detach() stands in for them).
                Only logprobs_BS receives gradients; batch tensors are detached.
            global_num_valid_tokens / global_num_valid_sequences: `count_valid` totals over the
                GLOBAL batch (all microbatches, all DP ranks).

        Returns:
            (scalar loss tensor in float32 or float64, metrics dict of python floats):
              loss, pg_loss, reference_kl_loss (beta * KL, aggregated like the loss),
              clip_fraction (valid tokens whose ratio is outside the clip range),
              dual_clip_fraction (valid tokens where the dual-clip cap binds; with dual clip),
              approx_kl_old (k3 of logp_old against logp), ratio_mean, ratio_max,
              reference_kl (the chosen estimator; when reference log-probs are given),
              is_weight_mean, is_weight_max (of the untruncated weight), is_truncated_fraction
              (with IS correction), num_valid_tokens, num_valid_sequences (this call's counts).
              Fractions and means are over valid tokens of the global batch. Sum-combined
              except MAX_METRICS; all are 0 for a microbatch without valid tokens.

        Raises:
            ValueError: a required key is missing, a tensor has the wrong shape, a mask is not
                0/1, or a global count is smaller than this microbatch's own count.
        """
        cfg = self.config
        if (
            not isinstance(logprobs_BS, torch.Tensor)
            or logprobs_BS.dim() != 2
            or not logprobs_BS.is_floating_point()
        ):
            raise ValueError(
                f"logprobs_BS must be a 2-D (B, S) floating-point torch.Tensor, got "
                f"{getattr(logprobs_BS, 'shape', type(logprobs_BS).__name__)} "
                f"{getattr(logprobs_BS, 'dtype', '')}"
            )
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"batch must be a mapping of key -> tensor (e.g. BatchedDataDict), "
                f"got {type(batch).__name__}"
            )
        shape_BS = tuple(logprobs_BS.shape)
        _check_masks(batch, shape_BS)
        if "prev_logprobs" in batch:
            check_tensor(
                batch,
                "prev_logprobs",
                shape_BS,
                "(B, S), the trainer's old-policy log-probs, same shape as logprobs_BS",
            )
        check_tensor(
            batch,
            "advantages",
            shape_BS,
            "(B, S), token-level advantages, same shape as logprobs_BS",
        )
        if cfg.use_importance_sampling_correction:
            check_tensor(
                batch,
                "generation_logprobs",
                shape_BS,
                "(B, S), the inference engine's sampled log-probs; required because "
                "loss_fn.use_importance_sampling_correction is true",
            )
        use_reference = cfg.reference_kl_coef > 0 or "reference_policy_logprobs" in batch
        if use_reference:
            check_tensor(
                batch,
                "reference_policy_logprobs",
                shape_BS,
                "(B, S), the reference policy's log-probs; required because "
                "loss_fn.reference_kl_coef > 0",
            )

        # bf16 log-probs lose too much in exp/expm1 and in long sums; do the math in >= float32.
        dtype = torch.promote_types(logprobs_BS.dtype, torch.float32)
        device = logprobs_BS.device

        def get(key: str) -> torch.Tensor:
            if key == "prev_logprobs" and key not in batch:
                # The only optimizer step on this batch: the old policy is the current one.
                return logprobs_BS.detach().to(dtype)
            return batch[key].detach().to(device=device, dtype=dtype)

        valid_BS = _valid_mask_BS(batch).to(device)
        valid_f_BS = valid_BS.to(dtype)
        num_valid_per_seq_B = valid_f_BS.sum(dim=1)
        num_valid_tokens = int(valid_BS.sum())
        num_valid_sequences = int(valid_BS.any(dim=1).sum())
        token_norm = self._check_global_count(
            global_num_valid_tokens, num_valid_tokens, "global_num_valid_tokens"
        )
        seq_norm = self._check_global_count(
            global_num_valid_sequences, num_valid_sequences, "global_num_valid_sequences"
        )

        # Masked positions may hold padding garbage (inf, nan, huge values). Zeroing the log-ratios
        # and advantages there BEFORE exp keeps both the forward and the backward NaN-free
        # (a mask multiplied after exp would give 0 * inf = nan).
        logp_BS = logprobs_BS.to(dtype)
        log_ratio_BS = torch.where(valid_BS, logp_BS - get("prev_logprobs"), 0.0)
        advantages_BS = torch.where(valid_BS, get("advantages"), 0.0)

        ratio_BS = torch.exp(log_ratio_BS)
        clipped_ratio_BS = ratio_BS.clamp(1.0 - cfg.ratio_clip_low, 1.0 + cfg.ratio_clip_high)
        pg_BS = torch.maximum(-advantages_BS * ratio_BS, -advantages_BS * clipped_ratio_BS)
        if cfg.dual_clip_c is not None:
            # Only A < 0: for A > 0 the cap -c*A is negative and would replace the PPO term.
            dual_bound_BS = -cfg.dual_clip_c * advantages_BS
            dual_binds_BS = (advantages_BS < 0) & (pg_BS > dual_bound_BS)
            pg_BS = torch.where(dual_binds_BS, dual_bound_BS, pg_BS)
        if cfg.use_importance_sampling_correction:
            is_log_weight_BS = torch.where(
                valid_BS, get("prev_logprobs") - get("generation_logprobs"), 0.0
            )
            is_weight_raw_BS = torch.exp(is_log_weight_BS)
            # Detached (batch tensors are), so it rescales the gradient without being optimised.
            pg_BS = pg_BS * is_weight_raw_BS.clamp(max=cfg.importance_sampling_cap)
        per_token_BS = pg_BS
        if use_reference:
            ref_log_ratio_BS = torch.where(
                valid_BS, logp_BS - get("reference_policy_logprobs"), 0.0
            )
            kl_ref_BS = _kl_estimate(cfg.kl_estimator, ref_log_ratio_BS)
            if cfg.reference_kl_coef > 0:
                per_token_BS = per_token_BS + cfg.reference_kl_coef * kl_ref_BS

        def aggregate(values_BS: torch.Tensor) -> torch.Tensor:
            masked_BS = values_BS * valid_f_BS
            if cfg.aggregation == "token":
                return masked_BS.sum() / token_norm
            # clamp(min=1): a sequence with no valid tokens has a zero sum and contributes 0.
            per_seq_B = masked_BS.sum(dim=1) / num_valid_per_seq_B.clamp(min=1)
            return per_seq_B.sum() / seq_norm

        loss = aggregate(per_token_BS)

        with torch.no_grad():

            def token_mean(values_BS: torch.Tensor) -> torch.Tensor:
                return (values_BS * valid_f_BS).sum() / token_norm

            def token_max(values_BS: torch.Tensor) -> torch.Tensor:
                # Values are positive, so 0 is the neutral element for microbatches w/o tokens.
                return (
                    torch.where(valid_BS, values_BS, 0.0).max()
                    if values_BS.numel()
                    else values_BS.new_zeros(())
                )

            clipped_BS = (ratio_BS < 1.0 - cfg.ratio_clip_low) | (
                ratio_BS > 1.0 + cfg.ratio_clip_high
            )
            named = {
                "loss": loss.detach(),
                "pg_loss": aggregate(pg_BS),
                "reference_kl_loss": (
                    aggregate(cfg.reference_kl_coef * kl_ref_BS)
                    if use_reference
                    else loss.new_zeros(())
                ),
                "clip_fraction": token_mean(clipped_BS.to(dtype)),
                "approx_kl_old": token_mean(_kl_estimate("k3", log_ratio_BS)),
                "ratio_mean": token_mean(ratio_BS),
                "ratio_max": token_max(ratio_BS),
            }
            if cfg.dual_clip_c is not None:
                named["dual_clip_fraction"] = token_mean(dual_binds_BS.to(dtype))
            if use_reference:
                named["reference_kl"] = token_mean(kl_ref_BS)
            if cfg.use_importance_sampling_correction:
                named["is_weight_mean"] = token_mean(is_weight_raw_BS)
                named["is_weight_max"] = token_max(is_weight_raw_BS)
                named["is_truncated_fraction"] = token_mean(
                    (is_weight_raw_BS > cfg.importance_sampling_cap).to(dtype)
                )
            # One device->host transfer for all metrics instead of one per metric.
            values = torch.stack([v.detach().reshape(()) for v in named.values()]).tolist()
        metrics = dict(zip(named, values))
        metrics["num_valid_tokens"] = float(num_valid_tokens)
        metrics["num_valid_sequences"] = float(num_valid_sequences)
        return loss, metrics

    @staticmethod
    def _check_global_count(
        global_count: int | float | torch.Tensor, local_count: int, name: str
    ) -> float:
        """Returns the normaliser for `global_count`, after checking it against `local_count`."""
        try:
            value = float(global_count)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"{name} must be a number (or a 0-d tensor), got {global_count!r}"
            ) from None
        if not math.isfinite(value) or value < local_count:
            raise ValueError(
                f"{name} is {value:g} but this microbatch alone has {local_count} "
                f"valid; pass the count_valid() total over the whole global batch "
                f"(all microbatches and data-parallel ranks)"
            )
        # Only 0 when nothing is valid anywhere: then every sum is 0, and 0 / 1 keeps it 0.
        return max(value, 1.0)
