"""The vLLM generation backend: vLLM's V1 async engine (`AsyncLLM`) in Ray actors.

Layout. `VllmGeneration` (driver side, implements `GenerationInterface`) owns `num_engines`
`VllmEngineActor`s (Ray async actors), each holding one `vllm.v1.engine.async_llm.AsyncLLM`. The
AsyncLLM starts its engine-core process, which starts one worker process per tensor-parallel rank;
vLLM mixes `vllm_worker_extension.VllmWorkerExtension` into those workers
(`AsyncEngineArgs.worker_extension_cls`) and we reach it with `AsyncLLM.collective_rpc`.

- Data parallelism: each prompt (with all its n samples, which share its prefix KV cache) goes to
  the engine with the fewest samples in flight. Each sample is one vLLM request (n=1), so samples
  stream back as they finish; sample i of a prompt uses seed `seed + i` (what vLLM itself does
  for n > 1), so the same seed gives the same tokens.
- Placement: the engine actors are a `WorkerGroup` of the inference fleet
  (distributed/worker_group.py): on nodes labelled for inference, with the fleet's strategy and
  NCCL environment from `cluster.fleets.inference`. On CPU each engine actor takes a bundle of 1
  CPU and vLLM uses the machine's cores. With GPUs, an engine with tensor_parallel_size=1 takes
  one GPU; with TP > 1 each engine gets its own placement group of TP bundles {GPU: 1, CPU: 1}
  (PACK by default: one node, so TP all-reduces stay on NVLink); the actor sits on its first
  bundle owning nothing itself, and vLLM's Ray executor (`distributed_executor_backend="ray"`)
  starts the TP workers in the captured group. The GPU paths are written but cannot run on this
  machine (no GPU): they are untested here.
- Ray is started on 127.0.0.1 only when the caller has not started or joined a cluster
  (`ensure_ray`).
- vLLM spawns processes (engine core, workers). Inside a Ray actor it always uses the `spawn`
  start method (set explicitly below), whose children re-import only the actor's modules, so the
  caller needs no `__main__` guard for the engine processes (a script that builds
  `VllmGeneration` at import time still needs one for its own reasons).

Weight updates (`update_weights_from_buckets`): the driver checks the manifest against the
expected refit info and the buckets against the manifest, then each engine actor pauses its
scheduler with mode "keep" (running requests stay queued; with
`recompute_kv_cache_after_weight_updates`, or the per-call `recompute_kv_cache=True`, the pause
also clears the KV cache, so they are preempted and recomputed on resume), sends the buckets as
bytes to its workers and lets them reload the weights (see vllm_worker_extension.py for why a
reload and not a parameter copy), labels the new weights with `AsyncLLM.update_weight_version`,
resets the prefix cache and resumes. vLLM then reports per-token weight-version spans for every
sample (`CompletionOutput.weight_versions`). A load that fails half-way aborts the engine's running
requests and makes it refuse new ones until an update succeeds.

Measured here (SmolLM2-135M float32, 2 shared cores, enforce_eager): engine start ~30-40 s; one
full weight update (540 MB in 8 buckets of 64 MB) ~4-6 s, nearly all of it vLLM's reload.

Memory (`MemoryBudget`). Before any engine starts, the driver logs the budget: the KV-cache size
per engine (`generation.kv_cache_memory_bytes`) times `num_engines`, the weights, and the machine's
total and available memory (psutil); on CPU it raises ValueError naming the key when the engines'
KV caches exceed the memory available right now. With a null size it logs what vLLM will derive
from `gpu_memory_utilization`. vLLM's own start-up refusals about KV memory (a size larger than
what is available at allocation, a size that cannot hold one max_model_len sequence, a null size
squeezed by the worker's own memory) reach the engine actor only as "Engine core initialization
failed. See root cause above": the cause is in the log lines that vLLM's engine processes wrote to
the actor's stdout/stderr, which Ray keeps in files; the actor reads the lines written since it
started the engine and re-raises a ValueError naming `generation.kv_cache_memory_bytes`
(`vllm_kv_memory_refusal`). The budget check uses the driver's machine: with engines on other
nodes of a CPU cluster only vLLM's own check (translated) applies there.

Stale KV and the prefix cache: `reset_prefix_cache()` cannot drop blocks that running requests
still hold (the in-flight case without recompute). So every request also carries
`cache_salt = "w<version at admission>"`: vLLM mixes the salt into the block hashes, so a request
admitted under version k can only reuse blocks of other requests admitted under k; nothing computed
before an update is reused by a request admitted after it.

Not covered: SGLang; a host-memory check on GPU machines (the KV cache lives on the GPUs; vLLM
checks their memory); sleep mode / memory release for colocated training (`finish_generation` only
stops scheduling); multi-node TP or pipeline parallelism; LoRA; restarting a crashed engine (its
calls raise; build a new `VllmGeneration`); prompts as text (callers tokenize with the chat
template, so the trainer sees exactly the token ids the engine saw).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
import torch

from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.worker_group import WorkerGroup
from dockyard_rl.distributed.workers import WorkerError
from dockyard_rl.kernels import refit_packer
from dockyard_rl.models import zoo
from dockyard_rl.models.generation.config import GenerationConfig, format_bytes
from dockyard_rl.models.generation.interfaces import GenerationInterface, GenerationSample
from dockyard_rl.weight_sync.manifest_check import check_manifest_against_refit_info, dtype_name

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = (
    "dockyard_rl.models.generation.vllm_worker_extension.VllmWorkerExtension")

# Environment of the engine actors and, through inheritance, of vLLM's processes.
_ENGINE_ENV = {
    # vLLM forces spawn inside Ray actors anyway; say it explicitly (forking a process that runs
    # Ray's threads is unsafe).
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    # No usage statistics are sent from this machine.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def ensure_ray() -> None:
    """Starts a local Ray on 127.0.0.1 unless the caller already started or joined one."""
    init_local_ray(log_to_driver=True)


def checkpoint_refit_info(model_dir: pathlib.Path,
                          dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype) of every tensor in the checkpoint's safetensors files, with the
    engine's dtype: the default expected refit info. Reads only the file headers."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors files; the "
                         "vLLM backend needs a safetensors checkpoint")
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                info[name] = (tuple(f.get_slice(name).get_shape()), dtype)
    return info


# ---------------------------------------------------------------------------------------------
# Memory


def kv_cache_bytes_per_token(hf_config: Mapping[str, Any], dtype: str) -> int | None:
    """KV-cache bytes one token takes in a standard-attention (Llama-family) model: K and V of
    every layer and KV head; None when the config lacks the fields. An estimate for the log (vLLM
    pads to blocks, and other attention types store other shapes)."""
    try:
        num_heads = int(hf_config["num_attention_heads"])
        num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
        head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads)
        num_layers = int(hf_config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=getattr(
        torch, dtype)).element_size()


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What the engines take, against the driver machine's memory at start-up (sizes in bytes)."""

    kv_cache_bytes: int | None  # per engine (per GPU with TP); None = vLLM sizes it
    num_engines: int
    on_gpu: bool  # the Ray cluster has GPUs: the KV cache lives there, not in host memory
    gpu_memory_utilization: float
    max_model_len: int
    total_bytes: int  # this machine's memory
    available_bytes: int  # available right now
    weight_bytes: int  # the checkpoint in the engine's dtype, per engine
    kv_bytes_per_token: int | None  # estimate (kv_cache_bytes_per_token)

    @property
    def total_kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_bytes is None else self.num_engines * self.kv_cache_bytes

    def describe(self) -> str:
        """The arithmetic, one line, for the log."""
        machine = (f"this machine: {format_bytes(self.total_bytes)} total, "
                   f"{format_bytes(self.available_bytes)} available now")
        weights = f"~{format_bytes(self.weight_bytes)} of weights per engine"
        gmu = f"gpu_memory_utilization {self.gpu_memory_utilization}"
        if self.kv_cache_bytes is None:
            if self.on_gpu:
                return (f"vLLM memory budget: KV cache sized by vLLM (generation."
                        f"kv_cache_memory_bytes: null) from {gmu} of each GPU, minus weights and "
                        f"activations; {self.num_engines} engine(s), {weights}; {machine}")
            requested = self.gpu_memory_utilization * self.total_bytes
            return (f"vLLM memory budget: KV cache sized by vLLM (generation.kv_cache_memory_bytes"
                    f": null): {gmu} x {format_bytes(self.total_bytes)} = "
                    f"{format_bytes(requested)} "
                    f"per engine, minus the worker's resident memory when the KV cache is sized "
                    f"(it refuses to start when that is <= 0); x {self.num_engines} engine(s) = "
                    f"{format_bytes(self.num_engines * requested)}; {weights}; {machine}. This "
                    "depends on what else runs on the machine; an explicit "
                    "generation.kv_cache_memory_bytes does not")
        if self.kv_bytes_per_token:
            num_tokens = self.kv_cache_bytes // self.kv_bytes_per_token
            tokens = (f"; ~{num_tokens} tokens at {self.kv_bytes_per_token / 1024:.1f} KiB per "
                      f"token = {num_tokens / self.max_model_len:.1f} x max_model_len "
                      f"{self.max_model_len}")
        else:
            tokens = ""
        where = "per GPU" if self.on_gpu else "per engine"
        unused = ("ignored by vLLM" if self.on_gpu else "not used on CPU")
        return (f"vLLM memory budget: KV cache {format_bytes(self.kv_cache_bytes)} {where} "
                f"(generation.kv_cache_memory_bytes{tokens}) x {self.num_engines} engine(s) = "
                f"{format_bytes(self.total_kv_cache_bytes)}"
                f"{' (on the GPUs)' if self.on_gpu else ''}; {weights}; {machine}; {gmu} is "
                f"{unused} when the KV size is explicit")


