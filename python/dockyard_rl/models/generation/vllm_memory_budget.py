"""Memory planning of the vLLM engines: `generation.kv_cache_memory_bytes` against the machine.

The budget (`plan_memory` -> `MemoryBudget`). Before any engine starts, the driver
(`VllmGeneration`, vllm_generation.py) logs the budget: the KV-cache size per engine
(`generation.kv_cache_memory_bytes`) times `num_engines`, the weights, and the machine's total and
available memory (psutil); on CPU it raises ValueError naming the key when the engines' KV caches
exceed the memory available right now. With a null size it logs what vLLM will derive from
`gpu_memory_utilization`. The budget check uses the driver's machine: with engines on other nodes
of a CPU cluster only vLLM's own check (translated) applies there.

vLLM's refusals (`vllm_kv_memory_refusal`, `kv_memory_error`). vLLM's own start-up refusals about
KV memory (a size larger than what is available at allocation, a size that cannot hold one
max_model_len sequence, a null size squeezed by the worker's own memory) reach the engine actor
only as "Engine core initialization failed. See root cause above": the cause is in the log lines
that vLLM's engine processes wrote to the actor's stdout/stderr, which Ray keeps in files; the
actor (vllm_engine_actor.py) reads the lines written since it started the engine and re-raises a
ValueError naming `generation.kv_cache_memory_bytes`.

Not covered: a host-memory check on GPU machines (the KV cache lives on the GPUs; vLLM checks
their memory).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from dockyard_rl.models.generation.config import GenerationConfig, format_bytes


def kv_cache_bytes_per_token(hf_config: Mapping[str, Any], dtype: str) -> int | None:
    """KV-cache bytes one token takes in a standard-attention (Llama-family) model: K and V of
    every layer and KV head; None when the config lacks the fields. An estimate for the log (vLLM
    pads to blocks, and other attention types store other shapes)."""
    try:
        num_heads = int(hf_config["num_attention_heads"])
        num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
        head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads)
        num_layers = int(hf_config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    return (
        2
        * num_layers
        * num_kv_heads
        * head_dim
        * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    )


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What the engines take, against the driver machine's memory at start-up (sizes in bytes)."""

    kv_cache_bytes: int | None  # per engine (per GPU with TP); None = vLLM sizes it
    num_engines: int
    on_gpu: bool  # the Ray cluster has GPUs: the KV cache lives there, not in host memory
    gpu_memory_utilization: float
    max_model_len: int
    total_bytes: int  # this machine's memory
    available_bytes: int  # available right now
    weight_bytes: int  # the checkpoint in the engine's dtype, per engine
    kv_bytes_per_token: int | None  # estimate (kv_cache_bytes_per_token)

    @property
    def total_kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_bytes is None else self.num_engines * self.kv_cache_bytes

    def describe(self) -> str:
        """The arithmetic, one line, for the log."""
        machine = (
            f"this machine: {format_bytes(self.total_bytes)} total, "
            f"{format_bytes(self.available_bytes)} available now"
        )
        weights = f"~{format_bytes(self.weight_bytes)} of weights per engine"
        gmu = f"gpu_memory_utilization {self.gpu_memory_utilization}"
        if self.kv_cache_bytes is None:
            if self.on_gpu:
                return (
                    f"vLLM memory budget: KV cache sized by vLLM (generation."
                    f"kv_cache_memory_bytes: null) from {gmu} of each GPU, minus weights and "
                    f"activations; {self.num_engines} engine(s), {weights}; {machine}"
                )
            requested = self.gpu_memory_utilization * self.total_bytes
            return (
                f"vLLM memory budget: KV cache sized by vLLM (generation.kv_cache_memory_bytes"
                f": null): {gmu} x {format_bytes(self.total_bytes)} = "
                f"{format_bytes(requested)} "
                f"per engine, minus the worker's resident memory when the KV cache is sized "
                f"(it refuses to start when that is <= 0); x {self.num_engines} engine(s) = "
                f"{format_bytes(self.num_engines * requested)}; {weights}; {machine}. This "
                "depends on what else runs on the machine; an explicit "
                "generation.kv_cache_memory_bytes does not"
            )
        if self.kv_bytes_per_token:
            num_tokens = self.kv_cache_bytes // self.kv_bytes_per_token
            tokens = (
                f"; ~{num_tokens} tokens at {self.kv_bytes_per_token / 1024:.1f} KiB per "
                f"token = {num_tokens / self.max_model_len:.1f} x max_model_len "
                f"{self.max_model_len}"
            )
        else:
            tokens = ""
        where = "per GPU" if self.on_gpu else "per engine"
        unused = "ignored by vLLM" if self.on_gpu else "not used on CPU"
        return (
            f"vLLM memory budget: KV cache {format_bytes(self.kv_cache_bytes)} {where} "
            f"(generation.kv_cache_memory_bytes{tokens}) x {self.num_engines} engine(s) = "
            f"{format_bytes(self.total_kv_cache_bytes)}"
            f"{' (on the GPUs)' if self.on_gpu else ''}; {weights}; {machine}; {gmu} is "
            f"{unused} when the KV size is explicit"
        )


