"""The code that runs inside vLLM's worker processes: weight updates from refit buckets.

vLLM loads this class by its qualified name (`AsyncEngineArgs.worker_extension_cls`) and mixes it
into its Worker class in every worker process (one per tensor-parallel rank). The engine client
reaches its methods with `collective_rpc(method_name, args=...)`, which runs the method on every
rank and returns their results in rank order. Method names carry a `dockyard_` prefix because
vLLM refuses an extension attribute that its Worker class already has.

Why `Worker.reload_weights` and not a copy into the parameters: on CPU (and for quantised or
repacked layers on GPU), vLLM's `process_weights_after_loading` replaces a linear layer's weight
by a kernel-specific packed copy (oneDNN / sgl-kernel) and frees the original parameter, so
writing into `model.named_parameters()` would change nothing the kernels read. `reload_weights(
weights_iterator=..., is_checkpoint_format=True)` is vLLM's supported in-place reload: it restores
each layer's checkpoint-format parameters, feeds the HF-named tensors through the model's own
`load_weights` (which maps HF names to vLLM's and fills fused tensors such as `qkv_proj` and
`gate_up_proj` from their `q/k/v_proj`, `gate/up_proj` parts, and shards them per TP rank), then
re-runs the layer's post-processing (repacking) in place. Tensors are handed to it as views into
the received buckets (`refit_packer.bucket_views`).

Buckets reach the worker in one of two ways. Through the engine actor (transports object_store
and http): as raw bytes, one `collective_rpc` per bucket, because vLLM's client -> engine-core RPC
decodes untyped arguments as plain msgpack (a tensor argument would arrive as a list). Or straight
from the trainer (collective, ipc_zmq): `dockyard_receive_buckets` runs the transport's receiver
inside the worker (a gloo/NCCL broadcast, or a mapping of the trainer's shared memory). Either
way the worker keeps the received buckets until the last one is in (peak memory: one model copy;
none for ipc_zmq, whose buckets are mappings of the trainer's segments).

The callers validate the manifest against the expected refit info before calling in here
(`VllmGeneration`, vllm_generation.py) and pause the scheduler around the call (the engine actor,
vllm_engine_actor.py); this module checks only what it must to not corrupt memory: the manifest's
own consistency and every bucket's size, before the model is touched.

Not covered: LoRA adapters, speculative-decoding draft models, quantised checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync import transport_registry


class VllmWorkerExtension:
    """Mixed into vLLM's Worker; `self` is the worker (it has `reload_weights`, `get_model`).

    A weight update is three collective calls, in this order (anything else raises RuntimeError):
    `dockyard_begin_weight_update(manifest_dict)`, then `dockyard_receive_bucket(index, data)` for
    every bucket in any order (or one `dockyard_receive_buckets(spec)`), then
    `dockyard_finish_weight_update()`, which loads all buckets into the model at once (vLLM's
    reload must see every weight of a layer in one `load_weights` pass).
    `dockyard_abort_weight_update()` drops a half-received update without touching the model.
    """

    def dockyard_begin_weight_update(self, manifest_dict: dict) -> None:
        """Starts receiving buckets described by `manifest_dict` (`Manifest.to_dict()`).

        Raises:
            ValueError: the manifest is inconsistent (see `refit_packer.Manifest`).
        """
        manifest = refit_packer.Manifest.from_dict(manifest_dict)
        # A new begin replaces a half-received update (its sender gave up).
        self._dockyard_update = _PendingUpdate(manifest, [None] * manifest.num_buckets)

    def dockyard_receive_bucket(self, bucket_index: int, data: bytes) -> None:
        """Stores bucket `bucket_index`. `data` is raw bytes: vLLM's RPC layer carries tensors
        only in typed messages, not in `collective_rpc` arguments, so buckets travel as bytes.

        Raises:
            RuntimeError: no update was begun. ValueError: a bad index or a wrong size.
        """
        pending = self._dockyard_pending("dockyard_receive_bucket")
        manifest = pending.manifest
        if not isinstance(bucket_index, int) or not 0 <= bucket_index < manifest.num_buckets:
            raise ValueError(
                f"bucket_index must be in [0, {manifest.num_buckets}), got {bucket_index!r}"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"bucket data must be bytes, got {type(data).__name__}")
        if len(data) != manifest.bucket_sizes[bucket_index]:
            raise ValueError(
                f"bucket {bucket_index} has {len(data)} bytes but the manifest says "
                f"{manifest.bucket_sizes[bucket_index]}"
            )
        # bytearray: a writable, freshly allocated (hence aligned, as the packer's typed views
        # need) copy that the bucket tensor owns.
        pending.buckets[bucket_index] = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if len(data)
            else torch.empty(0, dtype=torch.uint8)
        )

    def dockyard_receive_buckets(self, spec: dict) -> int:
        """Receives every bucket of the begun update through a push transport (`collective`,
        `ipc_zmq`: see dockyard_rl/weight_sync/); `spec` is the driver's receive spec (its
        `transport` key picks the module). Returns the number of buckets received.

        Raises:
            RuntimeError: no update was begun. TimeoutError: the trainer died or went silent
            (the pending update is dropped; the model is untouched).
        """
        pending = self._dockyard_pending("dockyard_receive_buckets")
        device = next(self.get_model().parameters()).device
        try:
            buckets = transport_registry.transport_module(spec["transport"]).receive_buckets(
                pending.manifest, spec, int(getattr(self, "rank", 0)), device
            )
        except BaseException:
            self._dockyard_update = None
            raise
        pending.buckets[:] = buckets
        return len(buckets)

    def dockyard_finish_weight_update(self) -> int:
        """Loads every received tensor (HF names) into the model in place; returns how many.

        Raises:
            RuntimeError: no update was begun, or a bucket is missing (the model is untouched).
        """
        pending = self._dockyard_pending("dockyard_finish_weight_update")
        missing = [b for b, bucket in enumerate(pending.buckets) if bucket is None]
        if missing:
            raise RuntimeError(
                f"dockyard_finish_weight_update: buckets {missing} were never "
                "received; send every bucket first"
            )
        self._dockyard_update = None
        device = next(self.get_model().parameters()).device
        self.reload_weights(
            weights_iterator=_iter_named_views(pending.manifest, pending.buckets, device),
            is_checkpoint_format=True,
        )
        _refresh_tied_kernels(self.get_model())
        return len(pending.manifest.tensors)

    def dockyard_abort_weight_update(self) -> None:
        """Drops a half-received update; the model keeps its weights. Idempotent."""
        self._dockyard_update = None

    def dockyard_model_dtype(self) -> str:
        """The dtype of the model's first floating-point parameter, e.g. "float32"."""
        for param in self.get_model().parameters():
            if param.is_floating_point():
                return str(param.dtype).removeprefix("torch.")
        raise RuntimeError("the model has no floating-point parameters")

    def _dockyard_pending(self, call: str) -> _PendingUpdate:
        pending = getattr(self, "_dockyard_update", None)
        if pending is None:
            raise RuntimeError(f"{call} called without dockyard_begin_weight_update first")
        return pending


@dataclasses.dataclass
class _PendingUpdate:
    manifest: refit_packer.Manifest
    buckets: list[torch.Tensor | None]


def _iter_named_views(
    manifest: refit_packer.Manifest,
    buckets: Sequence[torch.Tensor],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every manifest entry, bucket by bucket: views into the buckets."""
    for b, bucket in enumerate(buckets):
        if bucket.device != device:
            bucket = bucket.to(device)  # one bucket at a time bounds the extra device memory
        yield from refit_packer.bucket_views(bucket, manifest, b).items()


def _refresh_tied_kernels(model: torch.nn.Module) -> None:
    """Re-runs the CPU kernel set-up of modules that share a weight with another (tied weights).

    vLLM's CPU layers keep a kernel-specific packed copy of their weight (`layer.cpu_linear`, a
    oneDNN / sgl-kernel handle built by `process_weights_after_loading`). The reload rebuilds it
    for every layer that received weights, but a tied `lm_head` receives none (its weight is the
    embedding's, which the loader skips for it): its storage is refreshed through the embedding,
    while its packed copy would keep the old weights, and the logits with it. Modules that own
    no such copy are left alone.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel() > 0:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            quant_method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and quant_method is not None:
                quant_method.process_weights_after_loading(module)
