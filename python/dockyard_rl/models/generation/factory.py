"""Builds the generation backend `generation.backend` names: `create_generation(cfg, ...)`.

Backends (imported lazily, so a driver never imports an engine it does not use):
  vllm    dockyard_rl.models.generation.vllm_generation.VllmGeneration
          (vLLM's async engine in Ray)
  sglang  reserved for GPU clusters; not part of this build
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dockyard_rl.models.generation.config import BACKENDS, GenerationConfig
from dockyard_rl.models.generation.interfaces import GenerationInterface

# backend name -> (module, class)
GENERATION_BACKENDS: dict[str, tuple[str, str]] = {
    "vllm": ("dockyard_rl.models.generation.vllm_generation", "VllmGeneration"),
}


def create_generation(cfg: GenerationConfig, **options: Any) -> GenerationInterface:
    """The backend of `cfg.backend`, built with `options` (initial_weight_version,
    cluster_config, ...; see the backend's constructor).

    Raises:
        ValueError: `cfg` is not a GenerationConfig, or its backend is unknown or not part of
            this build (the message lists what is).
    """
    if not isinstance(cfg, GenerationConfig):
        raise ValueError(
            f"create_generation needs a GenerationConfig, got "
            f"{type(cfg).__name__}; build it with from_dict(GenerationConfig, "
            "yaml['generation'], 'generation')"
        )
    if cfg.backend not in GENERATION_BACKENDS:
        raise ValueError(
            f"generation.backend: {cfg.backend!r} is not available in this build "
            f"(valid names: {', '.join(BACKENDS)}; built: "
            f"{', '.join(GENERATION_BACKENDS)}); use backend: vllm"
        )
    module_name, class_name = GENERATION_BACKENDS[cfg.backend]
    backend: Callable[..., GenerationInterface] = getattr(
        importlib.import_module(module_name), class_name
    )
    return backend(cfg, **options)