def plan_memory(
    config: GenerationConfig,
    *,
    on_gpu: bool,
    weight_bytes: int,
    kv_bytes_per_token: int | None,
    memory=None,
) -> MemoryBudget:
    """The engines' memory budget against this machine's memory (`memory`: psutil's
    `virtual_memory()`, read now when None).

    Raises:
        ValueError: on CPU, the engines' explicit KV caches (num_engines x kv_cache_memory_bytes)
            exceed the memory available now, or, with a null size, num_engines x
            gpu_memory_utilization of the machine does (vLLM would refuse to start); the message
            names the key, the figures and the fix.
    """
    if memory is None:
        import psutil

        memory = psutil.virtual_memory()
    budget = MemoryBudget(
        kv_cache_bytes=config.kv_cache_memory_bytes,
        num_engines=config.num_engines,
        on_gpu=on_gpu,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        total_bytes=int(memory.total),
        available_bytes=int(memory.available),
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    if on_gpu:
        return budget
    available = budget.available_bytes
    engines = f"{budget.num_engines} engine(s)"
    machine = (
        f"the {format_bytes(available)} this machine has available now "
        f"({format_bytes(budget.total_bytes)} total)"
    )
    if budget.kv_cache_bytes is not None:
        if budget.total_kv_cache_bytes > available:
            raise ValueError(
                f"generation.kv_cache_memory_bytes: {engines} x "
                f"{format_bytes(budget.kv_cache_bytes)} of KV cache = "
                f"{format_bytes(budget.total_kv_cache_bytes)}, more than {machine}; lower "
                f"generation.kv_cache_memory_bytes (at most "
                f"{format_bytes(available // budget.num_engines)} per engine right now, less what "
                "the weights, the engines' runtime and the trainer need) or "
                "generation.num_engines, or free memory on the machine"
            )
    else:
        requested = math.ceil(budget.gpu_memory_utilization * budget.total_bytes)
        if budget.num_engines * requested > available:
            raise ValueError(
                f"generation.kv_cache_memory_bytes: null lets vLLM reserve gpu_memory_utilization "
                f"{budget.gpu_memory_utilization} x {format_bytes(budget.total_bytes)} = "
                f"{format_bytes(requested)} per engine for weights + KV cache, x {engines} = "
                f"{format_bytes(budget.num_engines * requested)}, more than {machine}; set "
                "generation.kv_cache_memory_bytes to an explicit size (e.g. 1GiB), or lower "
                "generation.gpu_memory_utilization"
            )
    return budget


# vLLM 0.32's start-up refusals about KV-cache memory (cpu_worker.py, kv_cache_utils.py), as they
# appear in its engine processes' logs.
_KV_MEMORY_REFUSALS = re.compile(
    r"(Available memory on node \S+ \(.*?\) on (?:kv cache allocation|startup) is less than "
    r".*|No available memory for the cache blocks\..*|To serve at least one request with the "
    r"model's max seq len .*)"
)


# Where vLLM's facts end and its advice (in terms of its own flags) begins.
_VLLM_ADVICE = re.compile(
    r" (?:Try increasing|On the CPU backend|Reduce CPU memory|Decrease "
    r"--kv-cache|See https://)|', please check"
)


def vllm_kv_memory_refusal(log_text: str) -> str | None:
    """vLLM's message refusing to start for lack of KV-cache memory, found in its engine
    processes' log output, or None. Only the facts: cut where vLLM's advice begins (it names its
    own flags, not our keys) or where its executor's quote of a worker's error ends
    ("Worker failed with error '...', please check ...")."""
    match = _KV_MEMORY_REFUSALS.search(log_text)
    if match is None:
        return None
    return _VLLM_ADVICE.split(match.group(1), 1)[0].strip()


def kv_memory_error(
    engine_index: int, engine_kwargs: Mapping[str, Any], refusal: str
) -> ValueError:
    kv_bytes = engine_kwargs.get("kv_cache_memory_bytes")
    said = f'engine {engine_index} refused to start: vLLM says "{refusal}"'
    if kv_bytes is None:
        return ValueError(
            f"generation.kv_cache_memory_bytes: null lets vLLM size the KV cache from "
            f"gpu_memory_utilization ({engine_kwargs['gpu_memory_utilization']}) and the memory "
            f"the engine's worker already holds, and {said}. Set generation.kv_cache_memory_bytes "
            "to an explicit size (e.g. 1GiB), which does not depend on what else runs on the "
            "machine"
        )
    if refusal.startswith(("To serve at least one request", "No available memory for the cache")):
        fix = (
            f"too small for one sequence of max_model_len {engine_kwargs['max_model_len']}; "
            "raise generation.kv_cache_memory_bytes or lower generation.max_model_len"
        )
    else:
        fix = "lower generation.kv_cache_memory_bytes or free memory on the machine"
    return ValueError(
        f"generation.kv_cache_memory_bytes: {format_bytes(kv_bytes)} per engine: {said}; {fix}"
    )
