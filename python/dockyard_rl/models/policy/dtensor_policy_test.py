"""Tests for the DTensor/FSDP2 policy: real Ray on 127.0.0.1, real gloo process groups, no mocks.

One 2-rank worker group on tiny-llama serves most tests (module-scoped; the first training step
is a fixture too, so the tests that need fresh weights see them whatever the test order). The
SmolLM2 parity test has its own 2-rank group. References are plain single-process transformers /
torch computations in the test process. Shape suffixes: B = samples, S = token positions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, count_valid
from dockyard_rl.models import zoo
from dockyard_rl.models.policy.config import (
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    learning_rate_at,
)
from dockyard_rl.models.policy.dtensor_policy import CHECKPOINT_MANIFEST, DTensorPolicy
from dockyard_rl.models.policy.dtensor_worker import shifted_logprobs

# eps comparable to the gradients keeps AdamW's first step a smooth function of the gradient
# (with eps = 1e-8 it is nearly sign(g), which amplifies float noise in tiny gradient entries),
# so comparing parameters after one step compares the gradients. max_grad_norm is below the
# gradient norm, so clipping is active in that comparison.
TINY_CFG = PolicyConfig(
    backend="dtensor",
    model="tiny-llama",
    dtype="float32",
    dp_size=2,
    micro_batch_size=1,
    max_grad_norm=1.0,
    seed=0,
    optimizer=OptimizerConfig(learning_rate=5e-3, eps=1e-3, weight_decay=0.01),
    scheduler=SchedulerConfig(warmup_steps=0, total_steps=8, min_lr_ratio=0.1),
)
LOSS_FN = ClippedPGLossFn(ClippedPGLossConfig(reference_kl_coef=0.01))


@pytest.fixture(scope="module")
def ray_cluster():
    # 4 logical CPUs: the tiny and the SmolLM2 groups (2 ranks each) may be alive together.
    init_local_ray(num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


def _make_batch(
    vocab_size: int, num_samples: int = 4, width: int = 16, seed: int = 0
) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, vocab_size, (num_samples, width), generator=gen)
    lengths_B = torch.tensor([width, 10, 7, 13, 9, 16, 5, 11][:num_samples])
    positions_S = torch.arange(width)
    real_BS = positions_S[None, :] < lengths_B[:, None]
    ids_BS = torch.where(real_BS, ids_BS, 0)  # right padding
    # The first 3 tokens are the "prompt"; the rest is the response that counts in the loss.
    token_mask_BS = (real_BS & (positions_S[None, :] >= 3)).float()
    return BatchedDataDict(
        input_ids=ids_BS,
        input_lengths=lengths_B,
        token_mask=token_mask_BS,
        sample_mask=torch.ones(num_samples),
    )


def _plain_logprobs(
    model, ids_BS: torch.Tensor, lengths_B: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Single-process reference: log_softmax + gather, aligned as the interface says."""
    logits_BSV = model(input_ids=ids_BS).logits.float() / temperature
    next_BS = (
        torch.log_softmax(logits_BSV[:, :-1], dim=-1).gather(-1, ids_BS[:, 1:, None]).squeeze(-1)
    )
    out_BS = torch.nn.functional.pad(next_BS, (1, 0))
    positions_S = torch.arange(ids_BS.shape[1])
    valid_BS = (positions_S[None, :] >= 1) & (positions_S[None, :] < lengths_B[:, None])
    return torch.where(valid_BS, out_BS, 0.0)


@pytest.fixture(scope="module")
def tiny_dir():
    return zoo.resolve_model("tiny-llama")


@pytest.fixture(scope="module")
def tiny_policy(ray_cluster, tiny_dir):
    policy = DTensorPolicy(TINY_CFG)
    yield policy
    policy.shutdown()


@pytest.fixture(scope="module")
def train_batch(tiny_policy):
    batch = _make_batch(vocab_size=512)
    logprobs_BS = tiny_policy.get_logprobs(batch)
    gen = torch.Generator().manual_seed(1)
    # Old-policy log-probs a little off the current ones, so ratios differ from 1 (and some
    # clip); advantages of both signs, one per sequence.
    batch["prev_logprobs"] = (
        logprobs_BS + 0.1 * torch.randn(logprobs_BS.shape, generator=gen) * batch["token_mask"]
    )
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.8, -1.2])[:, None].expand(4, 16).clone()
    batch["reference_policy_logprobs"] = tiny_policy.get_reference_policy_logprobs(batch)
    batch["initial_logprobs"] = logprobs_BS
    return batch


