"""The vLLM generation backend: vLLM's V1 async engine (`AsyncLLM`) in Ray actors.

Layout. `VllmGeneration` (this module; driver side, implements `GenerationInterface`) owns
`num_engines` `VllmEngineActor`s (vllm_engine_actor.py; Ray async actors), each holding one
`vllm.v1.engine.async_llm.AsyncLLM`. The AsyncLLM starts its engine-core process, which starts one
worker process per tensor-parallel rank; vLLM mixes `vllm_worker_extension.VllmWorkerExtension`
into those workers (`AsyncEngineArgs.worker_extension_cls`) and we reach it with
`AsyncLLM.collective_rpc`. Samples go through an `EngineClient` (vllm_engine_actor.py), which
`client()` also hands to other processes; the memory budget is vllm_memory_budget.py's.

- Data parallelism: each prompt (with all its n samples, which share its prefix KV cache) goes to
  the engine with the fewest samples in flight. Each sample is one vLLM request (n=1), so samples
  stream back as they finish. Seeds: the caller's per-sample `seeds` (the GRPO loops derive one
  per (run, prompt draw, sample): utils/seeding.py), else sample i of a prompt uses the config's
  `seed + i` (what vLLM itself does for n > 1); the same seed gives the same tokens on the same
  weights and engine layout.
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

Memory (vllm_memory_budget.py). Before any engine starts, the driver logs the budget (the engines'
KV caches, the weights, the machine's memory) and, on CPU, raises ValueError naming
`generation.kv_cache_memory_bytes` when the KV caches exceed the memory available right now; vLLM's
own start-up refusals about KV memory come back from the engine actors as ValueErrors naming the
same key.

Stale KV and the prefix cache: every request carries its admission weight version as vLLM's
`cache_salt`, so nothing computed before an update is reused by a request admitted after it
(vllm_engine_actor.py says why resetting the prefix cache is not enough).

Not covered: SGLang; a host-memory check on GPU machines (the KV cache lives on the GPUs; vLLM
checks their memory); sleep mode / memory release for colocated training (`finish_generation` only
stops scheduling); multi-node TP or pipeline parallelism; LoRA; restarting a crashed engine (its
calls raise; build a new `VllmGeneration`); prompts as text (callers tokenize with the chat
template, so the trainer sees exactly the token ids the engine saw).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import pathlib
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
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.interfaces import GenerationInterface, GenerationSample
from dockyard_rl.models.generation.vllm_engine_actor import EngineClient, VllmEngineActor, await_ref
from dockyard_rl.models.generation.vllm_memory_budget import kv_cache_bytes_per_token, plan_memory
from dockyard_rl.weight_sync.manifest_check import check_manifest_against_refit_info, dtype_name

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = "dockyard_rl.models.generation.vllm_worker_extension.VllmWorkerExtension"

# Environment of the engine actors and, through inheritance, of vLLM's processes.
# vLLM's default token budget per engine step (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS).
_CPU_MIN_BATCHED_TOKENS = 2048
_ENGINE_ENV = {
    # vLLM forces spawn inside Ray actors anyway; say it explicitly (forking a process that runs
    # Ray's threads is unsafe).
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    # No usage statistics are sent from this machine.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def ensure_ray() -> None:
    """Starts a local Ray on 127.0.0.1 unless the caller already started or joined one."""
    init_local_ray(log_to_driver=True)


def checkpoint_refit_info(
    model_dir: pathlib.Path, dtype: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype) of every tensor in the checkpoint's safetensors files, with the
    engine's dtype: the default expected refit info. Reads only the file headers."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model directory {str(model_dir)!r} has no *.safetensors files; the "
            "vLLM backend needs a safetensors checkpoint"
        )
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                info[name] = (tuple(f.get_slice(name).get_shape()), dtype)
    return info


def _cpu_scheduler_kwargs(max_model_len: int) -> dict[str, Any]:
    """Scheduler settings of a CPU engine: every prompt prefilled in one piece.

    Our samples are seeded per request (utils/seeding.py). When chunked prefill splits a prompt,
    vLLM rewinds that request's generator after the partial step (`gen.set_offset(...)`), which
    torch's CPU generators do not support: the engine core dies with "CPU Generator does not use
    offset" as soon as a step's prompts exceed the token budget (2048 by default; e.g. 32 prompts
    of 230 tokens). Without chunked prefill a prompt is scheduled whole or not at all, so the
    budget must hold the longest one: max_model_len tokens.
    """
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, _CPU_MIN_BATCHED_TOKENS),
    }


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

    def __init__(
        self,
        config: GenerationConfig,
        *,
        initial_weight_version: int = 0,
        engine_start_timeout_s: float = 900.0,
        worker_extension_cls: str = WORKER_EXTENSION_CLS,
        engine_env: Mapping[str, str] | None = None,
        cluster_config: ClusterConfig | None = None,
    ):
        if not isinstance(config, GenerationConfig):
            raise ValueError(
                f"VllmGeneration needs a GenerationConfig, got "
                f"{type(config).__name__}; build it with "
                "from_dict(GenerationConfig, yaml['generation'], 'generation')"
            )
        if config.backend != "vllm":
            raise ValueError(
                f"generation.backend: {config.backend!r} is not implemented on this build (SGLang "
                "is planned for GPU clusters); use backend: vllm"
            )
        if not isinstance(initial_weight_version, int) or initial_weight_version < 0:
            raise ValueError(
                f"initial_weight_version must be an int >= 0, got {initial_weight_version!r}"
            )
        if not isinstance(worker_extension_cls, str) or "." not in worker_extension_cls:
            raise ValueError(
                f"worker_extension_cls must be a qualified class name "
                f"(module.Class), got {worker_extension_cls!r}"
            )
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
            self._checkpoint_info
        )
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
                "the Ray cluster has none; use tensor_parallel_size: 1 on CPU"
            )
        itemsize = torch.empty(0, dtype=refit_packer.DTYPES[config.dtype]).element_size()
        self.memory_budget = plan_memory(
            config,
            on_gpu=num_gpus > 0,
            weight_bytes=sum(
                math.prod(shape) * itemsize for shape, _ in self._checkpoint_info.values()
            ),
            kv_bytes_per_token=kv_cache_bytes_per_token(hf_config, config.dtype),
        )
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
        if num_gpus == 0:
            engine_kwargs.update(_cpu_scheduler_kwargs(config.max_model_len))
        self._actors = []
        try:
            self._workers = self._start_group(engine_kwargs, num_gpus)
            self._actors = self._workers.actors
            self._client = EngineClient(self._actors, config, self._vocab_size)
            infos = self._workers.call_all("start", timeout_s=engine_start_timeout_s)
        except WorkerError as error:
            self.shutdown()
            # A config error of the actor (kv_memory_error): raise it plain, without Ray's
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
                raise ValueError(
                    f"generation.dtype: engine {index} loaded the model in "
                    f"{info['model_dtype']}, not {config.dtype}"
                )
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
            VllmEngineActor,
            self._config.num_engines,
            "inference",
            self._cluster_config,
            bundle=bundle,
            bundles_per_worker=tp,
            # Many generate calls wait concurrently on one engine.
            max_concurrency=10_000,
            runtime_env={"env_vars": self._engine_env},
            worker_args=lambda info: ((kwargs, info.rank, version), {}),
        )

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

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        num_samples_per_prompt: int,
        *,
        sampling_overrides: Mapping[str, Any] | None = None,
        seeds: Sequence[Sequence[int]] | None = None,
    ) -> AsyncIterator[GenerationSample]:
        # Validate eagerly (a plain function returning the async generator), so a bad call
        # raises here, before any request exists.
        self._check_open()
        if not self._ready:
            raise RuntimeError(
                "generate() after finish_generation(): call prepare_for_generation() first"
            )
        return self._client.generate(
            prompt_token_ids,
            num_samples_per_prompt,
            sampling_overrides=sampling_overrides,
            seeds=seeds,
        )

    def client(self) -> EngineClient:
        """A picklable client of these engines, for another process that generates for this
        run (async GRPO's trajectory collector actor). See `EngineClient`."""
        self._check_open()
        return EngineClient(self._actors, self._config, self._vocab_size)

    async def prepare_for_generation(self) -> None:
        self._check_open()
        if self._ready:
            return
        await asyncio.gather(*[await_ref(a.resume.remote()) for a in self._actors])
        self._ready = True

    async def finish_generation(self) -> None:
        self._check_open()
        if not self._ready:
            return
        await asyncio.gather(*[await_ref(a.pause.remote()) for a in self._actors])
        self._ready = False

    async def pause_generation(self) -> None:
        self._check_open()
        await asyncio.gather(*[await_ref(a.pause.remote()) for a in self._actors])

    async def resume_generation(self) -> None:
        self._check_open()
        await asyncio.gather(*[await_ref(a.resume.remote()) for a in self._actors])

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
                raise ValueError(
                    f"refit_info: the engine's model has no weight {name!r}; the "
                    "trainer and the engine must run the same architecture"
                )
            if shape != self._checkpoint_info[name][0]:
                raise ValueError(
                    f"refit_info: {name!r} has shape {shape} but the engine's model "
                    f"has {self._checkpoint_info[name][0]}"
                )
            # vLLM's loaders cast on copy, so any floating dtype the packer knows can be sent.
            if dtype not in refit_packer.DTYPES or not refit_packer.DTYPES[dtype].is_floating_point:
                raise ValueError(
                    f"refit_info: {name!r} has dtype {dtype}; send floating-point weights"
                )
            declared[name] = (shape, dtype)
        missing = sorted(set(self._checkpoint_info) - set(declared))
        if missing:
            raise ValueError(
                f"refit_info: {len(missing)} weight(s) of the engine's model are not "
                f"sent, e.g. {missing[0]!r}; send every weight"
            )
        self._expected_refit_info = declared

    async def update_weights_from_buckets(
        self,
        manifest_dict: Mapping[str, Any],
        buckets: Sequence[torch.Tensor],
        version: int,
        *,
        recompute_kv_cache: bool | None = None,
    ) -> None:
        self._check_open()
        recompute_kv_cache = self._recompute_kv_cache(recompute_kv_cache)
        # Every check before any engine is touched.
        manifest = self._checked_manifest(manifest_dict)
        if not isinstance(buckets, Sequence) or len(buckets) != manifest.num_buckets:
            raise ValueError(
                f"got {len(buckets) if isinstance(buckets, Sequence) else buckets!r} "
                f"buckets but the manifest has {manifest.num_buckets}"
            )
        for b, bucket in enumerate(buckets):
            if (
                not isinstance(bucket, torch.Tensor)
                or bucket.dtype != torch.uint8
                or bucket.dim() != 1
                or bucket.numel() != manifest.bucket_sizes[b]
            ):
                raise ValueError(
                    f"bucket {b} must be a 1-D uint8 tensor of {manifest.bucket_sizes[b]} bytes, "
                    f"got {getattr(bucket, 'dtype', type(bucket).__name__)} of shape "
                    f"{tuple(getattr(bucket, 'shape', ()))}"
                )
        async with self._update_lock:
            self._check_new_version(version)
            manifest_plain = manifest.to_dict()
            buckets_ref = ray.put([bucket.detach().cpu() for bucket in buckets])
            await self._on_every_engine(
                version,
                [
                    a.update_weights.remote(
                        manifest_plain, buckets_ref, version, recompute_kv_cache
                    )
                    for a in self._actors
                ],
            )

    async def begin_weight_update(
        self,
        manifest_dict: Mapping[str, Any],
        version: int,
        *,
        recompute_kv_cache: bool | None = None,
    ) -> None:
        """Starts an update that a push transport delivers (weight_sync/push_synchronizer.py):
        checks the manifest against the expected refit info and the version, then pauses every
        engine and opens a pending update in its workers. `finish_weight_update` or
        `abort_weight_update` must follow."""
        self._check_open()
        recompute_kv_cache = self._recompute_kv_cache(recompute_kv_cache)
        manifest = self._checked_manifest(manifest_dict)
        self._check_new_version(version)
        if self._pending_version is not None:
            raise RuntimeError(
                f"the update to version {self._pending_version} is still pending; "
                "finish or abort it first"
            )
        self._pending_version = version
        results = await asyncio.gather(
            *[
                await_ref(
                    a.begin_weight_update.remote(manifest.to_dict(), version, recompute_kv_cache)
                )
                for a in self._actors
            ],
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.abort_weight_update()
            raise errors[0]

    async def finish_weight_update(
        self, receive_specs: Sequence[Mapping[str, Any]]
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
            raise ValueError(
                f"got {len(receive_specs)} receive specs for {len(self._actors)} engines"
            )
        try:
            return await self._on_every_engine(
                version,
                [
                    a.finish_weight_update.remote(dict(spec))
                    for a, spec in zip(self._actors, receive_specs)
                ],
            )
        finally:
            self._pending_version = None

    async def abort_weight_update(self) -> None:
        """Drops the pending update on every engine (models untouched). Idempotent."""
        self._pending_version = None
        await asyncio.gather(
            *[await_ref(a.abort_weight_update.remote()) for a in self._actors],
            return_exceptions=True,
        )

    def open_weight_receiver(
        self, transport: str, *, host: str = "127.0.0.1", max_bucket_bytes: int = 1 << 30
    ) -> list[dict[str, Any]]:
        """Per engine: what a transport needs to reach it ({"num_workers", "node_id"}, plus
        "url" and "token" of its HTTP endpoint for transport http, started on first call)."""
        self._check_open()
        return ray.get(
            [
                a.open_weight_receiver.remote(transport, host, max_bucket_bytes)
                for a in self._actors
            ],
            timeout=120,
        )

    def engine_node_ids(self) -> list[str]:
        """The Ray node id of every engine actor (for the transport choice)."""
        self._check_open()
        return ray.get([a.node_id.remote() for a in self._actors], timeout=120)

    async def _on_every_engine(self, version: int, refs: list) -> list[dict[str, float]]:
        results = await asyncio.gather(*[await_ref(ref) for ref in refs], return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(
                f"weight update to version {version} failed on "
                f"{len(errors)} of {len(self._actors)} engine(s); their weights "
                f"are not trusted until an update succeeds"
            ) from errors[0]
        self._version = version
        self.last_update_stats = results
        return results

    def _recompute_kv_cache(self, recompute_kv_cache: bool | None) -> bool:
        if recompute_kv_cache is None:
            return self._config.recompute_kv_cache_after_weight_updates
        if not isinstance(recompute_kv_cache, bool):
            raise ValueError(
                f"recompute_kv_cache must be None (the config's "
                f"recompute_kv_cache_after_weight_updates) or a bool, got "
                f"{recompute_kv_cache!r}"
            )
        return recompute_kv_cache

    def _checked_manifest(self, manifest_dict: Mapping[str, Any]) -> refit_packer.Manifest:
        manifest = refit_packer.Manifest.from_dict(manifest_dict)
        check_manifest_against_refit_info(manifest, self._expected_refit_info)
        return manifest

    def _check_new_version(self, version: Any) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
            raise ValueError(
                f"version must be an int larger than the engine's current weight "
                f"version {self._version}, got {version!r}"
            )

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
