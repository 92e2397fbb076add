"""The JAX/Flax NNX policy backend (`policy.backend: jax`): `JaxPolicy`, a `PolicyInterface`.

One `JaxPolicy` object drives every local jax device of its process itself (a jax program is
single-controller: the "ranks" of the interface are the devices of one `Mesh`; each method returns
when all devices are done). In a training run it lives in a Ray actor of the trainer fleet:
`policy.backend: jax` builds `jax_fleet.JaxFleetPolicy`, the driver's controller, which forwards
every call to a `JaxPolicyWorker` actor holding this object (the weight-sync sender runs there
too), so the driver never imports jax. Used directly, as its tests do, it runs in the caller's
process. Constructor: `JaxPolicy(cfg, *, cache_dir=None, resume_from=None, tokenizer_dir=None)`,
the signature factory.py documents plus `tokenizer_dir`. Weights come from the same HF safetensors
checkpoint the DTensor backend and vLLM load (`models/zoo.py` names or a local directory) into the
flax.nnx Llama-family model of `llama_nnx.py`.

Sharding. A 1-D `jax.sharding.Mesh` with axis "data" over the first `policy.dp_size` devices (on
CPU there is 1 device unless `XLA_FLAGS=--xla_force_host_platform_device_count=N` is set before
jax is imported). Parameters and optimizer state are replicated; every microbatch is split along
its batch dim over the "data" axis. The loss is a sum of per-token terms over GLOBAL normalisers
(see losses/loss_functions.py), so the gradient of a replicated parameter is the SUM of the
per-device gradients: XLA inserts that all-reduce itself when it differentiates the sharded sum.

Training (`train`): the global batch is padded along B with fully masked rows (sample_mask 0) to a
multiple of `micro_batch_size * dp_size`, and along S with padding to a multiple of
`SEQ_LEN_MULTIPLE` (so the jit-compiled steps are reused across batches of similar length); padded
rows and positions carry no loss. Microbatches of `micro_batch_size * dp_size` rows each add their
gradient into an accumulator (one jit-compiled function, reused for every microbatch); then one
jit-compiled update applies `optax.clip_by_global_norm(policy.max_grad_norm)` and
`optax.adamw(schedule, b1, b2, eps, weight_decay)` (decoupled weight decay on every parameter,
as torch.optim.AdamW over `model.parameters()`). The schedule is
`optax.warmup_cosine_decay_schedule`, checked against `config.learning_rate_at`, the one
definition both backends use. The reported `grad_norm` is the global norm before clipping.

The loss. `ClippedPGLossFn` (torch) cannot run inside a jax trace, so `clipped_pg_loss`
(losses/jax_loss_functions.py) ports its math to jax.numpy: token/sequence aggregation with
global normalisers, PPO clip, dual clip, truncated importance sampling, reference KL with
k1/k2/k3, and the same metrics (tests compare values and gradients against the torch
implementation). Any other loss callable satisfying
`LossFunction` is WRAPPED instead: per microbatch, log-probs are computed in jax, handed to the
torch loss as a leaf tensor, `backward()` gives d loss / d logprobs, and a jax VJP pulls that
cotangent back to the parameters (one extra forward pass per microbatch). Its user: the supervised
warm start (algorithms/warm_start.py) trains with `SupervisedLossFn` through the policy's own
`train`, so a run with `policy.backend: jax` and a `warm_start` section takes this path.

Dtypes. Parameters, gradients and the AdamW moments are float32 (master weights), as in the
DTensor backend. `policy.dtype: bfloat16` makes it the compute dtype: each forward pass casts the
parameters to bfloat16 (the cast's transpose returns float32 gradients) and refit sends bfloat16
weights. Attention softmax, RMSNorm statistics, log-softmax and the loss run in float32 either way.
Checkpoints hold the float32 master weights.

Reference policy: the weights loaded at construction, frozen (jax arrays are immutable, so this is
the initial state itself, not a copy); with `policy.offload_reference_policy` they live on the
host CPU device and are copied to the mesh only for their forward pass. `load_checkpoint` does not
change it.

Compiled programs are module-level, keyed on the model's graphdef, the loss config and the
optimizer hyper-parameters, so a second policy of the same model (a resume, a test) reuses them.

Checkpoints (`save_checkpoint(dir)`): `model.safetensors` in HF names/layouts (loadable by
transformers and vLLM), `config.json` (dtype float32: the master weights) and every tokenizer /
generation file of the model directory (and of `tokenizer_dir`); plus
`jax_train_state.safetensors` (the optimizer state's leaves, including the schedule's step count)
and `jax_train_state.json` (step, model architecture, compute dtype; written last). There is no
RNG state to save: nothing in the forward pass or the loss samples. The directory is written under
a temporary sibling name, fsynced and renamed into place by `utils.checkpoint.publish_directory`;
a previous checkpoint at that path is renamed to `.<name>.old-*` first and deleted after the new
one is in place (a crash between the two renames leaves it there, complete). Checkpoints are
backend-specific: the DTensor backend does not read this optimizer state, nor this backend its.

Shape legend: B = sequences, S = token positions.

Not covered: tensor/sequence/pipeline parallelism and sharded (FSDP-style) parameters (the mesh
has one "data" axis; a 135M-7B model's replicated state must fit on each device), multi-host jax
(`jax.distributed`), sequence packing, loss functions other than ClippedPGLossFn on the fast
(ported) path, and architectures other than llama_nnx's. Step time on a CPU is compute-bound
(SmolLM2: ~3 forward passes' worth of matmuls per step); the first step of each new batch shape
pays the jit compile (SmolLM2: 10-35 s on 2 shared cores).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import time
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.kernels import refit_packer
from dockyard_rl.losses.jax_loss_functions import clipped_pg_loss
from dockyard_rl.losses.loss_functions import (
    MAX_METRICS,
    ClippedPGLossConfig,
    ClippedPGLossFn,
    check_tensor,
    count_valid,
)
from dockyard_rl.models import zoo
from dockyard_rl.models.policy import llama_nnx
from dockyard_rl.models.policy.config import OptimizerConfig, PolicyConfig, SchedulerConfig
from dockyard_rl.models.policy.interfaces import LossFunction, PolicyInterface
from dockyard_rl.utils.checkpoint import publish_directory
from dockyard_rl.weight_sync import sender_sessions
from dockyard_rl.weight_sync.manifest_buckets import iter_manifest_buckets

# Sequence lengths are padded up to a multiple of this, so batches of nearby lengths share one
# compiled program (jit specialises on shapes; compiling SmolLM2's train step takes seconds).
SEQ_LEN_MULTIPLE = 16
MESH_AXIS = "data"
TRAIN_STATE_JSON = "jax_train_state.json"
TRAIN_STATE_TENSORS = "jax_train_state.safetensors"
CHECKPOINT_FORMAT_VERSION = 1
# Files of the model directory that a checkpoint does not copy (we write our own weights).
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".gguf", ".lock")


# ---------------------------------------------------------------------------------------------
# The LR schedule (checked against config.learning_rate_at by the tests).


def make_schedule(optimizer: OptimizerConfig, scheduler: SchedulerConfig) -> optax.Schedule:
    """Linear warmup from 0 to the peak over warmup_steps, then cosine decay to
    min_lr_ratio x peak at total_steps, constant afterwards: `learning_rate_at` as an optax
    schedule of the 0-based optimizer step."""
    peak = optimizer.learning_rate
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=scheduler.warmup_steps,
        decay_steps=scheduler.total_steps,
        end_value=peak * scheduler.min_lr_ratio,
    )


def make_optimizer_from(
    optimizer: OptimizerConfig, scheduler: SchedulerConfig, max_grad_norm: float | None
) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) (unless None), then AdamW on the schedule; weight decay
    applies to every parameter, as torch.optim.AdamW(model.parameters())."""
    adamw = optax.adamw(
        make_schedule(optimizer, scheduler),
        b1=optimizer.beta1,
        b2=optimizer.beta2,
        eps=optimizer.eps,
        weight_decay=optimizer.weight_decay,
    )
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


