"""Tests for the policy factory: dispatch by `policy.backend`, its errors, and one real build.

The real build is a 1-rank DTensor policy (Ray on 127.0.0.1, gloo) on tiny-llama with
activation checkpointing on, checked against a plain single-process step (recomputation must not
change the math); its rank also shows that the `cluster` section's trainer NCCL settings reach it
(environment and process-group timeout). A second build shows the fleet's placement strategy and
`cluster.placement_timeout_s` taking effect. Shape suffixes: B = samples, S = token positions.
"""

from __future__ import annotations

import os

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from dockyard_rl.cluster.bootstrap import PlacementTimeoutError
from dockyard_rl.cluster.config import ClusterConfig, FleetConfig, FleetsConfig, NcclEnvConfig
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, count_valid
from dockyard_rl.models import zoo
from dockyard_rl.models.policy import factory
from dockyard_rl.models.policy.config import BACKENDS, PolicyConfig
from dockyard_rl.utils.config import from_dict


def test_factory_knows_exactly_the_configured_backends():
    assert tuple(factory.POLICY_BACKENDS) == BACKENDS


def test_unknown_backend_is_rejected_naming_the_key_and_valid_names():
    with pytest.raises(ValueError, match=r"policy\.backend.*'tpu'.*dtensor, jax"):
        from_dict(PolicyConfig, {"backend": "tpu"}, "policy")
    # A config that slipped past validation is still caught by the factory itself.
    cfg = PolicyConfig(model="tiny-llama")
    object.__setattr__(cfg, "backend", "tpu")
    with pytest.raises(
        ValueError,
        match=r"policy\.backend: unknown backend 'tpu'; valid: "
        r"dtensor, jax",
    ):
        factory.create_policy(cfg)
    with pytest.raises(ValueError, match="needs a PolicyConfig"):
        factory.create_policy({"backend": "dtensor"})


def test_backend_missing_from_the_installation_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(
        factory.POLICY_BACKENDS,
        "jax",
        ("dockyard_rl.models.policy.no_such_backend", "NoSuchPolicy"),
    )
    with pytest.raises(
        ValueError,
        match=r"policy\.backend: 'jax' is not available.*"
        r"available: dtensor",
    ):
        factory.create_policy(PolicyConfig(backend="jax", model="tiny-llama"))


def test_bad_model_fails_at_setup(tmp_path):
    with pytest.raises(ValueError, match=r"policy\.model.*nowhere"):
        factory.create_policy(PolicyConfig(model=str(tmp_path / "nowhere")))


def test_dtensor_backend_one_rank_with_activation_checkpointing():
    from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy

    cfg = PolicyConfig(
        backend="dtensor",
        model="tiny-llama",
        dp_size=1,
        micro_batch_size=2,
        activation_checkpointing=True,
        max_grad_norm=None,
    )
    gen = torch.Generator().manual_seed(0)
    num_samples, width = 4, 12
    lengths_B = torch.tensor([12, 6, 9, 4])
    real_BS = torch.arange(width)[None, :] < lengths_B[:, None]
    ids_BS = torch.where(real_BS, torch.randint(0, 512, (num_samples, width), generator=gen), 0)
    batch = BatchedDataDict(
        input_ids=ids_BS,
        input_lengths=lengths_B,
        token_mask=(real_BS & (torch.arange(width) >= 2)).float(),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
    )
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(aggregation="sequence"))

    # The trainer fleet's NCCL settings, as a recipe's `cluster` section gives them.
    cluster_config = ClusterConfig(
        fleets=FleetsConfig(
            trainer=FleetConfig(
                nccl_env=NcclEnvConfig(socket_ifname="lo", ib_hca="mlx5", heartbeat_timeout_s=77)
            )
        )
    )

    def rank_view(worker):
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        names = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
        return {name: os.environ.get(name) for name in names}, timeout.total_seconds()

    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        policy = factory.create_policy(cfg, cluster_config=cluster_config)
        try:
            assert isinstance(policy, DTensorPolicy)
            env, timeout_s = ray.get(policy._workers.actors[0].__ray_call__.remote(rank_view))
            assert env == {
                "NCCL_SOCKET_IFNAME": "lo",
                "NCCL_IB_HCA": "mlx5",
                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "77",
            }
            assert timeout_s == 77  # the ranks' process group: nccl_env.heartbeat_timeout_s
            batch["prev_logprobs"] = policy.get_logprobs(batch)
            batch["advantages"] = (
                torch.tensor([0.5, -1.0, 2.0, 1.5])[:, None].expand(num_samples, width).clone()
            )
            metrics = policy.train(batch, loss_fn)
        finally:
            policy.shutdown()
            policy.shutdown()  # idempotent
    finally:
        ray.shutdown()

    # The same step in one plain process, without recomputation.
    model = AutoModelForCausalLM.from_pretrained(
        zoo.resolve_model("tiny-llama"), dtype=torch.float32
    )
    logits_BSV = model(input_ids=ids_BS).logits
    next_BS = torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, ids_BS[:, 1:, None])[..., 0]
    logprobs_BS = torch.where(
        real_BS & (torch.arange(width) >= 1), torch.nn.functional.pad(next_BS, (1, 0)), 0.0
    )
    torch.testing.assert_close(logprobs_BS.detach(), batch["prev_logprobs"], rtol=0, atol=1e-5)
    loss, _ = loss_fn(logprobs_BS, batch, *count_valid(batch))
    loss.backward()
    grad_norm = float(
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    )
    assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert metrics["learning_rate"] == cfg.optimizer.learning_rate  # no warmup by default


def test_dtensor_ranks_are_placed_with_the_trainer_fleets_strategy_and_timeout():
    # Two ranks that must sit on different nodes (STRICT_SPREAD) never fit the one-node local
    # cluster: placement gives up after cluster.placement_timeout_s and names the key. With the
    # default config (SPREAD, 60 s) the same policy is placed at once.
    unplaceable = ClusterConfig(
        placement_timeout_s=1,
        fleets=FleetsConfig(trainer=FleetConfig(strategy="STRICT_SPREAD")),
    )
    cfg = PolicyConfig(backend="dtensor", model="tiny-llama", dp_size=2, micro_batch_size=1)
    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        with pytest.raises(
            PlacementTimeoutError,
            match=r"trainer fleet .* STRICT_SPREAD .*cluster\.placement_timeout_s=1 s",
        ):
            factory.create_policy(cfg, cluster_config=unplaceable)
    finally:
        ray.shutdown()
