"""Tests of the JAX/Flax NNX policy backend.

- the jax port of ClippedPGLossFn against the torch implementation (values, metrics, gradients);
- the optax schedule against `learning_rate_at`;
- SmolLM2-135M: log-probs of the JAX worker against a plain transformers forward pass, and one
  training step against the DTensor/FSDP2 backend (1 rank on Ray) from the same weights on the
  same batch: the same loss (1e-5) and parameter updates with cosine similarity > 0.999; the
  train step time once compiled;
- tiny-llama: one training step against a plain torch reference (transformers model +
  ClippedPGLossFn + torch AdamW + clip_grad_norm_, single process, same hyper-parameters and
  microbatching), independent of the DTensor backend;
- on the tiny random models: Qwen2 parity, refit round trip, checkpoint save -> load -> resume
  (bit-identical next-step loss), data parallelism over 2 host devices against 1, microbatch
  accumulation, the wrapped (non-ported) loss path, bfloat16 compute with an offloaded reference,
  and config / batch errors.

The module asks XLA for 2 host CPU devices (before jax is imported) so that dp_size=2 runs here.
Shape legend: B = sequences, S = token positions.
"""

import os

# Must precede the first jax import of this process (one Bazel test = one process).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from dockyard_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from dockyard_rl.kernels import refit_packer  # noqa: E402
from dockyard_rl.losses import jax_loss_functions  # noqa: E402
from dockyard_rl.losses.loss_functions import (  # noqa: E402
    ClippedPGLossConfig,
    ClippedPGLossFn,
    count_valid,
)
from dockyard_rl.models import zoo  # noqa: E402
from dockyard_rl.models.policy import jax_policy  # noqa: E402
from dockyard_rl.models.policy.config import (  # noqa: E402
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    learning_rate_at,
)
from dockyard_rl.models.policy.jax_policy import JaxPolicy  # noqa: E402
from dockyard_rl.weight_sync import http_transport  # noqa: E402

LOSS_FN = ClippedPGLossFn(ClippedPGLossConfig(reference_kl_coef=0.01))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # Reuse a developer's cache when one is configured; a fresh one under Bazel.
    from_env = os.environ.get(zoo.CACHE_ENV_VAR)
    return pathlib.Path(from_env) if from_env else tmp_path_factory.mktemp("zoo")


def _policy(cache_dir, model="tiny-llama", **overrides) -> JaxPolicy:
    fields = {
        "backend": "jax",
        "model": model,
        "micro_batch_size": 2,
        "optimizer": OptimizerConfig(learning_rate=1e-3),
        **overrides,
    }
    return JaxPolicy(PolicyConfig(**fields), cache_dir=cache_dir)


def _make_batch(
    policy: JaxPolicy,
    input_ids_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    prompt_length: int,
    seed: int,
) -> BatchedDataDict:
    """A training batch: response tokens after `prompt_length`, prev log-probs near the
    policy's own (so ratios differ from 1 and some clip), per-sample advantages."""
    g = torch.Generator().manual_seed(seed)
    num_rows, seq_len = input_ids_BS.shape
    positions_S = torch.arange(seq_len)
    token_mask_BS = (
        (positions_S[None] >= prompt_length) & (positions_S[None] < lengths_B[:, None])
    ).float()
    batch = BatchedDataDict(
        input_ids=input_ids_BS,
        input_lengths=lengths_B,
        token_mask=token_mask_BS,
        sample_mask=torch.ones(num_rows),
    )
    logprobs_BS = policy.get_logprobs(batch)
    batch["prev_logprobs"] = logprobs_BS + 0.1 * torch.randn(num_rows, seq_len, generator=g)
    batch["reference_policy_logprobs"] = logprobs_BS + 0.05 * torch.randn(
        num_rows, seq_len, generator=g
    )
    batch["advantages"] = torch.randn(num_rows, 1, generator=g).expand(num_rows, seq_len).clone()
    return batch


