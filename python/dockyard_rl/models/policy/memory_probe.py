"""Per-rank peak memory of the DTensor worker's model load and checkpoint save, measured in real
gloo process groups of spawned processes (no Ray), against the earlier full-load / full-gather
code kept here as the baseline. For dtensor_memory_test.py and
tests/benchmarks/policy_memory_benchmark.py; not used in training.

Each rank reports the growth of its resident-set high-water mark (VmHWM, which counts what torch
allocates outside Python) over one operation: `process_memory.reset_peak_rss()` right before it,
`VmHWM - VmRSS(before)` right after. Figures are divided by `full_bytes`, the model's float32
weights, so a rank that holds 1/dp of the model reads about 1/dp.

Operations (`probe(..., operation)`):
- "load": the trainable model only (`_build_model(trainable=True)`): meta device, `fully_shard`,
  each rank reading its own rows from the safetensors files.
- "load_full": the earlier code: `from_pretrained` in float32 on every rank, then `fully_shard`.
- "save": the sharded resume state (`save_checkpoint`: DCP + RNG + scheduler), optimizer state
  populated by one AdamW step first.
- "export": the streamed HF export (`export_hf`).
- "save_full": the earlier code: full weights and optimizer state gathered to rank 0's CPU
  (`full_state_dict=True, cpu_offload=True`), written with `save_file` and `torch.save`.

Not covered: GPU memory (torch.cuda's own counters report it), Ray actors' extra memory.
"""

from __future__ import annotations

import dataclasses
import pathlib
import socket
import traceback
from typing import Any

import torch

from dockyard_rl.models.policy.config import PolicyConfig
from dockyard_rl.models.policy.dtensor_worker import WEIGHTS_FILE, DTensorPolicyWorker
from dockyard_rl.utils import process_memory

OPERATIONS = ("load", "load_full", "save", "export", "save_full")


def build_random_llama(
    directory: pathlib.Path,
    *,
    hidden_size: int = 512,
    intermediate_size: int = 1408,
    num_layers: int = 12,
    vocab_size: int = 4096,
    tie_word_embeddings: bool = True,
    max_shard_size: str | None = None,
) -> int:
    """Writes a random Llama (seed 0, float32; ~150 MB with the defaults, no tokenizer) into
    `directory`; returns its float32 weight bytes. `max_shard_size` ("50MB") makes a sharded
    checkpoint with `model.safetensors.index.json`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return sum(p.numel() * 4 for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _old_full_load(worker: DTensorPolicyWorker) -> torch.nn.Module:
    """The old load, for comparison: the whole float32 model on every rank, then sharded."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from dockyard_rl.models.policy.dtensor_worker import _decoder_layers

    model = AutoModelForCausalLM.from_pretrained(worker.model_dir, dtype=torch.float32)
    if worker.world_size > 1:
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=worker.mesh)
        fully_shard(model, mesh=worker.mesh)
    return model


def _old_full_save(worker: DTensorPolicyWorker, directory: pathlib.Path) -> None:
    """The old save, for comparison: full state dicts gathered to rank 0's CPU and written there."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(worker.model, options=options)
    optimizer_state = get_optimizer_state_dict(worker.model, worker.optimizer, options=options)
    if worker.rank == 0:
        weights = {
            name: tensor.contiguous()
            for name, tensor in model_state.items()
            if name not in worker.tied_duplicates
        }
        save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})
        torch.save(optimizer_state, directory / "optimizer.pt")


def _touch(model: torch.nn.Module) -> None:
    """Reads every local parameter byte once: `from_pretrained` may leave weights as views of
    the memory-mapped file, resident only once used; a model in use has them all resident."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.sum()


def _warm_up(worker: DTensorPolicyWorker) -> None:
    """Imports what a load imports (the model's code, FSDP, safetensors: tens of MB of resident
    code and tables) before the measured window, which then holds the load alone."""
    import safetensors.torch  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(worker.model_dir))


def _populate_optimizer(worker: DTensorPolicyWorker) -> None:
    """One AdamW step with small constant gradients: the optimizer state exists, as in training."""
    for param in worker.model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    cfg: PolicyConfig,
    model_dir: str,
    out_dir: str,
    operation: str,
    results: Any,
) -> None:
    import torch.distributed as dist

    try:
        worker = DTensorPolicyWorker(cfg, rank, world_size)
        directory = pathlib.Path(out_dir)
        if operation in ("load", "load_full"):
            worker.init_process_group("127.0.0.1", port, 1)
            worker.model_dir = pathlib.Path(model_dir)
            _warm_up(worker)
            dist.barrier()
            before = process_memory.status_bytes("VmRSS") or 0
            process_memory.reset_peak_rss()
            if operation == "load":
                model = worker._build_model(trainable=True)
            else:
                model = _old_full_load(worker)
            _touch(model)
            peak = process_memory.status_bytes("VmHWM") or 0
            del model
        else:
            worker.setup(model_dir, "127.0.0.1", port, 1)
            _populate_optimizer(worker)
            directory.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            before = process_memory.status_bytes("VmRSS") or 0
            process_memory.reset_peak_rss()
            if operation == "save":
                worker.save_checkpoint(str(directory))
            elif operation == "export":
                worker.export_hf(str(directory))
            else:
                _old_full_save(worker, directory)
            peak = process_memory.status_bytes("VmHWM") or 0
        dist.barrier()
        results.put((rank, {"peak_growth_bytes": peak - before}))
        worker.shutdown()
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def probe(
    model_dir: pathlib.Path,
    out_dir: pathlib.Path,
    world_size: int,
    operation: str,
    cfg: PolicyConfig | None = None,
    timeout_s: float = 600.0,
) -> list[int]:
    """Runs `operation` (module docstring) on `world_size` spawned gloo ranks; returns each
    rank's peak resident-set growth in bytes, rank order.

    Raises:
        ValueError: an unknown operation.
        RuntimeError: a rank failed (its traceback in the message) or did not report in time.
    """
    import multiprocessing

    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")
    cfg = cfg or PolicyConfig(model=str(model_dir), dtype="float32", dp_size=world_size)
    cfg = dataclasses.replace(cfg, model=str(model_dir), dp_size=world_size)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, port, cfg, str(model_dir), str(out_dir), operation, results),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(world_size):
            rank, report = results.get(timeout=timeout_s)
            reports[rank] = report
            if "error" in report:  # the other ranks may wait in a collective forever
                break
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [f"rank {r}: {rep['error']}" for r, rep in sorted(reports.items()) if "error" in rep]
    if errors:
        raise RuntimeError(f"{operation} at dp={world_size} failed:\n" + "\n".join(errors))
    if len(reports) < world_size:
        raise RuntimeError(f"{operation} at dp={world_size}: ranks {sorted(reports)} reported")
    return [reports[r]["peak_growth_bytes"] for r in range(world_size)]
