"""The DTensor policy's rank worker: one data-parallel rank of FSDP2 training, in a Ray actor.

`DTensorPolicy` (dtensor_policy.py, the controller) starts `policy.dp_size` of these as a
`WorkerGroup` and calls every model method on all ranks at once with equal shards (collective).

`setup` joins one torch process group (gloo on CPU, NCCL on GPU) at the group's master address,
builds a 1-D DeviceMesh "dp" and the model, sharded with `fully_shard` per decoder layer (the
classes in `_no_split_modules`), then at the root: parameters are DTensors `Shard(0)` over "dp"
(torch.chunk's split of dim 0), each forward all-gathers one layer at a time.
One rank (dp_size 1) keeps plain modules unless it needs FSDP's mixed precision or offload: there
FSDP2 only adds per-layer parameter copies and DTensor dispatch (~1.2x an eager step on CPU).

Model load (no rank ever holds the full model): `from_config` on the meta device (shapes only),
`fully_shard`, `to_empty` (allocates this rank's shards), then `load_sharded_weights` reads this
rank's rows of each tensor from the safetensors files (single or sharded with an index), one
tensor at a time, cast to the load dtype: float32 for the trained model, `policy.dtype` for the
reference. Tied weights are tied again after `to_empty`; non-persistent buffers (rotary
`inv_freq`) are recomputed with the model's `_init_weights`, as `from_pretrained` does. The
weights equal `from_pretrained(dtype=...)`'s exactly. Peak per rank: its shard plus about one
tensor (memory_probe.py; tests/benchmarks/policy_memory_benchmark.py for the figures).

Log-probs: microbatches of `policy.micro_batch_size` rows sorted longest first, each cut to its
longest row (rows are right-padded, attention is causal: no mask needed); the fused
`gather_logprobs` kernel reads log p(ids[t + 1] | ids[:t + 1]) at position t, shifted one column
right into the interface's alignment (0 in column 0 and on padding).

Training: gradients accumulate over the microbatches, the loss multiplied by the world size so
that FSDP's averaging reduce-scatter yields the SUM over ranks the loss's aggregation needs
(losses/loss_functions.py); then `clip_grad_norm_` (pre-clip norm reported), AdamW and a
LambdaLR whose factor is `learning_rate_at(step)` (base rate 1.0: exactly the shared schedule).
With bfloat16, parameters, gradients and optimizer state stay float32 and FSDP computes in
bfloat16. The frozen reference model is a second model of the initial weights (CPU-offloaded per
layer on GPU with `policy.offload_reference_policy`).

Refit: `gather_weights` all-gathers full tensors (rank 0 receives them, in `policy.dtype`);
`send_weights` does that per bucket of a weight-sync manifest and rank 0 sends each bucket
(weight_sync/sender_sessions.py).

Checkpoints: `save_checkpoint` writes the resume state sharded with torch.distributed.checkpoint
(`dcp/`: each rank its own shards of the float32 weights and optimizer state, nothing gathered),
its RNG state (`rng_rank<r>.pt`) and, rank 0, the scheduler; `load_checkpoint` reads it back at
any dp_size (DCP reshards). `export_hf` streams a Hugging Face directory (safetensors in
`policy.dtype`, cut into files of `EXPORT_FILE_BYTES` with an index when larger; config;
tokenizer files): every rank all-gathers one tensor at a time and rank 0 writes it at once.

Not covered: checkpoints that are not safetensors (`.bin`), models whose checkpoint names differ
from their `state_dict` names (transformers' key renames for old checkpoints), non-persistent
buffers that `_init_weights` does not recompute (those of Llama-family rotary embeddings are).
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import shutil
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.cluster.config import process_group_timeout
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict, invert_permutation
from dockyard_rl.kernels import refit_packer
from dockyard_rl.models.policy.config import PolicyConfig, learning_rate_at
from dockyard_rl.models.policy.interfaces import LossFunction
from dockyard_rl.utils import process_memory
from dockyard_rl.weight_sync import sender_sessions

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The sharded resume state: torch.distributed.checkpoint's directory (`.metadata` + one
# `__<rank>_0.distcp` per saving rank).
DCP_DIR = "dcp"
DCP_METADATA = f"{DCP_DIR}/.metadata"
SCHEDULER_FILE = "scheduler.pt"
# The HF export cuts its safetensors into files of at most this much tensor data (as
# save_pretrained does); one file is `model.safetensors`.
EXPORT_FILE_BYTES = 5 * 1024**3


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: instances of the classes in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"policy.model: {type(model).__name__} names no decoder layer classes in "
            f"_no_split_modules ({sorted(names)}), so it cannot be sharded per layer; use a "
            "Hugging Face causal LM that declares them (Llama, Qwen2, Mistral, ...)"
        )
    return layers


def _tied_duplicate_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that are another parameter (tied weights) -> the name kept for it.

    `named_parameters()` yields a shared parameter once, under its first name (for tied
    embeddings `model.embed_tokens.weight`); a HF checkpoint holds that name only.
    """
    first_name: dict[int, str] = {}
    duplicates: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = first_name.setdefault(id(param), name)
        if kept != name:
            duplicates[name] = kept
    return duplicates


