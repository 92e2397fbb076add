"""A Llama-family decoder written with flax.nnx, loading and exporting Hugging Face checkpoints.

Architectures (Hugging Face `model_type`): `llama` (Llama 2/3 layout, SmolLM2) and `qwen2` (the same
layout with q/k/v biases). Per decoder layer:

    h = x + o_proj(attention(rope(q_proj(rmsnorm(x))), rope(k_proj(.)), v_proj(.)))
    y = h + down_proj(silu(gate_proj(rmsnorm(h))) * up_proj(rmsnorm(h)))

followed by a final RMSNorm and the LM head (tied to the embedding matrix or separate). The math
follows transformers' implementation so that log-probs agree to float32 rounding:

- RMSNorm normalises in float32 and multiplies the weight after casting back to the input dtype;
- rotary embeddings use `inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)` computed in
  float32 and HF's "rotate half" convention (the two halves of a head, not interleaved pairs),
  with `theta` from config.json (`rope_parameters.rope_theta`, or `rope_theta` in older configs);
- grouped-query attention: each of the `num_key_value_heads` K/V heads serves
  `num_attention_heads / num_key_value_heads` query heads; softmax in float32; causal mask plus a
  key padding mask (right-padded rows; positions are 0..S-1 as in HF without a cache);
- logits are computed in the parameter dtype and returned in float32.

Layout. The decoder layers' parameters are stacked along a leading layer axis (L) and the layers
run under `jax.lax.scan`: XLA compiles ONE layer body instead of L unrolled copies, which keeps jit
compile time of a 30-layer model's training step in seconds on CPU. Kernels are stored as
(in, out) (x @ kernel), the transpose of torch's `nn.Linear.weight` (out, in); the HF name map
(`hf_names_and_shapes`, `params_from_hf`, `iter_hf_weights`) transposes and (un)stacks.

Shape legend: B = sequences, S = token positions, H = hidden size, V = vocabulary,
N = query heads, K = key/value heads, D = head dim, F = MLP (intermediate) size, L = layers.

Covered: the two architectures above in float32 and bfloat16, tied or untied LM head, loading a
safetensors checkpoint directory (single file or sharded with `model.safetensors.index.json`)
and exporting HF names/shapes/layouts for refit and checkpoints.
Not covered (rejected with a ValueError when config.json asks for them): RoPE scaling variants
(llama3, yarn, dynamic, linear), sliding-window attention, MLP biases, attention output biases,
activations other than SiLU, KV caches / generation (the inference engine does that), left padding.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ARCHITECTURES = ("llama", "qwen2")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture hyper-parameters read from a HF config.json (see `from_hf_config`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
        """Builds the config from a parsed HF config.json; ValueError for what is not covered."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported by the jax "
                f"backend; supported: {', '.join(ARCHITECTURES)} (use "
                f"policy.backend=dtensor for other architectures)"
            )

        def unsupported(what: str) -> ValueError:
            return ValueError(
                f"{source}: {what} is not supported by the jax backend's "
                f"llama_nnx model; use policy.backend=dtensor for this checkpoint"
            )

        if hf.get("hidden_act", "silu") != "silu":
            raise unsupported(f"hidden_act={hf.get('hidden_act')!r}")
        if hf.get("mlp_bias", False):
            raise unsupported("mlp_bias=true")
        if hf.get("use_sliding_window", False):
            raise unsupported("use_sliding_window=true")
        rope = dict(hf.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" or hf.get("rope_scaling"):
            raise unsupported(f"rope scaling ({rope_type!r} / {hf.get('rope_scaling')!r})")
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if model_type == "llama":
            if hf.get("attention_bias", False):
                # Llama's attention_bias also adds an o_proj bias, which this model does not have.
                raise unsupported("attention_bias=true")
            qkv_bias = False
        else:
            qkv_bias = True  # Qwen2: q/k/v projections always have biases, o_proj has none
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path) -> LlamaConfig:
        path = pathlib.Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; a model directory needs a HF config.json")
        return cls.from_hf_config(json.loads(path.read_text()), source=str(path))


def _rms_norm(x_BSH: jax.Array, weight_H: jax.Array, eps: float) -> jax.Array:
    # As HF: normalise in float32, cast back to the input dtype, then scale by the weight.
    x32 = x_BSH.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return weight_H * (x32 * jax.lax.rsqrt(variance + eps)).astype(x_BSH.dtype)