# ---------------------------------------------------------------------------------------------
# jit-compiled programs. Module level with the graphdef (hashable) as a static argument, so every
# JaxPolicy of the same architecture shares the compiled programs.


def _forward_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids_BS: jax.Array,
    input_lengths_B: jax.Array,
    remat: bool,
    compute_dtype: Any,
) -> jax.Array:
    if compute_dtype != jnp.float32:
        # Mixed precision: float32 master weights, the forward in compute_dtype; the cast's
        # transpose brings the gradients back to float32.
        params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    positions_S = jnp.arange(input_ids_BS.shape[1])
    attention_mask_BS = positions_S[None, :] < input_lengths_B[:, None]
    logits_BSV = model(input_ids_BS, attention_mask_BS, remat=remat)
    return llama_nnx.token_logprobs(logits_BSV, input_ids_BS, input_lengths_B)


@partial(jax.jit, static_argnums=(0, 4))
def _logprobs_jit(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids_BS: jax.Array,
    input_lengths_B: jax.Array,
    compute_dtype: Any,
) -> jax.Array:
    return _forward_logprobs(graphdef, params, input_ids_BS, input_lengths_B, False, compute_dtype)


# The accumulator is donated: XLA adds into its buffer instead of allocating another copy of
# the gradients per microbatch.
@partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=5)
def _accumulate_ported(
    graphdef: nnx.GraphDef,
    loss_config: ClippedPGLossConfig,
    remat: bool,
    compute_dtype: Any,
    params: nnx.State,
    grads_acc: nnx.State,
    mb: dict[str, jax.Array],
    token_norm: jax.Array,
    seq_norm: jax.Array,
) -> tuple[nnx.State, dict[str, jax.Array]]:
    """grads_acc + d loss(mb) / d params, and the microbatch's metrics."""

    def loss_of(p: nnx.State) -> tuple[jax.Array, dict[str, jax.Array]]:
        logprobs_BS = _forward_logprobs(
            graphdef, p, mb["input_ids"], mb["input_lengths"], remat, compute_dtype
        )
        loss_inputs = {k: v for k, v in mb.items() if k not in ("input_ids", "input_lengths")}
        return clipped_pg_loss(loss_config, logprobs_BS, loss_inputs, token_norm, seq_norm)

    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    return jax.tree.map(jnp.add, grads_acc, grads), metrics


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4)
def _accumulate_cotangent(
    graphdef: nnx.GraphDef,
    remat: bool,
    compute_dtype: Any,
    params: nnx.State,
    grads_acc: nnx.State,
    input_ids_BS: jax.Array,
    input_lengths_B: jax.Array,
    cotangent_BS: jax.Array,
) -> nnx.State:
    """grads_acc + the VJP of the log-probs with `cotangent_BS` (d loss / d logprobs)."""
    _, vjp = jax.vjp(
        lambda p: _forward_logprobs(
            graphdef, p, input_ids_BS, input_lengths_B, remat, compute_dtype
        ),
        params,
    )
    (grads,) = vjp(cotangent_BS)
    return jax.tree.map(jnp.add, grads_acc, grads)