def plan_memory(config: GenerationConfig, *, on_gpu: bool, weight_bytes: int,
                kv_bytes_per_token: int | None, memory=None) -> MemoryBudget:
    """The engines' memory budget against this machine's memory (`memory`: psutil's
    `virtual_memory()`, read now when None).

    Raises:
        ValueError: on CPU, the engines' explicit KV caches (num_engines x kv_cache_memory_bytes)
            exceed the memory available now, or, with a null size, num_engines x
            gpu_memory_utilization of the machine does (vLLM would refuse to start); the message
            names the key, the figures and the fix.
    """
    if memory is None:
        import psutil

        memory = psutil.virtual_memory()
    budget = MemoryBudget(
        kv_cache_bytes=config.kv_cache_memory_bytes,
        num_engines=config.num_engines,
        on_gpu=on_gpu,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        total_bytes=int(memory.total),
        available_bytes=int(memory.available),
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    if on_gpu:
        return budget
    available = budget.available_bytes
    engines = f"{budget.num_engines} engine(s)"
    machine = (f"the {format_bytes(available)} this machine has available now "
               f"({format_bytes(budget.total_bytes)} total)")
    if budget.kv_cache_bytes is not None:
        if budget.total_kv_cache_bytes > available:
            raise ValueError(
                f"generation.kv_cache_memory_bytes: {engines} x "
                f"{format_bytes(budget.kv_cache_bytes)} of KV cache = "
                f"{format_bytes(budget.total_kv_cache_bytes)}, more than {machine}; lower "
                f"generation.kv_cache_memory_bytes (at most "
                f"{format_bytes(available // budget.num_engines)} per engine right now, less what "
                "the weights, the engines' runtime and the trainer need) or "
                "generation.num_engines, or free memory on the machine")
    else:
        requested = math.ceil(budget.gpu_memory_utilization * budget.total_bytes)
        if budget.num_engines * requested > available:
            raise ValueError(
                f"generation.kv_cache_memory_bytes: null lets vLLM reserve gpu_memory_utilization "
                f"{budget.gpu_memory_utilization} x {format_bytes(budget.total_bytes)} = "
                f"{format_bytes(requested)} per engine for weights + KV cache, x {engines} = "
                f"{format_bytes(budget.num_engines * requested)}, more than {machine}; set "
                "generation.kv_cache_memory_bytes to an explicit size (e.g. 1GiB), or lower "
                "generation.gpu_memory_utilization")
    return budget


# vLLM 0.32's start-up refusals about KV-cache memory (cpu_worker.py, kv_cache_utils.py), as they
# appear in its engine processes' logs.
_KV_MEMORY_REFUSALS = re.compile(
    r"(Available memory on node \S+ \(.*?\) on (?:kv cache allocation|startup) is less than "
    r".*|No available memory for the cache blocks\..*|To serve at least one request with the "
    r"model's max seq len .*)")


# Where vLLM's facts end and its advice (in terms of its own flags) begins.
_VLLM_ADVICE = re.compile(r" (?:Try increasing|On the CPU backend|Reduce CPU memory|Decrease "
                          r"--kv-cache|See https://)|', please check")


def vllm_kv_memory_refusal(log_text: str) -> str | None:
    """vLLM's message refusing to start for lack of KV-cache memory, found in its engine
    processes' log output, or None. Only the facts: cut where vLLM's advice begins (it names its
    own flags, not our keys) or where its executor's quote of a worker's error ends
    ("Worker failed with error '...', please check ...")."""
    match = _KV_MEMORY_REFUSALS.search(log_text)
    if match is None:
        return None
    return _VLLM_ADVICE.split(match.group(1), 1)[0].strip()


def _kv_memory_error(engine_index: int, engine_kwargs: Mapping[str, Any],
                     refusal: str) -> ValueError:
    kv_bytes = engine_kwargs.get("kv_cache_memory_bytes")
    said = f"engine {engine_index} refused to start: vLLM says \"{refusal}\""
    if kv_bytes is None:
        return ValueError(
            f"generation.kv_cache_memory_bytes: null lets vLLM size the KV cache from "
            f"gpu_memory_utilization ({engine_kwargs['gpu_memory_utilization']}) and the memory "
            f"the engine's worker already holds, and {said}. Set generation.kv_cache_memory_bytes "
            "to an explicit size (e.g. 1GiB), which does not depend on what else runs on the "
            "machine")
    if refusal.startswith(("To serve at least one request", "No available memory for the cache")):
        fix = (f"too small for one sequence of max_model_len {engine_kwargs['max_model_len']}; "
               "raise generation.kv_cache_memory_bytes or lower generation.max_model_len")
    else:
        fix = "lower generation.kv_cache_memory_bytes or free memory on the machine"
    return ValueError(f"generation.kv_cache_memory_bytes: {format_bytes(kv_bytes)} per engine: "
                      f"{said}; {fix}")


def _output_marks() -> list[tuple[str, int]]:
    """(path, size now) of this process's stdout and stderr where they are regular files (Ray
    writes an actor's output to files under its session's logs/); processes that this one starts
    inherit them."""
    marks = []
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.isfile(path):
                marks.append((path, os.path.getsize(path)))
        except OSError:
            continue  # not Linux, or a closed descriptor: nothing to read back
    return marks


def _output_since(marks: list[tuple[str, int]], max_bytes: int = 8 << 20) -> str:
    texts = []
    for path, offset in marks:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                texts.append(f.read(max_bytes).decode(errors="replace"))
        except OSError:
            continue  # rotated away
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------
# The engine actor


class VllmEngineActor:
    """One vLLM AsyncLLM in a Ray async actor (create with `ray.remote(VllmEngineActor)`).

    All methods are coroutines on the actor's event loop, so generation requests, weight updates
    and pauses interleave; one weight update at a time is pending (between
    `begin_weight_update` and `finish_weight_update` / `abort_weight_update`), and `_no_update`
    holds new requests back while it runs (so a request's admission version is exact for requests that
    arrive during an update).
    """

    def __init__(self, engine_kwargs: dict[str, Any], engine_index: int, initial_version: int):
        self._engine_kwargs = engine_kwargs
        self._engine_index = engine_index
        self._version = initial_version
        self._llm = None
        self._no_update: asyncio.Event | None = None
        self._pending: dict[str, Any] | None = None  # the update between begin and finish
        self._http = None  # the HTTP endpoint of transport http, started on demand
        self._paused_by_caller = False
        self._weights_error: str | None = None  # set when a load failed half-way

    async def start(self) -> dict[str, Any]:
        """Builds the engine (about a minute for SmolLM2 on CPU). Returns facts for checks."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._no_update = asyncio.Event()
        self._no_update.set()
        # The worker group gives every actor torch's env:// variables (RANK, MASTER_ADDR, ...);
        # vLLM's processes form their own groups and must not see this engine's rank among
        # the engines.
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT"):
            os.environ.pop(name, None)
        # vLLM's Ray executor compares its own host IP with Ray's node IP (127.0.0.1 on a local
        # cluster, which vLLM would not guess).
        os.environ.setdefault("VLLM_HOST_IP", ray.util.get_node_ip_address())
        start = time.monotonic()
        marks = _output_marks()
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_kwargs))
        except Exception as error:
            # The cause is only in the engine processes' log lines (module docstring).
            refusal = vllm_kv_memory_refusal(_output_since(marks))
            if refusal is None:
                raise
            raise _kv_memory_error(self._engine_index, self._engine_kwargs, refusal) from error
        await self._llm.update_weight_version(str(self._version))
        (model_dtype, *_) = await self._llm.collective_rpc("dockyard_model_dtype")
        return {"model_dtype": model_dtype, "start_seconds": time.monotonic() - start}

    async def generate_sample(self, prompt_token_ids: list[int], sampling: dict[str, Any],
                              request_id: str, prompt_index: int,
                              sample_index: int) -> GenerationSample:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._engine()
        await self._no_update.wait()
        if self._weights_error is not None:
            raise RuntimeError(f"engine {self._engine_index}: {self._weights_error}; push "
                               "weights again before generating")
        admitted_version = self._version
        params = SamplingParams(
            n=1,
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=sampling["top_k"],
            max_tokens=sampling["max_tokens"],
            stop=list(sampling["stop"]) or None,
            seed=None if sampling["seed"] is None else sampling["seed"] + sample_index,
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = {"prompt_token_ids": list(prompt_token_ids),
                  "cache_salt": f"w{admitted_version}"}
        final = None
        async for output in llm.generate(prompt, params, request_id):
            final = output
        assert final is not None and len(final.outputs) == 1
        completion = final.outputs[0]
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = tuple(
            float(position[token].logprob)
            for token, position in zip(token_ids, completion.logprobs or ()))
        if completion.finish_reason not in _FINISH_REASONS:
            raise RuntimeError(f"engine {self._engine_index}: request {request_id} ended with "
                               f"finish reason {completion.finish_reason!r}")
        spans = completion.weight_versions or ()
        versions = sorted({int(span.version) for span in spans if span.end > span.start})
        return GenerationSample(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_token_ids=tuple(prompt_token_ids),
            response_token_ids=token_ids,
            response_logprobs=logprobs,
            response_text=completion.text,
            finish_reason=_FINISH_REASONS[completion.finish_reason],
            stop_reason=completion.stop_reason,
            weight_versions=tuple(versions),
            oldest_weight_version=min([admitted_version, *versions]),
            engine_index=self._engine_index,
        )

    async def update_weights(self, manifest_dict: dict, buckets: list[torch.Tensor],
                             version: int, recompute_kv_cache: bool) -> dict[str, float]:
        """The object_store path in one call: begin, the buckets as bytes, finish."""
        await self.begin_weight_update(manifest_dict, version, recompute_kv_cache)
        return await self.finish_weight_update({"transport": "object_store"}, buckets)

    async def begin_weight_update(self, manifest_dict: dict, version: int,
                                  recompute_kv_cache: bool) -> None:
        """Pauses the scheduler (requests kept) and starts a pending update in the workers.
        Exactly one `finish_weight_update` or `abort_weight_update` must follow."""
        llm = self._engine()
        if self._pending is not None:
            raise RuntimeError(f"engine {self._engine_index}: the update to version "
                               f"{self._pending['version']} is still pending; finish or abort it")
        if version <= self._version:
            raise ValueError(f"weight version {version} is not newer than the engine's "
                             f"{self._version}")
        self._pending = {"version": version, "start": time.monotonic(),
                         "recompute": recompute_kv_cache}
        self._no_update.clear()
        try:
            # clear_cache=True also drops the KV cache of running requests (vLLM preempts
            # them; on resume they recompute prompt + tokens so far with the new weights);
            # False keeps it.
            await llm.pause_generation(mode="keep", clear_cache=recompute_kv_cache)
            self._pending["paused"] = time.monotonic()
            await llm.collective_rpc("dockyard_begin_weight_update", args=(manifest_dict,))
            if self._http is not None:
                self._http.expect(refit_packer.Manifest.from_dict(manifest_dict), version)
        except BaseException:
            await self.abort_weight_update()
            raise

    async def finish_weight_update(self, receive: dict[str, Any],
                                   buckets: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Receives the buckets the way `receive["transport"]` says, loads them, labels the new
        version, resets the prefix cache and resumes. On a receive failure the pending update
        is dropped (model untouched); on a load failure the engine refuses to generate until an
        update succeeds."""
        llm = self._engine()
        pending = self._pending
        if pending is None:
            raise RuntimeError(f"engine {self._engine_index}: finish_weight_update without "
                               "begin_weight_update")
        try:
            transport = receive["transport"]
            if transport == "object_store":
                for index, bucket in enumerate(buckets):
                    # A memoryview of the CPU bucket: no copy before vLLM's serialiser.
                    data = bucket.detach().cpu().contiguous().numpy().data
                    await llm.collective_rpc("dockyard_receive_bucket", args=(index, data))
            elif transport == "http":
                await self._http.wait_complete(float(receive["timeout_s"]))
            else:
                await llm.collective_rpc("dockyard_receive_buckets", args=(receive,))
        except BaseException:
            await self.abort_weight_update()
            raise
        received = time.monotonic()
        try:
            await llm.collective_rpc("dockyard_finish_weight_update")
        except BaseException:
            # The reload may have stopped half-way: abort the requests that ran on these weights
            # and refuse new ones until an update succeeds.
            self._weights_error = f"weight update failed while loading (version {self._version} " \
                                  "was partly overwritten)"
            await llm.pause_generation(mode="abort", clear_cache=True)
            await self._end_update()
            raise
        loaded = time.monotonic()
        self._weights_error = None
        self._version = pending["version"]
        try:
            await llm.update_weight_version(str(self._version))
            # Returns False while running requests hold blocks (in-flight update without
            # recompute); the cache salt covers that case (module docstring).
            prefix_cache_reset = await llm.reset_prefix_cache(
                reset_running_requests=pending.get("recompute", False))
        finally:
            await self._end_update()
        return {"pause_seconds": pending.get("paused", pending["start"]) - pending["start"],
                "receive_seconds": received - pending.get("paused", pending["start"]),
                "load_seconds": loaded - received,
                "total_seconds": time.monotonic() - pending["start"],
                "prefix_cache_reset": float(prefix_cache_reset)}

    async def abort_weight_update(self) -> None:
        """Drops a pending update (the model keeps its weights) and resumes. Idempotent."""
        if self._pending is None:
            return
        if self._http is not None:
            self._http.cancel()
        try:
            await self._engine().collective_rpc("dockyard_abort_weight_update")
        finally:
            await self._end_update()

    async def _end_update(self) -> None:
        self._pending = None
        try:
            if not self._paused_by_caller:
                await self._engine().resume_generation()
        finally:
            self._no_update.set()

    async def open_weight_receiver(self, transport: str, host: str,
                                   max_bucket_bytes: int) -> dict[str, Any]:
        """What the driver needs to connect a transport to this engine (plain data)."""
        import ray

        info: dict[str, Any] = {"num_workers": self._engine_kwargs["tensor_parallel_size"],
                                "node_id": ray.get_runtime_context().get_node_id()}
        if transport == "http":
            from dockyard_rl.weight_sync.http_push import HttpBucketReceiver

            if self._http is None:
                llm = self._engine()

                async def deliver(index: int, data: bytes) -> None:
                    await llm.collective_rpc("dockyard_receive_bucket", args=(index, data))

                self._http = HttpBucketReceiver(deliver)
                await self._http.start(host, max_bucket_bytes)
            info.update(url=self._http.url, token=self._http.token)
        return info

    async def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def pause(self) -> None:
        self._paused_by_caller = True
        await self._engine().pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        self._paused_by_caller = False
        await self._engine().resume_generation()

    async def is_paused(self) -> bool:
        return await self._engine().is_paused()

    async def shutdown(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.stop()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()

    def _engine(self):
        if self._llm is None:
            raise RuntimeError(f"engine {self._engine_index} is not running (not started or "
                               "shut down)")
        return self._llm


# ---------------------------------------------------------------------------------------------
# The driver-side controller


class EngineClient:
    """The sampling half of `VllmGeneration`: requests to its engine actors, validated and
    balanced (module docstring: Data parallelism). Picklable (actor handles and the config), so
    a process other than the driver can generate from the same engines: async GRPO's trajectory
    collector (a Ray actor) gets one from `VllmGeneration.client()`. Each client balances with
    its own in-flight counts; the samples carry the engines' weight versions either way. Weight
    updates and pausing stay with `VllmGeneration` (the driver)."""

    def __init__(self, actors: Sequence[Any], config: GenerationConfig, vocab_size: int):
        self.actors = list(actors)
        self.config = config
        self.vocab_size = vocab_size
        self.closed = False  # set by VllmGeneration.shutdown: the engines are gone
        self._num_in_flight = [0] * len(self.actors)

    def __getstate__(self) -> dict[str, Any]:
        # A copy starts with nothing in flight of its own.
        return {**self.__dict__, "_num_in_flight": [0] * len(self.actors)}

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], num_samples_per_prompt: int, *,
                 sampling_overrides: Mapping[str, Any] | None = None
                 ) -> AsyncIterator[GenerationSample]:
        """`GenerationInterface.generate`, validated eagerly (a plain function returning the
        async generator), so a bad call raises here, before any request exists."""
        if self.closed:
            raise RuntimeError("the engines were shut down")
        config = self.config.with_sampling_overrides(
            dict(sampling_overrides) if sampling_overrides else None)
        prompts = self._check_prompts(prompt_token_ids, config)
        if isinstance(num_samples_per_prompt, bool) or not isinstance(num_samples_per_prompt, int) \
                or num_samples_per_prompt < 1:
            raise ValueError(f"num_samples_per_prompt must be an int >= 1, got "
                             f"{num_samples_per_prompt!r}")
        sampling = {key: getattr(config, key)
                    for key in ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")}
        return self._generate(prompts, num_samples_per_prompt, sampling)

    def _check_prompts(self, prompt_token_ids, config: GenerationConfig) -> list[list[int]]:
        if isinstance(prompt_token_ids, (str, bytes)) \
                or not isinstance(prompt_token_ids, Sequence) or len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must be a non-empty list of prompts, each a list of "
                             "token ids (tokenize with the chat template first)")
        max_prompt_len = config.max_model_len - config.max_tokens
        prompts = []
        for i, prompt in enumerate(prompt_token_ids):
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
                raise ValueError(f"prompt_token_ids[{i}] must be a non-empty list of token ids, "
                                 f"got {type(prompt).__name__}")
            ids = list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < self.vocab_size]
            if bad:
                bad = bad[0]
                raise ValueError(f"prompt_token_ids[{i}]: {bad!r} is not a token id in "
                                 f"[0, {self.vocab_size})")
            if len(ids) > max_prompt_len:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(ids)} tokens, more than max_model_len - "
                    f"max_tokens = {max_prompt_len}; shorten the prompt or raise "
                    "generation.max_model_len")
            prompts.append(ids)
        return prompts

    async def _generate(self, prompts: list[list[int]], num_samples: int,
                        sampling: dict[str, Any]) -> AsyncIterator[GenerationSample]:
        pending: dict[asyncio.Future, tuple[int, ray.ObjectRef]] = {}
        try:
            for prompt_index, prompt in enumerate(prompts):
                # Least-loaded engine for the whole prompt (its samples share the prefix).
                engine = min(range(len(self.actors)), key=self._num_in_flight.__getitem__)
                self._num_in_flight[engine] += num_samples
                for sample_index in range(num_samples):
                    request_id = f"p{prompt_index}-s{sample_index}-{uuid.uuid4().hex}"
                    ref = self.actors[engine].generate_sample.remote(
                        prompt, sampling, request_id, prompt_index, sample_index)
                    pending[asyncio.ensure_future(_await_ref(ref))] = (engine, ref)
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    engine, _ = pending.pop(future)
                    self._num_in_flight[engine] -= 1
                    yield future.result()
        finally:
            # Left early (break, aclose, an error, cancellation): cancel what still runs. Ray
            # cancels the actor's coroutine, and vLLM aborts a request whose generate() is
            # cancelled, freeing its KV cache.
            for future, (engine, ref) in pending.items():
                future.cancel()
                self._num_in_flight[engine] -= 1
                if not self.closed:
                    ray.cancel(ref)


