"""The trainer fleet's seam: `PolicyInterface`, what every policy backend implements.

Backends (one module each, picked by `policy.backend` through factory.py):
  dtensor   torch FSDP2 (`fully_shard` per decoder layer) over a DeviceMesh, one Ray actor per rank
  jax       a flax.nnx Llama-family model sharded over a jax Mesh, in one Ray actor

Who calls what. The GRPO loop runs in a driver process and holds ONE `PolicyInterface` object.
For multi-rank backends that object is a thin controller over a group of rank actors: each
method below is called once by the driver and fans out to every rank itself (ranks never call
these methods on each other). Every method is blocking and returns only when all ranks are done.

Batch layouts (`BatchedDataDict`s, declared in distributed/batch_layouts.py): the log-prob
methods read a `LogprobBatch` (input_ids, input_lengths), `train` a `TrainBatch` (+ token_mask,
sample_mask) plus its loss function's `required_batch_keys` (a GRPO step's `RolloutBatch`).
Log-prob alignment: logprobs_BS[b, t] = log p(input_ids[b, t] | input_ids[b, :t]); column 0 (no
context) and padding positions are 0. This is the alignment the loss function expects.

Experience over the data plane (async GRPO with a `data_plane` section): instead of a
BatchedDataDict, `get_logprobs`, `get_reference_policy_logprobs` and `train` may take a
`data_plane.experience.RemoteBatch`, a handle to a global batch whose shards were sent straight
to the ranks (rank r: shard r). Each rank receives its shard once and keeps it; the log-prob
methods then store their result rank-side in the shard (`prev_logprobs`,
`reference_policy_logprobs`) and return None; `train` trains on it and the ranks drop it.
Backends that support it implement `data_plane_receivers` and `open_data_plane`; the defaults
raise ValueError.

Call order: construct (loads weights, fails fast on bad config) -> any number of
get_logprobs / get_reference_policy_logprobs / train / prepare_refit_info / iter_refit_weights /
save_checkpoint / load_checkpoint, in any order -> shutdown() (idempotent). `train` is the only
method that changes the weights; every successful `train` call is one optimizer step.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from dockyard_rl.data_plane.experience import RemoteBatch
from dockyard_rl.distributed.batch_layouts import LogprobBatch, TrainBatch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict


class LossFunction(Protocol):
    """What `train` accepts: `losses.loss_functions.ClippedPGLossFn` satisfies it."""

    def __call__(
        self,
        logprobs_BS: torch.Tensor,
        batch: Any,
        global_num_valid_tokens: Any,
        global_num_valid_sequences: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


class PolicyInterface(abc.ABC):
    """A trainable policy (plus its frozen reference policy) behind one object."""

    @abc.abstractmethod
    def get_logprobs(
        self, batch: BatchedDataDict[LogprobBatch] | RemoteBatch
    ) -> torch.Tensor | None:
        """Log-probs of `batch["input_ids"]` under the current policy, (B, S) float32 on CPU;
        None for a RemoteBatch (stored rank-side: module docstring).

        No gradient, no weight change; idempotent. Raises ValueError for a malformed batch
        (missing keys, ragged fields, lengths beyond the model's context).
        """

    @abc.abstractmethod
    def get_reference_policy_logprobs(
        self, batch: BatchedDataDict[LogprobBatch] | RemoteBatch
    ) -> torch.Tensor | None:
        """As `get_logprobs`, under the frozen reference policy (the initial weights)."""

    @abc.abstractmethod
    def train(
        self, batch: BatchedDataDict[TrainBatch] | RemoteBatch, loss_fn: LossFunction
    ) -> dict[str, float]:
        """One optimizer step on the global batch: microbatches with gradient accumulation,
        data-parallel sharding, gradient clipping, optimizer and LR-scheduler step.

        Returns metrics: at least `loss`, `grad_norm` (before clipping), `learning_rate` (the
        one used for this step), `num_tokens`, `tokens_per_second`, plus the loss function's
        metrics combined over microbatches and ranks. Raises ValueError for a malformed batch
        before any weight changes.
        """

    @abc.abstractmethod
    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF parameter name -> (shape, dtype) of every weight the inference engine receives,
        in the order `iter_refit_weights` yields them. Idempotent; no communication with the
        engine. Weight-sync transports build their manifest from it once."""

    @abc.abstractmethod
    def iter_refit_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF name, full unsharded tensor in HF layout) for every refit weight, in
        `prepare_refit_info` order (the refit seam: DTensor shards or NNX arrays are gathered and
        mapped back to what a Hugging Face checkpoint / vLLM expects). Tensors may be views of
        internal buffers: consume (copy or send) each before advancing the iterator."""

    # -- weight-sync senders: weight_sync's `WeightSource` (weight_sync/interfaces.py) is the
    # contract; only the driver's synchronizer calls these. Each backend runs the sender next to
    # the weights (a multi-rank backend in its rank 0) through weight_sync/sender_sessions.py.

    @abc.abstractmethod
    def weight_sender_node_id(self) -> str | None:
        """The Ray node id of the process that sends weights (None: Ray is not running)."""

    @abc.abstractmethod
    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict[str, Any], options: dict[str, Any]
    ) -> dict[str, Any]:
        """Creates `transport`'s sender for `session` in the sending process (idempotent) and
        returns its endpoint (plain data for the engines). Raises ValueError for an unknown
        transport or a bad manifest."""

    @abc.abstractmethod
    def send_weights(
        self, session: str, manifest_dict: dict[str, Any], version: int
    ) -> dict[str, float]:
        """Packs every refit weight into the manifest's buckets and sends them through the open
        `session` (blocking; the engines receive concurrently). Returns timing figures. Raises
        whatever the transport raises (TimeoutError: the engine side died or went silent)."""

    @abc.abstractmethod
    def close_weight_sender(self, session: str) -> None:
        """Closes `session`'s sender. Idempotent; unknown sessions are ignored."""

    # -- experience over the data plane (module docstring). Only the driver calls these, once at
    # setup: `plane.connect([collector], policy.data_plane_receivers())`, then
    # `policy.open_data_plane(endpoints.receivers, receive_timeout_s)`.

    def data_plane_receivers(self) -> list[Any]:
        """The Ray actors that receive the shards, in rank order (declared with
        `data_plane.ray_direct.data_plane_actor_options()`)."""
        raise ValueError(
            f"data_plane: the {type(self).__name__} policy backend does not take experience "
            "over the data plane; set data_plane: null (or use policy.backend: dtensor)"
        )

    def open_data_plane(self, receiver_specs: Any, receive_timeout_s: float) -> None:
        """Each rank opens its receiver spec (`DataPlaneEndpoints.receivers`, rank order) and
        waits at most `receive_timeout_s` for a shard later."""
        raise ValueError(
            f"data_plane: the {type(self).__name__} policy backend does not take experience "
            "over the data plane; set data_plane: null"
        )

    @abc.abstractmethod
    def save_checkpoint(self, directory: pathlib.Path, *, export_hf: bool = True) -> None:
        """Writes the weights and the optimizer, scheduler and RNG state, so that
        `load_checkpoint` resumes exactly (the next step's loss is bit-identical), and with
        `export_hf` also HF-format weights (`export_hf`'s files) beside them. A backend whose
        resume state is that format writes it either way. Written atomically: a crash leaves
        the previous checkpoint intact."""

    @abc.abstractmethod
    def export_hf(self, directory: pathlib.Path) -> None:
        """Writes the current weights as a Hugging Face model directory (safetensors + config +
        tokenizer, loadable by transformers and vLLM) and nothing else, atomically."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: pathlib.Path) -> None:
        """Restores everything `save_checkpoint` wrote. Raises ValueError naming the directory
        when it is missing or incomplete, or was written for another model."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases actors, process groups and memory. Safe to call more than once."""