def rotary_cos_sin(
    num_positions: int, head_dim: int, theta: float, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """(cos_SD, sin_SD) for positions 0..num_positions-1, duplicated over the two head halves."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs_SD2 = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb_SD = jnp.concatenate([freqs_SD2, freqs_SD2], axis=-1)
    return jnp.cos(emb_SD).astype(dtype), jnp.sin(emb_SD).astype(dtype)


def _apply_rotary(x_BSXD: jax.Array, cos_SD: jax.Array, sin_SD: jax.Array) -> jax.Array:
    # HF's rotate_half: (x1, x2) -> (-x2, x1) on the two halves of each head.
    half = x_BSXD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BSXD[..., half:], x_BSXD[..., :half]], axis=-1)
    return x_BSXD * cos_SD[None, :, None, :] + rotated * sin_SD[None, :, None, :]


class DecoderLayers(nnx.Module):
    """All L decoder layers, parameters stacked along a leading layer axis (see module doc)."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        L, H, F = c.num_hidden_layers, c.hidden_size, c.intermediate_size
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        init = nnx.initializers.normal(0.02)

        def kernel(*shape: int) -> nnx.Param:
            return nnx.Param(init(rngs.params(), (L, *shape), dtype))

        self.input_layernorm = nnx.Param(jnp.ones((L, H), dtype))
        self.q_kernel = kernel(H, q_size)
        self.k_kernel = kernel(H, kv_size)
        self.v_kernel = kernel(H, kv_size)
        if c.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((L, q_size), dtype))
            self.k_bias = nnx.Param(jnp.zeros((L, kv_size), dtype))
            self.v_bias = nnx.Param(jnp.zeros((L, kv_size), dtype))
        self.o_kernel = kernel(q_size, H)
        self.post_attention_layernorm = nnx.Param(jnp.ones((L, H), dtype))
        self.gate_kernel = kernel(H, F)
        self.up_kernel = kernel(H, F)
        self.down_kernel = kernel(F, H)
        self.config = config

    def __call__(
        self, x_BSH: jax.Array, attention_mask_BS: jax.Array, *, remat: bool = False
    ) -> jax.Array:
        c = self.config
        B, S, _ = x_BSH.shape
        N, K, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos_SD, sin_SD = rotary_cos_sin(S, D, c.rope_theta, x_BSH.dtype)
        # Query s may attend to key t when t <= s and t is a real token. With right padding, every
        # query row (even a padding row) keeps key 0, so no softmax row is fully masked.
        allowed_BSS = jnp.tril(jnp.ones((S, S), bool))[None] & (attention_mask_BS[:, None, :] != 0)
        names = [
            "input_layernorm",
            "q_kernel",
            "k_kernel",
            "v_kernel",
            "o_kernel",
            "post_attention_layernorm",
            "gate_kernel",
            "up_kernel",
            "down_kernel",
        ]
        if c.qkv_bias:
            names += ["q_bias", "k_bias", "v_bias"]
        stacked = {name: getattr(self, name)[...] for name in names}

        def layer(h_BSH: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
            x = _rms_norm(h_BSH, p["input_layernorm"], c.rms_norm_eps)
            q, k, v = x @ p["q_kernel"], x @ p["k_kernel"], x @ p["v_kernel"]
            if c.qkv_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            q_BSND = _apply_rotary(q.reshape(B, S, N, D), cos_SD, sin_SD)
            k_BSKD = _apply_rotary(k.reshape(B, S, K, D), cos_SD, sin_SD)
            v_BSKD = v.reshape(B, S, K, D)
            # Group the N query heads as (K, N/K) so each K/V head serves its group unrepeated.
            q_BSKGD = q_BSND.reshape(B, S, K, N // K, D)
            scores_BKGST = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BSKD) * (D**-0.5)
            scores_BKGST = jnp.where(
                allowed_BSS[:, None, None],
                scores_BKGST.astype(jnp.float32),
                jnp.finfo(jnp.float32).min,
            )
            probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BSKD.dtype)
            attn_BSKGD = jnp.einsum("bkgst,btkd->bskgd", probs_BKGST, v_BSKD)
            h_BSH = h_BSH + attn_BSKGD.reshape(B, S, N * D) @ p["o_kernel"]
            x = _rms_norm(h_BSH, p["post_attention_layernorm"], c.rms_norm_eps)
            mlp = (jax.nn.silu(x @ p["gate_kernel"]) * (x @ p["up_kernel"])) @ p["down_kernel"]
            return h_BSH + mlp, None

        if remat:
            # Activation checkpointing: keep only each layer's input; recompute inside backward.
            layer = jax.checkpoint(layer)
        out_BSH, _ = jax.lax.scan(layer, x_BSH, stacked)
        return out_BSH


