"""The DTensor/FSDP2 policy backend: any Hugging Face causal LM, sharded with `fully_shard`.

Layout. `DTensorPolicy` (the `PolicyInterface` the GRPO driver holds) is a controller over
`policy.dp_size` rank actors (`DTensorPolicyWorker`, dtensor_worker.py: the model, FSDP2, the
microbatch loops and the checkpoint files live there). The ranks are a `WorkerGroup` of the
trainer fleet (distributed/worker_group.py): one placement group with the fleet's strategy from
`cluster.fleets.trainer` (SPREAD by default: ranks on different nodes where there are several;
on one machine the bundles share it), its NCCL environment, and the master address and port of
the ranks' process group. Ray is started on 127.0.0.1 unless this process already started or
joined a cluster.

Data flow. The controller validates a batch, shards it over the ranks with
`BatchedDataDict.shard_by_batch_size(dp_size, balance_by="input_lengths")` (equal sample counts,
balanced token counts) and puts the results back in the original order. Equal shard sizes matter
beyond balance: FSDP's per-layer collectives need every rank to run the same number of
forward/backward passes. The loss's global normalisers come from `count_valid` over the whole
global batch, once, here.

A `RemoteBatch` (data_plane/experience.py) is a handle: its shards already wait in the ranks
(split as above), log-probs stay there beside them, and `train(remote.select(rows, last=...))`
is one optimizer step on global `rows`: each rank trains its shard's rows of them, padded with
masked rows to the same count on every rank, normalised by the rows' global valid counts (an
all-reduce of each rank's `count_valid`: the same numbers as the driver path's).

Refit seam: `prepare_refit_info` lists `named_parameters()` (HF names; a tied `lm_head.weight`
is omitted, as in a HF checkpoint, since it is the embedding itself); `iter_refit_weights`
gathers them bucket by bucket of the refit packer's layout and yields them in that order, cast
to `policy.dtype`; the weight-sync senders run in rank 0 (`open_weight_sender`, `send_weights`:
every rank gathers each bucket, rank 0 sends it).

Checkpoints (`save_checkpoint`, dtensor_worker.py): the resume state is sharded, each rank
writes its own part with torch.distributed.checkpoint (`dcp/`: weights and optimizer state,
float32), plus `rng_rank<r>.pt` and (rank 0) `scheduler.pt`; then, with `export_hf` (the
default; `checkpointing.export_hf` in the GRPO loop), the ranks stream a Hugging Face export
beside it (`model.safetensors` or sharded files + index, in `policy.dtype`; `config.json`;
tokenizer), one tensor gathered at a time, which transformers and vLLM load as an ordinary model
(the GRPO loop's engines resume from it, or from an export made at resume). No rank ever holds
the full model or optimizer state. All of it goes into a temporary sibling directory; the
controller adds the manifest `CHECKPOINT_MANIFEST` last, and
`utils.checkpoint.publish_directory` fsyncs it all and renames the directory into place, so a
crash leaves the previous checkpoint (or none) intact. Loading with the same dp_size resumes
bit-exactly; with another dp_size DCP reshards the weights and optimizer state (exactly) and the
schedule loads as is, but the per-rank RNG streams restart from `policy.seed`.
`export_hf(directory)` writes the HF export alone.

Not covered: tensor, pipeline, context or expert parallelism (the mesh is 1-D); sequence
packing into one row (token-budget packing would give ranks different numbers of microbatches,
which FSDP's lockstep collectives forbid); checkpoints of the earlier format 1 (full
`optimizer.pt`: refused as incomplete); models whose
decoder layers are not named in `_no_split_modules`; checkpoints on file systems that the ranks
do not share (each rank writes its RNG file itself); recovering a worker group after a rank
failed mid-collective (the group refuses further calls: recreate the policy from a checkpoint).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.data_plane.experience import RemoteBatch, start_inbox_actors
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.distributed.worker_group import WorkerGroup
from dockyard_rl.distributed.workers import WorkerError
from dockyard_rl.kernels import refit_packer
from dockyard_rl.losses.loss_functions import combine_metrics, count_valid
from dockyard_rl.models import zoo
from dockyard_rl.models.policy.config import PolicyConfig
from dockyard_rl.models.policy.dtensor_worker import (
    DCP_METADATA,
    SCHEDULER_FILE,
    DTensorPolicyWorker,
    shifted_logprobs,
)
from dockyard_rl.models.policy.interfaces import LossFunction, PolicyInterface
from dockyard_rl.utils.checkpoint import publish_directory

CHECKPOINT_MANIFEST = "dockyard_checkpoint.json"
CHECKPOINT_FORMAT_VERSION = 2  # 2: sharded (DCP) resume state
# Config fields that must match for a checkpoint to belong to this model.
_IDENTITY_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
)
# `iter_refit_weights` gathers in buckets of about this many bytes (the transports use their own
# `weight_sync.bucket_size_bytes`).
_REFIT_BUCKET_BYTES = 256 * 1024 * 1024


def _checkpoint_dir_problem(directory: pathlib.Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is."""
    if not directory.is_dir():
        return "no such directory"
    missing = [
        name
        for name in (
            CHECKPOINT_MANIFEST,
            "config.json",
            DCP_METADATA,
            SCHEDULER_FILE,
        )
        if not (directory / name).is_file()
    ]
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
        cluster_config: the `cluster` section: the trainer fleet's placement strategy, NCCL
            environment and placement timeout (None: the defaults).

    Raises:
        ValueError: `policy.model` is neither a zoo name nor a HF directory, `resume_from` is
            not a complete checkpoint of this model, or the Ray cluster cannot place
            `policy.dp_size` ranks within `cluster.placement_timeout_s`
            (PlacementTimeoutError, naming what is missing).
    """

    def __init__(
        self,
        cfg: PolicyConfig,
        *,
        cache_dir: str | os.PathLike | None = None,
        resume_from: str | os.PathLike | None = None,
        cluster_config: ClusterConfig | None = None,
    ):
        if not isinstance(cfg, PolicyConfig):
            raise ValueError(
                f"DTensorPolicy needs a PolicyConfig, got {type(cfg).__name__}; "
                "build it with from_dict(PolicyConfig, yaml['policy'], 'policy')"
            )
        self.cfg = cfg
        self._cluster_config = cluster_config or ClusterConfig()
        self._workers: WorkerGroup | None = None
        self._broken: str | None = None
        self._refit_info: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._inboxes: list[Any] = []  # data-plane shard inboxes, one per rank (if used)
        # Fail fast, before any actor starts: the model and the checkpoint must exist.
        try:
            self.model_dir = zoo.resolve_model(cfg.model, cache_dir=cache_dir)
        except ValueError as error:
            raise ValueError(f"policy.model: {error}") from None
        if resume_from is not None:
            resume_from = pathlib.Path(resume_from)
            problem = _checkpoint_dir_problem(resume_from)
            if problem is not None:
                raise ValueError(
                    f"resume_from: {str(resume_from)!r}: {problem}; pass a "
                    "directory written by save_checkpoint, or None to start from "
                    "policy.model"
                )
            self._check_checkpoint_identity(resume_from)
        self._start_workers()
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    # -- worker group

    def _start_workers(self) -> None:
        import ray

        dp_size = self.cfg.dp_size
        num_host_cpus = os.cpu_count() or 1
        # A local cluster on 127.0.0.1 unless this process already started or joined one
        # (a deployment's driver calls cluster.bootstrap.init_ray first).
        init_local_ray(num_cpus=max(num_host_cpus, dp_size), log_to_driver=False)
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        if 0 < num_gpus < dp_size:
            raise ValueError(
                f"policy.dp_size: {dp_size} ranks need one GPU each but the Ray "
                f"cluster has {num_gpus}; set policy.dp_size <= {num_gpus}"
            )
        bundle = {"CPU": 1, **({"GPU": 1} if num_gpus else {})}
        cfg = self.cfg
        # Ray adds 15 to its worker processes' niceness (RAY_worker_niceness): on a machine
        # shared with anything at the default priority a rank then gets a sliver of a core (train
        # steps 1.5-3x slower than the same code in the driver). Ranks keep the raylet's (the
        # driver's, when it started Ray), as Ray's own job supervisor does for drivers.
        runtime_env = {"env_vars": {"RAY_worker_niceness": "0"}}
        self._workers = WorkerGroup(
            DTensorPolicyWorker,
            dp_size,
            "trainer",
            self._cluster_config,
            bundle=bundle,
            runtime_env=runtime_env,
            worker_args=lambda info: ((cfg, info.rank, info.world_size), {}),
        )
        master_addr, master_port = self._workers.master_address
        # CPU ranks share this machine's cores (torch would otherwise start one thread per core
        # in every rank and oversubscribe them).
        num_threads = max(1, num_host_cpus // dp_size)
        try:
            infos = self._call_all(
                "setup", str(self.model_dir), master_addr, master_port, num_threads
            )
        except WorkerError as error:
            self.shutdown()
            cause = getattr(error.__cause__, "cause", None)
            if isinstance(cause, ValueError):  # a config problem found by the ranks
                raise ValueError(str(cause)) from None
            raise
        self._max_positions = infos[0]["max_position_embeddings"]
        self._vocab_size = infos[0]["vocab_size"]

    def _call_all(
        self, method: str, *args: Any, per_rank_args: Sequence[tuple] | None = None
    ) -> list[Any]:
        """Calls `method` on every rank and waits for all; the first failure raises at once.

        A rank that fails mid-collective leaves the others blocked in it, so after a failure the
        group is marked unusable (recreate the policy from a checkpoint).
        """
        return self._call("call_all", method, *args, per_rank_args=per_rank_args)

    def _call_rank0(self, method: str, *args: Any) -> Any:
        return self._call("call_rank", 0, method, *args)

    def _call(self, how: str, *args: Any, **kwargs: Any) -> Any:
        if self._broken is not None:
            raise RuntimeError(
                f"the policy worker group failed earlier ({self._broken}); "
                "shut it down and create a new policy (restoring a checkpoint)"
            )
        if self._workers is None:
            raise RuntimeError("the policy was shut down; create a new one")
        try:
            return getattr(self._workers, how)(*args, **kwargs)
        except WorkerError as error:
            self._broken = f"{error.method} failed on rank {error.rank}: {error.cause}"
            raise

    # -- batch checks

    def _check_batch(self, batch: BatchedDataDict, extra_keys: Sequence[str] = ()) -> None:
        if not isinstance(batch, BatchedDataDict):
            raise ValueError(f"batch must be a BatchedDataDict, got {type(batch).__name__}")
        required = ("input_ids", "input_lengths", *extra_keys)
        missing = [key for key in required if key not in batch]
        if missing:
            raise ValueError(
                f"batch is missing key(s) {missing}; it has {sorted(batch)} (see "
                "the batch layouts in distributed/batch_layouts.py)"
            )
        batch_size = batch.batch_size
        ids_BS, lengths_B = batch["input_ids"], batch["input_lengths"]
        if not isinstance(ids_BS, torch.Tensor) or ids_BS.dim() != 2 or ids_BS.dtype != torch.int64:
            raise ValueError(
                f"batch['input_ids'] must be a (B, S) int64 tensor, got "
                f"{getattr(ids_BS, 'shape', type(ids_BS).__name__)} "
                f"{getattr(ids_BS, 'dtype', '')}"
            )
        if (
            not isinstance(lengths_B, torch.Tensor)
            or lengths_B.dim() != 1
            or lengths_B.dtype.is_floating_point
        ):
            raise ValueError("batch['input_lengths'] must be a (B,) integer tensor")
        width = ids_BS.shape[1]
        if batch_size and (int(lengths_B.min()) < 1 or int(lengths_B.max()) > width):
            raise ValueError(
                f"batch['input_lengths'] must be in [1, {width}] (the width of "
                f"input_ids), got min {int(lengths_B.min())}, max "
                f"{int(lengths_B.max())}"
            )
        if self._max_positions and width > self._max_positions:
            raise ValueError(
                f"input_ids has {width} positions but the model's context is "
                f"{self._max_positions} (max_position_embeddings); truncate the "
                "sequences"
            )
        if batch_size and (int(ids_BS.min()) < 0 or int(ids_BS.max()) >= self._vocab_size):
            raise ValueError(
                f"batch['input_ids'] holds ids outside [0, {self._vocab_size}) "
                "(the model's vocabulary)"
            )
        for key in extra_keys:
            value = batch[key]
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == 2
                and tuple(value.shape) != tuple(ids_BS.shape)
            ):
                raise ValueError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}, expected "
                    f"{tuple(ids_BS.shape)} (aligned with input_ids)"
                )
        if batch_size == 0 or batch_size % self.cfg.dp_size != 0:
            raise ValueError(
                f"batch size {batch_size} is not a positive multiple of policy.dp_size="
                f"{self.cfg.dp_size}: every data-parallel rank needs the same number of "
                f"samples; send batches of a multiple of {self.cfg.dp_size} samples (e.g. set "
                "the GRPO batch so that it divides) or change policy.dp_size"
            )

    def _shard(self, batch: BatchedDataDict, keys: Sequence[str]):
        return batch.select_keys(keys).shard_by_batch_size(
            self.cfg.dp_size, balance_by="input_lengths"
        )

    # -- PolicyInterface

    def get_logprobs(self, batch: BatchedDataDict | RemoteBatch) -> torch.Tensor | None:
        return self._logprobs(batch, reference=False)

    def get_reference_policy_logprobs(
        self, batch: BatchedDataDict | RemoteBatch
    ) -> torch.Tensor | None:
        return self._logprobs(batch, reference=True)

    def _logprobs(
        self, batch: BatchedDataDict | RemoteBatch, reference: bool
    ) -> torch.Tensor | None:
        if isinstance(batch, RemoteBatch):  # computed and kept in the ranks, beside the shard
            self._call_all("get_remote_logprobs", batch, reference)
            return None
        self._check_batch(batch)
        sharded = self._shard(batch, ("input_ids", "input_lengths"))
        results = self._call_all(
            "get_logprobs", per_rank_args=[(shard, reference) for shard in sharded.shards]
        )
        return sharded.unshard([{"logprobs": r} for r in results])["logprobs"]

    def train(
        self, batch: BatchedDataDict | RemoteBatch, loss_fn: LossFunction
    ) -> dict[str, float]:
        if isinstance(batch, RemoteBatch):
            # One optimizer step on the handle's rows (all of them when `rows` is None): each
            # rank trains its shard's rows of them, padded to the same count (experience.py).
            start = time.perf_counter()
            results = self._call_all(
                "train_remote", per_rank_args=[(batch, loss_fn, rows) for rows in batch.rank_rows()]
            )
            num_tokens = sum(result["num_tokens"] for result in results)
            return self._train_metrics(results, num_tokens, time.perf_counter() - start)
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
        results = self._call_all(
            "train",
            per_rank_args=[
                (shard, loss_fn, num_valid_tokens, num_valid_sequences) for shard in sharded.shards
            ],
        )
        elapsed = time.perf_counter() - start
        return self._train_metrics(results, int(batch["input_lengths"].sum()), elapsed)

    def _train_metrics(
        self, results: list[dict[str, Any]], num_tokens: int, elapsed: float
    ) -> dict[str, float]:
        metrics = combine_metrics([m for result in results for m in result["metrics"]])
        metrics.update(
            grad_norm=results[0]["grad_norm"],
            learning_rate=results[0]["learning_rate"],
            num_tokens=float(num_tokens),
            tokens_per_second=num_tokens / elapsed,
        )
        return metrics

    def data_plane_receivers(self) -> list[Any]:
        """One shard inbox actor per rank, on the rank's node, in rank order (started on the
        first call): the data plane's receivers (data_plane/experience.py says why not the
        ranks themselves)."""
        import ray

        from dockyard_rl.cluster.bootstrap import fleet_runtime_env

        if not self._inboxes:
            node_ids = [info.node_id for info in self._workers.worker_infos]
            self._inboxes = start_inbox_actors(
                node_ids, fleet_runtime_env("trainer", self._cluster_config)
            )
            ray.get([inbox.__ray_ready__.remote() for inbox in self._inboxes])
        return list(self._inboxes)

    def open_data_plane(self, receiver_specs: Sequence[Any], receive_timeout_s: float) -> None:
        """Inbox r opens receiver r (`DataPlaneEndpoints.receivers`, rank order); rank r takes
        its shards from inbox r."""
        import ray

        inboxes, specs = self.data_plane_receivers(), list(receiver_specs)
        ray.get([inbox.open.remote(spec, receive_timeout_s) for inbox, spec in zip(inboxes, specs)])
        self._call_all(
            "open_data_plane", per_rank_args=[(inbox, receive_timeout_s) for inbox in inboxes]
        )

    def data_plane_stats(self) -> list[dict[str, Any]]:
        """Per rank: its inbox's receiver counters, the (producer, seq, step) of every shard it
        received (ShardInbox.stats) and `num_cached`, the shards the rank still holds."""
        import ray

        inbox_stats = ray.get([inbox.stats.remote() for inbox in self._inboxes])
        cached = self._call_all("num_cached_shards")
        return [{**stats, "num_cached": n} for stats, n in zip(inbox_stats, cached)]

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self._refit_info is None:
            info = self._call_rank0("refit_info")
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
        return self._workers.worker_infos[0].node_id

    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict[str, Any], options: dict[str, Any]
    ) -> dict[str, Any]:
        # The sender lives in rank 0, next to the gathered weights.
        return self._call_rank0("open_weight_sender", session, transport, manifest_dict, options)

    def send_weights(
        self, session: str, manifest_dict: dict[str, Any], version: int
    ) -> dict[str, float]:
        return self._call_all("send_weights", session, manifest_dict, version)[0]

    def close_weight_sender(self, session: str) -> None:
        if self._workers is not None and self._broken is None:
            self._call_rank0("close_weight_sender", session)

    def save_checkpoint(self, directory: pathlib.Path, *, export_hf: bool = True) -> None:
        def write(tmp: pathlib.Path) -> None:
            self._call_all("save_checkpoint", str(tmp))
            if export_hf:
                self._call_all("export_hf", str(tmp))
            else:  # the architecture still goes with the sharded state (the export writes it)
                shutil.copy2(self.model_dir / "config.json", tmp / "config.json")
            step = self._call_rank0("step_count")
            config = json.loads((self.model_dir / "config.json").read_text())
            manifest = {
                "format_version": CHECKPOINT_FORMAT_VERSION,
                "backend": "dtensor",
                "step": step,
                "dp_size": self.cfg.dp_size,
                "model": str(self.cfg.model),
                "identity": {key: config.get(key) for key in _IDENTITY_KEYS},
                "saved_at_unix": time.time(),
            }
            (tmp / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

        # The ranks write into the temporary directory (a sibling, so on the same file system).
        publish_directory(directory, write)

    def export_hf(self, directory: pathlib.Path) -> None:
        """Writes the current weights as a Hugging Face model directory (safetensors in
        `policy.dtype`, config, tokenizer) and nothing else, streamed one tensor at a time
        (dtensor_worker.py `export_hf`), published atomically like a checkpoint;
        `save_checkpoint(export_hf=True)` includes the same export."""
        publish_directory(
            pathlib.Path(directory), lambda tmp: self._call_all("export_hf", str(tmp))
        )

    def _check_checkpoint_identity(self, directory: pathlib.Path) -> None:
        saved = json.loads((directory / CHECKPOINT_MANIFEST).read_text()).get("identity", {})
        ours = json.loads((self.model_dir / "config.json").read_text())
        mismatched = {
            key: (saved.get(key), ours.get(key))
            for key in _IDENTITY_KEYS
            if saved.get(key) != ours.get(key)
        }
        if mismatched:
            listing = ", ".join(
                f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in mismatched.items()
            )
            raise ValueError(
                f"checkpoint {str(directory)!r} was written for another model "
                f"({listing}); load it with policy.model set to that model"
            )

    def load_checkpoint(self, directory: pathlib.Path) -> None:
        directory = pathlib.Path(directory).absolute()
        problem = _checkpoint_dir_problem(directory)
        if problem is not None:
            raise ValueError(
                f"checkpoint {str(directory)!r}: {problem}; pass a directory "
                "written by save_checkpoint"
            )
        self._check_checkpoint_identity(directory)
        self._call_all("load_checkpoint", str(directory))

    def memory_stats(self, reset: bool = False) -> list[dict[str, int]]:
        """Per rank: peak resident memory (and peak device memory on GPU) since the last reset;
        for benchmarks. Not part of PolicyInterface."""
        return self._call_all("memory_stats", reset)

    def shutdown(self) -> None:
        if self._inboxes:
            import ray

            for inbox in self._inboxes:
                ray.kill(inbox)
            self._inboxes = []
        if self._workers is not None:
            workers, self._workers = self._workers, None
            # A broken group may hang in its collective: kill it without the clean shutdown.
            workers.shutdown(method=None if self._broken else "shutdown")


__all__ = ["CHECKPOINT_MANIFEST", "DTensorPolicy", "DTensorPolicyWorker", "shifted_logprobs"]
