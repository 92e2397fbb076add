"""Every weight-sync transport moves a real trainer's weights into a real vLLM engine.

The trainer: the DTensor policy with SmolLM2-135M-Instruct on 2 FSDP ranks (gloo), after one real
optimizer step (learning rate 1e-3, so the weights differ clearly from the checkpoint it started
from), saved as a checkpoint. The reference: a vLLM engine started from that saved checkpoint;
its greedy tokens and their log-probs are the truth. The engine under test starts from the
original SmolLM2; after each transport's sync (mark_stale -> sync_weights ->
prepare_for_generation, through `create_weight_synchronizer`) its greedy tokens and log-probs
must equal the reference's (tokens bit for bit), then the original weights are pushed back so the
next transport has something to change. (Log-probs too: a tied lm_head whose CPU kernel kept the
old weights once gave the same first tokens and log-probs 1e-2 off.)

ONE trainer and ONE engine serve the module (each takes about a minute to start on 2 cores);
the reference engine is shut down before the engine under test starts. Transport-level failure
cases (peers killed mid-transfer, bad HTTP requests) are in
python/dockyard_rl/weight_sync/transports_test.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
import torch

from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.kernels import refit_packer
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.vllm_generation import VllmGeneration
from dockyard_rl.models.policy.config import OptimizerConfig, PolicyConfig
from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy
from dockyard_rl.weight_sync.config import WeightSyncConfig
from dockyard_rl.weight_sync.factory import create_weight_synchronizer
from dockyard_rl.weight_sync.interfaces import SyncState, WeightSyncError

MODEL = "smollm2-135m-instruct"
ENGINE_CONFIG = GenerationConfig(
    model=MODEL,
    dtype="float32",
    max_model_len=256,
    kv_cache_memory_bytes="128MiB",
    enforce_eager=True,
    temperature=0.0,
    max_tokens=24,
    seed=0,
)
PROMPTS = [list(range(100, 116)), [1, 504, 3458, 314, 260, 3575, 282, 4649, 47]]


@pytest.fixture(scope="module")
def loop():
    init_local_ray(num_cpus=4, log_to_driver=False)
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
    ray.shutdown()


def _greedy(loop, engine) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """Per prompt: the greedy tokens and their log-probs."""

    async def run():
        return [s async for s in engine.generate(PROMPTS, 1)]

    samples = sorted(loop.run_until_complete(run()), key=lambda s: s.prompt_index)
    return [(s.response_token_ids, s.response_logprobs) for s in samples]


def _assert_same_generation(got, want) -> None:
    """The same greedy tokens, bit for bit; log-probs equal up to float noise (vLLM may batch
    the two prompts differently in two engines), far below the 1e-2 of stale weights."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want):
        assert torch.allclose(
            torch.tensor(got_logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-4
        )


@pytest.fixture(scope="module")
def trainer(loop, tmp_path_factory):
    """The 2-rank trainer after one optimizer step, and that step's checkpoint."""
    policy = DTensorPolicy(
        PolicyConfig(
            model=MODEL,
            dp_size=2,
            micro_batch_size=2,
            optimizer=OptimizerConfig(learning_rate=1e-3),
        )
    )
    generator = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(0, 49152, (4, 24), generator=generator)
    batch = BatchedDataDict(
        input_ids=ids_BS,
        input_lengths=torch.full((4,), 24),
        token_mask=torch.ones(4, 24),
        sample_mask=torch.ones(4),
    )
    logprobs_BS = policy.get_logprobs(batch)
    batch["prev_logprobs"] = logprobs_BS
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 24).clone()
    policy.train(batch, ClippedPGLossFn(ClippedPGLossConfig()))
    checkpoint = tmp_path_factory.mktemp("trained")
    policy.save_checkpoint(checkpoint)
    yield policy, checkpoint
    policy.shutdown()


@pytest.fixture(scope="module")
def reference_tokens(loop, trainer):
    """Greedy tokens (and log-probs) of an engine loaded from the trained checkpoint."""
    _, checkpoint = trainer
    reference = VllmGeneration(dataclasses.replace(ENGINE_CONFIG, model=str(checkpoint)))
    try:
        return _greedy(loop, reference)
    finally:
        reference.shutdown()