class VllmGeneration(GenerationInterface):
    """`num_engines` vLLM engines behind one `GenerationInterface` (see the module docstring).

    Construction starts Ray (on 127.0.0.1, if not started), resolves the model, validates
    everything it can, logs the memory budget (`memory_budget`), then starts the engines in
    parallel and waits for them (about a minute each for SmolLM2 on CPU).

    `worker_extension_cls` is the qualified name of the class vLLM mixes into its workers: ours,
    or a subclass of it. `engine_env` adds environment variables for the engine processes (e.g.
    vLLM's own `VLLM_LOGGING_LEVEL`).

    Raises:
        ValueError: `backend` is not vllm (sglang is not implemented on this build), the model
            cannot be resolved, tensor_parallel_size > 1 without GPUs in the Ray cluster, the
            engines' KV caches do not fit in the memory available (`plan_memory`) or vLLM
            refused to start for lack of KV-cache memory (both name
            `generation.kv_cache_memory_bytes`), or the engine's model dtype differs from `dtype`.
    """

    def __init__(self, config: GenerationConfig, *, initial_weight_version: int = 0,
                 engine_start_timeout_s: float = 900.0,
                 worker_extension_cls: str = WORKER_EXTENSION_CLS,
                 engine_env: Mapping[str, str] | None = None,
                 cluster_config: ClusterConfig | None = None):
        if not isinstance(config, GenerationConfig):
            raise ValueError(f"VllmGeneration needs a GenerationConfig, got "
                             f"{type(config).__name__}; build it with "
                             "from_dict(GenerationConfig, yaml['generation'], 'generation')")
        if config.backend != "vllm":
            raise ValueError(
                f"generation.backend: {config.backend!r} is not implemented on this build (SGLang "
                "is planned for GPU clusters); use backend: vllm")
        if not isinstance(initial_weight_version, int) or initial_weight_version < 0:
            raise ValueError(f"initial_weight_version must be an int >= 0, got "
                             f"{initial_weight_version!r}")
        if not isinstance(worker_extension_cls, str) or "." not in worker_extension_cls:
            raise ValueError(f"worker_extension_cls must be a qualified class name "
                             f"(module.Class), got {worker_extension_cls!r}")
        engine_env = dict(engine_env or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in engine_env.items()):
            raise ValueError(f"engine_env must map names to strings, got {engine_env!r}")
        self._engine_env = {**engine_env, **_ENGINE_ENV}
        self._cluster_config = cluster_config or ClusterConfig()
        self._workers: WorkerGroup | None = None
        self._client: EngineClient | None = None
        self._config = config
        try:
            self._model_dir = zoo.resolve_model(config.model)
        except ValueError as error:
            raise ValueError(f"generation.model: {error}") from None
        hf_config = json.loads((self._model_dir / "config.json").read_text())
        self._vocab_size = int(hf_config["vocab_size"])
        self._checkpoint_info = checkpoint_refit_info(self._model_dir, config.dtype)
        self._expected_refit_info: dict[str, tuple[tuple[int, ...], str]] = dict(
            self._checkpoint_info)
        self._version = initial_weight_version
        self._ready = True
        self._closed = False
        self._update_lock = asyncio.Lock()
        self._pending_version: int | None = None

        ensure_ray()
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        if config.tensor_parallel_size > 1 and num_gpus == 0:
            raise ValueError(
                f"generation.tensor_parallel_size: {config.tensor_parallel_size} needs GPUs, but "
                "the Ray cluster has none; use tensor_parallel_size: 1 on CPU")
        itemsize = torch.empty(0, dtype=refit_packer.DTYPES[config.dtype]).element_size()
        self.memory_budget = plan_memory(
            config, on_gpu=num_gpus > 0,
            weight_bytes=sum(math.prod(shape) * itemsize
                             for shape, _ in self._checkpoint_info.values()),
            kv_bytes_per_token=kv_cache_bytes_per_token(hf_config, config.dtype))
        logger.info("%s", self.memory_budget.describe())
        engine_kwargs = dict(
            model=str(self._model_dir),
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            # Per engine (per GPU with TP); None = vLLM sizes it from gpu_memory_utilization.
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            tensor_parallel_size=config.tensor_parallel_size,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            worker_extension_cls=worker_extension_cls,
            # Log-probs after temperature (and top-p / top-k): the distribution the tokens were
            # sampled from, the behaviour policy of importance weights. The trainer divides its
            # logits by the same temperature (policy.logprob_temperature); at temperature 1
            # without top-p / top-k this equals the raw log-probs.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            seed=0 if config.seed is None else config.seed,
        )
        self._actors = []
        try:
            self._workers = self._start_group(engine_kwargs, num_gpus)
            self._actors = self._workers.actors
            self._client = EngineClient(self._actors, config, self._vocab_size)
            infos = self._workers.call_all("start", timeout_s=engine_start_timeout_s)
        except WorkerError as error:
            self.shutdown()
            # A config error of the actor (_kv_memory_error): raise it plain, without Ray's
            # wrapping of the actor's traceback.
            cause = getattr(error.__cause__, "cause", None)
            if isinstance(cause, ValueError) and str(cause).startswith("generation."):
                raise ValueError(str(cause)) from None
            raise
        except BaseException:
            self.shutdown()
            raise
        for index, info in enumerate(infos):
            if info["model_dtype"] != config.dtype:
                self.shutdown()
                raise ValueError(f"generation.dtype: engine {index} loaded the model in "
                                 f"{info['model_dtype']}, not {config.dtype}")
        self.engine_start_seconds = max(info["start_seconds"] for info in infos)

    def _start_group(self, engine_kwargs: dict, num_gpus: int) -> WorkerGroup:
        """The engines as a WorkerGroup of the inference fleet (module docstring: Placement)."""
        tp = self._config.tensor_parallel_size
        bundle: dict[str, float] = {"CPU": 1, **({"GPU": 1} if num_gpus else {})}
        kwargs = dict(engine_kwargs)
        if tp > 1:
            # The actor owns nothing; vLLM's Ray executor starts the TP workers in the engine's
            # own placement group (captured), one bundle each.
            kwargs["distributed_executor_backend"] = "ray"
        version = self._version
        return WorkerGroup(
            VllmEngineActor, self._config.num_engines, "inference", self._cluster_config,
            bundle=bundle, bundles_per_worker=tp,
            # Many generate calls wait concurrently on one engine.
            max_concurrency=10_000, runtime_env={"env_vars": self._engine_env},
            worker_args=lambda info: ((kwargs, info.rank, version), {}))

    # ------------------------------------------------------------------------------ properties

    @property
    def config(self) -> GenerationConfig:
        return self._config

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def expected_refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (shape, dtype name) that every weight manifest must match."""
        return dict(self._expected_refit_info)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    # ------------------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], num_samples_per_prompt: int, *,
                 sampling_overrides: Mapping[str, Any] | None = None
                 ) -> AsyncIterator[GenerationSample]:
        # Validate eagerly (a plain function returning the async generator), so a bad call
        # raises here, before any request exists.
        self._check_open()
        if not self._ready:
            raise RuntimeError("generate() after finish_generation(): call "
                               "prepare_for_generation() first")
        return self._client.generate(prompt_token_ids, num_samples_per_prompt,
                                     sampling_overrides=sampling_overrides)

    def client(self) -> EngineClient:
        """A picklable client of these engines, for another process that generates for this
        run (async GRPO's trajectory collector actor). See `EngineClient`."""
        self._check_open()
        return EngineClient(self._actors, self._config, self._vocab_size)

    async def prepare_for_generation(self) -> None:
        self._check_open()
        if self._ready:
            return
        await asyncio.gather(*[_await_ref(a.resume.remote()) for a in self._actors])
        self._ready = True

    async def finish_generation(self) -> None:
        self._check_open()
        if not self._ready:
            return
        await asyncio.gather(*[_await_ref(a.pause.remote()) for a in self._actors])
        self._ready = False

    async def pause_generation(self) -> None:
        self._check_open()
        await asyncio.gather(*[_await_ref(a.pause.remote()) for a in self._actors])

    async def resume_generation(self) -> None:
        self._check_open()
        await asyncio.gather(*[_await_ref(a.resume.remote()) for a in self._actors])

    # ---------------------------------------------------------------------------- weight updates

    async def prepare_refit_info(
        self, refit_info: Mapping[str, tuple[Sequence[int], torch.dtype | str]]
    ) -> None:
        self._check_open()
        if not isinstance(refit_info, Mapping) or not refit_info:
            raise ValueError("refit_info must be a non-empty mapping HF name -> (shape, dtype)")
        declared: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, value in refit_info.items():
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise ValueError(f"refit_info[{name!r}] must be (shape, dtype), got {value!r}")
            shape, dtype = tuple(value[0]), dtype_name(value[1])
            if name not in self._checkpoint_info:
                raise ValueError(f"refit_info: the engine's model has no weight {name!r}; the "
                                 "trainer and the engine must run the same architecture")
            if shape != self._checkpoint_info[name][0]:
                raise ValueError(f"refit_info: {name!r} has shape {shape} but the engine's model "
                                 f"has {self._checkpoint_info[name][0]}")
            # vLLM's loaders cast on copy, so any floating dtype the packer knows can be sent.
            if dtype not in refit_packer.DTYPES or not refit_packer.DTYPES[dtype].is_floating_point:
                raise ValueError(f"refit_info: {name!r} has dtype {dtype}; send floating-point "
                                 "weights")
            declared[name] = (shape, dtype)
        missing = sorted(set(self._checkpoint_info) - set(declared))
        if missing:
            raise ValueError(f"refit_info: {len(missing)} weight(s) of the engine's model are not "
                             f"sent, e.g. {missing[0]!r}; send every weight")
        self._expected_refit_info = declared

    async def update_weights_from_buckets(self, manifest_dict: Mapping[str, Any],
                                          buckets: Sequence[torch.Tensor], version: int, *,
                                          recompute_kv_cache: bool | None = None) -> None:
        self._check_open()
        recompute_kv_cache = self._recompute_kv_cache(recompute_kv_cache)
        # Every check before any engine is touched.
        manifest = self._checked_manifest(manifest_dict)
        if not isinstance(buckets, Sequence) or len(buckets) != manifest.num_buckets:
            raise ValueError(f"got {len(buckets) if isinstance(buckets, Sequence) else buckets!r} "
                             f"buckets but the manifest has {manifest.num_buckets}")
        for b, bucket in enumerate(buckets):
            if not isinstance(bucket, torch.Tensor) or bucket.dtype != torch.uint8 \
                    or bucket.dim() != 1 or bucket.numel() != manifest.bucket_sizes[b]:
                raise ValueError(
                    f"bucket {b} must be a 1-D uint8 tensor of {manifest.bucket_sizes[b]} bytes, "
                    f"got {getattr(bucket, 'dtype', type(bucket).__name__)} of shape "
                    f"{tuple(getattr(bucket, 'shape', ()))}")
        async with self._update_lock:
            self._check_new_version(version)
            manifest_plain = manifest.to_dict()
            buckets_ref = ray.put([bucket.detach().cpu() for bucket in buckets])
            await self._on_every_engine(version, [
                a.update_weights.remote(manifest_plain, buckets_ref, version, recompute_kv_cache)
                for a in self._actors])

    async def begin_weight_update(self, manifest_dict: Mapping[str, Any], version: int, *,
                                  recompute_kv_cache: bool | None = None) -> None:
        """Starts an update that a push transport delivers (weight_sync/push.py): checks the
        manifest against the expected refit info and the version, then pauses every engine and
        opens a pending update in its workers. `finish_weight_update` or `abort_weight_update`
        must follow."""
        self._check_open()
        recompute_kv_cache = self._recompute_kv_cache(recompute_kv_cache)
        manifest = self._checked_manifest(manifest_dict)
        self._check_new_version(version)
        if self._pending_version is not None:
            raise RuntimeError(f"the update to version {self._pending_version} is still pending; "
                               "finish or abort it first")
        self._pending_version = version
        results = await asyncio.gather(
            *[_await_ref(a.begin_weight_update.remote(manifest.to_dict(), version,
                                                      recompute_kv_cache))
              for a in self._actors], return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.abort_weight_update()
            raise errors[0]

    async def finish_weight_update(self, receive_specs: Sequence[Mapping[str, Any]]
                                   ) -> list[dict[str, float]]:
        """Each engine receives its buckets (`receive_specs[i]` for engine i, from the
        transport), loads them and resumes. Returns each engine's timing figures.

        Raises:
            RuntimeError: no update is pending; or it failed on some engine (the cause is
            chained: a TimeoutError when the trainer died); those engines keep their previous
            weights, or refuse to generate when their reload broke half-way.
        """
        self._check_open()
        version = self._pending_version
        if version is None:
            raise RuntimeError("finish_weight_update without begin_weight_update")
        if len(receive_specs) != len(self._actors):
            raise ValueError(f"got {len(receive_specs)} receive specs for "
                             f"{len(self._actors)} engines")
        try:
            return await self._on_every_engine(version, [
                a.finish_weight_update.remote(dict(spec))
                for a, spec in zip(self._actors, receive_specs)])
        finally:
            self._pending_version = None

    async def abort_weight_update(self) -> None:
        """Drops the pending update on every engine (models untouched). Idempotent."""
        self._pending_version = None
        await asyncio.gather(*[_await_ref(a.abort_weight_update.remote())
                               for a in self._actors], return_exceptions=True)

    def open_weight_receiver(self, transport: str, *, host: str = "127.0.0.1",
                             max_bucket_bytes: int = 1 << 30) -> list[dict[str, Any]]:
        """Per engine: what a transport needs to reach it ({"num_workers", "node_id"}, plus
        "url" and "token" of its HTTP endpoint for transport http, started on first call)."""
        self._check_open()
        return ray.get([a.open_weight_receiver.remote(transport, host, max_bucket_bytes)
                        for a in self._actors], timeout=120)

    def engine_node_ids(self) -> list[str]:
        """The Ray node id of every engine actor (for the transport choice)."""
        self._check_open()
        return ray.get([a.node_id.remote() for a in self._actors], timeout=120)

    async def _on_every_engine(self, version: int, refs: list) -> list[dict[str, float]]:
        results = await asyncio.gather(*[_await_ref(ref) for ref in refs],
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"weight update to version {version} failed on "
                               f"{len(errors)} of {len(self._actors)} engine(s); their weights "
                               f"are not trusted until an update succeeds") from errors[0]
        self._version = version
        self.last_update_stats = results
        return results

    def _recompute_kv_cache(self, recompute_kv_cache: bool | None) -> bool:
        if recompute_kv_cache is None:
            return self._config.recompute_kv_cache_after_weight_updates
        if not isinstance(recompute_kv_cache, bool):
            raise ValueError(f"recompute_kv_cache must be None (the config's "
                             f"recompute_kv_cache_after_weight_updates) or a bool, got "
                             f"{recompute_kv_cache!r}")
        return recompute_kv_cache

    def _checked_manifest(self, manifest_dict: Mapping[str, Any]) -> refit_packer.Manifest:
        manifest = refit_packer.Manifest.from_dict(manifest_dict)
        check_manifest_against_refit_info(manifest, self._expected_refit_info)
        return manifest

    def _check_new_version(self, version: Any) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version must be an int larger than the engine's current weight "
                             f"version {self._version}, got {version!r}")

    # ------------------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._actors = []
        if self._client is not None:
            self._client.closed = True
        if self._workers is not None:
            workers, self._workers = self._workers, None
            workers.shutdown(method="shutdown")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VllmGeneration was shut down; build a new one")


async def _await_ref(ref: ray.ObjectRef) -> Any:
    return await ref