@pytest.fixture(scope="module")
def first_step(tiny_policy, train_batch):
    """The very first optimizer step of the tiny group, with the weights before and after."""
    before = dict(tiny_policy.iter_refit_weights())
    metrics = tiny_policy.train(train_batch, LOSS_FN)
    after = dict(tiny_policy.iter_refit_weights())
    return {"before": before, "metrics": metrics, "after": after}


def test_logprobs_at_the_sampling_temperature(tiny_dir):
    # The worker's own function, in this process: log-probs of softmax(logits / T).
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    batch = _make_batch(vocab_size=512)
    ids_BS, lengths_B = batch["input_ids"], batch["input_lengths"]
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            torch.testing.assert_close(
                shifted_logprobs(model, ids_BS, lengths_B, temperature),
                _plain_logprobs(model, ids_BS, lengths_B, temperature),
                rtol=0,
                atol=1e-5,
            )
        assert not torch.allclose(
            shifted_logprobs(model, ids_BS, lengths_B, 0.7),
            shifted_logprobs(model, ids_BS, lengths_B),
        )


# ---------------------------------------------------------------------------------------------
# 2 ranks vs one process


def _check_first_step_against_single_process(tiny_dir, batch, step, what):
    """`step` (weights before / metrics / weights after one policy step on `batch`) against the
    same step of plain transformers + torch in this process."""
    cfg = TINY_CFG
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.load_state_dict(step["before"], strict=False)  # tied lm_head follows the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logprobs_BS = _plain_logprobs(model, batch["input_ids"], batch["input_lengths"])
    torch.testing.assert_close(logprobs_BS.detach(), batch["initial_logprobs"], rtol=0, atol=1e-5)
    loss, _ = LOSS_FN(logprobs_BS, batch, *count_valid(batch))
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=learning_rate_at(0, cfg.optimizer, cfg.scheduler),
        betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
    )
    optimizer.step()

    metrics = step["metrics"]
    print(
        f"\n{what} vs 1-process: loss {metrics['loss']:.8f} vs {float(loss.detach()):.8f}, "
        f"grad norm {metrics['grad_norm']:.8f} vs {grad_norm:.8f}"
    )
    assert grad_norm > cfg.max_grad_norm  # clipping was active
    assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    expected = {name: param.detach() for name, param in model.named_parameters()}
    max_diff = max(float((step["after"][name] - expected[name]).abs().max()) for name in expected)
    # Also shows that the weights yielded before the step were copies, not the live parameters.
    max_update = max(
        float((step["after"][name] - step["before"][name]).abs().max()) for name in expected
    )
    print(f"max |param diff| after one step: {max_diff:.2e} (max update {max_update:.2e})")
    assert max_update > 1e-3  # the step really moved the weights
    assert max_diff < 1e-5


def test_two_rank_step_matches_single_process_step(tiny_dir, train_batch, first_step):
    _check_first_step_against_single_process(tiny_dir, train_batch, first_step, "2 ranks")


def test_metrics_schedule_and_loss_decrease(tiny_policy, train_batch, first_step):
    metrics = first_step["metrics"]
    num_valid_tokens, num_valid_sequences = count_valid(train_batch)
    for key in (
        "loss",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "tokens_per_second",
        "pg_loss",
        "reference_kl",
        "clip_fraction",
        "ratio_max",
    ):
        assert key in metrics and math.isfinite(metrics[key]), key
    # Loss metrics are combined over microbatches and ranks into the global batch's values.
    assert metrics["num_valid_tokens"] == num_valid_tokens
    assert metrics["num_valid_sequences"] == num_valid_sequences
    assert metrics["num_tokens"] == float(train_batch["input_lengths"].sum())
    assert metrics["tokens_per_second"] > 0
    cfg = TINY_CFG
    assert metrics["learning_rate"] == learning_rate_at(0, cfg.optimizer, cfg.scheduler)
    losses = [metrics["loss"]]
    for step in (1, 2, 3):
        step_metrics = tiny_policy.train(train_batch, LOSS_FN)
        assert step_metrics["learning_rate"] == learning_rate_at(step, cfg.optimizer, cfg.scheduler)
        losses.append(step_metrics["loss"])
    print(f"\nlosses on a fixed batch: {losses}")
    assert losses[-1] < losses[0] - 0.05