def _tie_again(model: torch.nn.Module, tied: Mapping[str, str]) -> None:
    """Makes every duplicate name in `tied` (`_tied_duplicate_names`) the kept parameter again."""
    for duplicate, kept in tied.items():
        kept_param = model.get_parameter(kept)
        if model.get_parameter(duplicate) is not kept_param:
            module_name, _, attr = duplicate.rpartition(".")
            setattr(model.get_submodule(module_name), attr, kept_param)


def safetensors_files(model_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the file holding it, for a HF checkpoint in one `model.safetensors` or
    sharded with `model.safetensors.index.json`.

    Raises:
        ValueError: the directory holds neither.
    """
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / WEIGHTS_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ValueError(
        f"policy.model: {model_dir} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}; the dtensor "
        "backend loads safetensors checkpoints (save the model with save_pretrained)"
    )


def _shard_rows(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that `Shard(0)` gives `rank`: torch.chunk's split (chunks of
    ceil(num_rows / world_size), the last ones shorter or empty), as FSDP2 shards."""
    chunk = -(-num_rows // world_size)
    start = min(rank * chunk, num_rows)
    return start, min(start + chunk, num_rows)


def _read_rows(
    path: pathlib.Path, name: str, start: int, stop: int | None
) -> tuple[tuple[int, ...], torch.Tensor]:
    """The full shape of tensor `name` and its rows [start, stop) (all of it when stop is None).

    The file is opened per tensor on purpose: safetensors memory-maps it, and the pages a read
    touches stay in this process's resident set until the map is closed; one open per tensor
    bounds them by one tensor instead of letting them add up to this rank's whole shard.
    """
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        piece = f.get_slice(name)
        shape = tuple(piece.get_shape())
        if stop is None or len(shape) == 0 or shape[0] < stop:  # whole (or wrong: caller says)
            return shape, f.get_tensor(name)
        return shape, piece[start:stop]


def _init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Recomputes buffers that no checkpoint holds (rotary `inv_freq`): `to_empty` left them
    uninitialised. Uses the model's own `_init_weights`, as `from_pretrained` does; the
    modules that own such buffers (rotary embeddings) have no parameters for it to touch."""
    for module in model.modules():
        if getattr(module, "_non_persistent_buffers_set", None):
            model._init_weights(module)


def load_sharded_weights(model: torch.nn.Module, model_dir: pathlib.Path) -> None:
    """Fills a materialised (`to_empty`) model from the HF safetensors in `model_dir`, reading
    only this rank's rows of every `Shard(0)` DTensor and the whole of plain tensors, one tensor
    at a time, cast to the parameter's dtype (as `from_pretrained(dtype=...)` casts).

    Tied weights are filled once (a checkpoint holds only the first name); non-persistent buffers
    are recomputed. Every rank reads the files itself: no collective.

    Raises:
        ValueError: the files lack a parameter or persistent buffer of the model, or hold a
            tensor of another shape.
    """
    from torch.distributed.tensor import DTensor, Shard

    files = safetensors_files(model_dir)
    tied = _tied_duplicate_names(model)
    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers
    missing = sorted(name for name in state if name not in files and name not in tied)
    if missing:
        raise ValueError(
            f"policy.model: the safetensors in {model_dir} lack {len(missing)} tensor(s) of "
            f"{type(model).__name__}, e.g. {missing[:3]}; is config.json that of these weights?"
        )
    _init_non_persistent_buffers(model)
    with torch.no_grad():
        for name, target in state.items():
            if name in tied:
                continue
            if isinstance(target, DTensor):
                # FSDP2's layout: a 1-D mesh, Shard(0) (module docstring).
                assert tuple(target.placements) == (Shard(0),), (name, target.placements)
                local = target.to_local()
                mesh = target.device_mesh
                start, stop = _shard_rows(target.shape[0], mesh.get_local_rank(), mesh.size())
                assert local.shape[0] == stop - start, (name, local.shape, start, stop)
            else:
                local, start, stop = target, 0, None
            shape, piece = _read_rows(files[name], name, start, stop)
            if shape != tuple(target.shape):
                raise ValueError(
                    f"policy.model: {name} in {files[name]} has shape {shape}, the model's "
                    f"is {tuple(target.shape)}; is config.json that of these weights?"
                )
            local.copy_(piece)


# safetensors' dtype names (the format's spec).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def plan_export_files(
    entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]], max_file_bytes: int
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """`entries` (name, shape, dtype) cut in order into files of at most `max_file_bytes` of
    tensor data each (a larger tensor gets a file of its own), as HF shards checkpoints."""
    files: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def write_safetensors_streamed(
    path: pathlib.Path,
    entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterator[torch.Tensor],
) -> None:
    """Writes a safetensors file of `entries` (name, shape, dtype), taking their data one tensor
    at a time from `tensors` (in the same order): the header is known from the shapes alone, so
    the file never needs all tensors in memory at once (safetensors' `save_file` does).

    Format: 8-byte little-endian header length, the JSON header (padded with spaces to a
    multiple of 8), then the tensors' bytes back to back, row-major, little-endian.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape, dtype in entries:
            tensor = next(tensors)
            assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, name
            # A byte view of the tensor's own memory: no copy beyond `contiguous` (a no-op here).
            f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def shifted_logprobs(
    model: torch.nn.Module,
    input_ids_BS: torch.Tensor,
    input_lengths_B: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(B, S) float32 log-probs of softmax(logits / temperature) in the interface's alignment
    (see the module docstring).

    Differentiable when grad is enabled. Padding positions and column 0 are exactly 0.
    """
    from dockyard_rl.kernels.logprobs import gather_logprobs

    num_rows, width_full = input_ids_BS.shape
    width = int(input_lengths_B.max())
    ids_BS = input_ids_BS[:, :width]
    logits_BSV = model(input_ids=ids_BS, use_cache=False).logits
    if temperature != 1.0:  # a copy of the step's largest tensor: only when it matters
        logits_BSV = logits_BSV / temperature
    # Targets are the ids shifted one left. The last column has no next token: it gets a dummy
    # valid id (its own) and is dropped below. Gathering from the full (B, S, V) logits keeps
    # them a view (no copy of the largest tensor of the step, as logits[:, :-1] would force).
    targets_BS = torch.cat([ids_BS[:, 1:], ids_BS[:, -1:]], dim=1)
    next_logprobs_BS = gather_logprobs(logits_BSV, targets_BS)
    # next_logprobs_BS[:, t] = log p(ids[t + 1] | ids[:t + 1]) -> column t + 1 of the output.
    logprobs_BS = torch.nn.functional.pad(next_logprobs_BS[:, :-1], (1, width_full - width))
    positions_S = torch.arange(width_full, device=logprobs_BS.device)
    valid_BS = (positions_S[None, :] >= 1) & (
        positions_S[None, :] < input_lengths_B.to(logprobs_BS.device)[:, None]
    )
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
        self.logprob_temperature = cfg.logprob_temperature or 1.0
        self.rank = rank
        self.world_size = world_size

    def setup(
        self, model_dir: str, master_addr: str, master_port: int, num_threads: int
    ) -> dict[str, Any]:
        cfg = self.cfg
        self.init_process_group(master_addr, master_port, num_threads)
        self.model_dir = pathlib.Path(model_dir)
        torch.manual_seed(cfg.seed)
        self.model = self._build_model(trainable=True)
        self.reference_model = self._build_model(trainable=False)
        self.tied_duplicates = _tied_duplicate_names(self.model)
        self.refit_names = [name for name, _ in self.model.named_parameters()]
        opt = cfg.optimizer
        # Base lr 1.0 and a LambdaLR factor equal to the schedule: lr == learning_rate_at(step).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=1.0,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: learning_rate_at(step, cfg.optimizer, cfg.scheduler)
        )
        return {
            "max_position_embeddings": int(
                getattr(self.model.config, "max_position_embeddings", 0) or 0
            ),
            "vocab_size": int(self.model.config.vocab_size),
        }

    def init_process_group(self, master_addr: str, master_port: int, num_threads: int) -> None:
        """Joins the ranks' process group and builds the "dp" mesh (the first part of `setup`;
        memory_probe.py calls it alone to load models by themselves)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        # Ray exposes exactly the GPU of this actor's bundle, if any, as cuda:0.
        self.device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(num_threads)
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            rank=self.rank,
            world_size=self.world_size,
            # cluster.fleets.trainer.nccl_env.heartbeat_timeout_s (None: torch's default).
            timeout=process_group_timeout(),
        )
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))

    def _build_model(self, trainable: bool) -> torch.nn.Module:
        """The model built on the meta device, sharded, then materialised with only this rank's
        shard of every weight read from the safetensors files (module docstring: Model load)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = self.cfg
        compute_dtype = refit_packer.DTYPES[cfg.dtype]
        # Trainable: float32 master weights, bf16 compute through FSDP's mixed precision.
        # Reference: loaded directly in the compute dtype (it has no optimizer state).
        load_dtype = torch.float32 if trainable else compute_dtype
        config = AutoConfig.from_pretrained(self.model_dir)
        with torch.device("meta"):  # shapes only: no memory, no random init
            model = AutoModelForCausalLM.from_config(config, dtype=load_dtype)
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        if trainable and compute_dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=compute_dtype, reduce_dtype=torch.float32
            )
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            if cfg.offload_reference_policy and self.device.type == "cuda":
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        if trainable and cfg.activation_checkpointing:
            # Non-reentrant torch.utils.checkpoint around every decoder layer (HF's own hook):
            # the recomputation re-runs FSDP's pre-forward all-gather of that layer.
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        layers = _decoder_layers(model)  # checked at every dp_size alike
        if self.world_size > 1 or kwargs.keys() - {"mesh"}:  # one rank: plain (module docstring)
            for layer in layers:
                fully_shard(layer, **kwargs)
            # The root group holds what is left: embeddings, final norm, (tied) lm_head.
            fully_shard(model, **kwargs)
        # Allocates this rank's shards (uninitialised); an offloaded model keeps them on the CPU.
        # to_empty gives each name of a shared (tied) parameter a new parameter of its own on a
        # plain module: tie them again.
        tied = _tied_duplicate_names(model)
        model.to_empty(device="cpu" if "offload_policy" in kwargs else self.device)
        _tie_again(model, tied)
        load_sharded_weights(model, self.model_dir)
        return model

    # -- log-probs

    def get_logprobs(self, shard: BatchedDataDict, reference: bool) -> torch.Tensor:
        model = self.reference_model if reference else self.model
        model.eval()
        order = _length_order(shard)
        pieces_BS = []
        with torch.no_grad():
            for mb in shard.select_indices(order).make_microbatch_iterator(
                self.cfg.micro_batch_size, allow_partial=True
            ):
                pieces_BS.append(
                    shifted_logprobs(
                        model,
                        mb["input_ids"].to(self.device),
                        mb["input_lengths"],
                        self.logprob_temperature,
                    ).cpu()
                )
        return torch.cat(pieces_BS, dim=0)[invert_permutation(order)]

    # -- training

    def train(
        self,
        shard: BatchedDataDict,
        loss_fn: LossFunction,
        global_num_valid_tokens: int,
        global_num_valid_sequences: int,
    ) -> dict[str, Any]:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        model = self.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Microbatch order does not change the summed loss; length order cuts padding.
        microbatches = list(
            shard.select_indices(_length_order(shard)).make_microbatch_iterator(
                self.cfg.micro_batch_size, allow_partial=True
            )
        )
        metrics_list = []
        for index, mb in enumerate(microbatches):
            if isinstance(model, FSDPModule):  # accumulate locally; reduce-scatter after the last
                model.set_requires_gradient_sync(index == len(microbatches) - 1)
            logprobs_BS = shifted_logprobs(
                model,
                mb["input_ids"].to(self.device),
                mb["input_lengths"],
                self.logprob_temperature,
            )
            loss, metrics = loss_fn(
                logprobs_BS, mb, global_num_valid_tokens, global_num_valid_sequences
            )
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
        return {
            "metrics": metrics_list,
            "grad_norm": float(grad_norm),
            "learning_rate": float(learning_rate),
        }

    # -- experience over the data plane (data_plane/experience.py): this rank takes the shard of
    # a RemoteBatch from its inbox actor once, keeps it with its log-probs through the step's
    # optimizer steps (each on its rows of one mini-batch), drops it after the last.

    def open_data_plane(self, inbox: Any, receive_timeout_s: float) -> None:
        self.inbox, self.inbox_timeout_s = inbox, receive_timeout_s
        # (step, seq) -> the shard: every `select` of a RemoteBatch shares it.
        self.shards: dict[tuple[int, int], BatchedDataDict] = {}

    def _remote_shard(self, remote: Any) -> BatchedDataDict:
        import ray

        if remote.key not in self.shards:
            self.shards.clear()  # a shard of an earlier step that never trained (failed step)
            # The inbox waits receive_timeout_s itself and raises naming the key.
            self.shards[remote.key] = ray.get(
                self.inbox.take.remote(remote), timeout=self.inbox_timeout_s + 60
            )
        return self.shards[remote.key]

    def get_remote_logprobs(self, remote: Any, reference: bool) -> None:
        from dockyard_rl.data_plane.experience import PREV_LOGPROBS, REFERENCE_LOGPROBS

        shard = self._remote_shard(remote)
        shard[REFERENCE_LOGPROBS if reference else PREV_LOGPROBS] = self.get_logprobs(
            shard, reference
        )

    def train_remote(
        self, remote: Any, loss_fn: LossFunction, local_rows: Sequence[int]
    ) -> dict[str, Any]:
        """One optimizer step on this rank's `local_rows` of the shard (`remote.rank_rows()[rank]`:
        the same length on every rank, padding rows masked), normalised by the optimizer step's
        global valid counts; drops the shard after `remote.last` (or a failure). Adds
        `num_tokens`: the input lengths of this rank's real (unpadded) rows."""
        from dockyard_rl.data_plane.experience import PAD_ROW, select_shard_rows
        from dockyard_rl.losses.loss_functions import count_valid

        try:
            shard = self._remote_shard(remote)
            rows = select_shard_rows(shard, local_rows)
            num_valid_tokens, num_valid_sequences = self._global_counts(count_valid(rows))
            result = self.train(rows, loss_fn, num_valid_tokens, num_valid_sequences)
            real = torch.tensor([row != PAD_ROW for row in local_rows])
            result["num_tokens"] = int(rows["input_lengths"][real].sum())
        except BaseException:
            self.shards.pop(remote.key, None)
            raise
        if remote.last:
            self.shards.pop(remote.key, None)
        return result

    def _global_counts(self, local: tuple[int, int]) -> tuple[int, int]:
        """`count_valid` of this rank's rows summed over the ranks (collective): the loss's
        normalisers, what `count_valid` of the whole optimizer step's rows gives the driver."""
        import torch.distributed as dist

        counts = torch.tensor(local, dtype=torch.int64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(counts)
        return int(counts[0]), int(counts[1])

    def num_cached_shards(self) -> int:
        return len(getattr(self, "shards", {}))

    def step_count(self) -> int:
        return int(self.scheduler.last_epoch)

    # -- refit

    def refit_info(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        params = dict(self.model.named_parameters())
        dtype = refit_packer.DTYPES[self.cfg.dtype]
        return [(name, tuple(params[name].shape), dtype) for name in self.refit_names]

    def gather_weights(self, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """Full tensors of `names` (collective); rank 0 returns them, other ranks None."""
        from torch.distributed.tensor import DTensor

        params = dict(self.model.named_parameters())
        dtype = refit_packer.DTYPES[self.cfg.dtype]
        out = {}
        for name in names:
            param = params[name].detach()
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if self.rank == 0:  # a plain (dp_size 1) parameter is copied, never aliased
                out[name] = full.to(device="cpu", dtype=dtype, copy=full is param)
        return out if self.rank == 0 else None

    def iter_full_buckets(
        self, manifest: refit_packer.Manifest
    ) -> Iterator[tuple[int, dict[str, torch.Tensor] | None]]:
        """(bucket index, full tensors of that bucket) on rank 0, (index, None) elsewhere.
        Collective: every rank must iterate to the end, in step."""
        for b in range(manifest.num_buckets):
            yield b, self.gather_weights([e.name for e in manifest.bucket_entries(b)])

    def weight_sender_node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict, options: dict
    ) -> dict[str, Any]:
        return sender_sessions.open_session(session, transport, manifest_dict, options)

    def send_weights(
        self, session: str, manifest_dict: dict, version: int
    ) -> dict[str, float] | None:
        """Collective: every rank gathers each bucket; rank 0 sends it
        (weight_sync/sender_sessions.py)."""
        manifest = refit_packer.Manifest.from_dict(manifest_dict)
        buckets = self.iter_full_buckets(manifest)
        if self.rank != 0:
            for _ in buckets:
                pass
            return None
        try:
            return sender_sessions.send_weights(session, manifest, version, buckets)
        except BaseException:
            for _ in buckets:  # finish the all-gathers, so the other ranks are not left waiting
                pass
            raise

    def close_weight_sender(self, session: str) -> None:
        sender_sessions.close_session(session)

    # -- checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """Collective. The sharded resume state: every rank writes its own shards of the weights
        and optimizer state (torch.distributed.checkpoint, under `DCP_DIR`) and its RNG state;
        rank 0 the scheduler. Nothing is gathered: no rank holds more than its shard."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        directory = pathlib.Path(directory)
        # Sharded (DTensor) state dicts keyed by parameter name: views, no copies.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=directory / DCP_DIR,
        )
        torch.save(self._rng_state(), directory / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), directory / SCHEDULER_FILE)

    def load_checkpoint(self, directory: str) -> None:
        """Collective. Restores what `save_checkpoint` wrote, at any dp_size: DCP reads each
        rank's rows of every tensor from whichever saved shards hold them (resharding)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        directory = pathlib.Path(directory)
        # The current tensors are the destination (a fresh optimizer's state is created first,
        # by zero-gradient steps with lr 0 inside get_state_dict, so that DCP has a target).
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=directory / DCP_DIR)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))
        rng_file = directory / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            self._set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            torch.manual_seed(self.cfg.seed + self.rank)

    def export_hf(self, directory: str, max_file_bytes: int = EXPORT_FILE_BYTES) -> None:
        """Collective. A Hugging Face model directory in `directory`: safetensors in
        `policy.dtype` (one `model.safetensors`, or files of at most `max_file_bytes` with
        `model.safetensors.index.json`), `config.json`, and the tokenizer and generation files
        of the model directory.

        Streams: every rank all-gathers one tensor at a time, rank 0 writes it and drops it, so
        no rank ever holds more than its shard plus one full tensor. A tied weight is written
        once, under its first name, as HF checkpoints do.
        """
        from torch.distributed.tensor import DTensor

        directory = pathlib.Path(directory)
        export_dtype = refit_packer.DTYPES[self.cfg.dtype]
        state = {
            name: tensor.detach()
            for name, tensor in self.model.state_dict(keep_vars=True).items()
            if name not in self.tied_duplicates
        }
        # Floating tensors in the export dtype; others (integer buffers) as they are.
        entries = [
            (name, tuple(t.shape), export_dtype if t.is_floating_point() else t.dtype)
            for name, t in state.items()
        ]
        files = plan_export_files(entries, max_file_bytes)

        def full_tensors() -> Iterator[torch.Tensor]:
            for name, _, dtype in entries:
                tensor = state[name]
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                yield full.to(dtype)

        tensors = full_tensors()
        if self.rank != 0:
            for _ in tensors:  # the all-gathers, in step with rank 0
                pass
            return
        names = (
            [WEIGHTS_FILE]
            if len(files) == 1
            else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        )
        try:
            for name, file_entries in zip(names, files):
                write_safetensors_streamed(directory / name, file_entries, tensors)
        except BaseException:
            for _ in tensors:  # finish the all-gathers, so the other ranks are not left waiting
                pass
            raise
        if len(files) > 1:
            total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)
            weight_map = {
                entry[0]: name for name, file_entries in zip(names, files) for entry in file_entries
            }
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = copy.deepcopy(self.model.config)
        config.dtype = export_dtype
        config.save_pretrained(directory)
        for source in self.model_dir.iterdir():
            # Tokenizer, generation config, chat template: everything but weights and config.
            if (
                source.is_file()
                and not source.name.startswith(".")
                and source.name != "config.json"
                and not source.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))
            ):
                shutil.copy2(source, directory / source.name)

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
        stats = {"peak_rss_bytes": process_memory.status_bytes("VmHWM") or 0}
        if self.device.type == "cuda":
            stats["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        if reset:
            process_memory.reset_peak_rss()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        return stats

    def shutdown(self) -> None:
        import torch.distributed as dist

        # Ray kills this process next: it would leave the sessions' segments in /dev/shm.
        sender_sessions.close_all_sessions()
        if dist.is_initialized():
            dist.destroy_process_group()