class LlamaForCausalLM(nnx.Module):
    """Embeddings -> L decoder layers -> final RMSNorm -> LM head (tied or not)."""

    def __init__(self, config: LlamaConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Param(
            nnx.initializers.normal(0.02)(
                rngs.params(), (config.vocab_size, config.hidden_size), dtype
            )
        )
        self.layers = DecoderLayers(config, dtype=dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        if not config.tie_word_embeddings:
            # Stored (H, V) so the head is `hidden @ lm_head`; HF's lm_head.weight is (V, H).
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(
                    rngs.params(), (config.hidden_size, config.vocab_size), dtype
                )
            )

    def __call__(
        self, input_ids_BS: jax.Array, attention_mask_BS: jax.Array, *, remat: bool = False
    ) -> jax.Array:
        """Float32 logits (B, S, V) of the next token at every position."""
        embed_VH = self.embed_tokens[...]
        h_BSH = jnp.take(embed_VH, input_ids_BS, axis=0)
        h_BSH = self.layers(h_BSH, attention_mask_BS, remat=remat)
        h_BSH = _rms_norm(h_BSH, self.norm[...], self.config.rms_norm_eps)
        if self.config.tie_word_embeddings:
            logits_BSV = jnp.einsum("bsh,vh->bsv", h_BSH, embed_VH)
        else:
            logits_BSV = h_BSH @ self.lm_head[...]
        # As HF: the head runs in the parameter dtype, the log-softmax downstream in float32.
        return logits_BSV.astype(jnp.float32)


def token_logprobs(
    logits_BSV: jax.Array, input_ids_BS: jax.Array, input_lengths_B: jax.Array
) -> jax.Array:
    """logprobs_BS[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) in float32.

    Column 0 (no context) and positions t >= input_lengths[b] (padding) are 0: the alignment of
    `PolicyInterface` and the loss functions.
    """
    logp_BSV = jax.nn.log_softmax(logits_BSV[:, :-1].astype(jnp.float32), axis=-1)
    taken_BS = jnp.take_along_axis(logp_BSV, input_ids_BS[:, 1:, None], axis=-1)[..., 0]
    logprobs_BS = jnp.pad(taken_BS, ((0, 0), (1, 0)))
    positions_S = jnp.arange(input_ids_BS.shape[1])
    return jnp.where(positions_S[None, :] < input_lengths_B[:, None], logprobs_BS, 0.0)


# ---------------------------------------------------------------------------------------------
# HF name map. Every stacked NNX parameter maps to one HF tensor per layer.

# NNX name in DecoderLayers -> (HF suffix after `model.layers.{i}.`, transpose?)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "input_layernorm": ("input_layernorm.weight", False),
    "q_kernel": ("self_attn.q_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_kernel": ("self_attn.k_proj.weight", True),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_kernel": ("self_attn.v_proj.weight", True),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_kernel": ("self_attn.o_proj.weight", True),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
    "gate_kernel": ("mlp.gate_proj.weight", True),
    "up_kernel": ("mlp.up_proj.weight", True),
    "down_kernel": ("mlp.down_proj.weight", True),
}
_LAYER_ORDER = (
    "input_layernorm",
    "q_kernel",
    "q_bias",
    "k_kernel",
    "k_bias",
    "v_kernel",
    "v_bias",
    "o_kernel",
    "post_attention_layernorm",
    "gate_kernel",
    "up_kernel",
    "down_kernel",
)


def _layer_names(config: LlamaConfig) -> list[str]:
    return [n for n in _LAYER_ORDER if config.qkv_bias or not n.endswith("_bias")]


def hf_names_and_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> HF shape, in the order `iter_hf_weights` yields them (layer by layer,
    as a HF state dict). With tied embeddings there is no `lm_head.weight` (HF checkpoints and
    vLLM take the head from `model.embed_tokens.weight`)."""
    c = config
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {
        "input_layernorm": (c.hidden_size,),
        "post_attention_layernorm": (c.hidden_size,),
        "q_kernel": (q_size, c.hidden_size),
        "q_bias": (q_size,),
        "k_kernel": (kv_size, c.hidden_size),
        "k_bias": (kv_size,),
        "v_kernel": (kv_size, c.hidden_size),
        "v_bias": (kv_size,),
        "o_kernel": (c.hidden_size, q_size),
        "gate_kernel": (c.intermediate_size, c.hidden_size),
        "up_kernel": (c.intermediate_size, c.hidden_size),
        "down_kernel": (c.hidden_size, c.intermediate_size),
    }
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        for name in _layer_names(c):
            out[f"model.layers.{i}.{_LAYER_MAP[name][0]}"] = shapes[name]
    out["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return out


def load_hf_tensors(model_dir: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors checkpoint in `model_dir` (one file or an index + shards)."""
    from safetensors.numpy import load_file

    model_dir = pathlib.Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"{model_dir} holds no model.safetensors nor "
            f"model.safetensors.index.json; the jax backend loads safetensors "
            f"checkpoints only (re-save the model with save_pretrained)"
        )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


