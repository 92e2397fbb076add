"""The jax backend as a trainer-fleet actor (jax_fleet.py), on a simulated 2-node Ray cluster.

The cluster (one per module, cluster/testing_cluster.py): a head labelled `driver` with no CPUs
(this process connects to it as the driver) and one `trainer` node. Built through the factory, as
the GRPO loop does:

- the policy runs in an actor on the trainer node, not in this process (pid, node id), and this
  process never imports jax;
- refit weights fetched through the controller equal tiny-llama's checkpoint before training;
- the first training step's loss and grad_norm equal a 1-rank DTensor policy's (same fleet,
  same weights, same batch, float32), with the loss function pickled to both;
- a malformed batch raises ValueError here and leaves the policy usable; checkpoint save / load
  run in the actor (the step count comes back);
- keyword arguments reach the actor's JaxPolicy (an unknown one fails there, naming it).

The jax backend's numerics themselves (against transformers and a torch reference) are
jax_policy_test.py's. Shape legend: B = sequences, S = token positions.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
from safetensors.torch import load_file

from dockyard_rl.cluster.testing_cluster import fleet_cluster
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
from dockyard_rl.models import zoo
from dockyard_rl.models.policy.config import OptimizerConfig, PolicyConfig
from dockyard_rl.models.policy.factory import create_policy
from dockyard_rl.models.policy.jax_fleet import JaxFleetPolicy

LOSS_FN = ClippedPGLossFn(ClippedPGLossConfig(reference_kl_coef=0.01))


@pytest.fixture(scope="module")
def cluster():
    # 2 CPUs on the trainer node: the jax actor and the DTensor rank side by side.
    with fleet_cluster([("trainer", 2)]) as fleet:
        fleet.connect()
        yield fleet


@pytest.fixture(scope="module")
def cfg() -> PolicyConfig:
    zoo.resolve_model("tiny-llama")  # built once here, not in both policies at once
    return PolicyConfig(
        backend="jax",
        model="tiny-llama",
        dtype="float32",
        micro_batch_size=2,
        optimizer=OptimizerConfig(learning_rate=1e-3),
    )


@pytest.fixture(scope="module")
def policy(cluster, cfg):
    policy = create_policy(cfg, cluster_config=cluster.config())
    yield policy
    policy.shutdown()


@pytest.fixture(scope="module")
def batch(policy) -> BatchedDataDict:
    """4 rows of random tokens (2 microbatches), response after position 4, prev log-probs near
    the policy's own (ratios differ from 1, some clip), per-sample advantages."""
    g = torch.Generator().manual_seed(0)
    lengths_B = torch.tensor([28, 20, 13, 9])
    ids_BS = torch.randint(0, 512, (4, 28), generator=g)
    ids_BS[torch.arange(28)[None] >= lengths_B[:, None]] = 2
    positions_S = torch.arange(28)
    batch = BatchedDataDict(
        input_ids=ids_BS,
        input_lengths=lengths_B,
        token_mask=((positions_S[None] >= 4) & (positions_S[None] < lengths_B[:, None])).float(),
        sample_mask=torch.ones(4),
    )
    logprobs_BS = policy.get_logprobs(batch)
    batch["prev_logprobs"] = logprobs_BS + 0.1 * torch.randn(4, 28, generator=g)
    batch["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(batch)
    batch["advantages"] = torch.randn(4, 1, generator=g).expand(4, 28).clone()
    return batch


def test_the_policy_runs_in_an_actor_on_the_trainer_fleet(cluster, policy):
    assert isinstance(policy, JaxFleetPolicy)
    where = policy.worker_location
    assert where["pid"] != os.getpid()
    assert cluster.role_of(where["node_id"]) == "trainer"
    assert policy.weight_sender_node_id() == where["node_id"]  # the sender sits by the weights
    assert where["platform"] == "cpu" and len(where["devices"]) == 1
    # Nothing of jax in the driver: the actor imports it.
    assert "jax" not in sys.modules and "flax" not in sys.modules


def test_refit_weights_through_the_controller_are_the_checkpoint(policy):
    (checkpoint,) = zoo.resolve_model("tiny-llama").glob("*.safetensors")
    expected = load_file(str(checkpoint))
    info = policy.prepare_refit_info()
    weights = dict(policy.iter_refit_weights())
    assert list(weights) == list(info)
    for name, tensor in weights.items():
        assert tuple(tensor.shape) == info[name][0] and tensor.dtype == info[name][1]
        assert torch.equal(tensor, expected[name].float()), name


def test_first_step_matches_the_dtensor_backend(cluster, cfg, policy, batch):
    """Same weights, batch, config and loss object; both in float32 on the trainer fleet."""
    import dataclasses

    from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy

    dtensor = DTensorPolicy(
        dataclasses.replace(cfg, backend="dtensor"), cluster_config=cluster.config()
    )
    try:
        assert torch.allclose(dtensor.get_logprobs(batch), policy.get_logprobs(batch), atol=1e-5)
        theirs = dtensor.train(batch, LOSS_FN)
    finally:
        dtensor.shutdown()
    ours = policy.train(batch, LOSS_FN)
    print(
        f"\ntiny-llama first step, jax actor vs DTensor rank: loss {ours['loss']:.8f} vs "
        f"{theirs['loss']:.8f} (|delta| {abs(ours['loss'] - theirs['loss']):.1e}), grad_norm "
        f"{ours['grad_norm']:.6f} vs {theirs['grad_norm']:.6f}"
    )
    # float32 on both sides; what differs is only the order of reductions (XLA's vs torch's
    # matmul and softmax kernels), ~1e-7 relative per op over a 2-layer model: the log-probs
    # agree to ~1e-6, the loss (~0.33, a mean of per-token terms) to ~3e-8 and the gradient
    # norm to ~1e-6 relative (measured). The bounds leave 100x room for other CPUs' kernels; a
    # real mismatch (a masking, normaliser, clipping or KL difference) moves both by >= 1e-2.
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert ours["learning_rate"] == pytest.approx(theirs["learning_rate"], rel=1e-6)
    assert ours["num_valid_tokens"] == theirs["num_valid_tokens"]
    assert ours["clip_fraction"] == pytest.approx(theirs["clip_fraction"], abs=1e-6)


def test_errors_and_checkpoints_go_through_the_actor(policy, batch, tmp_path):
    bad = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"] + 99)
    with pytest.raises(ValueError, match=r"input_lengths.*must lie in"):
        policy.get_logprobs(bad)
    with pytest.raises(ValueError, match="advantages"):
        policy.train(batch.select_keys([k for k in batch if k != "advantages"]), LOSS_FN)
    step = policy.step  # still usable after the refusals
    assert step >= 0
    policy.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "jax_train_state.json").is_file()
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    before = policy.get_logprobs(batch)
    policy.train(batch, LOSS_FN)
    assert policy.step == step + 1
    policy.load_checkpoint(pathlib.Path(tmp_path / "ckpt"))
    assert policy.step == step
    assert torch.equal(policy.get_logprobs(batch), before)
    with pytest.raises(ValueError, match="does not exist"):
        policy.load_checkpoint(tmp_path / "nowhere")


def test_keyword_arguments_reach_the_actor(policy, batch):
    # Last in the module: a failure other than ValueError marks the policy broken.
    with pytest.raises(Exception, match="no_such_option"):
        policy.get_logprobs(batch, no_such_option=True)
    with pytest.raises(RuntimeError, match="failed earlier"):
        policy.get_logprobs(batch)
