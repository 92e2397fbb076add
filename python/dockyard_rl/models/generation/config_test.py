"""Tests of the `generation` config section: defaults, YAML building, validation messages."""

from __future__ import annotations

import pytest

from dockyard_rl.models.generation.config import (
    SAMPLING_KEYS,
    GenerationConfig,
    format_bytes,
    parse_byte_size,
)
from dockyard_rl.utils.config import from_dict


def test_defaults_are_valid_and_cpu_friendly():
    cfg = GenerationConfig()
    assert cfg.backend == "vllm" and cfg.dtype == "float32"
    assert cfg.gpu_memory_utilization == 0.3
    assert cfg.kv_cache_memory_bytes == 1 << 30  # explicit by default (see the field's comment)
    assert cfg.num_engines == 1 and cfg.tensor_parallel_size == 1
    assert cfg.stop == () and cfg.seed is None
    assert cfg.recompute_kv_cache_after_weight_updates is False


def test_from_yaml_dict_turns_stop_lists_into_tuples():
    cfg = from_dict(
        GenerationConfig,
        {"stop": ["</patch>", "\n\n\n"], "seed": 3, "temperature": 0.7, "top_k": 50},
        "generation",
    )
    assert cfg.stop == ("</patch>", "\n\n\n")
    assert (cfg.seed, cfg.temperature, cfg.top_k) == (3, 0.7, 50)
    assert from_dict(GenerationConfig, {"stop": "###"}, "generation").stop == ("###",)
    hash(cfg)  # frozen and hashable (tuples, not lists)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"backend": "tgi"}, "generation.backend: unknown backend 'tgi'; valid: vllm, sglang"),
        ({"dtype": "float64"}, "generation.dtype: must be one of"),
        ({"max_model_len": 1}, "generation.max_model_len: must be an int >= 2"),
        (
            {"kv_cache_memory_bytes": 0},
            "generation.kv_cache_memory_bytes: must be > 0 bytes, got 0",
        ),
        ({"kv_cache_memory_bytes": "-1GiB"}, "generation.kv_cache_memory_bytes: must be an int of"),
        (
            {"kv_cache_memory_bytes": "1GB"},
            "generation.kv_cache_memory_bytes: must be an int of bytes or a string with a unit (B, "
            'KiB, MiB, GiB, TiB), e.g. "1GiB" or "512 MiB", got \'1GB\'',
        ),
        ({"kv_cache_memory_bytes": 1.5e9}, "generation.kv_cache_memory_bytes: must be an int of"),
        ({"kv_cache_memory_bytes": True}, "generation.kv_cache_memory_bytes: must be an int of"),
        ({"gpu_memory_utilization": 0}, "generation.gpu_memory_utilization: must be in (0, 1]"),
        ({"gpu_memory_utilization": 1.5}, "generation.gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "generation.tensor_parallel_size: must be an int >= 1"),
        ({"num_engines": 2.0}, "generation.num_engines: must be an int >= 1"),
        ({"enforce_eager": "yes"}, "generation.enforce_eager: must be true or false"),
        ({"temperature": -1}, "generation.temperature: must be a number >= 0"),
        ({"top_p": 0}, "generation.top_p: must be in (0, 1]"),
        ({"top_p": 1.01}, "generation.top_p"),
        ({"top_k": -2}, "generation.top_k"),
        ({"top_k": 1.5}, "generation.top_k"),
        ({"max_tokens": 0}, "generation.max_tokens: must be an int >= 1"),
        ({"max_tokens": 2048}, "generation.max_tokens: (2048) must be below max_model_len (2048)"),
        ({"stop": ["ok", ""]}, "generation.stop: must be a list of non-empty strings"),
        ({"stop": [1]}, "generation.stop"),
        ({"seed": -1}, "generation.seed: must be null or an int >= 0"),
        ({"seed": True}, "generation.seed"),
        (
            {"recompute_kv_cache_after_weight_updates": 1},
            "generation.recompute_kv_cache_after_weight_updates: must be true or false",
        ),
        ({"beam_width": 4}, "generation: unknown key(s) 'beam_width'"),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ValueError) as info:
        from_dict(GenerationConfig, data, "generation")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "value, expected",
    [
        (123_456_789, 123_456_789),
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("1.5 GiB", 3 << 29),
        (" 2 KiB ", 2048),
        (".5TiB", 1 << 39),
        ("100B", 100),
    ],
)
def test_kv_cache_size_from_yaml_is_stored_in_bytes(value, expected):
    cfg = from_dict(GenerationConfig, {"kv_cache_memory_bytes": value}, "generation")
    assert cfg.kv_cache_memory_bytes == expected
    hash(cfg)
    # Rebuilding from the stored value (as with_sampling_overrides does) keeps it.
    assert cfg.with_sampling_overrides({"seed": 1}).kv_cache_memory_bytes == expected


def test_null_kv_cache_size_leaves_sizing_to_vllm():
    cfg = from_dict(GenerationConfig, {"kv_cache_memory_bytes": None}, "generation")
    assert cfg.kv_cache_memory_bytes is None


@pytest.mark.parametrize(
    "value", ["0.1B", "0 MiB", "1", "1 gib", "1GB", "1 G", "GiB", "", None, [1], 2.0, False]
)
def test_parse_byte_size_rejects_everything_else(value):
    with pytest.raises(ValueError, match=r"^some\.key: must be"):
        parse_byte_size(value, "some.key")


def test_format_bytes():
    assert format_bytes(3 << 29) == "1.50 GiB"
    assert format_bytes(24 << 30) == "24.00 GiB"
    assert format_bytes(64 << 20) == "64.00 MiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(0) == "0 B"
    assert format_bytes(-(1 << 30)) == "-1.00 GiB"


def test_sglang_is_a_valid_name_in_the_config():
    # Rejected by the vLLM backend at setup, not by the config (clusters will have it).
    assert GenerationConfig(backend="sglang").backend == "sglang"


def test_sampling_overrides_are_validated_like_yaml():
    cfg = GenerationConfig(max_tokens=16)
    assert cfg.with_sampling_overrides(None) is cfg
    changed = cfg.with_sampling_overrides({"temperature": 0.0, "stop": ["x"], "seed": 5})
    assert (changed.temperature, changed.stop, changed.seed) == (0.0, ("x",), 5)
    assert changed.max_tokens == 16 and cfg.temperature == 1.0
    with pytest.raises(ValueError, match=r"generation\.top_p: must be in \(0, 1\]"):
        cfg.with_sampling_overrides({"top_p": 2})
    with pytest.raises(ValueError, match="'dtype' cannot be overridden per call"):
        cfg.with_sampling_overrides({"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="must be a dict"):
        cfg.with_sampling_overrides([("seed", 1)])
    assert set(SAMPLING_KEYS) == {"temperature", "top_p", "top_k", "max_tokens", "stop", "seed"}