_zeros_like_jit = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))


@dataclasses.dataclass(frozen=True)
class _OptimizerPrograms:
    """The optimizer's jit-compiled programs for one (optimizer config, mesh)."""

    init: Any  # params -> opt_state, replicated on the mesh
    update: Any  # (params, opt_state, grads) -> (params, opt_state, pre-clip grad norm)
    learning_rate_at: Any  # step -> the schedule's learning rate


@functools.lru_cache(maxsize=16)
def _optimizer_programs(
    optimizer: OptimizerConfig, scheduler: SchedulerConfig, max_grad_norm: float | None, mesh: Mesh
) -> _OptimizerPrograms:
    """Shared by every JaxPolicy with the same hyper-parameters and mesh, so a new policy (tests,
    resumes) reuses the compiled update instead of compiling it again."""
    schedule = make_schedule(optimizer, scheduler)
    tx = make_optimizer_from(optimizer, scheduler, max_grad_norm)
    replicated = NamedSharding(mesh, P())

    def update(
        params: nnx.State, opt_state: Any, grads: nnx.State
    ) -> tuple[nnx.State, Any, jax.Array]:
        grad_norm = optax.tree.norm(grads)  # before clipping, as the interface reports it
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grad_norm

    # Explicit output placement: the state that comes out of a step has the same shardings as
    # the state that goes in, so the second step does not compile another variant.
    return _OptimizerPrograms(
        init=jax.jit(tx.init, out_shardings=replicated),
        # Donates the optimizer state and gradients (never the params:
        # the frozen reference may be the very same arrays).
        update=jax.jit(update, out_shardings=replicated, donate_argnums=(1, 2)),
        learning_rate_at=jax.jit(schedule),
    )


