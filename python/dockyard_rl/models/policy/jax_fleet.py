"""The jax backend as a trainer fleet: `JaxFleetPolicy` (driver side) over one `JaxPolicyWorker`.

`policy.backend: jax` builds `JaxFleetPolicy` (factory.py). It is the `PolicyInterface` the GRPO
driver holds, a thin controller: every method forwards to ONE Ray actor, `JaxPolicyWorker`, which
holds a `JaxPolicy` (jax_policy.py: the model, optimizer, compiled programs, checkpoints) and
drives that host's jax devices. A jax program is single-controller per host, so the
`policy.dp_size` data-parallel "ranks" are the devices of the actor's Mesh, not actors.

Placement: the actor is a one-worker `WorkerGroup` of the trainer fleet
(distributed/worker_group.py), the same code that places the DTensor ranks: one placement group
with `cluster.fleets.trainer.strategy`, the trainer fleet's node-label selector, waiting at most
`cluster.placement_timeout_s` (PlacementTimeoutError names what is missing), the fleet's
runtime environment. Its bundle is `{"CPU": dp_size}` on a CPU cluster (the CPUs the same
dp_size would reserve for DTensor ranks) and `{"CPU": 1, "GPU": dp_size}` when the cluster has
GPUs (Ray sets CUDA_VISIBLE_DEVICES to those GPUs, jax sees exactly them; all on one node).
Ray is started on 127.0.0.1 unless this process already started or joined a cluster.

The actor's environment: `RAY_worker_niceness=0` (as the DTensor ranks: at Ray's default +15 a
trainer on a shared machine gets a sliver of a core), and, before jax is first imported in the
actor, `--xla_force_host_platform_device_count=<dp_size>` appended to the node's own XLA_FLAGS
when it runs on CPU with dp_size > 1 (XLA offers one host device otherwise). Flags are composed
in the actor rather than set through runtime_env so that what a trainer node sets itself
(XLA_FLAGS, JAX_* variables) is kept. The driver never imports jax or flax: this module and
everything it imports are jax-free; jax_policy.py is imported inside the actor only.

Calls: each method is one blocking actor call. Batches and the loss function travel pickled
through Ray's object store (`ClippedPGLossFn` is a plain object around a frozen config; a loss
that cannot be pickled fails in `train` with Ray's serialisation error). Keyword arguments that
callers add to `get_logprobs` / `get_reference_policy_logprobs` / `train` are forwarded to
`JaxPolicy` unchanged. A ValueError raised in the actor (malformed batch, bad checkpoint, bad
config at setup) is raised here as a ValueError with the same message and leaves the policy
usable, since `JaxPolicy` checks before it changes anything; any other failure, or the actor's
death, marks the policy broken (recreate it from a checkpoint).

Weight sync: the weight-sync sender runs inside the actor, next to the weights, exactly as in
DTensor's rank 0 (`weight_sender_node_id` is the actor's node; `open_weight_sender`,
`send_weights`, `close_weight_sender` run `JaxPolicy`'s in-process sender there, fed by
`JaxPolicy.iter_refit_weights`), so the collective, IPC and HTTP transports move the weights
from the trainer node to the engines without passing through the driver. `iter_refit_weights`
on this controller (the object-store transport, tests) fetches the weights bucket by bucket of
the refit packer's layout.

Checkpoints are written and read by the actor: the checkpoint directory must be on a file
system the trainer node shares with the driver (as for the DTensor ranks).

Not covered: multi-host jax (`jax.distributed`: several actors forming one jax program across
nodes; the Mesh is one host's devices, so `policy.dp_size` devices must fit one node), restarts
of the actor (`max_restarts` of the fleet is not used: recreate the policy from a checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.cluster.local_ray import init_local_ray
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.distributed.worker_group import WorkerGroup
from dockyard_rl.distributed.workers import WorkerError
from dockyard_rl.kernels import refit_packer
from dockyard_rl.models.policy.config import PolicyConfig
from dockyard_rl.models.policy.interfaces import LossFunction, PolicyInterface
from dockyard_rl.weight_sync import sender_sessions

logger = logging.getLogger(__name__)

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# `iter_refit_weights` fetches in buckets of about this many bytes (as the DTensor controller).
_REFIT_BUCKET_BYTES = 256 * 1024 * 1024


def _absolute(path: str | os.PathLike[str] | None) -> str | None:
    """The actor's working directory is not the driver's: relative paths become absolute."""
    return None if path is None else str(pathlib.Path(path).expanduser().absolute())


def _in_actor(cfg: PolicyConfig) -> PolicyConfig:
    """`cfg` with a relative `policy.model` directory made absolute (zoo names stay names)."""
    from dockyard_rl.models import zoo

    if isinstance(cfg.model, str) and cfg.model in zoo.ZOO_NAMES:
        return cfg
    return dataclasses.replace(cfg, model=_absolute(cfg.model))


class JaxPolicyWorker:
    """The Ray actor: one `JaxPolicy` in its own process on a trainer-fleet node.

    Construction does nothing heavy (WorkerGroup waits for it); `setup` builds the policy. Every
    other method requires `setup` first and forwards to the policy.
    """

    def __init__(self) -> None:
        self._policy: Any = None
        self._refit: Iterator[tuple[str, torch.Tensor]] | None = None

    def setup(
        self,
        cfg: PolicyConfig,
        cache_dir: str | None,
        resume_from: str | None,
        tokenizer_dir: str | None,
        host_devices: int,
    ) -> dict[str, Any]:
        """Composes XLA_FLAGS (module docstring), imports jax, builds the JaxPolicy; returns
        where it runs: pid, node id, jax platform and devices, XLA_FLAGS."""
        import ray

        if host_devices > 1:
            # Must happen before jax's first import in this process (XLA reads it once).
            assert "jax" not in sys.modules, "jax was imported before XLA_FLAGS were set"
            flags = os.environ.get("XLA_FLAGS", "")
            if HOST_DEVICE_FLAG not in flags:
                os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICE_FLAG}={host_devices}".strip()
        import jax

        from dockyard_rl.models.policy.jax_policy import JaxPolicy

        self._policy = JaxPolicy(
            cfg, cache_dir=cache_dir, resume_from=resume_from, tokenizer_dir=tokenizer_dir
        )
        devices = list(self._policy.mesh.devices.flat)
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "platform": devices[0].platform,
            "devices": [str(device) for device in devices],
            "num_visible_devices": len(jax.devices()),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }

    def get_logprobs(self, batch: BatchedDataDict, reference: bool, **kwargs: Any) -> torch.Tensor:
        if reference:
            return self._policy.get_reference_policy_logprobs(batch, **kwargs)
        return self._policy.get_logprobs(batch, **kwargs)

    def train(self, batch: BatchedDataDict, loss_fn: LossFunction, **kwargs: Any) -> dict:
        return self._policy.train(batch, loss_fn, **kwargs)

    def refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self._policy.prepare_refit_info()

    def refit_bucket(self, names: list[str], first: bool) -> dict[str, torch.Tensor]:
        """The next `names` of `iter_refit_weights` (in its order); `first` starts a new pass."""
        if first or self._refit is None:
            self._refit = self._policy.iter_refit_weights()
        out = {}
        for expected in names:
            name, tensor = next(self._refit)
            assert name == expected, f"refit order: got {name}, expected {expected}"
            out[name] = tensor.clone()  # the iterator may hand out views of its buffers
        return out

    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict, options: dict
    ) -> dict[str, Any]:
        return self._policy.open_weight_sender(session, transport, manifest_dict, options)

    def send_weights(self, session: str, manifest_dict: dict, version: int) -> dict[str, float]:
        return self._policy.send_weights(session, manifest_dict, version)

    def close_weight_sender(self, session: str) -> None:
        self._policy.close_weight_sender(session)

    def save_checkpoint(self, directory: str, export_hf: bool) -> None:
        self._policy.save_checkpoint(pathlib.Path(directory), export_hf=export_hf)

    def export_hf(self, directory: str) -> None:
        self._policy.export_hf(pathlib.Path(directory))

    def load_checkpoint(self, directory: str) -> None:
        self._policy.load_checkpoint(pathlib.Path(directory))

    def step_count(self) -> int:
        return self._policy.step

    def memory_stats(self, reset: bool) -> dict[str, int]:
        """Peak resident memory of this process (and, on GPU, jax's peak device bytes) since the
        last reset; `reset` starts a new window (the device peak cannot be reset)."""
        from dockyard_rl.utils import process_memory

        stats = {"peak_rss_bytes": process_memory.status_bytes("VmHWM") or 0}
        device = next(iter(self._policy.mesh.devices.flat))
        if device.platform != "cpu":
            stats["peak_device_bytes"] = int(
                (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
            )
        if reset:
            process_memory.reset_peak_rss()
        return stats

    def shutdown(self) -> None:
        # Ray kills this process next: it would leave the sessions' segments in /dev/shm.
        sender_sessions.close_all_sessions()
        if self._policy is not None:
            self._policy.shutdown()


class JaxFleetPolicy(PolicyInterface):
    """`PolicyInterface` over one `JaxPolicyWorker` actor of the trainer fleet (module docstring).

    Args:
        cfg: the `policy` section; `cfg.backend` must be "jax" (JaxPolicy checks it).
        cache_dir: the model zoo's cache directory on the trainer node (None: the zoo's default).
        resume_from: a directory written by `save_checkpoint`, restored at construction.
        tokenizer_dir: where checkpoints copy the tokenizer from (None: the model directory).
        cluster_config: the `cluster` section: the trainer fleet's strategy, node labels,
            environment and placement timeout (None: the defaults).

    Raises:
        ValueError: whatever JaxPolicy refuses at setup (policy.* keys, resume_from), the
            cluster has fewer GPUs than policy.dp_size, or the trainer fleet cannot be placed
            within `cluster.placement_timeout_s` (PlacementTimeoutError).
    """

    def __init__(
        self,
        cfg: PolicyConfig,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        tokenizer_dir: str | os.PathLike[str] | None = None,
        cluster_config: ClusterConfig | None = None,
    ):
        import ray

        if not isinstance(cfg, PolicyConfig):
            raise ValueError(
                f"JaxFleetPolicy needs a PolicyConfig, got {type(cfg).__name__}; build it "
                "with from_dict(PolicyConfig, yaml['policy'], 'policy')"
            )
        self.cfg = cfg
        self._broken: str | None = None
        self._refit_info: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._workers: WorkerGroup | None = None
        # A local cluster on 127.0.0.1 unless this process already started or joined one.
        init_local_ray(num_cpus=max(os.cpu_count() or 1, cfg.dp_size), log_to_driver=False)
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        if 0 < num_gpus < cfg.dp_size:
            raise ValueError(
                f"policy.dp_size: the jax policy needs {cfg.dp_size} GPUs on one node but the "
                f"Ray cluster has {num_gpus}; set policy.dp_size <= {num_gpus}"
            )
        bundle = {"CPU": 1, "GPU": cfg.dp_size} if num_gpus else {"CPU": cfg.dp_size}
        self._workers = WorkerGroup(
            JaxPolicyWorker,
            1,
            "trainer",
            cluster_config or ClusterConfig(),
            bundle=bundle,
            runtime_env={"env_vars": {"RAY_worker_niceness": "0"}},  # module docstring
        )
        try:
            self.worker_location: dict[str, Any] = self._call(
                "setup",
                _in_actor(cfg),
                _absolute(cache_dir),
                _absolute(resume_from),
                _absolute(tokenizer_dir),
                0 if num_gpus else cfg.dp_size,
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "jax policy: actor pid %d on trainer node %s (%s devices %s); driver pid %d",
            self.worker_location["pid"],
            self.worker_location["node_id"],
            self.worker_location["platform"],
            ",".join(self.worker_location["devices"]),
            os.getpid(),
        )

    # -- calls

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._broken is not None:
            raise RuntimeError(
                f"the jax policy actor failed earlier ({self._broken}); shut it down and "
                "create a new policy (restoring a checkpoint)"
            )
        if self._workers is None:
            raise RuntimeError("the policy was shut down; create a new one")
        try:
            return self._workers.call_rank(0, method, *args, **kwargs)
        except WorkerError as error:
            cause = getattr(error.__cause__, "cause", None)
            if isinstance(cause, ValueError):  # refused before anything changed (JaxPolicy)
                raise ValueError(str(cause)) from None
            self._broken = f"{error.method} failed: {error.cause}"
            raise

    # -- PolicyInterface

    def get_logprobs(self, batch: BatchedDataDict[Any], **kwargs: Any) -> torch.Tensor:
        return self._call("get_logprobs", batch, False, **kwargs)

    def get_reference_policy_logprobs(
        self, batch: BatchedDataDict[Any], **kwargs: Any
    ) -> torch.Tensor:
        return self._call("get_logprobs", batch, True, **kwargs)

    def train(
        self, batch: BatchedDataDict[Any], loss_fn: LossFunction, **kwargs: Any
    ) -> dict[str, float]:
        return self._call("train", batch, loss_fn, **kwargs)

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self._refit_info is None:
            self._refit_info = self._call("refit_info")
        return dict(self._refit_info)

    def iter_refit_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One actor round trip per bucket of the refit packer's layout, not per tensor.
        manifest = refit_packer.plan_buckets(self.prepare_refit_info(), _REFIT_BUCKET_BYTES)
        for b in range(manifest.num_buckets):
            names = [entry.name for entry in manifest.bucket_entries(b)]
            tensors = self._call("refit_bucket", names, b == 0)
            for name in names:
                yield name, tensors.pop(name)

    def weight_sender_node_id(self) -> str:
        return str(self.worker_location["node_id"])

    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict[str, Any], options: dict[str, Any]
    ) -> dict[str, Any]:
        # The sender lives in the actor, next to the weights.
        return self._call("open_weight_sender", session, transport, manifest_dict, options)

    def send_weights(
        self, session: str, manifest_dict: dict[str, Any], version: int
    ) -> dict[str, float]:
        return self._call("send_weights", session, manifest_dict, version)

    def close_weight_sender(self, session: str) -> None:
        if self._workers is not None and self._broken is None:
            self._call("close_weight_sender", session)

    def save_checkpoint(self, directory: pathlib.Path, *, export_hf: bool = True) -> None:
        self._call("save_checkpoint", str(pathlib.Path(directory).absolute()), export_hf)

    def export_hf(self, directory: pathlib.Path) -> None:
        self._call("export_hf", str(pathlib.Path(directory).absolute()))

    def load_checkpoint(self, directory: pathlib.Path) -> None:
        self._call("load_checkpoint", str(pathlib.Path(directory).absolute()))

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by load_checkpoint)."""
        return int(self._call("step_count"))

    def memory_stats(self, reset: bool = False) -> list[dict[str, int]]:
        """[the actor's peak memory] (as DTensorPolicy.memory_stats, one entry); for benchmarks.
        Not part of PolicyInterface."""
        return [self._call("memory_stats", reset)]

    def shutdown(self) -> None:
        if self._workers is not None:
            workers, self._workers = self._workers, None
            workers.shutdown(method=None if self._broken else "shutdown")


__all__ = ["JaxFleetPolicy", "JaxPolicyWorker"]
