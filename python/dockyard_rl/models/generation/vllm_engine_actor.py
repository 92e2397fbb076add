"""The engine side of the vLLM backend: `VllmEngineActor`, one vLLM `AsyncLLM` in a Ray async
actor, and `EngineClient`, the picklable sampling client of those actors.

`VllmGeneration` (vllm_generation.py, whose docstring describes the backend: layout, data
parallelism, placement, weight updates) starts the actors as a `WorkerGroup` of the inference fleet
and hands out clients. Each actor builds its AsyncLLM (translating vLLM's refusals for lack of KV
memory into config errors: vllm_memory_budget.py), serves one vLLM request per sample, and runs
the weight-update protocol with the worker extension (vllm_worker_extension.py) through
`AsyncLLM.collective_rpc`.

Stale KV and the prefix cache: `reset_prefix_cache()` cannot drop blocks that running requests
still hold (the in-flight case without recompute). So every request also carries
`cache_salt = "w<version at admission>"`: vLLM mixes the salt into the block hashes, so a request
admitted under version k can only reuse blocks of other requests admitted under k; nothing computed
before an update is reused by a request admitted after it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.interfaces import GenerationSample
from dockyard_rl.models.generation.vllm_memory_budget import kv_memory_error, vllm_kv_memory_refusal
from dockyard_rl.utils import shared_memory

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


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
    holds new requests back while it runs (so a request's admission version is exact for requests
    that arrive during an update).
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
        for name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            os.environ.pop(name, None)
        # vLLM's Ray executor compares its own host IP with Ray's node IP (127.0.0.1 on a local
        # cluster, which vLLM would not guess).
        os.environ.setdefault("VLLM_HOST_IP", ray.util.get_node_ip_address())
        start = time.monotonic()
        marks = _output_marks()
        segments_before = shared_memory.segment_names()
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_kwargs))
        except Exception as error:
            # vLLM kills its processes on a failed start before they unlink their rings (the
            # workers' `psm_*`, 240 MiB each): the new segments nobody holds any more are theirs.
            shared_memory.unlink_unused(shared_memory.segment_names() - segments_before, wait_s=5.0)
            # The cause is only in the engine processes' log lines (vllm_memory_budget.py).
            refusal = vllm_kv_memory_refusal(_output_since(marks))
            if refusal is None:
                raise
            raise kv_memory_error(self._engine_index, self._engine_kwargs, refusal) from error
        await self._llm.update_weight_version(str(self._version))
        (model_dtype, *_) = await self._llm.collective_rpc("dockyard_model_dtype")
        return {"model_dtype": model_dtype, "start_seconds": time.monotonic() - start}

    async def generate_sample(
        self,
        prompt_token_ids: list[int],
        sampling: dict[str, Any],
        request_id: str,
        prompt_index: int,
        sample_index: int,
        seed: int | None = None,
    ) -> GenerationSample:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._engine()
        await self._no_update.wait()
        if self._weights_error is not None:
            raise RuntimeError(
                f"engine {self._engine_index}: {self._weights_error}; push "
                "weights again before generating"
            )
        admitted_version = self._version
        params = SamplingParams(
            n=1,
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=sampling["top_k"],
            max_tokens=sampling["max_tokens"],
            stop=list(sampling["stop"]) or None,
            seed=seed,  # the client's choice (EngineClient._request_seed)
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = {"prompt_token_ids": list(prompt_token_ids), "cache_salt": f"w{admitted_version}"}
        final = None
        async for output in llm.generate(prompt, params, request_id):
            final = output
        assert final is not None and len(final.outputs) == 1
        completion = final.outputs[0]
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = tuple(
            float(position[token].logprob)
            for token, position in zip(token_ids, completion.logprobs or ())
        )
        if completion.finish_reason not in _FINISH_REASONS:
            raise RuntimeError(
                f"engine {self._engine_index}: request {request_id} ended with "
                f"finish reason {completion.finish_reason!r}"
            )
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
            seed=seed,
        )

    async def update_weights(
        self,
        manifest_dict: dict,
        buckets: list[torch.Tensor],
        version: int,
        recompute_kv_cache: bool,
    ) -> dict[str, float]:
        """The object_store path in one call: begin, the buckets as bytes, finish."""
        await self.begin_weight_update(manifest_dict, version, recompute_kv_cache)
        return await self.finish_weight_update({"transport": "object_store"}, buckets)

    async def begin_weight_update(
        self, manifest_dict: dict, version: int, recompute_kv_cache: bool
    ) -> None:
        """Pauses the scheduler (requests kept) and starts a pending update in the workers.
        Exactly one `finish_weight_update` or `abort_weight_update` must follow."""
        llm = self._engine()
        if self._pending is not None:
            raise RuntimeError(
                f"engine {self._engine_index}: the update to version "
                f"{self._pending['version']} is still pending; finish or abort it"
            )
        if version <= self._version:
            raise ValueError(
                f"weight version {version} is not newer than the engine's {self._version}"
            )
        self._pending = {
            "version": version,
            "start": time.monotonic(),
            "recompute": recompute_kv_cache,
        }
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

    async def finish_weight_update(
        self, receive: dict[str, Any], buckets: list[torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Receives the buckets the way `receive["transport"]` says, loads them, labels the new
        version, resets the prefix cache and resumes. On a receive failure the pending update
        is dropped (model untouched); on a load failure the engine refuses to generate until an
        update succeeds."""
        llm = self._engine()
        pending = self._pending
        if pending is None:
            raise RuntimeError(
                f"engine {self._engine_index}: finish_weight_update without begin_weight_update"
            )
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
            self._weights_error = (
                f"weight update failed while loading (version {self._version} "
                "was partly overwritten)"
            )
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
                reset_running_requests=pending.get("recompute", False)
            )
        finally:
            await self._end_update()
        return {
            "pause_seconds": pending.get("paused", pending["start"]) - pending["start"],
            "receive_seconds": received - pending.get("paused", pending["start"]),
            "load_seconds": loaded - received,
            "total_seconds": time.monotonic() - pending["start"],
            "prefix_cache_reset": float(prefix_cache_reset),
        }

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

    async def open_weight_receiver(
        self, transport: str, host: str, max_bucket_bytes: int
    ) -> dict[str, Any]:
        """What the driver needs to connect a transport to this engine (plain data)."""
        import ray

        info: dict[str, Any] = {
            "num_workers": self._engine_kwargs["tensor_parallel_size"],
            "node_id": ray.get_runtime_context().get_node_id(),
        }
        if transport == "http":
            from dockyard_rl.weight_sync.http_transport import HttpBucketReceiver

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
            # vLLM's engine core unlinks its shared-memory RPC ring (`psm_*`, 160 MiB) only when
            # garbage-collected, and Ray kills this actor and its children (the resource tracker
            # too) right after: unlink the engine's segments once its processes are gone.
            segments = shared_memory.segments_of_tree(os.getpid())
            llm.shutdown()
            shared_memory.unlink_unused(segments, wait_s=10.0)

    def _engine(self):
        if self._llm is None:
            raise RuntimeError(
                f"engine {self._engine_index} is not running (not started or shut down)"
            )
        return self._llm


