"""The DTensor/FSDP2 policy backend: any Hugging Face causal LM, sharded with `fully_shard`.

Layout. `DTensorPolicy` (the `PolicyInterface` the GRPO driver holds) is a controller over
`policy.dp_size` Ray actors, one per data-parallel rank, placed by a placement group (SPREAD, the
trainer fleet's strategy; on one machine the bundles simply share it). Each actor is a
`DTensorPolicyWorker`: it joins one torch process group (gloo on CPU, NCCL on GPU; rank 0's node
address and a free port found there), builds a 1-D DeviceMesh with axis "dp", loads the model with
`AutoModelForCausalLM` and shards it with `fully_shard` on every decoder layer (the classes the
model names in `_no_split_modules`) and then at the root. Parameters become DTensors sharded on dim
0 (`Shard(0)` over "dp"); each forward all-gathers one layer at a time and reshards after it.

Data flow. The controller validates a batch, shards it over the ranks with
`BatchedDataDict.shard_by_batch_size(dp_size, balance_by="input_lengths")` (equal sample counts,
balanced token counts), every rank cuts its shard into microbatches of `policy.micro_batch_size`
rows sorted longest first (length bucketing: a microbatch holds rows of similar length and is cut to
its longest row, so little compute goes to padding), and the results are put back in the original
order. Equal shard sizes matter beyond balance:
FSDP's per-layer collectives need every rank to run the same number of forward/backward passes.

Log-probs. A microbatch is cut to its longest row, the model runs without an attention mask (rows
are right-padded and attention is causal, so a real token never sees padding), and the fused
`gather_logprobs` kernel gathers log p(input_ids[t + 1] | input_ids[:t + 1]) from the logits at
position t; shifting it one column right gives the interface's alignment
(logprobs_BS[b, t] = log p(input_ids[b, t] | input_ids[b, :t]), 0 in column 0 and on padding).

Training (`train`): the loss's global normalisers come from `count_valid` over the whole global
batch, once, on the controller. Each rank accumulates gradients over its microbatches (gradient
reduce-scatter only after the last one), with the loss multiplied by the world size so that FSDP's
averaging reduce-scatter yields the SUM over ranks that the loss's aggregation needs (see
algorithms/loss_functions.py). Then: `clip_grad_norm_` over the DTensor gradients (the pre-clip
norm is reported), AdamW, and a LambdaLR step. The optimizer's base learning rate is 1.0 and the
LambdaLR factor is `learning_rate_at(step)` itself, so the rate used is exactly the shared schedule
(no peak * (lr / peak) rounding). With `policy.dtype: bfloat16` the parameters, gradients and
optimizer state stay float32 (master weights) and FSDP's mixed-precision policy computes in
bfloat16 and reduces gradients in float32.

Reference policy: a second, frozen FSDP model built from the same initial weights (loading a
checkpoint does not change it). With `policy.offload_reference_policy` on a GPU its shards live
in CPU memory and are copied to the device per layer during its forward pass (FSDP2's
CPUOffloadPolicy); on CPU it is on CPU anyway.

Refit seam: `prepare_refit_info` lists `named_parameters()` (HF names; a tied `lm_head.weight`
is omitted, as in a HF checkpoint, since it is the embedding itself), `iter_refit_weights`
gathers them with `DTensor.full_tensor()` in buckets (every rank joins the all-gather, rank 0
returns the tensors) and yields them in that order, cast to `policy.dtype`.

Checkpoints (`save_checkpoint`): `model.safetensors` (full float32 state dict, tied duplicates
dropped, gathered with `get_model_state_dict(full_state_dict=True, cpu_offload=True)`),
`config.json`, the tokenizer and generation config copied from the model directory, so
transformers and vLLM load it as an ordinary checkpoint; plus `optimizer.pt` (full optimizer state
dict), `scheduler.pt`, `rng_rank<r>.pt` per rank and the manifest `CHECKPOINT_MANIFEST`, written
last. Everything goes into a temporary sibling directory that is renamed into place, so a crash
leaves the previous checkpoint (or none) intact. Loading the same checkpoint with the same dp_size
resumes bit-exactly; with another dp_size the weights, optimizer and schedule still load exactly
but the per-rank RNG streams restart from `policy.seed`.

Not covered: tensor, pipeline, context or expert parallelism (the mesh is 1-D); sequence
packing into one row (microbatches are length-bucketed padded rows instead: token-budget packing
would give ranks different numbers of microbatches, which FSDP's lockstep collectives forbid); sharded
(multi-file) safetensors output; models whose decoder layers are not named in `_no_split_modules`;
checkpoints on file systems that the ranks do not share (each rank writes its RNG file itself);
recovering a worker group after a rank failed mid-collective (the group refuses further calls).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.algorithms.loss_functions import combine_metrics, count_valid
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict, invert_permutation
from dockyard_rl.kernels import refit_packer
from dockyard_rl.models import zoo
from dockyard_rl.models.policy.config import PolicyConfig, learning_rate_at
from dockyard_rl.models.policy.interfaces import LossFunction, PolicyInterface

logger = logging.getLogger(__name__)

CHECKPOINT_MANIFEST = "dockyard_checkpoint.json"
CHECKPOINT_FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
_OPTIMIZER_FILE = "optimizer.pt"
_SCHEDULER_FILE = "scheduler.pt"
# Config fields that must match for a checkpoint to belong to this model.
_IDENTITY_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "tie_word_embeddings")
# `iter_refit_weights` gathers in buckets of about this many bytes (the transports use their own
# `weight_sync.bucket_size_bytes`).
_REFIT_BUCKET_BYTES = 256 * 1024 * 1024
# How long to wait for the placement group before concluding the cluster cannot hold it.
_PLACEMENT_TIMEOUT_S = 120.0
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# The rank worker (runs inside a Ray actor)


def _read_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: instances of the classes in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"policy.model: {type(model).__name__} names no decoder layer classes in "
            f"_no_split_modules ({sorted(names)}), so it cannot be sharded per layer; use a "
            "Hugging Face causal LM that declares them (Llama, Qwen2, Mistral, ...)")
    return layers


def _tied_duplicate_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that are another parameter (tied weights) -> the name kept for it.

    `named_parameters()` yields a shared parameter once, under its first name (for tied
    embeddings `model.embed_tokens.weight`); a HF checkpoint holds that name only.
    """
    first_name: dict[int, str] = {}
    duplicates: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            duplicates[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return duplicates


def shifted_logprobs(model: torch.nn.Module, input_ids_BS: torch.Tensor,
                     input_lengths_B: torch.Tensor) -> torch.Tensor:
    """(B, S) float32 log-probs in the interface's alignment (see the module docstring).

    Differentiable when grad is enabled. Padding positions and column 0 are exactly 0.
    """
    from dockyard_rl.kernels.logprobs import gather_logprobs

    num_rows, width_full = input_ids_BS.shape
    width = int(input_lengths_B.max())
    ids_BS = input_ids_BS[:, :width]
    logits_BSV = model(input_ids=ids_BS, use_cache=False).logits
    # Targets are the ids shifted one left. The last column has no next token: it gets a dummy
    # valid id (its own) and is dropped below. Gathering from the full (B, S, V) logits keeps
    # them a view (no copy of the largest tensor of the step, as logits[:, :-1] would force).
    targets_BS = torch.cat([ids_BS[:, 1:], ids_BS[:, -1:]], dim=1)
    next_logprobs_BS = gather_logprobs(logits_BSV, targets_BS)
    # next_logprobs_BS[:, t] = log p(ids[t + 1] | ids[:t + 1]) -> column t + 1 of the output.
    logprobs_BS = torch.nn.functional.pad(next_logprobs_BS[:, :-1], (1, width_full - width))
    positions_S = torch.arange(width_full, device=logprobs_BS.device)
    valid_BS = (positions_S[None, :] >= 1) & (positions_S[None, :] < input_lengths_B.to(
        logprobs_BS.device)[:, None])
    return torch.where(valid_BS, logprobs_BS, 0.0)


def _length_order(shard: BatchedDataDict) -> list[int]:
    """Shard positions sorted longest first (stable), so that a microbatch holds rows of
    similar length and is cut to little more than its rows' own lengths (length bucketing)."""
    lengths = shard["input_lengths"].tolist()
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


class DTensorPolicyWorker:
    """One data-parallel rank. Created by `DTensorPolicy` as a Ray actor; not used directly.

    Every method that touches the model is collective: the controller calls it on all ranks at
    once with equally sized shards.
    """

    def __init__(self, cfg: PolicyConfig, rank: int, world_size: int):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size

    def node_address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for rank 0's process-group store."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, model_dir: str, master_addr: str, master_port: int,
              num_threads: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        cfg = self.cfg
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        # Ray exposes exactly the GPU of this actor's bundle, if any, as cuda:0.
        self.device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(num_threads)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                rank=self.rank, world_size=self.world_size)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,),
                                     mesh_dim_names=("dp",))
        self.model_dir = pathlib.Path(model_dir)
        torch.manual_seed(cfg.seed)
        self.model = self._build_model(trainable=True)
        self.reference_model = self._build_model(trainable=False)
        self.tied_duplicates = _tied_duplicate_names(self.model)
        self.refit_names = [name for name, _ in self.model.named_parameters()]
        opt = cfg.optimizer
        # Base lr 1.0 and a LambdaLR factor equal to the schedule: lr == learning_rate_at(step).
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1.0,
                                           betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: learning_rate_at(step, cfg.optimizer, cfg.scheduler))
        return {"max_position_embeddings": int(getattr(
            self.model.config, "max_position_embeddings", 0) or 0),
            "vocab_size": int(self.model.config.vocab_size)}

    def _build_model(self, trainable: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        cfg = self.cfg
        compute_dtype = _TORCH_DTYPES[cfg.dtype]
        # Trainable: float32 master weights, bf16 compute through FSDP's mixed precision.
        # Reference: loaded directly in the compute dtype (it has no optimizer state).
        load_dtype = torch.float32 if trainable else compute_dtype
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=load_dtype)
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        if trainable and compute_dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                                       reduce_dtype=torch.float32)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            if cfg.offload_reference_policy and self.device.type == "cuda":
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        if trainable and cfg.activation_checkpointing:
            # Non-reentrant torch.utils.checkpoint around every decoder layer (HF's own hook):
            # the recomputation re-runs FSDP's pre-forward all-gather of that layer.
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in _decoder_layers(model):
            fully_shard(layer, **kwargs)
        # The root group holds what is left: embeddings, final norm, (tied) lm_head.
        fully_shard(model, **kwargs)
        if "offload_policy" not in kwargs:
            model.to(self.device)
        return model

    # -- log-probs

    def get_logprobs(self, shard: BatchedDataDict, reference: bool) -> torch.Tensor:
        model = self.reference_model if reference else self.model
        model.eval()
        order = _length_order(shard)
        pieces_BS = []
        with torch.no_grad():
            for mb in shard.select_indices(order).make_microbatch_iterator(
                    self.cfg.micro_batch_size, allow_partial=True):
                pieces_BS.append(shifted_logprobs(model, mb["input_ids"].to(self.device),
                                                  mb["input_lengths"]).cpu())
        return torch.cat(pieces_BS, dim=0)[invert_permutation(order)]

    # -- training

    def train(self, shard: BatchedDataDict, loss_fn: LossFunction,
              global_num_valid_tokens: int, global_num_valid_sequences: int) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        model = self.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Microbatch order does not change the summed loss; length order cuts padding.
        microbatches = list(shard.select_indices(_length_order(shard)).make_microbatch_iterator(
            self.cfg.micro_batch_size, allow_partial=True))
        metrics_list = []
        for index, mb in enumerate(microbatches):
            # Accumulate unsharded gradients locally; reduce-scatter once, after the last.
            model.set_requires_gradient_sync(index == len(microbatches) - 1)
            logprobs_BS = shifted_logprobs(model, mb["input_ids"].to(self.device),
                                           mb["input_lengths"])
            loss, metrics = loss_fn(logprobs_BS, mb, global_num_valid_tokens,
                                    global_num_valid_sequences)
            # FSDP averages gradients over ranks; the loss's pieces must be summed instead.
            (loss * self.world_size).backward()
            metrics_list.append(metrics)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        # With max_norm = inf the clip coefficient is clamped to 1.0: gradients are untouched.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"metrics": metrics_list, "grad_norm": float(grad_norm),
                "learning_rate": float(learning_rate)}

    def step_count(self) -> int:
        return int(self.scheduler.last_epoch)

    # -- refit

    def refit_info(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        params = dict(self.model.named_parameters())
        dtype = _TORCH_DTYPES[self.cfg.dtype]
        return [(name, tuple(params[name].shape), dtype) for name in self.refit_names]

    def gather_weights(self, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """Full tensors of `names` (collective); rank 0 returns them, other ranks None."""
        from torch.distributed.tensor import DTensor

        params = dict(self.model.named_parameters())
        dtype = _TORCH_DTYPES[self.cfg.dtype]
        out = {}
        for name in names:
            param = params[name].detach()
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if self.rank == 0:
                out[name] = full.to(device="cpu", dtype=dtype)
        return out if self.rank == 0 else None

    def iter_full_buckets(self, manifest: refit_packer.Manifest
                          ) -> Iterator[tuple[int, dict[str, torch.Tensor] | None]]:
        """(bucket index, full tensors of that bucket) on rank 0, (index, None) elsewhere.
        Collective: every rank must iterate to the end, in step."""
        for b in range(manifest.num_buckets):
            yield b, self.gather_weights([e.name for e in manifest.bucket_entries(b)])

    def weight_sender_node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def open_weight_sender(self, session: str, transport: str, manifest_dict: dict,
                           options: dict) -> dict[str, Any]:
        from dockyard_rl.weight_sync import sender

        return sender.open_session(session, transport, manifest_dict, options)

    def send_weights(self, session: str, manifest_dict: dict,
                     version: int) -> dict[str, float] | None:
        """Collective: every rank gathers each bucket; rank 0 sends it (weight_sync/sender.py)."""
        from dockyard_rl.weight_sync import sender

        manifest = refit_packer.Manifest.from_dict(manifest_dict)
        buckets = self.iter_full_buckets(manifest)
        if self.rank != 0:
            for _ in buckets:
                pass
            return None
        try:
            return sender.send_weights(session, manifest, version, buckets)
        except BaseException:
            for _ in buckets:  # finish the all-gathers, so the other ranks are not left waiting
                pass
            raise

    def close_weight_sender(self, session: str) -> None:
        from dockyard_rl.weight_sync import sender

        sender.close_session(session)

    # -- checkpoints

    def save_checkpoint(self, directory: str) -> None:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        directory = pathlib.Path(directory)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # Both are collectives; with cpu_offload only rank 0 receives the full dicts.
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        torch.save(self._rng_state(), directory / f"rng_rank{self.rank}.pt")
        if self.rank != 0:
            return
        # A HF checkpoint holds a tied weight once; safetensors also refuses shared storage.
        weights = {name: tensor.contiguous() for name, tensor in model_state.items()
                   if name not in self.tied_duplicates}
        save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})
        self.model.config.save_pretrained(directory)
        for source in self.model_dir.iterdir():
            # Tokenizer, generation config, chat template: everything but weights and config.
            if (source.is_file() and not source.name.startswith(".")
                    and source.name != "config.json"
                    and not source.name.endswith((".safetensors", ".bin", ".pt", ".pth",
                                                  ".index.json"))):
                shutil.copy2(source, directory / source.name)
        torch.save(optimizer_state, directory / _OPTIMIZER_FILE)
        torch.save(self.scheduler.state_dict(), directory / _SCHEDULER_FILE)

    def load_checkpoint(self, directory: str) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        directory = pathlib.Path(directory)
        weights = load_file(directory / WEIGHTS_FILE)
        for duplicate, kept in self.tied_duplicates.items():
            weights[duplicate] = weights[kept]
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, weights, options=options)
        optimizer_state = torch.load(directory / _OPTIMIZER_FILE, weights_only=True)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)
        self.scheduler.load_state_dict(torch.load(directory / _SCHEDULER_FILE,
                                                  weights_only=True))
        rng_file = directory / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            self._set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            torch.manual_seed(self.cfg.seed + self.rank)

    def _rng_state(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def memory_stats(self, reset: bool) -> dict[str, int]:
        """Peak memory of this rank since the last reset: resident set high-water mark (VmHWM)
        and, on GPU, torch's peak allocated device memory. `reset` starts a new window."""
        stats = {"peak_rss_bytes": _read_status_bytes("VmHWM")}
        if self.device.type == "cuda":
            stats["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        if reset:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            except OSError:
                pass
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        return stats

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The controller (runs in the driver)


def _ensure_ray(num_cpus: int) -> None:
    # 127.0.0.1 only: nothing of the cluster is reachable from outside this machine.
    init_local_ray(num_cpus=num_cpus, log_to_driver=False)


def _checkpoint_dir_problem(directory: pathlib.Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is."""
    if not directory.is_dir():
        return "no such directory"
    missing = [name for name in (CHECKPOINT_MANIFEST, WEIGHTS_FILE, "config.json",
                                 _OPTIMIZER_FILE, _SCHEDULER_FILE)
               if not (directory / name).is_file()]
    if missing:
        return f"incomplete checkpoint, missing {missing}"
    return None


class DTensorPolicy(PolicyInterface):
    """`PolicyInterface` over `cfg.dp_size` FSDP2 rank actors (see the module docstring).

    Args:
        cfg: the `policy` config section (`cfg.backend` is not checked here; the factory
            dispatches on it).
        cache_dir: the model zoo's cache directory (None: the zoo's default).
        resume_from: a checkpoint directory written by `save_checkpoint` to restore right
            after loading the model (None: start from `cfg.model`'s weights).

    Raises:
        ValueError: `policy.model` is neither a zoo name nor a HF directory, `resume_from` is
            not a complete checkpoint of this model, or the Ray cluster cannot place
            `policy.dp_size` ranks.
    """

    def __init__(self, cfg: PolicyConfig, *, cache_dir: str | os.PathLike | None = None,
                 resume_from: str | os.PathLike | None = None):
        if not isinstance(cfg, PolicyConfig):
            raise ValueError(f"DTensorPolicy needs a PolicyConfig, got {type(cfg).__name__}; "
                             "build it with from_dict(PolicyConfig, yaml['policy'], 'policy')")
        self.cfg = cfg
        self._actors: list[Any] = []
        self._placement_group = None
        self._broken: str | None = None
        self._refit_info: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        # Fail fast, before any actor starts: the model and the checkpoint must exist.
        try:
            self.model_dir = zoo.resolve_model(cfg.model, cache_dir=cache_dir)
        except ValueError as error:
            raise ValueError(f"policy.model: {error}") from None
        if resume_from is not None:
            resume_from = pathlib.Path(resume_from)
            problem = _checkpoint_dir_problem(resume_from)
            if problem is not None:
                raise ValueError(f"resume_from: {str(resume_from)!r}: {problem}; pass a "
                                 "directory written by save_checkpoint, or None to start from "
                                 "policy.model")
            self._check_checkpoint_identity(resume_from)
        self._start_workers()
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    # -- worker group

    def _start_workers(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        dp_size = self.cfg.dp_size
        num_host_cpus = os.cpu_count() or 1
        _ensure_ray(max(num_host_cpus, dp_size))
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        if 0 < num_gpus < dp_size:
            raise ValueError(f"policy.dp_size: {dp_size} ranks need one GPU each but the Ray "
                             f"cluster has {num_gpus}; set policy.dp_size <= {num_gpus}")
        use_gpu = num_gpus > 0
        bundle = {"CPU": 1, **({"GPU": 1} if use_gpu else {})}
        self._placement_group = placement_group([dict(bundle) for _ in range(dp_size)],
                                                strategy="SPREAD")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            resources = ray.available_resources()
            self.shutdown()
            raise ValueError(
                f"policy.dp_size: the Ray cluster cannot place {dp_size} ranks of {bundle} "
                f"within {_PLACEMENT_TIMEOUT_S:.0f} s (available: {resources}); lower "
                "policy.dp_size or add nodes")
        worker_cls = ray.remote(DTensorPolicyWorker)
        # Workers import dockyard_rl from the driver's import path.
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH", ""), *_import_roots()) if p)}}
        self._actors = [
            worker_cls.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0, runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank),
            ).remote(self.cfg, rank, dp_size)
            for rank in range(dp_size)
        ]
        master_addr, master_port = ray.get(self._actors[0].node_address.remote())
        # CPU ranks share this machine's cores (torch would otherwise start one thread per core
        # in every rank and oversubscribe them).
        num_threads = max(1, num_host_cpus // dp_size)
        infos = self._call_all("setup", str(self.model_dir), master_addr, master_port,
                               num_threads)
        self._max_positions = infos[0]["max_position_embeddings"]
        self._vocab_size = infos[0]["vocab_size"]

    def _call_all(self, method: str, *args: Any, per_rank_args: Sequence[tuple] | None = None
                  ) -> list[Any]:
        """Calls `method` on every rank and waits for all; raises the first failure promptly.

        A rank that fails mid-collective leaves the others blocked in it, so waiting on all
        results in order could hang; after a failure the group is marked unusable.
        """
        import ray

        if self._broken is not None:
            raise RuntimeError(f"the policy worker group failed earlier ({self._broken}); "
                               "shut it down and create a new policy (restoring a checkpoint)")
        if not self._actors:
            raise RuntimeError("the policy was shut down; create a new one")
        refs = [getattr(actor, method).remote(*(per_rank_args[rank] if per_rank_args else args))
                for rank, actor in enumerate(self._actors)]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as error:
                self._broken = f"{method} failed on a rank: {type(error).__name__}"
                raise
        return ray.get(refs)

    # -- batch checks

    def _check_batch(self, batch: BatchedDataDict, extra_keys: Sequence[str] = ()) -> None:
        if not isinstance(batch, BatchedDataDict):
            raise ValueError(f"batch must be a BatchedDataDict, got {type(batch).__name__}")
        required = ("input_ids", "input_lengths", *extra_keys)
        missing = [key for key in required if key not in batch]
        if missing:
            raise ValueError(f"batch is missing key(s) {missing}; it has {sorted(batch)} (see "
                             "the batch layout in models/policy/interfaces.py)")
        batch_size = batch.batch_size
        ids_BS, lengths_B = batch["input_ids"], batch["input_lengths"]
        if not isinstance(ids_BS, torch.Tensor) or ids_BS.dim() != 2 \
                or ids_BS.dtype != torch.int64:
            raise ValueError(f"batch['input_ids'] must be a (B, S) int64 tensor, got "
                             f"{getattr(ids_BS, 'shape', type(ids_BS).__name__)} "
                             f"{getattr(ids_BS, 'dtype', '')}")
        if not isinstance(lengths_B, torch.Tensor) or lengths_B.dim() != 1 \
                or lengths_B.dtype.is_floating_point:
            raise ValueError("batch['input_lengths'] must be a (B,) integer tensor")
        width = ids_BS.shape[1]
        if batch_size and (int(lengths_B.min()) < 1 or int(lengths_B.max()) > width):
            raise ValueError(f"batch['input_lengths'] must be in [1, {width}] (the width of "
                             f"input_ids), got min {int(lengths_B.min())}, max "
                             f"{int(lengths_B.max())}")
        if self._max_positions and width > self._max_positions:
            raise ValueError(f"input_ids has {width} positions but the model's context is "
                             f"{self._max_positions} (max_position_embeddings); truncate the "
                             "sequences")
        if batch_size and (int(ids_BS.min()) < 0 or int(ids_BS.max()) >= self._vocab_size):
            raise ValueError(f"batch['input_ids'] holds ids outside [0, {self._vocab_size}) "
                             "(the model's vocabulary)")
        for key in extra_keys:
            value = batch[key]
            if isinstance(value, torch.Tensor) and value.dim() == 2 \
                    and tuple(value.shape) != tuple(ids_BS.shape):
                raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}, expected "
                                 f"{tuple(ids_BS.shape)} (aligned with input_ids)")
        if batch_size == 0 or batch_size % self.cfg.dp_size != 0:
            raise ValueError(
                f"batch size {batch_size} is not a positive multiple of policy.dp_size="
                f"{self.cfg.dp_size}: every data-parallel rank needs the same number of "
                f"samples; send batches of a multiple of {self.cfg.dp_size} samples (e.g. set "
                "the GRPO batch so that it divides) or change policy.dp_size")

    def _shard(self, batch: BatchedDataDict, keys: Sequence[str]):
        return batch.select_keys(keys).shard_by_batch_size(self.cfg.dp_size,
                                                           balance_by="input_lengths")

    # -- PolicyInterface

    def get_logprobs(self, batch: BatchedDataDict) -> torch.Tensor:
        return self._logprobs(batch, reference=False)

    def get_reference_policy_logprobs(self, batch: BatchedDataDict) -> torch.Tensor:
        return self._logprobs(batch, reference=True)

    def _logprobs(self, batch: BatchedDataDict, reference: bool) -> torch.Tensor:
        self._check_batch(batch)
        sharded = self._shard(batch, ("input_ids", "input_lengths"))
        results = self._call_all("get_logprobs", per_rank_args=[
            (shard, reference) for shard in sharded.shards])
        return sharded.unshard([{"logprobs": r} for r in results])["logprobs"]

    def train(self, batch: BatchedDataDict, loss_fn: LossFunction) -> dict[str, float]:
        loss_keys = tuple(getattr(loss_fn, "required_batch_keys", ()))
        required = tuple(dict.fromkeys(("token_mask", "sample_mask", *loss_keys)))
        self._check_batch(batch, required)
        # Every tensor field travels, not only the required ones: a loss may also read optional
        # keys (ClippedPGLossFn reports the reference KL whenever its log-probs are present).
        keys = [key for key, value in batch.items() if isinstance(value, torch.Tensor)]
        # Once over the global batch (also validates the masks), before any rank starts.
        num_valid_tokens, num_valid_sequences = count_valid(batch)
        sharded = self._shard(batch, keys)
        start = time.perf_counter()
        results = self._call_all("train", per_rank_args=[
            (shard, loss_fn, num_valid_tokens, num_valid_sequences)
            for shard in sharded.shards])
        elapsed = time.perf_counter() - start
        metrics = combine_metrics([m for result in results for m in result["metrics"]])
        num_tokens = int(batch["input_lengths"].sum())
        metrics.update(
            grad_norm=results[0]["grad_norm"],
            learning_rate=results[0]["learning_rate"],
            num_tokens=float(num_tokens),
            tokens_per_second=num_tokens / elapsed,
        )
        return metrics

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        import ray

        if self._refit_info is None:
            info = ray.get(self._actors[0].refit_info.remote())
            self._refit_info = {name: (shape, dtype) for name, shape, dtype in info}
        return dict(self._refit_info)

    def iter_refit_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One all-gather round trip per bucket of the refit packer's layout (not per tensor),
        # and a bounded peak on rank 0.
        manifest = refit_packer.plan_buckets(self.prepare_refit_info(), _REFIT_BUCKET_BYTES)
        for b in range(manifest.num_buckets):
            names = [entry.name for entry in manifest.bucket_entries(b)]
            tensors = self._call_all("gather_weights", names)[0]
            for name in names:
                yield name, tensors.pop(name)

    def weight_sender_node_id(self) -> str:
        import ray

        return ray.get(self._actors[0].weight_sender_node_id.remote())

    def open_weight_sender(self, session: str, transport: str, manifest_dict: dict[str, Any],
                           options: dict[str, Any]) -> dict[str, Any]:
        import ray

        # The sender lives in rank 0, next to the gathered weights.
        return ray.get(self._actors[0].open_weight_sender.remote(
            session, transport, manifest_dict, options))

    def send_weights(self, session: str, manifest_dict: dict[str, Any],
                     version: int) -> dict[str, float]:
        return self._call_all("send_weights", session, manifest_dict, version)[0]

    def close_weight_sender(self, session: str) -> None:
        import ray

        if self._actors:
            ray.get(self._actors[0].close_weight_sender.remote(session))

    def save_checkpoint(self, directory: pathlib.Path) -> None:
        import ray

        directory = pathlib.Path(directory).absolute()
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-",
                                            dir=directory.parent))
        try:
            os.chmod(tmp, 0o755)
            self._call_all("save_checkpoint", str(tmp))
            step = ray.get(self._actors[0].step_count.remote())
            config = json.loads((tmp / "config.json").read_text())
            manifest = {
                "format_version": CHECKPOINT_FORMAT_VERSION,
                "backend": "dtensor",
                "step": step,
                "dp_size": self.cfg.dp_size,
                "model": str(self.cfg.model),
                "identity": {key: config.get(key) for key in _IDENTITY_KEYS},
                "saved_at_unix": time.time(),
            }
            with open(tmp / CHECKPOINT_MANIFEST, "w") as f:
                f.write(json.dumps(manifest, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            # Publish: move an existing checkpoint aside, rename the new one in, drop the old.
            old = None
            if directory.exists():
                old = directory.parent / f".{directory.name}.old-{os.getpid()}-{time.time_ns()}"
                os.rename(directory, old)
            os.rename(tmp, directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _check_checkpoint_identity(self, directory: pathlib.Path) -> None:
        saved = json.loads((directory / CHECKPOINT_MANIFEST).read_text()).get("identity", {})
        ours = json.loads((self.model_dir / "config.json").read_text())
        mismatched = {key: (saved.get(key), ours.get(key)) for key in _IDENTITY_KEYS
                      if saved.get(key) != ours.get(key)}
        if mismatched:
            listing = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}"
                                for k, (a, b) in mismatched.items())
            raise ValueError(f"checkpoint {str(directory)!r} was written for another model "
                             f"({listing}); load it with policy.model set to that model")

    def load_checkpoint(self, directory: pathlib.Path) -> None:
        directory = pathlib.Path(directory).absolute()
        problem = _checkpoint_dir_problem(directory)
        if problem is not None:
            raise ValueError(f"checkpoint {str(directory)!r}: {problem}; pass a directory "
                             "written by save_checkpoint")
        self._check_checkpoint_identity(directory)
        self._call_all("load_checkpoint", str(directory))

    def memory_stats(self, reset: bool = False) -> list[dict[str, int]]:
        """Per rank: peak resident memory (and peak device memory on GPU) since the last reset;
        for benchmarks. Not part of PolicyInterface."""
        return self._call_all("memory_stats", reset)

    def shutdown(self) -> None:
        import ray

        if self._actors and self._broken is None:
            try:
                ray.get([actor.shutdown.remote() for actor in self._actors], timeout=60)
            except Exception as error:  # a dead or stuck rank must not block the rest
                logger.warning("policy worker shutdown failed: %s", error)
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None


def _import_roots() -> list[str]:
    """Directories the workers need on their path: where dockyard_rl (and its kernels) live."""
    import dockyard_rl

    roots = [str(pathlib.Path(dockyard_rl.__file__).resolve().parent.parent)]
    try:
        import _dockyard_kernels  # noqa: F401  (built by Bazel; optional)

        roots.append(str(pathlib.Path(_dockyard_kernels.__file__).resolve().parent))
    except ImportError:
        pass
    return roots


__all__ = ["CHECKPOINT_MANIFEST", "DTensorPolicy", "DTensorPolicyWorker", "shifted_logprobs"]