@pytest.fixture(scope="module")
def engine(loop, reference_tokens):
    generation = VllmGeneration(ENGINE_CONFIG)
    yield generation
    generation.shutdown()


@pytest.fixture(scope="module")
def original(engine):
    """The engine's original weights, packed for pushing them back."""
    from safetensors.torch import load_file

    (path,) = engine._model_dir.glob("*.safetensors")
    named = {name: tensor.float() for name, tensor in load_file(str(path)).items()}
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(named), 64 << 20)
    return manifest, refit_packer.pack(named, manifest)


def _restore_original(loop, engine, original) -> None:
    manifest, buckets = original
    loop.run_until_complete(
        engine.prepare_refit_info({e.name: (e.shape, e.dtype) for e in manifest.tensors})
    )
    loop.run_until_complete(
        engine.update_weights_from_buckets(manifest.to_dict(), buckets, engine.weight_version + 1)
    )


@pytest.mark.parametrize("transport", ["object_store", "collective", "ipc_zmq", "http"])
def test_transport_gives_the_engine_the_trainers_weights_bit_for_bit(
    loop, trainer, reference_tokens, engine, original, transport
):
    policy, _ = trainer
    _restore_original(loop, engine, original)
    before = _greedy(loop, engine)
    assert [t for t, _ in before] != [t for t, _ in reference_tokens], (
        "one optimizer step must change the greedy tokens"
    )

    sync = create_weight_synchronizer(
        WeightSyncConfig(
            transport=transport, bucket_size_bytes="64MiB", sync_timeout_s=300, peer_timeout_s=120
        ),
        policy,
        engine,
    )
    try:
        version = sync.mark_stale()
        sync.sync_weights()
        sync.prepare_for_generation()
        assert sync.state is SyncState.READY and engine.weight_version == version
        _assert_same_generation(_greedy(loop, engine), reference_tokens)
        metrics = sync.metrics()
        print(
            f"{transport}: {metrics['last_sync_bytes'] / 1e6:.0f} MB in "
            f"{metrics['last_transfer_seconds']:.2f} s ({metrics['last_transfer_gb_per_s']:.3f}"
            f" GB/s; pack {metrics['last_pack_seconds']:.2f} s, engine load "
            f"{metrics['last_engine_load_seconds']:.2f} s)"
        )
        assert metrics["transport"] == transport
        assert metrics["last_sync_bytes"] == sync.manifest.total_bytes > 500e6
        if transport != "object_store":  # a second sync reuses the session
            sync.mark_stale()
            sync.sync_weights()
            sync.prepare_for_generation()
            _assert_same_generation(_greedy(loop, engine), reference_tokens)
    finally:
        sync.close()


def test_auto_picks_ipc_zmq_when_trainer_and_engine_share_the_node(trainer, engine):
    policy, _ = trainer
    sync = create_weight_synchronizer(WeightSyncConfig(transport="auto"), policy, engine)
    assert sync.transport == "ipc_zmq"


def test_a_manifest_the_engine_does_not_expect_fails_before_the_engine_is_touched(
    loop, trainer, engine, original
):
    policy, _ = trainer
    _restore_original(loop, engine, original)
    before, version = _greedy(loop, engine), engine.weight_version
    sync = create_weight_synchronizer(WeightSyncConfig(transport="collective"), policy, engine)
    info = policy.prepare_refit_info()
    name = "model.norm.weight"
    info[name] = ((info[name][0][0] + 1,), info[name][1])  # the trainer would send a wrong shape
    sync.manifest = refit_packer.plan_buckets(info, 64 << 20)
    sync.mark_stale()
    with pytest.raises(WeightSyncError, match="'model.norm.weight' has shape"):
        sync.sync_weights()
    assert sync.state is SyncState.FAILED
    assert engine.weight_version == version
    _assert_same_generation(_greedy(loop, engine), before)
    sync.close()
