"""Tests of the flax.nnx Llama-family model against transformers on the zoo's tiny models.

Parity on the real SmolLM2-135M goes through the JAX worker in jax_policy_test.py; here the tiny
random Llama and Qwen2 (q/k/v biases), an untied-head variant, bfloat16, the HF name map and the
config checks. Shape legend: B = sequences, S = token positions, V = vocabulary.
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from dockyard_rl.models import zoo
from dockyard_rl.models.policy import llama_nnx

_B, _S = 3, 24
_LENGTHS = np.array([24, 17, 5])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # Reuse a developer's cache when one is configured; a fresh one under Bazel.
    from_env = os.environ.get(zoo.CACHE_ENV_VAR)
    return pathlib.Path(from_env) if from_env else tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A random Llama with an untied LM head (the zoo's tiny models are tied, like SmolLM2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("untied")
    model.save_pretrained(out)
    return out


def _batch(vocab_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids_BS = np.random.default_rng(seed).integers(0, vocab_size, (_B, _S))
    mask_BS = (np.arange(_S)[None, :] < _LENGTHS[:, None]).astype(np.int64)
    return ids_BS, mask_BS


def _hf_logprobs(model_dir, ids_BS, mask_BS, dtype=torch.float32) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with torch.no_grad():
        logits_BSV = model(
            input_ids=torch.tensor(ids_BS), attention_mask=torch.tensor(mask_BS)
        ).logits.float()
    taken = torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, torch.tensor(ids_BS)[:, 1:, None])
    logprobs_BS = torch.nn.functional.pad(taken[..., 0], (1, 0)) * torch.tensor(mask_BS)
    return logprobs_BS.numpy()


def _jax_logprobs_for(graphdef):
    @jax.jit
    def run(state, ids_BS, mask_BS):
        model = nnx.merge(graphdef, state)
        lengths_B = mask_BS.sum(axis=1)
        return llama_nnx.token_logprobs(model(ids_BS, mask_BS), ids_BS, lengths_B)

    return run


def _load_and_run(model_dir, ids_BS, mask_BS, dtype="float32"):
    config, graphdef, state = llama_nnx.load_model(model_dir, dtype)
    out = _jax_logprobs_for(graphdef)(state, jnp.asarray(ids_BS), jnp.asarray(mask_BS))
    return config, state, np.asarray(out)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_logprobs_match_transformers_float32(name, cache_dir):
    model_dir = zoo.resolve_model(name, cache_dir=cache_dir)
    ids_BS, mask_BS = _batch(512)
    config, _, ours_BS = _load_and_run(model_dir, ids_BS, mask_BS)
    assert config.qkv_bias == (name == "tiny-qwen2")
    theirs_BS = _hf_logprobs(model_dir, ids_BS, mask_BS)
    delta = float(np.abs(ours_BS - theirs_BS).max())
    print(f"{name}: max |logprob delta| vs transformers = {delta:.2e}")
    assert delta < 1e-4
    # The alignment: column 0 and padding are exactly 0, real positions are negative.
    assert (ours_BS[:, 0] == 0).all() and (ours_BS[mask_BS == 0] == 0).all()
    assert (ours_BS[:, 1:][mask_BS[:, 1:] == 1] < 0).all()


def test_untied_head_and_rope_theta(untied_dir):
    ids_BS, mask_BS = _batch(256, seed=1)
    config, state, ours_BS = _load_and_run(untied_dir, ids_BS, mask_BS)
    assert not config.tie_word_embeddings and config.rope_theta == 5000.0
    assert "lm_head" in nnx.to_pure_dict(state)
    delta = float(np.abs(ours_BS - _hf_logprobs(untied_dir, ids_BS, mask_BS)).max())
    assert delta < 1e-4


def test_bfloat16_close_to_transformers_bfloat16(cache_dir):
    model_dir = zoo.resolve_model("tiny-llama", cache_dir=cache_dir)
    ids_BS, mask_BS = _batch(512, seed=2)
    _, state, ours_BS = _load_and_run(model_dir, ids_BS, mask_BS, dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(state))
    theirs_BS = _hf_logprobs(model_dir, ids_BS, mask_BS, dtype=torch.bfloat16)
    exact_BS = _hf_logprobs(model_dir, ids_BS, mask_BS)
    real = mask_BS == 1
    # bf16 has 8 mantissa bits: both implementations are ~1e-2 from float32; ours must not be
    # systematically further off than transformers' own bf16 path.
    ours_err = np.abs(ours_BS - exact_BS)[real].mean()
    theirs_err = np.abs(theirs_BS - exact_BS)[real].mean()
    assert ours_err < 0.05 and ours_err < 2 * theirs_err + 1e-3, (ours_err, theirs_err)


def test_padding_does_not_change_real_tokens(cache_dir):
    model_dir = zoo.resolve_model("tiny-qwen2", cache_dir=cache_dir)
    ids_BS, mask_BS = _batch(512, seed=3)
    _, _, full_BS = _load_and_run(model_dir, ids_BS, mask_BS)
    # Row 2 alone, cut to its own length, gives the same log-probs as inside the padded batch.
    length = int(_LENGTHS[2])
    _, _, alone_BS = _load_and_run(model_dir, ids_BS[2:3, :length], mask_BS[2:3, :length])
    np.testing.assert_allclose(alone_BS[0], full_BS[2, :length], atol=2e-6)


@pytest.mark.parametrize("name", ["tiny-qwen2"])
def test_hf_name_map_round_trips(name, cache_dir, tmp_path):
    model_dir = zoo.resolve_model(name, cache_dir=cache_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    config, _, state = llama_nnx.load_model(model_dir)
    expected = llama_nnx.hf_names_and_shapes(config)
    assert set(expected) == set(tensors)
    exported = list(llama_nnx.iter_hf_weights(config, nnx.to_pure_dict(state)))
    assert [name for name, _ in exported] == list(expected)
    for hf_name, array in exported:
        assert array.shape == expected[hf_name] == tensors[hf_name].shape
        np.testing.assert_array_equal(array, tensors[hf_name], err_msg=hf_name)
    # A sharded checkpoint (index + two files) loads to the same state.
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file_name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file_name))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}})
    )
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    _, _, sharded_state = llama_nnx.load_model(tmp_path)
    jax.tree.map(
        np.testing.assert_array_equal, nnx.to_pure_dict(sharded_state), nnx.to_pure_dict(state)
    )


def test_checkpoint_problems_name_the_tensor(cache_dir, tmp_path):
    model_dir = zoo.resolve_model("tiny-llama", cache_dir=cache_dir)
    config = llama_nnx.LlamaConfig.from_model_dir(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        llama_nnx.params_from_hf(config, missing, jnp.float32)
    wrong = dict(tensors, **{"model.norm.weight": np.zeros((7,), np.float32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(7,\)"):
        llama_nnx.params_from_hf(config, wrong, jnp.float32)
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="no model.safetensors"):
        llama_nnx.load_hf_tensors(tmp_path)


def _hf_config(**overrides):
    base = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
    }
    return {**base, **overrides}


def test_config_reads_rope_theta_and_defaults():
    old_style = llama_nnx.LlamaConfig.from_hf_config(_hf_config(rope_theta=123.0))
    assert old_style.rope_theta == 123.0 and old_style.head_dim == 4
    new_style = llama_nnx.LlamaConfig.from_hf_config(
        _hf_config(rope_parameters={"rope_type": "default", "rope_theta": 77.0}, head_dim=8)
    )
    assert new_style.rope_theta == 77.0 and new_style.head_dim == 8
    assert llama_nnx.LlamaConfig.from_hf_config(_hf_config(model_type="qwen2")).qkv_bias


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope scaling"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ],
)
def test_config_rejects_what_is_not_covered(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        llama_nnx.LlamaConfig.from_hf_config(_hf_config(**overrides))