# ---------------------------------------------------------------------------------------------
# Batch checks and host-side preparation.


def _to_numpy(t: torch.Tensor, dtype: Any) -> np.ndarray:
    return t.detach().to("cpu").numpy().astype(dtype)


def _torch_from_numpy(a: np.ndarray) -> torch.Tensor:
    # torch.from_numpy knows no bfloat16 (ml_dtypes): move the bits through int16.
    if not a.flags.writeable:  # jax host buffers are read-only; torch wants writable memory
        a = np.array(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class JaxPolicy(PolicyInterface):
    """flax.nnx Llama-family policy on a jax Mesh (see the module docstring)."""

    def __init__(
        self,
        cfg: PolicyConfig,
        *,
        cache_dir: str | os.PathLike | None = None,
        resume_from: str | os.PathLike | None = None,
        tokenizer_dir: str | os.PathLike | None = None,
    ):
        """Loads the model and builds the mesh and optimizer; fails fast on bad config.

        Args:
            cfg: the `policy` section; `cfg.backend` must be "jax".
            cache_dir: the model zoo's cache directory (None: the zoo's default).
            resume_from: a directory written by `save_checkpoint` to restore right after loading
                the model (None: start from `cfg.model`'s weights at step 0).
            tokenizer_dir: where checkpoints copy the tokenizer from (None: the model directory).

        Raises ValueError naming the key: policy.backend is not "jax", policy.dp_size does not
        divide the number of jax devices, policy.model is neither a zoo name nor a checkpoint
        directory (or is an architecture llama_nnx does not cover), resume_from is not a
        complete checkpoint of this model, tokenizer_dir is not a directory.
        """
        if not isinstance(cfg, PolicyConfig):
            raise ValueError(
                f"JaxPolicy needs a PolicyConfig, got {type(cfg).__name__}; build it "
                f"with from_dict(PolicyConfig, yaml['policy'], 'policy')"
            )
        if cfg.backend != "jax":
            raise ValueError(
                f"policy.backend is {cfg.backend!r} but JaxPolicy is the 'jax' "
                f"backend; create policies through models/policy/factory.py"
            )
        if cfg.logprob_temperature not in (None, 1.0):
            raise ValueError(
                f"policy.logprob_temperature: the jax backend computes log-probs at "
                f"temperature 1 only, got {cfg.logprob_temperature}; sample at "
                "generation.temperature 1.0 or use policy.backend: dtensor"
            )
        self.cfg = cfg
        devices = jax.devices()
        if len(devices) % cfg.dp_size:
            hint = (
                " (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax "
                "is imported to get N host devices)"
                if devices[0].platform == "cpu"
                else ""
            )
            raise ValueError(
                f"policy.dp_size={cfg.dp_size} must divide the number of jax "
                f"devices ({len(devices)} {devices[0].platform} device(s)); set "
                f"policy.dp_size to a divisor of {len(devices)}{hint}"
            )
        self.mesh = Mesh(np.array(devices[: cfg.dp_size]), (MESH_AXIS,))
        self._replicated = NamedSharding(self.mesh, P())
        self._batch_sharded = NamedSharding(self.mesh, P(MESH_AXIS))
        try:
            self.model_dir = zoo.resolve_model(cfg.model, cache_dir=cache_dir)
        except ValueError as e:
            raise ValueError(f"policy.model: {e}") from None
        self.tokenizer_dir = (
            pathlib.Path(tokenizer_dir) if tokenizer_dir is not None else self.model_dir
        )
        if not self.tokenizer_dir.is_dir():
            raise ValueError(
                f"tokenizer_dir {str(self.tokenizer_dir)!r} is not a directory; pass "
                f"the directory holding tokenizer.json (default: the model directory)"
            )
        try:
            self.model_config, self._graphdef, params = llama_nnx.load_model(
                self.model_dir, "float32"
            )
        except ValueError as e:
            raise ValueError(f"policy.model ({self.model_dir}): {e}") from None
        self._compute_dtype = llama_nnx.DTYPES[cfg.dtype]
        self._params = jax.device_put(params, self._replicated)
        self._reference_device = jax.devices("cpu")[0] if cfg.offload_reference_policy else None
        self._reference_params = (
            jax.device_put(params, self._reference_device)
            if self._reference_device is not None
            else self._params
        )
        self._optimizer = _optimizer_programs(
            cfg.optimizer, cfg.scheduler, cfg.max_grad_norm, self.mesh
        )
        self._opt_state = self._optimizer.init(self._params)
        self._step = 0
        self._rows_per_microbatch = cfg.micro_batch_size * cfg.dp_size
        self._closed = False
        if resume_from is not None:
            try:
                self.load_checkpoint(pathlib.Path(resume_from))
            except ValueError as e:
                raise ValueError(
                    f"resume_from: {e}; pass a directory written by "
                    f"save_checkpoint, or None to start from policy.model"
                ) from None

    # -- helpers ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("JaxPolicy was shut down; create a new policy")

    def _check_sequences(self, batch: Mapping[str, Any]) -> tuple[int, int]:
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"batch must be a BatchedDataDict (a mapping of key -> tensor), got "
                f"{type(batch).__name__}"
            )
        if "input_ids" not in batch:
            raise ValueError(
                f"batch is missing key 'input_ids' ((B, S) int64 token ids); it has "
                f"keys {sorted(batch)}"
            )
        ids = batch["input_ids"]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise ValueError(
                f"batch['input_ids'] must be a 2-D (B, S) integer torch.Tensor, got "
                f"{getattr(ids, 'shape', type(ids).__name__)} "
                f"{getattr(ids, 'dtype', '')}"
            )
        num_rows, seq_len = ids.shape
        if num_rows == 0 or seq_len == 0:
            raise ValueError(f"batch['input_ids'] is empty (shape {tuple(ids.shape)})")
        check_tensor(batch, "input_lengths", (num_rows,), "(B,) number of real tokens per row")
        lengths = batch["input_lengths"]
        if bool((lengths < 1).any()) or bool((lengths > seq_len).any()):
            raise ValueError(
                f"batch['input_lengths'] must lie in [1, {seq_len}] (the padded "
                f"length S); got min {int(lengths.min())}, max {int(lengths.max())}"
            )
        max_positions = self.model_config.max_position_embeddings
        if seq_len > max_positions:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's context "
                f"(max_position_embeddings={max_positions})"
            )
        if bool((ids < 0).any()) or bool((ids >= self.model_config.vocab_size).any()):
            raise ValueError(
                f"batch['input_ids'] holds ids outside [0, "
                f"{self.model_config.vocab_size}) (the model's vocab_size)"
            )
        return num_rows, seq_len

    def _padded_arrays(
        self, batch: Mapping[str, Any], keys: tuple[str, ...], num_rows: int, seq_len: int
    ) -> dict[str, np.ndarray]:
        """Host arrays of `keys`, padded to (multiple of rows per microbatch, SEQ_LEN_MULTIPLE).

        Padded rows get input_lengths 1 (a valid forward pass) and all-zero masks: no loss."""
        padded_rows = _round_up(num_rows, self._rows_per_microbatch)
        padded_len = _round_up(seq_len, SEQ_LEN_MULTIPLE)
        out = {}
        for key in keys:
            value = batch[key]
            if key in ("input_ids", "input_lengths"):
                a = _to_numpy(value, np.int32)
            else:
                a = _to_numpy(value, np.float32)
            widths = [(0, padded_rows - num_rows)] + [(0, padded_len - seq_len)] * (a.ndim - 1)
            a = np.pad(a, widths)
            if key == "input_lengths":
                a[num_rows:] = 1
            out[key] = a
        return out

    def _microbatches(self, arrays: Mapping[str, np.ndarray]) -> Iterator[dict[str, jax.Array]]:
        num_padded_rows = next(iter(arrays.values())).shape[0]
        for start in range(0, num_padded_rows, self._rows_per_microbatch):
            end = start + self._rows_per_microbatch
            yield {k: jax.device_put(v[start:end], self._batch_sharded) for k, v in arrays.items()}

    def _logprobs(self, params: nnx.State, batch: BatchedDataDict) -> torch.Tensor:
        self._check_open()
        num_rows, seq_len = self._check_sequences(batch)
        arrays = self._padded_arrays(batch, ("input_ids", "input_lengths"), num_rows, seq_len)
        chunks = [
            _logprobs_jit(
                self._graphdef, params, mb["input_ids"], mb["input_lengths"], self._compute_dtype
            )
            for mb in self._microbatches(arrays)
        ]
        logprobs_BS = np.concatenate([np.asarray(c) for c in chunks])[:num_rows, :seq_len]
        return torch.from_numpy(np.ascontiguousarray(logprobs_BS, dtype=np.float32))

    # -- PolicyInterface -------------------------------------------------------------------------

    def get_logprobs(self, batch: BatchedDataDict) -> torch.Tensor:
        return self._logprobs(self._params, batch)

    def get_reference_policy_logprobs(self, batch: BatchedDataDict) -> torch.Tensor:
        params = self._reference_params
        if self._reference_device is not None:
            params = jax.device_put(params, self._replicated)
        return self._logprobs(params, batch)

    def train(self, batch: BatchedDataDict, loss_fn: LossFunction) -> dict[str, float]:
        self._check_open()
        start = time.perf_counter()
        num_rows, seq_len = self._check_sequences(batch)
        ported = isinstance(loss_fn, ClippedPGLossFn)
        if not callable(loss_fn):
            raise ValueError(
                f"loss_fn must be a LossFunction (e.g. ClippedPGLossFn), got "
                f"{type(loss_fn).__name__}"
            )
        # Validates token_mask / sample_mask (shape, 0/1) before anything changes.
        num_valid_tokens, num_valid_sequences = count_valid(batch)
        if ported:
            loss_keys = list(loss_fn.required_batch_keys)
            # Optional keys travel when present: the reference KL is reported as a metric, and
            # prev_logprobs is absent only on a batch's single on-policy step (loss_functions).
            for key in ("reference_policy_logprobs", "prev_logprobs"):
                if key in batch and key not in loss_keys:
                    loss_keys.append(key)
            for key in loss_keys:
                shape = (num_rows,) if key == "sample_mask" else (num_rows, seq_len)
                check_tensor(batch, key, shape, "required by the loss function's config")
            arrays = self._padded_arrays(
                batch, ("input_ids", "input_lengths", *loss_keys), num_rows, seq_len
            )
            grads, metrics = self._grads_ported(
                loss_fn.config, arrays, num_valid_tokens, num_valid_sequences
            )
        else:
            grads, metrics = self._grads_wrapped(
                batch, loss_fn, num_rows, seq_len, num_valid_tokens, num_valid_sequences
            )
        learning_rate = float(self._optimizer.learning_rate_at(self._step))
        self._params, self._opt_state, grad_norm = self._optimizer.update(
            self._params, self._opt_state, grads
        )
        grad_norm = float(grad_norm)  # blocks until the step is done
        self._step += 1
        elapsed = time.perf_counter() - start
        num_tokens = int(batch["input_lengths"].sum())
        metrics.update(
            grad_norm=grad_norm,
            learning_rate=learning_rate,
            num_tokens=float(num_tokens),
            tokens_per_second=num_tokens / elapsed,
            step_seconds=elapsed,
        )
        return metrics

    def _grads_ported(
        self,
        loss_config: ClippedPGLossConfig,
        arrays: dict[str, np.ndarray],
        num_valid_tokens: int,
        num_valid_sequences: int,
    ) -> tuple[nnx.State, dict[str, float]]:
        token_norm = jnp.float32(max(num_valid_tokens, 1))
        seq_norm = jnp.float32(max(num_valid_sequences, 1))
        grads = jax.device_put(_zeros_like_jit(self._params), self._replicated)
        mb_metrics = []
        for mb in self._microbatches(arrays):
            grads, metrics = _accumulate_ported(
                self._graphdef,
                loss_config,
                self.cfg.activation_checkpointing,
                self._compute_dtype,
                self._params,
                grads,
                mb,
                token_norm,
                seq_norm,
            )
            mb_metrics.append(metrics)
        return grads, _combine(jax.device_get(mb_metrics))

    def _grads_wrapped(
        self,
        batch: BatchedDataDict,
        loss_fn: LossFunction,
        num_rows: int,
        seq_len: int,
        num_valid_tokens: int,
        num_valid_sequences: int,
    ) -> tuple[nnx.State, dict[str, float]]:
        """A torch loss callable: torch autograd gives d loss / d logprobs, jax the rest."""
        arrays = self._padded_arrays(batch, ("input_ids", "input_lengths"), num_rows, seq_len)
        grads = jax.device_put(_zeros_like_jit(self._params), self._replicated)
        mb_metrics = []
        rows = self._rows_per_microbatch
        for index, mb in enumerate(self._microbatches(arrays)):
            # Padding rows (all in the last microbatch) get a zero cotangent: no gradient.
            start, end = index * rows, min((index + 1) * rows, num_rows)
            logprobs = _logprobs_jit(
                self._graphdef,
                self._params,
                mb["input_ids"],
                mb["input_lengths"],
                self._compute_dtype,
            )
            logprobs_BS = torch.from_numpy(np.array(logprobs)[: end - start, :seq_len])
            logprobs_BS.requires_grad_(True)
            loss, metrics = loss_fn(
                logprobs_BS, batch.slice(start, end), num_valid_tokens, num_valid_sequences
            )
            loss.backward()
            cotangent = np.zeros(logprobs.shape, np.float32)
            cotangent[: end - start, :seq_len] = logprobs_BS.grad.numpy()
            grads = _accumulate_cotangent(
                self._graphdef,
                self.cfg.activation_checkpointing,
                self._compute_dtype,
                self._params,
                grads,
                mb["input_ids"],
                mb["input_lengths"],
                jax.device_put(cotangent, self._batch_sharded),
            )
            mb_metrics.append({k: float(v) for k, v in metrics.items()})
        return grads, _combine(mb_metrics)

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        self._check_open()
        # Refit sends the weights in the compute dtype (what the engine runs in).
        dtype = refit_packer.DTYPES[self.cfg.dtype]
        return {
            name: (shape, dtype)
            for name, shape in llama_nnx.hf_names_and_shapes(self.model_config).items()
        }

    def iter_refit_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._check_open()
        for name, array in llama_nnx.iter_hf_weights(
            self.model_config, nnx.to_pure_dict(self._params)
        ):
            yield name, _torch_from_numpy(array.astype(self._compute_dtype, copy=False))

    # -- weight-sync senders: in this process (in a training run, the fleet's worker actor, next
    # to the weights), fed by `iter_refit_weights`.

    def weight_sender_node_id(self) -> str | None:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict[str, Any], options: dict[str, Any]
    ) -> dict[str, Any]:
        return sender_sessions.open_session(session, transport, manifest_dict, options)

    def send_weights(
        self, session: str, manifest_dict: dict[str, Any], version: int
    ) -> dict[str, float]:
        manifest = refit_packer.Manifest.from_dict(manifest_dict)
        return sender_sessions.send_weights(
            session, manifest, version, iter_manifest_buckets(manifest, self.iter_refit_weights())
        )

    def close_weight_sender(self, session: str) -> None:
        sender_sessions.close_session(session)

    def _write_hf(self, tmp: pathlib.Path) -> None:
        """The float32 weights in HF names and layouts, config and tokenizer files in `tmp`."""
        from safetensors.numpy import save_file

        weights = dict(llama_nnx.iter_hf_weights(self.model_config, nnx.to_pure_dict(self._params)))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for source in (self.model_dir, self.tokenizer_dir):
            for path in sorted(source.iterdir()):
                if (
                    path.is_file()
                    and not path.name.startswith(".")
                    and not path.name.endswith(_NOT_COPIED)
                    and path.name != "model.safetensors.index.json"
                    and not (tmp / path.name).exists()
                ):
                    shutil.copy2(path, tmp / path.name)
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        hf_config["dtype"] = "float32"  # the master weights we wrote
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    def export_hf(self, directory: pathlib.Path) -> None:
        self._check_open()
        publish_directory(pathlib.Path(directory), self._write_hf)

    def save_checkpoint(self, directory: pathlib.Path, *, export_hf: bool = True) -> None:
        """The HF files are this backend's resume weights: written whatever `export_hf` says."""
        from safetensors.numpy import save_file

        self._check_open()

        def write(tmp: pathlib.Path) -> None:
            self._write_hf(tmp)
            leaves, treedef = jax.tree.flatten(self._opt_state)
            save_file(
                {
                    f"optimizer.{i}": np.asarray(jax.device_get(leaf))
                    for i, leaf in enumerate(leaves)
                },
                str(tmp / TRAIN_STATE_TENSORS),
            )
            state = {
                "format_version": CHECKPOINT_FORMAT_VERSION,
                "step": self._step,
                "compute_dtype": self.cfg.dtype,
                "model_config": dataclasses.asdict(self.model_config),
                "optimizer_treedef": str(treedef),
                "num_optimizer_leaves": len(leaves),
            }
            # Written last: a directory without it is incomplete (load_checkpoint refuses it).
            (tmp / TRAIN_STATE_JSON).write_text(json.dumps(state, indent=2) + "\n")

        publish_directory(directory, write)

    def load_checkpoint(self, directory: pathlib.Path) -> None:
        from safetensors.numpy import load_file

        self._check_open()
        directory = pathlib.Path(directory)
        state_path = directory / TRAIN_STATE_JSON
        if not directory.is_dir():
            raise ValueError(f"checkpoint directory {str(directory)!r} does not exist")
        if not state_path.is_file() or not (directory / TRAIN_STATE_TENSORS).is_file():
            raise ValueError(
                f"checkpoint directory {str(directory)!r} is incomplete (no "
                f"{TRAIN_STATE_JSON} / {TRAIN_STATE_TENSORS}); it was not written by "
                f"JaxPolicy.save_checkpoint or the save was interrupted"
            )
        state = json.loads(state_path.read_text())
        if state.get("format_version") != CHECKPOINT_FORMAT_VERSION:
            raise ValueError(
                f"checkpoint {str(directory)!r} has format_version "
                f"{state.get('format_version')!r}; this JaxPolicy reads "
                f"{CHECKPOINT_FORMAT_VERSION}"
            )
        if state["model_config"] != dataclasses.asdict(self.model_config):
            raise ValueError(
                f"checkpoint {str(directory)!r} was written for another model "
                f"({state['model_config']}); this policy (policy.model) is "
                f"{dataclasses.asdict(self.model_config)}"
            )
        leaves, treedef = jax.tree.flatten(self._opt_state)
        if state["optimizer_treedef"] != str(treedef) or state["num_optimizer_leaves"] != len(
            leaves
        ):
            raise ValueError(
                f"checkpoint {str(directory)!r} holds optimizer state of another "
                f"structure (policy.max_grad_norm or the optimizer changed since it "
                f"was written)"
            )
        try:
            pure = llama_nnx.params_from_hf(
                self.model_config, llama_nnx.load_hf_tensors(directory), jnp.float32
            )
        except ValueError as e:
            raise ValueError(f"checkpoint {str(directory)!r}: {e}") from None
        opt_tensors = load_file(str(directory / TRAIN_STATE_TENSORS))
        new_leaves = []
        for i, leaf in enumerate(leaves):
            saved = opt_tensors.get(f"optimizer.{i}")
            if saved is None or saved.shape != leaf.shape or saved.dtype != leaf.dtype:
                raise ValueError(
                    f"checkpoint {str(directory)!r}: optimizer tensor {i} is missing "
                    f"or has the wrong shape/dtype"
                )
            new_leaves.append(saved)
        params = jax.tree.map(lambda x: x, self._params)  # a new State of the same structure
        nnx.replace_by_pure_dict(params, pure)
        self._params = jax.device_put(params, self._replicated)
        self._opt_state = jax.device_put(jax.tree.unflatten(treedef, new_leaves), self._replicated)
        self._step = int(state["step"])

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by load_checkpoint)."""
        return self._step

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._params = self._opt_state = self._reference_params = None


def _combine(metrics_list: list[Mapping[str, Any]]) -> dict[str, float]:
    """Microbatch metrics -> global-batch metrics (max for MAX_METRICS, else sum)."""
    assert metrics_list
    return {
        key: float((max if key in MAX_METRICS else sum)(float(m[key]) for m in metrics_list))
        for key in metrics_list[0]
    }