def test_reference_policy_stays_at_the_initial_weights(tiny_policy, train_batch, first_step):
    batch = train_batch.select_keys(["input_ids", "input_lengths"])
    reference_BS = tiny_policy.get_reference_policy_logprobs(batch)
    torch.testing.assert_close(reference_BS, train_batch["initial_logprobs"], rtol=0, atol=0)
    assert not torch.allclose(tiny_policy.get_logprobs(batch), reference_BS, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Refit seam


def test_refit_weights_are_what_a_hf_checkpoint_holds(tiny_policy, tiny_dir, first_step):
    checkpoint = load_file(tiny_dir / "model.safetensors")
    info = tiny_policy.prepare_refit_info()
    # Tied embeddings: no lm_head.weight, exactly like the HF checkpoint (and what vLLM loads).
    assert sorted(info) == sorted(checkpoint)
    assert "lm_head.weight" not in info
    assert list(first_step["before"]) == list(info)  # yielded in prepare_refit_info order
    for name, tensor in first_step["before"].items():
        assert info[name] == (tuple(checkpoint[name].shape), torch.float32)
        torch.testing.assert_close(tensor, checkpoint[name], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_save_load_resume_is_bit_identical(tiny_policy, train_batch, first_step, tmp_path):
    directory = tmp_path / "ckpt"
    tiny_policy.save_checkpoint(directory)
    tiny_policy.save_checkpoint(directory)  # overwriting an existing checkpoint is atomic too
    bare = tmp_path / "bare"
    tiny_policy.save_checkpoint(bare, export_hf=False)  # the sharded resume state alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "ckpt"]  # no leftovers
    assert list(directory.glob("*.safetensors")) and not list(bare.glob("*.safetensors*"))
    manifest = json.loads((directory / CHECKPOINT_MANIFEST).read_text())
    assert manifest["dp_size"] == 2 and manifest["step"] >= 1

    continued = [tiny_policy.train(train_batch, LOSS_FN) for _ in range(2)]
    for resume_from in (directory, bare):
        tiny_policy.load_checkpoint(resume_from)
        resumed = [tiny_policy.train(train_batch, LOSS_FN) for _ in range(2)]
        # Step 1 checks the weights, step 2 also the optimizer moments and the schedule.
        for a, b in zip(continued, resumed, strict=True):
            assert a["loss"] == b["loss"], resume_from.name
            assert a["grad_norm"] == b["grad_norm"], resume_from.name
            assert a["learning_rate"] == b["learning_rate"], resume_from.name

    # The checkpoint is an ordinary HF checkpoint: transformers loads it, with its tokenizer.
    tiny_policy.load_checkpoint(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.chat_template
    batch = train_batch.select_keys(["input_ids", "input_lengths"])
    with torch.no_grad():
        expected_BS = _plain_logprobs(model, batch["input_ids"], batch["input_lengths"])
    torch.testing.assert_close(tiny_policy.get_logprobs(batch), expected_BS, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# One rank (a plain module, no FSDP) and checkpoints across dp sizes


def _train_steps(policy, batch, num_steps):
    return [
        (m["loss"], m["grad_norm"], m["learning_rate"])
        for m in (policy.train(batch, LOSS_FN) for _ in range(num_steps))
    ]


def test_one_rank_step_resume_and_checkpoints_across_dp_sizes(tiny_dir, train_batch, tmp_path):
    one_rank_cfg = dataclasses.replace(TINY_CFG, dp_size=1)
    policy = DTensorPolicy(one_rank_cfg)
    try:
        before = dict(policy.iter_refit_weights())
        metrics = policy.train(train_batch, LOSS_FN)
        step = {"before": before, "metrics": metrics, "after": dict(policy.iter_refit_weights())}
        _check_first_step_against_single_process(tiny_dir, train_batch, step, "1 rank")
        # Bit-exact resume on one rank: the weights, the optimizer moments and the schedule.
        policy.save_checkpoint(tmp_path / "one_rank")
        continued = _train_steps(policy, train_batch, 2)
        policy.load_checkpoint(tmp_path / "one_rank")
        assert _train_steps(policy, train_batch, 2) == continued
    finally:
        policy.shutdown()  # the cluster has room for one more group of 2 ranks only
    # One rank's checkpoint resumes on 2 ranks and the other way round (DCP reshards), equal
    # steps up to the order of float sums.
    two_ranks = DTensorPolicy(TINY_CFG, resume_from=tmp_path / "one_rank")
    try:
        resumed = _train_steps(two_ranks, train_batch, 2)
        two_ranks.save_checkpoint(tmp_path / "two_ranks")
        saved_on_two = dict(two_ranks.iter_refit_weights())
        continued_on_two = _train_steps(two_ranks, train_batch, 1)
    finally:
        two_ranks.shutdown()
    # The sharded (DCP) checkpoint of 2 ranks resharded onto 1: exactly the same weights.
    policy = DTensorPolicy(one_rank_cfg, resume_from=tmp_path / "two_ranks")
    try:
        for name, tensor in policy.iter_refit_weights():
            torch.testing.assert_close(tensor, saved_on_two[name], rtol=0, atol=0)
        resumed_on_one = _train_steps(policy, train_batch, 1)
    finally:
        policy.shutdown()
    for got, expected in zip(resumed + resumed_on_one, continued + continued_on_two):
        assert got == pytest.approx(expected, rel=1e-5)
    assert continued_on_two[0][2] == learning_rate_at(3, TINY_CFG.optimizer, TINY_CFG.scheduler)


def test_mini_batches_over_the_data_plane_match_the_driver_path(tiny_policy, first_step, tmp_path):
    """The same batch and plan (2 epochs of mini-batches of 3, 3, 2 samples: rows fall unevenly
    on the 2 ranks), trained once from the driver (BatchedDataDict) and once from shards sent over
    the data plane (RemoteBatch): the same losses, metrics and weights."""
    from dockyard_rl.algorithms.mini_batches import mini_batch_plan, train_mini_batches
    from dockyard_rl.data_plane.experience import PAD_ROW, REFERENCE_LOGPROBS
    from dockyard_rl.data_plane.factory import create_data_plane
    from dockyard_rl.data_plane.ray_direct import data_plane_actor_options
    from dockyard_rl.data_plane.testing_actors import StepProducer

    batch = _make_batch(vocab_size=512, num_samples=8, seed=3)
    batch["sample_mask"][5] = 0.0  # a masked sample counts nowhere on either path
    batch["advantages"] = torch.linspace(-1.0, 1.2, 8)[:, None].expand(8, 16).clone()
    batch["weight_version"] = torch.zeros(8, dtype=torch.int64)
    plan = mini_batch_plan(8, 3, 2, seed=5)
    # After the fixtures' first step (they assume it is the group's very first); restored below.
    tiny_policy.save_checkpoint(tmp_path / "start", export_hf=False)
    start = dict(tiny_policy.iter_refit_weights())

    driver_batch = batch.copy()
    driver_batch[REFERENCE_LOGPROBS] = tiny_policy.get_reference_policy_logprobs(batch)
    driver = train_mini_batches(tiny_policy, driver_batch, LOSS_FN, plan, TINY_CFG.dp_size)
    driver_weights = dict(tiny_policy.iter_refit_weights())

    tiny_policy.load_checkpoint(tmp_path / "start")
    plane = create_data_plane({"transport": "ray_direct", "max_in_flight_batches": 1})
    producer = ray.remote(**data_plane_actor_options())(StepProducer).options(num_cpus=0).remote()
    try:
        endpoints = plane.connect([producer], tiny_policy.data_plane_receivers())
        ray.get(producer.open.remote(endpoints.senders[0]))
        tiny_policy.open_data_plane(endpoints.receivers, 60.0)
        remote = ray.get(producer.send_step.remote(batch, 1))
        assert any(
            PAD_ROW in rows for m in plan for rows in remote.select(m, last=False).rank_rows()
        )
        assert tiny_policy.get_reference_policy_logprobs(remote) is None  # kept rank-side
        remote = remote.with_rank_side_key(REFERENCE_LOGPROBS)
        over_plane = train_mini_batches(tiny_policy, remote, LOSS_FN, plan, TINY_CFG.dp_size)
        remote_weights = dict(tiny_policy.iter_refit_weights())
        assert [stats["num_cached"] for stats in tiny_policy.data_plane_stats()] == [0, 0]
    finally:
        tiny_policy.load_checkpoint(tmp_path / "start")  # the module's policy as it was
        plane.close()
        ray.kill(producer)

    assert driver["optimizer_steps"] == over_plane["optimizer_steps"] == 6.0
    assert driver["logprobs_pass_skipped"] == over_plane["logprobs_pass_skipped"] == 0.0
    assert 0.0 < over_plane["clip_fraction"]  # the later mini-batches are off-policy
    # The driver path also counts its padding rows' tokens; the ranks count the rows trained.
    assert over_plane["num_tokens"] == 2 * int(batch["input_lengths"].sum())
    for key in driver.keys() - {"num_tokens", "tokens_per_second"}:
        assert over_plane[key] == pytest.approx(driver[key], rel=1e-4, abs=1e-6), key
    for name, tensor in driver_weights.items():
        torch.testing.assert_close(remote_weights[name], tensor, rtol=1e-4, atol=1e-6)
    assert driver_weights.keys() == remote_weights.keys()
    assert any(not torch.equal(driver_weights[name], t) for name, t in start.items())


# ---------------------------------------------------------------------------------------------
# Bad input and bad config


def test_bad_batches_fail_before_any_weight_change(tiny_policy, train_batch, first_step):
    batch = train_batch.select_keys(["input_ids", "input_lengths"])
    before_BS = tiny_policy.get_logprobs(batch)
    with pytest.raises(ValueError, match=r"batch size 3 .*policy\.dp_size=2"):
        tiny_policy.get_logprobs(batch.slice(0, 3))
    with pytest.raises(ValueError, match=r"batch size 3 .*policy\.dp_size=2"):
        tiny_policy.train(train_batch.slice(0, 3), LOSS_FN)
    without_advantages = BatchedDataDict(
        {k: v for k, v in train_batch.items() if k != "advantages"}
    )
    with pytest.raises(ValueError, match="advantages"):
        tiny_policy.train(without_advantages, LOSS_FN)
    zero_length = BatchedDataDict({key: value.clone() for key, value in batch.items()})
    zero_length["input_lengths"][0] = 0
    with pytest.raises(ValueError, match="input_lengths"):
        tiny_policy.get_logprobs(zero_length)
    out_of_vocab = BatchedDataDict({key: value.clone() for key, value in batch.items()})
    out_of_vocab["input_ids"][0, 0] = 512
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_policy.get_logprobs(out_of_vocab)
    torch.testing.assert_close(tiny_policy.get_logprobs(batch), before_BS, rtol=0, atol=0)


def test_bad_config_fails_at_setup(tiny_policy, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=r"policy\.model.*no-such-model"):
        DTensorPolicy(PolicyConfig(model=str(missing), dp_size=2))
    with pytest.raises(ValueError, match=r"resume_from.*no-such-checkpoint.*no such directory"):
        DTensorPolicy(TINY_CFG, resume_from=tmp_path / "no-such-checkpoint")
    with pytest.raises(ValueError, match=r"no-such-checkpoint.*no such directory"):
        tiny_policy.load_checkpoint(tmp_path / "no-such-checkpoint")
    directory = tmp_path / "ckpt"
    tiny_policy.save_checkpoint(directory)
    (directory / "dcp" / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"incomplete checkpoint.*dcp/\.metadata"):
        tiny_policy.load_checkpoint(directory)
    tiny_policy.save_checkpoint(directory)
    manifest = json.loads((directory / CHECKPOINT_MANIFEST).read_text())
    manifest["identity"]["hidden_size"] = 576
    (directory / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"another model.*hidden_size"):
        tiny_policy.load_checkpoint(directory)
    shutil.rmtree(directory)


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M parity with plain transformers


@pytest.fixture(scope="module")
def smollm2_dir():
    return zoo.resolve_model(zoo.SMOLLM2_NAME)


def test_smollm2_two_rank_logprobs_match_transformers(ray_cluster, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "def add(a, b):\n    return a + b\n",
        "The tests in the repository must pass after your patch is applied.",
        "Issue: parse_date('') raises IndexError instead of ValueError.",
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n",
    ]
    encoded = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    batch = BatchedDataDict.from_sequences(
        {"input_ids": encoded},
        pad_values={"input_ids": tokenizer.pad_token_id},
        lengths_key="input_lengths",
    )
    policy = DTensorPolicy(PolicyConfig(model=zoo.SMOLLM2_NAME, dp_size=2, micro_batch_size=2))
    try:
        logprobs_BS = policy.get_logprobs(batch)
        reference_BS = policy.get_reference_policy_logprobs(batch)
        refit = dict(policy.iter_refit_weights())
    finally:
        policy.shutdown()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        expected_BS = _plain_logprobs(model, batch["input_ids"], batch["input_lengths"])
    max_diff = float((logprobs_BS - expected_BS).abs().max())
    print(
        f"\nSmolLM2-135M, 2 ranks vs single-process transformers: max |dlogprob| = "
        f"{max_diff:.2e} over {int(batch['input_lengths'].sum())} tokens"
    )
    assert max_diff < 1e-4
    torch.testing.assert_close(reference_BS, logprobs_BS, rtol=0, atol=0)
    # Refit of a tied-embedding model: exactly the checkpoint's tensors, under its names.
    checkpoint = load_file(smollm2_dir / "model.safetensors")
    assert sorted(refit) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(refit[name], tensor, rtol=0, atol=0)