# ---------------------------------------------------------------------------------------------
# The client


class EngineClient:
    """The sampling half of `VllmGeneration`: requests to its engine actors, validated and
    balanced (vllm_generation.py's docstring: Data parallelism). Picklable (actor handles and the
    config), so a process other than the driver can generate from the same engines: async GRPO's
    trajectory collector (a Ray actor) gets one from `VllmGeneration.client()`. Each client
    balances with its own in-flight counts; the samples carry the engines' weight versions either
    way. Weight updates and pausing stay with `VllmGeneration` (the driver)."""

    def __init__(self, actors: Sequence[Any], config: GenerationConfig, vocab_size: int):
        self.actors = list(actors)
        self.config = config
        self.vocab_size = vocab_size
        self.closed = False  # set by VllmGeneration.shutdown: the engines are gone
        self._num_in_flight = [0] * len(self.actors)

    def __getstate__(self) -> dict[str, Any]:
        # A copy starts with nothing in flight of its own.
        return {**self.__dict__, "_num_in_flight": [0] * len(self.actors)}

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        num_samples_per_prompt: int,
        *,
        sampling_overrides: Mapping[str, Any] | None = None,
        seeds: Sequence[Sequence[int]] | None = None,
    ) -> AsyncIterator[GenerationSample]:
        """`GenerationInterface.generate`, validated eagerly (a plain function returning the
        async generator), so a bad call raises here, before any request exists."""
        if self.closed:
            raise RuntimeError("the engines were shut down")
        config = self.config.with_sampling_overrides(
            dict(sampling_overrides) if sampling_overrides else None
        )
        prompts = self._check_prompts(prompt_token_ids, config)
        if (
            isinstance(num_samples_per_prompt, bool)
            or not isinstance(num_samples_per_prompt, int)
            or num_samples_per_prompt < 1
        ):
            raise ValueError(
                f"num_samples_per_prompt must be an int >= 1, got {num_samples_per_prompt!r}"
            )
        sampling = {
            key: getattr(config, key)
            for key in ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")
        }
        if seeds is None:
            # The config's rule: sample i of a prompt uses seed + i (what vLLM does for n > 1).
            base = sampling["seed"]
            seeds = [
                [None if base is None else base + i for i in range(num_samples_per_prompt)]
            ] * len(prompts)
        else:
            seeds = _check_seeds(seeds, len(prompts), num_samples_per_prompt)
        return self._generate(prompts, num_samples_per_prompt, sampling, seeds)

    def _check_prompts(self, prompt_token_ids, config: GenerationConfig) -> list[list[int]]:
        if (
            isinstance(prompt_token_ids, (str, bytes))
            or not isinstance(prompt_token_ids, Sequence)
            or len(prompt_token_ids) == 0
        ):
            raise ValueError(
                "prompt_token_ids must be a non-empty list of prompts, each a list of "
                "token ids (tokenize with the chat template first)"
            )
        max_prompt_len = config.max_model_len - config.max_tokens
        prompts = []
        for i, prompt in enumerate(prompt_token_ids):
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
                raise ValueError(
                    f"prompt_token_ids[{i}] must be a non-empty list of token ids, "
                    f"got {type(prompt).__name__}"
                )
            ids = list(prompt)
            bad = [
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
            ]
            if bad:
                bad = bad[0]
                raise ValueError(
                    f"prompt_token_ids[{i}]: {bad!r} is not a token id in [0, {self.vocab_size})"
                )
            if len(ids) > max_prompt_len:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(ids)} tokens, more than max_model_len - "
                    f"max_tokens = {max_prompt_len}; shorten the prompt or raise "
                    "generation.max_model_len"
                )
            prompts.append(ids)
        return prompts

    async def _generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        sampling: dict[str, Any],
        seeds: Sequence[Sequence[int | None]],
    ) -> AsyncIterator[GenerationSample]:
        pending: dict[asyncio.Future, tuple[int, ray.ObjectRef]] = {}
        try:
            for prompt_index, prompt in enumerate(prompts):
                # Least-loaded engine for the whole prompt (its samples share the prefix).
                engine = min(range(len(self.actors)), key=self._num_in_flight.__getitem__)
                self._num_in_flight[engine] += num_samples
                for sample_index in range(num_samples):
                    request_id = f"p{prompt_index}-s{sample_index}-{uuid.uuid4().hex}"
                    ref = self.actors[engine].generate_sample.remote(
                        prompt,
                        sampling,
                        request_id,
                        prompt_index,
                        sample_index,
                        seeds[prompt_index][sample_index],
                    )
                    pending[asyncio.ensure_future(await_ref(ref))] = (engine, ref)
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


def _check_seeds(
    seeds: Sequence[Sequence[int]], num_prompts: int, num_samples: int
) -> list[list[int]]:
    """`generate`'s explicit seeds: one list of `num_samples` ints in [0, 2**63) per prompt."""
    if (
        isinstance(seeds, (str, bytes))
        or not isinstance(seeds, Sequence)
        or (len(seeds) != num_prompts)
    ):
        raise ValueError(
            f"seeds must be one list of seeds per prompt ({num_prompts}), got "
            f"{len(seeds) if isinstance(seeds, Sequence) else type(seeds).__name__}"
        )
    checked = []
    for p, row in enumerate(seeds):
        if not isinstance(row, Sequence) or len(row) != num_samples:
            raise ValueError(f"seeds[{p}] must hold {num_samples} seeds, one per sample")
        for seed in row:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise ValueError(f"seeds[{p}]: {seed!r} is not an int in [0, 2**63)")
        checked.append(list(row))
    return checked


async def await_ref(ref: ray.ObjectRef) -> Any:
    return await ref