def params_from_hf(
    config: LlamaConfig, tensors: Mapping[str, np.ndarray], dtype: Any
) -> dict[str, Any]:
    """The pure-dict NNX state of `LlamaForCausalLM` from HF-named tensors (numpy, in `dtype`).

    Raises ValueError naming the first missing tensor or a shape mismatch. Extra tensors are
    ignored except a stray `lm_head.weight` in a tied model equal to the embeddings (some
    exporters write it).
    """
    expected = hf_names_and_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(
                f"checkpoint has no tensor {name!r} (expected by config.json: "
                f"{config.model_type}, {config.num_hidden_layers} layers)"
            )
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {shape}"
            )
    np_dtype = np.dtype(dtype)

    def cast(a: np.ndarray) -> np.ndarray:
        return np.asarray(a).astype(np_dtype)

    layers = {}
    for name in _layer_names(config):
        suffix, transpose = _LAYER_MAP[name]
        per_layer = [tensors[f"model.layers.{i}.{suffix}"] for i in range(config.num_hidden_layers)]
        layers[name] = cast(np.stack([a.T if transpose else a for a in per_layer]))
    params = {
        "embed_tokens": cast(tensors["model.embed_tokens.weight"]),
        "layers": layers,
        "norm": cast(tensors["model.norm.weight"]),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = cast(tensors["lm_head.weight"].T)
    return params


def iter_hf_weights(
    config: LlamaConfig, params: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy array in HF layout) from a pure-dict state, in `hf_names_and_shapes`
    order. Each stacked parameter is fetched to host once; yielded arrays are contiguous copies."""
    yield "model.embed_tokens.weight", np.asarray(jax.device_get(params["embed_tokens"]))
    host_layers = {}
    for name in _layer_names(config):
        host_layers[name] = np.asarray(jax.device_get(params["layers"][name]))
    for i in range(config.num_hidden_layers):
        for name in _layer_names(config):
            suffix, transpose = _LAYER_MAP[name]
            a = host_layers[name][i]
            yield f"model.layers.{i}.{suffix}", np.ascontiguousarray(a.T if transpose else a)
    yield "model.norm.weight", np.asarray(jax.device_get(params["norm"]))
    if not config.tie_word_embeddings:
        lm_head_HV = np.asarray(jax.device_get(params["lm_head"]))
        yield "lm_head.weight", np.ascontiguousarray(lm_head_HV.T)


def abstract_model(config: LlamaConfig, dtype: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) without allocating or initialising any weights."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def load_model(
    model_dir: str | pathlib.Path, dtype: str = "float32"
) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """(config, graphdef, state) of the HF checkpoint in `model_dir`, parameters in `dtype`
    ("float32" | "bfloat16"), as host-backed jax arrays."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config = LlamaConfig.from_model_dir(model_dir)
    graphdef, state = abstract_model(config, DTYPES[dtype])
    pure = params_from_hf(config, load_hf_tensors(model_dir), DTYPES[dtype])
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
    return config, graphdef, state