def _tiny_batch(policy: JaxPolicy, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lengths_B = torch.tensor([28, 20, 13, 9])
    ids_BS = torch.randint(0, policy.model_config.vocab_size, (4, 28), generator=g)
    ids_BS[torch.arange(28)[None] >= lengths_B[:, None]] = 2  # pad id
    return _make_batch(policy, ids_BS, lengths_B, prompt_length=4, seed=seed)


def _hf_logprobs(model, batch) -> torch.Tensor:
    """The interface's alignment from a transformers model (gradients flow when enabled)."""
    ids_BS, lengths_B = batch["input_ids"], batch["input_lengths"]
    mask_BS = (torch.arange(ids_BS.shape[1])[None] < lengths_B[:, None]).long()
    logits_BSV = model(input_ids=ids_BS, attention_mask=mask_BS).logits.float()
    taken_BS = torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, ids_BS[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(taken_BS, (1, 0)) * mask_BS


def _refit(policy: JaxPolicy) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in policy.iter_refit_weights()}


# ---------------------------------------------------------------------------------------------
# The loss port and the schedule (no model).

_LOSS_CONFIGS = {
    "token": ClippedPGLossConfig(),
    "sequence_clip_higher": ClippedPGLossConfig(aggregation="sequence", ratio_clip_high=0.28),
    "dual_clip": ClippedPGLossConfig(dual_clip_c=3.0),
    "kl_k1": ClippedPGLossConfig(reference_kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": ClippedPGLossConfig(reference_kl_coef=0.05, kl_estimator="k2"),
    "kl_k3_tis_sequence": ClippedPGLossConfig(
        reference_kl_coef=0.02,
        kl_estimator="k3",
        use_importance_sampling_correction=True,
        importance_sampling_cap=1.5,
        aggregation="sequence",
        dual_clip_c=2.0,
    ),
    "kl_reported_only": ClippedPGLossConfig(use_importance_sampling_correction=True),
}


@pytest.mark.parametrize("name", sorted(_LOSS_CONFIGS))
def test_loss_port_matches_torch(name):
    config = _LOSS_CONFIGS[name]
    g = torch.Generator().manual_seed(sorted(_LOSS_CONFIGS).index(name))
    num_rows, seq_len = 6, 20
    logprobs_BS = -torch.rand(num_rows, seq_len, generator=g) * 3
    token_mask_BS = (torch.rand(num_rows, seq_len, generator=g) < 0.7).float()
    token_mask_BS[2] = 0  # a sequence without valid tokens
    sample_mask_B = torch.ones(num_rows)
    sample_mask_B[4] = 0
    batch = {
        "token_mask": token_mask_BS,
        "sample_mask": sample_mask_B,
        # Large deviations so that clipping, dual clip and IS truncation all happen.
        "prev_logprobs": logprobs_BS + 1.0 * torch.randn(num_rows, seq_len, generator=g),
        "generation_logprobs": logprobs_BS + 0.4 * torch.randn(num_rows, seq_len, generator=g),
        "reference_policy_logprobs": logprobs_BS
        + 0.3 * torch.randn(num_rows, seq_len, generator=g),
        "advantages": torch.randn(num_rows, seq_len, generator=g),
    }
    invalid_BS = (token_mask_BS == 0) | (sample_mask_B == 0)[:, None]
    batch["prev_logprobs"][invalid_BS] = float("inf")  # padding garbage must not leak
    batch["advantages"][invalid_BS] = 1e30
    if config.reference_kl_coef == 0 and name != "kl_reported_only":
        del batch["reference_policy_logprobs"]  # absent: no KL term nor metric
    num_tokens, num_sequences = count_valid(batch)
    # As if this were one microbatch of a larger global batch.
    global_tokens, global_sequences = num_tokens + 7, num_sequences + 2

    torch_lp = logprobs_BS.clone().requires_grad_(True)
    torch_loss, torch_metrics = ClippedPGLossFn(config)(
        torch_lp, batch, global_tokens, global_sequences
    )
    torch_loss.backward()

    jax_batch = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}

    def loss_of(lp):
        return jax_loss_functions.clipped_pg_loss(
            config, lp, jax_batch, float(global_tokens), float(global_sequences)
        )

    (jax_loss, jax_metrics), jax_grad = jax.value_and_grad(loss_of, has_aux=True)(
        jnp.asarray(logprobs_BS.numpy())
    )
    assert math.isfinite(float(jax_loss))
    np.testing.assert_allclose(float(jax_loss), float(torch_loss.detach()), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(jax_grad), torch_lp.grad.numpy(), rtol=1e-5, atol=1e-8)
    assert np.abs(np.asarray(jax_grad)).sum() > 0
    torch_metrics = ClippedPGLossFn(config)(logprobs_BS, batch, global_tokens, global_sequences)[1]
    assert set(jax_metrics) == set(torch_metrics)
    for key, value in torch_metrics.items():
        np.testing.assert_allclose(
            float(jax_metrics[key]), value, rtol=1e-5, atol=1e-7, err_msg=key
        )
    if config.dual_clip_c is not None:
        assert torch_metrics["dual_clip_fraction"] > 0
    assert torch_metrics["clip_fraction"] > 0


@pytest.mark.parametrize(
    "scheduler",
    [
        SchedulerConfig(warmup_steps=0, total_steps=10, min_lr_ratio=0.1),
        SchedulerConfig(warmup_steps=3, total_steps=12, min_lr_ratio=0.0),
        SchedulerConfig(warmup_steps=5, total_steps=6, min_lr_ratio=0.5),
    ],
)
def test_optax_schedule_equals_learning_rate_at(scheduler):
    optimizer = OptimizerConfig(learning_rate=3e-4)
    schedule = jax_policy.make_schedule(optimizer, scheduler)
    for step in range(scheduler.total_steps + 4):
        expected = learning_rate_at(step, optimizer, scheduler)
        np.testing.assert_allclose(
            float(schedule(step)), expected, rtol=2e-6, atol=1e-12, err_msg=f"step {step}"
        )


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M: parity with transformers and one training step against a torch reference.


@pytest.fixture(scope="module")
def smollm2_setup(cache_dir):
    """(policy, batch): built once; the parity test runs before the training test changes it."""
    from transformers import AutoTokenizer

    policy = JaxPolicy(
        PolicyConfig(
            backend="jax",
            model=zoo.SMOLLM2_NAME,
            micro_batch_size=2,
            max_grad_norm=1.0,
            optimizer=OptimizerConfig(
                learning_rate=1e-5, weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8
            ),
            scheduler=SchedulerConfig(warmup_steps=0, total_steps=100, min_lr_ratio=0.1),
        ),
        cache_dir=cache_dir,
    )
    tokenizer = AutoTokenizer.from_pretrained(policy.model_dir)
    texts = [
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
        "The test fails because the parser drops the trailing newline.",
        "Fix: handle empty input in split_lines()",
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n",
    ]
    rows = [tokenizer(t)["input_ids"][:40] for t in texts]
    seq_len = max(len(r) for r in rows)
    ids_BS = torch.full((len(rows), seq_len), tokenizer.pad_token_id or 0, dtype=torch.long)
    for i, row in enumerate(rows):
        ids_BS[i, : len(row)] = torch.tensor(row)
    lengths_B = torch.tensor([len(r) for r in rows])
    return policy, _make_batch(policy, ids_BS, lengths_B, prompt_length=3, seed=1)


def test_smollm2_logprobs_match_transformers(smollm2_setup):
    from transformers import AutoModelForCausalLM

    policy, batch = smollm2_setup
    assert policy.step == 0
    model = AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected_BS = _hf_logprobs(model, batch)
    ours_BS = policy.get_logprobs(batch)
    assert ours_BS.dtype == torch.float32 and ours_BS.shape == batch["input_ids"].shape
    delta = float((ours_BS - expected_BS).abs().max())
    print(
        f"\nSmolLM2-135M float32: max |logprob delta| JAX worker vs transformers = {delta:.2e} "
        f"(mean {float((ours_BS - expected_BS).abs().mean()):.1e})"
    )
    assert delta < 1e-4
    # The frozen reference is the same initial model.
    assert torch.equal(policy.get_reference_policy_logprobs(batch), ours_BS)


def _torch_reference_step(model_dir, cfg: PolicyConfig, batch, loss_fn):
    """One optimizer step the plain torch way, single process: microbatches of
    cfg.micro_batch_size with global normalisers, clip_grad_norm_, AdamW at learning_rate_at(0).
    Returns (loss, pre-clip grad norm, {HF name: update}, seconds)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=learning_rate_at(0, opt, cfg.scheduler),
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    start = time.perf_counter()
    num_tokens, num_sequences = count_valid(batch)
    total_loss = 0.0
    for microbatch in batch.make_microbatch_iterator(cfg.micro_batch_size):
        loss, _ = loss_fn(_hf_logprobs(model, microbatch), microbatch, num_tokens, num_sequences)
        loss.backward()
        total_loss += float(loss.detach())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    optimizer.step()
    seconds = time.perf_counter() - start
    updates = {name: p.detach() - before[name] for name, p in model.named_parameters()}
    return total_loss, grad_norm, updates, seconds


@pytest.fixture(scope="module")
def smollm2_first_step(smollm2_setup):
    """The JAX worker's first optimizer step on SmolLM2: metrics and per-tensor updates."""
    policy, batch = smollm2_setup
    before = _refit(policy)
    metrics = policy.train(batch, LOSS_FN)
    updates = {name: tensor - before[name] for name, tensor in policy.iter_refit_weights()}
    return metrics, updates


def _compare_steps(
    what: str,
    ours,
    theirs_loss: float,
    theirs_grad_norm: float,
    theirs_updates: dict[str, torch.Tensor],
) -> None:
    metrics, updates = ours
    assert set(theirs_updates) == set(updates)  # the refit names are HF's named_parameters()
    names = sorted(updates)
    ours_flat = torch.cat([updates[n].flatten() for n in names]).double()
    theirs_flat = torch.cat([theirs_updates[n].flatten() for n in names]).double()
    cosine = float(torch.nn.functional.cosine_similarity(ours_flat, theirs_flat, dim=0))
    print(
        f"\n{what}: loss {metrics['loss']:.7f} vs {theirs_loss:.7f} "
        f"(|delta| {abs(metrics['loss'] - theirs_loss):.1e}), grad_norm "
        f"{metrics['grad_norm']:.5f} vs {theirs_grad_norm:.5f}, update cosine {cosine:.6f}, "
        f"update norm ratio {float(ours_flat.norm() / theirs_flat.norm()):.5f}"
    )
    assert abs(metrics["loss"] - theirs_loss) < 1e-5
    assert metrics["grad_norm"] == pytest.approx(theirs_grad_norm, rel=1e-3)
    assert cosine > 0.999


def test_smollm2_train_step_matches_dtensor_backend(smollm2_setup, smollm2_first_step, cache_dir):
    """The issue's cross-backend check: the DTensor/FSDP2 backend (1 rank on Ray, gloo) from the
    same weights on the same batch with the same config."""
    import ray

    from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy

    policy, batch = smollm2_setup
    dtensor = DTensorPolicy(dataclasses.replace(policy.cfg, backend="dtensor"), cache_dir=cache_dir)
    try:
        before = {name: tensor.clone() for name, tensor in dtensor.iter_refit_weights()}
        metrics = dtensor.train(batch, LOSS_FN)
        updates = {name: tensor - before[name] for name, tensor in dtensor.iter_refit_weights()}
    finally:
        dtensor.shutdown()
        ray.shutdown()
    _compare_steps(
        "SmolLM2 one step, JAX vs DTensor backend",
        smollm2_first_step,
        metrics["loss"],
        metrics["grad_norm"],
        updates,
    )
    ours = smollm2_first_step[0]
    assert metrics["learning_rate"] == pytest.approx(ours["learning_rate"], rel=1e-6)
    assert ours["learning_rate"] == pytest.approx(1e-5, rel=1e-6)
    assert ours["clip_fraction"] > 0 and ours["num_valid_tokens"] == count_valid(batch)[0]


def test_smollm2_step_time(smollm2_setup, smollm2_first_step):
    policy, batch = smollm2_setup
    first = smollm2_first_step[0]
    second = policy.train(batch, LOSS_FN)  # same shapes: the compiled step is reused
    assert policy.step == 2 and math.isfinite(second["loss"])
    print(
        f"\nSmolLM2 train step (B={batch.batch_size}, {int(second['num_tokens'])} tokens, "
        f"micro_batch_size=2, float32, {jax.devices()[0].platform}): "
        f"{second['step_seconds']:.2f} s, {second['tokens_per_second']:.1f} tokens/s (first "
        f"step incl. jit compile {first['step_seconds']:.1f} s)"
    )


# ---------------------------------------------------------------------------------------------
# Tiny models.


def test_tiny_qwen2_logprobs_match_transformers_with_padded_microbatches(cache_dir):
    from transformers import AutoModelForCausalLM

    policy = _policy(cache_dir, model="tiny-qwen2", micro_batch_size=2)
    g = torch.Generator().manual_seed(5)
    lengths_B = torch.tensor([19, 7, 12, 3, 19])  # 5 rows: the last microbatch gets a padding row
    ids_BS = torch.randint(0, 512, (5, 19), generator=g)
    batch = BatchedDataDict(input_ids=ids_BS, input_lengths=lengths_B)
    model = AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected_BS = _hf_logprobs(model, batch)
    ours_BS = policy.get_logprobs(batch)
    delta = float((ours_BS - expected_BS).abs().max())
    print(f"\ntiny-qwen2 (q/k/v biases): max |logprob delta| vs transformers = {delta:.2e}")
    assert ours_BS.shape == (5, 19) and delta < 1e-4
    assert (ours_BS[:, 0] == 0).all() and (ours_BS[1, 7:] == 0).all()


def test_tiny_train_step_matches_torch_reference(cache_dir):
    """Independent of the DTensor backend: transformers + ClippedPGLossFn + torch AdamW."""
    policy = _policy(cache_dir)
    batch = _tiny_batch(policy)
    before = _refit(policy)
    metrics = policy.train(batch, LOSS_FN)
    updates = {name: tensor - before[name] for name, tensor in policy.iter_refit_weights()}
    loss, grad_norm, torch_updates, _ = _torch_reference_step(
        policy.model_dir, policy.cfg, batch, LOSS_FN
    )
    _compare_steps(
        "tiny-llama one step, JAX vs plain torch reference",
        (metrics, updates),
        loss,
        grad_norm,
        torch_updates,
    )
    assert grad_norm > policy.cfg.max_grad_norm  # clipping was active on both sides


def test_refit_round_trips_to_the_hf_checkpoint(cache_dir):
    # (llama_nnx_test checks the Qwen2 biases' names; tiny-llama shares compiled steps here.)
    policy = _policy(cache_dir)
    tensors = load_file(str(policy.model_dir / "model.safetensors"))
    info = policy.prepare_refit_info()
    assert set(info) == set(tensors)
    weights = list(policy.iter_refit_weights())
    assert [name for name, _ in weights] == list(info)  # the documented order
    for name, tensor in weights:
        assert (
            (tuple(tensor.shape), tensor.dtype)
            == info[name]
            == (tensors[name].shape, torch.float32)
        )
        assert torch.equal(tensor, torch.from_numpy(tensors[name])), name
    policy.train(_tiny_batch(policy), LOSS_FN)
    changed = [
        name
        for name, tensor in policy.iter_refit_weights()
        if not torch.equal(tensor, torch.from_numpy(tensors[name]))
    ]
    assert len(changed) == len(info)  # lr 1e-3 with AdamW moves every tensor


def test_weight_sender_pushes_the_refit_weights_in_manifest_buckets(cache_dir):
    # The in-process sender (weight_sync's WeightSource methods) against a real HTTP receiver on
    # 127.0.0.1: every bucket arrives as the refit packer packs `iter_refit_weights`.
    policy = _policy(cache_dir)
    manifest = refit_packer.plan_buckets(policy.prepare_refit_info(), 64 << 10)
    assert manifest.num_buckets > 2  # the sender's two pack buffers really rotate
    expected = [
        bytes(b.numpy()) for b in refit_packer.pack(dict(policy.iter_refit_weights()), manifest)
    ]
    delivered: dict[int, bytes] = {}

    async def deliver(index: int, data: bytes) -> None:
        delivered[index] = data

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    receiver = http_transport.HttpBucketReceiver(deliver)
    asyncio.run_coroutine_threadsafe(
        receiver.start("127.0.0.1", manifest.max_bucket_size), loop
    ).result(60)
    session = "jax-policy-test"
    try:
        loop.call_soon_threadsafe(receiver.expect, manifest, 1)
        endpoint = policy.open_weight_sender(
            session,
            "http",
            manifest.to_dict(),
            {"engines": [{"url": receiver.url, "token": receiver.token}], "timeout_s": 10.0},
        )
        assert endpoint == policy.open_weight_sender(session, "http", manifest.to_dict(), {})
        waiting = asyncio.run_coroutine_threadsafe(receiver.wait_complete(30.0), loop)
        stats = policy.send_weights(session, manifest.to_dict(), 1)
        waiting.result(60)
    finally:
        policy.close_weight_sender(session)
        policy.close_weight_sender(session)  # idempotent
        asyncio.run_coroutine_threadsafe(receiver.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    assert [delivered[b] for b in range(manifest.num_buckets)] == expected
    assert stats["num_bytes"] == manifest.total_bytes
    with pytest.raises(KeyError, match="not open in this process"):
        policy.send_weights(session, manifest.to_dict(), 2)


def test_schedule_and_microbatch_accumulation(cache_dir):
    scheduler = SchedulerConfig(warmup_steps=2, total_steps=5, min_lr_ratio=0.1)
    policy = _policy(cache_dir, scheduler=scheduler, micro_batch_size=2)
    batch = _tiny_batch(policy)
    initial = _refit(policy)
    rates = []
    for step in range(4):
        metrics = policy.train(batch, LOSS_FN)
        rates.append(metrics["learning_rate"])
        if step == 0:  # warmup starts at 0: the first step must not move anything
            assert all(torch.equal(t, initial[n]) for n, t in policy.iter_refit_weights())
            first = metrics
    expected = [learning_rate_at(s, policy.cfg.optimizer, scheduler) for s in range(4)]
    np.testing.assert_allclose(rates, expected, rtol=2e-6)
    assert policy.step == 4
    # One microbatch of 4 gives the same first step as two of 2 (accumulation with global norms).
    whole = _policy(cache_dir, scheduler=scheduler, micro_batch_size=4).train(batch, LOSS_FN)
    for key in ("loss", "grad_norm", "pg_loss", "clip_fraction", "ratio_max", "reference_kl"):
        assert whole[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key
    assert first["num_tokens"] == float(batch["input_lengths"].sum())
    assert first["tokens_per_second"] > 0


def test_data_parallel_over_two_devices_matches_one(cache_dir):
    if len(jax.devices()) < 2:
        pytest.skip(f"needs 2 jax devices (XLA_FLAGS was set too late?), have {jax.devices()}")
    one = _policy(cache_dir, dp_size=1, micro_batch_size=2)
    two = _policy(cache_dir, dp_size=2, micro_batch_size=1)  # same 2 rows per microbatch
    assert two.mesh.shape == {"data": 2}
    batch = _tiny_batch(one)
    np.testing.assert_allclose(two.get_logprobs(batch), one.get_logprobs(batch), atol=1e-6)
    m1, m2 = one.train(batch, LOSS_FN), two.train(batch, LOSS_FN)
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5), key
    # The 2-device all-reduce sums in another order.
    _assert_first_updates_close(_refit(two), _refit(one))


def test_wrapped_torch_loss_matches_the_port(cache_dir):
    def generic_loss(logprobs_BS, batch, num_tokens, num_sequences):
        # Not a ClippedPGLossFn instance: takes the wrapped path (torch autograd + jax VJP).
        return LOSS_FN(logprobs_BS, batch, num_tokens, num_sequences)

    ported, wrapped = _policy(cache_dir), _policy(cache_dir)
    batch = _tiny_batch(ported)
    m_ported, m_wrapped = ported.train(batch, LOSS_FN), wrapped.train(batch, generic_loss)
    assert set(m_ported) == set(m_wrapped)
    for key in ("loss", "grad_norm", "clip_fraction", "reference_kl"):
        assert m_wrapped[key] == pytest.approx(m_ported[key], rel=1e-5, abs=1e-7), key
    # Float32 rounding differs between the two gradient paths.
    _assert_first_updates_close(_refit(wrapped), _refit(ported))


def _assert_first_updates_close(actual, expected, learning_rate=1e-3):
    """Weights after one AdamW step from the same start. The step is lr * g / (|g| + eps), about
    lr * sign(g): float32 rounding that differs between two gradient paths moves it by far less
    than 1% of lr, except for the odd element whose gradient is within rounding of 0, which can
    move by up to lr. So: every element within lr, all but 0.1% within 1% of lr."""
    for name in expected:
        difference = (actual[name] - expected[name]).abs()
        assert float(difference.max()) <= learning_rate, name
        num_off = int((difference > 0.01 * learning_rate).sum())
        assert num_off <= 0.001 * difference.numel(), (name, num_off)


def test_save_load_resume_is_bit_identical(cache_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = _policy(cache_dir)
    batch_a, batch_b = _tiny_batch(policy, seed=1), _tiny_batch(policy, seed=2)
    policy.train(batch_a, LOSS_FN)
    checkpoint = tmp_path / "ckpt"
    policy.save_checkpoint(checkpoint)
    policy.save_checkpoint(checkpoint)  # overwriting an existing checkpoint works
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers
    expected_logprobs = policy.get_logprobs(batch_b)
    expected = policy.train(batch_b, LOSS_FN)
    expected_weights = _refit(policy)

    resumed = JaxPolicy(policy.cfg, cache_dir=cache_dir, resume_from=checkpoint)
    assert resumed.step == 1
    assert torch.equal(resumed.get_logprobs(batch_b), expected_logprobs)
    again = resumed.train(batch_b, LOSS_FN)
    assert again["loss"] == expected["loss"] and again["grad_norm"] == expected["grad_norm"]
    assert again["learning_rate"] == expected["learning_rate"]
    for name, tensor in resumed.iter_refit_weights():
        assert torch.equal(tensor, expected_weights[name]), name

    # load_checkpoint into a used policy restores the same state too.
    policy.load_checkpoint(checkpoint)
    assert policy.step == 1 and policy.train(batch_b, LOSS_FN)["loss"] == expected["loss"]

    # The checkpoint is an ordinary HF checkpoint: transformers loads it with our log-probs.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (checkpoint / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        hf_BS = _hf_logprobs(model, batch_b)
    assert float((hf_BS - expected_logprobs).abs().max()) < 1e-4


def test_bfloat16_compute_with_offloaded_reference(cache_dir):
    policy = _policy(cache_dir, dtype="bfloat16", offload_reference_policy=True)
    batch = _tiny_batch(policy)
    reference_before = policy.get_reference_policy_logprobs(batch)
    metrics = policy.train(batch, LOSS_FN)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert {dtype for _, dtype in policy.prepare_refit_info().values()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for _, t in policy.iter_refit_weights())
    # Master weights stay float32; the reference is frozen; the policy moved.
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(policy._params))
    assert torch.equal(policy.get_reference_policy_logprobs(batch), reference_before)
    assert not torch.equal(policy.get_logprobs(batch), reference_before)


def test_bad_config_fails_at_setup(cache_dir, tmp_path):
    with pytest.raises(ValueError, match="policy.backend"):
        JaxPolicy(PolicyConfig(backend="dtensor", model="tiny-llama"), cache_dir=cache_dir)
    num_devices = len(jax.devices())
    with pytest.raises(ValueError, match=rf"policy.dp_size={num_devices + 1} must divide"):
        _policy(cache_dir, dp_size=num_devices + 1)
    with pytest.raises(ValueError, match="policy.model"):
        _policy(cache_dir, model=str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="resume_from.*does not exist"):
        JaxPolicy(
            PolicyConfig(backend="jax", model="tiny-llama"),
            cache_dir=cache_dir,
            resume_from=tmp_path / "missing",
        )
    policy = _policy(cache_dir)
    with pytest.raises(ValueError, match="does not exist"):
        policy.load_checkpoint(tmp_path / "missing")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    with pytest.raises(ValueError, match="incomplete"):
        policy.load_checkpoint(incomplete)
    other = _policy(cache_dir, model="tiny-qwen2")
    other.save_checkpoint(tmp_path / "qwen")
    with pytest.raises(ValueError, match="another model"):
        policy.load_checkpoint(tmp_path / "qwen")
    state = json.loads((tmp_path / "qwen" / jax_policy.TRAIN_STATE_JSON).read_text())
    assert state["step"] == 0
    other.shutdown()
    other.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        other.get_logprobs(
            BatchedDataDict(
                input_ids=torch.zeros(1, 4, dtype=torch.long), input_lengths=torch.tensor([4])
            )
        )


def test_malformed_batch_changes_nothing(cache_dir):
    policy = _policy(cache_dir)
    good = _tiny_batch(policy)
    before = _refit(policy)
    cases = {
        "missing key 'advantages'": lambda b: b.pop("advantages"),
        r"input_lengths.*\[1, 28\]": lambda b: b.__setitem__(
            "input_lengths", torch.tensor([29, 20, 13, 9])
        ),
        "outside": lambda b: b["input_ids"].__setitem__((0, 0), 512),
        "only 0 and 1": lambda b: b["token_mask"].__setitem__((0, 5), 0.5),
        r"prev_logprobs.*shape": lambda b: b.__setitem__(
            "prev_logprobs", b["prev_logprobs"][:, :5]
        ),
    }
    for pattern, corrupt in cases.items():
        batch = BatchedDataDict({key: value.clone() for key, value in good.items()})
        corrupt(batch)
        with pytest.raises(ValueError, match=pattern):
            policy.train(batch, LOSS_FN)
    assert policy.step == 0
    assert all(torch.equal(t, before[n]) for n, t in policy.iter_refit_weights())
    with pytest.raises(ValueError, match="input_ids"):
        policy.get_logprobs(BatchedDataDict(input_lengths=torch.tensor([3])))
    too_long = policy.model_config.max_position_embeddings + 1
    with pytest.raises(ValueError, match="max_position_embeddings"):
        policy.get_logprobs(
            BatchedDataDict(
                input_ids=torch.zeros(1, too_long, dtype=torch.long),
                input_lengths=torch.tensor([too_long]),
            )
        )
