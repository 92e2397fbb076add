"""Worker groups: N Ray actors of one class for one fleet, ranked for torch.distributed.

    group = WorkerGroup(PolicyWorker, 4, "trainer", cluster_config,
                        bundle={"CPU": 4, "GPU": 1},
                        worker_args=lambda w: ((policy_cfg, w.rank, w.world_size), {}),
                        on_restart=lambda group, ranks: group.call_all("setup", model_dir))
    group.call_all("setup", model_dir)                          # every rank, fails fast
    group.call_all("train", per_rank_args=[(s,) for s in shards])
    group.call_rank(0, "save_checkpoint", path)
    group.health_check(timeout_s=10)                            # {rank: problem}
    group.restart_dead_workers()                                # re-create, then on_restart
    group.shutdown()                                            # safe to repeat

Placement (bootstrap.place_fleet: the role's nodes, the fleet's strategy, a clear error within
`cluster.placement_timeout_s`): with `bundles_per_worker=1` one placement group holds one bundle
per worker (trainer SPREAD puts ranks on different nodes); with `bundles_per_worker=k>1` each
worker gets its own group of k bundles and sits on its first, and what it starts inherits the
group (vLLM's tensor-parallel workers of one engine, PACK: one node). A worker's own
num_cpus / num_gpus / custom resources default to its whole bundle when k=1 and to 0 otherwise.

Each worker is told its place (workers.py): WorkerInfo (role, rank, world size, local rank,
master address and port) goes to `worker_args(info)`, which returns the constructor's (args,
kwargs), and into its environment as torch's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; `current_worker()` reads them inside the actor). The
master is rank 0's node IP and a port found free there when the group starts. The runtime_env
is the fleet's (bootstrap.fleet_runtime_env: NCCL settings, PYTHONPATH so actors import
dockyard_rl, the role) plus the caller's `runtime_env` (its env_vars may not set NCCL_*).

Calls fan out to every rank and fail fast: the first rank that raises or dies ends the wait and
WorkerError names the rank, the method and the cause. The other ranks' calls are left to finish:
Ray cannot interrupt a running call of a non-async actor, and cancelling one still queued leaves
a gap in the actor's call sequence that stalls its next call for 30 s (ActorUnavailableError).
A rank stuck in a collective with a dead peer stays stuck until the caller restarts it
(restart_worker).

Restarts. A worker that died (ray.kill, a crash, os._exit, a lost node) is found by a failed call
(WorkerDiedError) or by `health_check`; `restart_dead_workers()` re-creates each dead rank in its
own bundle, at most `max_restarts` times per rank over the group's life (default
`cluster.fleets.<role>.max_worker_restarts`), then WorkerRestartError names the rank and the last
cause. A restarted worker is a NEW process constructed like the first (`worker_args` called again
with the current WorkerInfo): none of the old one's state survives (model, optimizer, process
group, anything set by a setup call). Re-establishing it is the caller's job: `on_restart(group,
ranks)` runs after every restart, typically re-running setup on all ranks (a process group needs
every rank) and reloading a checkpoint. The failed call itself is never retried. When rank 0 is
restarted the master port is chosen anew: `group.worker_infos` is current, while the environment of
workers that kept running still holds the old values, so setup methods should take the master
address from the caller (`group.master_address`).

Not covered: Ray's own actor restarts (workers have max_restarts=0: the group decides), elastic
world sizes, gang-rescheduling after a node is lost (Ray reschedules the lost bundle; the restart
waits for it up to `ready_timeout_s`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dockyard_rl.cluster.bootstrap import fleet_runtime_env, place_fleet
from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.distributed.workers import (
    WorkerDiedError,
    WorkerError,
    WorkerInfo,
    WorkerRestartError,
    current_worker,
    describe_error,
    gather,
    node_address_and_free_port,
    worker_error,
)

logger = logging.getLogger(__name__)


class WorkerGroup:
    """`num_workers` actors of `actor_cls` for fleet `role` (module docstring). Ray must be
    initialised (bootstrap.init_ray). Raises PlacementTimeoutError (a ValueError) when the fleet
    cannot be placed and WorkerError when a worker fails to start; nothing is left behind."""

    def __init__(
        self,
        actor_cls: type,
        num_workers: int,
        role: str,
        cluster_config: ClusterConfig,
        *,
        bundle: Mapping[str, float] | None = None,
        bundles_per_worker: int = 1,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        max_concurrency: int | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        worker_args: Callable[[WorkerInfo], tuple[Sequence, Mapping]] | None = None,
        on_restart: Callable[[WorkerGroup, list[int]], Any] | None = None,
        max_restarts: int | None = None,
        ready_timeout_s: float = 300.0,
        actor_options: Mapping[str, Any] | None = None,
    ):
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "Ray is not initialised: call dockyard_rl.cluster.bootstrap."
                "init_ray(cluster_config) before creating a WorkerGroup"
            )
        fleet = cluster_config.fleets.of(role)
        bundle = dict(bundle or {"CPU": 1})
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers: must be an int >= 1, got {num_workers!r}")
        if not isinstance(bundles_per_worker, int) or bundles_per_worker < 1:
            raise ValueError(f"bundles_per_worker: must be an int >= 1, got {bundles_per_worker!r}")
        reserved = {"scheduling_strategy", "runtime_env", "max_restarts", "placement_group"}
        if reserved & set(actor_options or {}):
            raise ValueError(
                f"actor_options: {sorted(reserved & set(actor_options))} are set by the group"
            )
        self.role, self.num_workers = role, num_workers
        self.max_restarts = fleet.max_worker_restarts if max_restarts is None else max_restarts
        self._config, self._bundles_per_worker = cluster_config, bundles_per_worker
        self._runtime_env = dict(runtime_env or {})
        self._worker_args = worker_args or (lambda info: ((), {}))
        self._on_restart, self._ready_timeout_s = on_restart, ready_timeout_s
        own = bundles_per_worker == 1
        self._options = {
            "num_cpus": bundle.get("CPU", 0) if num_cpus is None and own else (num_cpus or 0),
            "num_gpus": bundle.get("GPU", 0) if num_gpus is None and own else (num_gpus or 0),
            "max_restarts": 0,
            **(
                {
                    "resources": {
                        k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")
                    }
                }
                if own
                else {}
            ),
            **({"memory": bundle["memory"]} if own and "memory" in bundle else {}),
            **({"max_concurrency": max_concurrency} if max_concurrency is not None else {}),
            **dict(actor_options or {}),
        }
        # A plain class, or one already decorated with @ray.remote.
        self._actor_cls = (
            actor_cls if isinstance(actor_cls, ray.actor.ActorClass) else ray.remote(actor_cls)
        )
        self._groups: list[Any] = []
        self._actors: list[Any] = []
        self._restarts = [0] * num_workers
        self._dead: dict[int, str] = {}
        self._closed = False
        try:
            if own:
                self._groups = [place_fleet(role, [bundle] * num_workers, cluster_config)]
                self._slots = [(self._groups[0], rank) for rank in range(num_workers)]
            else:
                for _ in range(num_workers):
                    self._groups.append(
                        place_fleet(role, [bundle] * bundles_per_worker, cluster_config)
                    )
                self._slots = [(group, 0) for group in self._groups]
            self._infos = self._plan()
            self._actors = [self._create(rank) for rank in range(num_workers)]
            self._gather(
                list(enumerate(a.__ray_ready__.remote() for a in self._actors)),
                "__init__",
                ready_timeout_s,
            )
        except BaseException:
            self.shutdown()
            raise

    # ----------------------------------------------------------------------------- placement

    def _plan(self) -> list[WorkerInfo]:
        """WorkerInfo of every rank from where the bundles are; a fresh master port."""
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, index = self._slots[0]
        probe = ray.remote(num_cpus=0)(node_address_and_free_port).options(
            runtime_env=fleet_runtime_env(self.role, self._config),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            ),
        )
        master_addr, master_port = ray.get(probe.remote(), timeout=self._ready_timeout_s)
        nodes = [placement_group_table(g)["bundles_to_node_id"][i] for g, i in self._slots]
        return [
            WorkerInfo(
                role=self.role,
                rank=rank,
                world_size=self.num_workers,
                local_rank=nodes[:rank].count(node),
                local_world_size=nodes.count(node),
                master_addr=master_addr,
                master_port=master_port,
                node_id=node,
            )
            for rank, node in enumerate(nodes)
        ]

    def _create(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        info = self._infos[rank]
        args, kwargs = self._worker_args(info)
        runtime_env = dict(self._runtime_env)
        runtime_env.update(
            fleet_runtime_env(
                self.role, self._config, {**runtime_env.get("env_vars", {}), **info.env_vars()}
            )
        )
        group, index = self._slots[rank]
        return self._actor_cls.options(
            runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group,
                placement_group_bundle_index=index,
                placement_group_capture_child_tasks=self._bundles_per_worker > 1,
            ),
            **self._options,
        ).remote(*args, **dict(kwargs))

    # --------------------------------------------------------------------------------- calls

    @property
    def actors(self) -> list[Any]:
        """The actor handles by rank (current ones: a restart replaces a handle)."""
        return list(self._actors)

    @property
    def worker_infos(self) -> list[WorkerInfo]:
        return list(self._infos)

    @property
    def master_address(self) -> tuple[str, int]:
        return self._infos[0].master_addr, self._infos[0].master_port

    @property
    def placement_groups(self) -> list[Any]:
        return list(self._groups)

    @property
    def restart_counts(self) -> list[int]:
        return list(self._restarts)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.role} worker group was shut down; create a new one")

    def submit_all(
        self,
        method: str,
        *args: Any,
        per_rank_args: Sequence[Sequence] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Starts `method` on every rank (`per_rank_args[rank]` replaces `args`); object refs by
        rank, not waited on (for callers that await them)."""
        self._check_open()
        if per_rank_args is not None and len(per_rank_args) != self.num_workers:
            raise ValueError(
                f"per_rank_args: {len(per_rank_args)} entries for {self.num_workers} ranks"
            )
        return [
            getattr(actor, method).remote(
                *(args if per_rank_args is None else per_rank_args[rank]), **kwargs
            )
            for rank, actor in enumerate(self._actors)
        ]

    def call_all(
        self,
        method: str,
        *args: Any,
        per_rank_args: Sequence[Sequence] | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """`method` on every rank; results by rank. Fails fast with WorkerError (module
        docstring); `timeout_s` bounds the whole call."""
        refs = self.submit_all(method, *args, per_rank_args=per_rank_args, **kwargs)
        return self._gather(list(enumerate(refs)), method, timeout_s)

    def call_rank(
        self, rank: int, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """`method` on one rank; WorkerError when it fails."""
        self._check_open()
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank: must be in [0, {self.num_workers}), got {rank}")
        ref = getattr(self._actors[rank], method).remote(*args, **kwargs)
        return self._gather([(rank, ref)], method, timeout_s)[0]

    def _gather(
        self, refs: list[tuple[int, Any]], method: str, timeout_s: float | None
    ) -> list[Any]:
        try:
            return gather(refs, self.role, method, timeout_s)
        except WorkerDiedError as error:
            self._dead[error.rank] = error.cause
            raise

    # ------------------------------------------------------------------------ health, restarts

    def health_check(self, timeout_s: float = 10.0) -> dict[int, str]:
        """{rank: problem} for every rank that is dead or gives no answer within `timeout_s`
        (a non-async worker busy in a long call cannot answer either); {} when all are well."""
        import ray

        self._check_open()
        refs = {actor.__ray_ready__.remote(): rank for rank, actor in enumerate(self._actors)}
        done, not_done = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        problems = {
            refs[ref]: f"no answer within {timeout_s:g} s (busy or hung)" for ref in not_done
        }
        for ref in done:
            try:
                ray.get(ref)
            except Exception as error:
                failure = worker_error(refs[ref], self.role, "health_check", error)
                problems[refs[ref]] = failure.cause
                if isinstance(failure, WorkerDiedError):
                    self._dead[refs[ref]] = failure.cause
        return dict(sorted(problems.items()))

    def restart_dead_workers(self, timeout_s: float = 10.0) -> list[int]:
        """Re-creates the ranks found dead (by a failed call or a health check now), then runs
        `on_restart(group, ranks)`; the restarted ranks (sorted; [] when none was dead).
        Raises WorkerRestartError when a rank is over its restart limit."""
        self.health_check(timeout_s)
        ranks = sorted(self._dead)
        for rank in ranks:
            self._restart(rank, self._dead[rank])
        if ranks and self._on_restart is not None:
            self._on_restart(self, ranks)
        return ranks

    def restart_worker(self, rank: int, cause: str = "restarted by the caller") -> None:
        """Kills and re-creates one rank (e.g. one that hangs), then runs `on_restart`."""
        self._check_open()
        self._restart(rank, cause)
        if self._on_restart is not None:
            self._on_restart(self, [rank])

    def _restart(self, rank: int, cause: str) -> None:
        import ray

        while True:
            if self._restarts[rank] >= self.max_restarts:
                raise WorkerRestartError(
                    f"{self.role} worker group: rank {rank} is dead and was restarted "
                    f"{self._restarts[rank]} time(s) already, the limit (max_restarts="
                    f"{self.max_restarts}, cluster.fleets.{self.role}.max_worker_restarts); last "
                    f"cause: {cause}",
                    rank,
                    "restart",
                    cause,
                )
            self._restarts[rank] += 1
            logger.warning(
                "%s worker group: restarting rank %d (%d/%d): %s",
                self.role,
                rank,
                self._restarts[rank],
                self.max_restarts,
                cause,
            )
            ray.kill(self._actors[rank], no_restart=True)
            if rank == 0:  # rank 0's bundle may have moved, its port been taken
                self._infos = self._plan()
            self._actors[rank] = self._create(rank)
            try:
                self._gather(
                    [(rank, self._actors[rank].__ray_ready__.remote())],
                    "__init__",
                    self._ready_timeout_s,
                )
            except WorkerError as error:
                cause = error.cause
                continue
            self._dead.pop(rank, None)
            return

    # ------------------------------------------------------------------------------ shutdown

    def shutdown(self, method: str | None = None, timeout_s: float = 60.0) -> None:
        """Optionally calls `method` on every live rank (bounded by `timeout_s`, failures
        logged), then kills the workers and removes the placement groups. Safe to repeat."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._closed:
            return
        self._closed = True
        if method is not None and self._actors:
            refs = [
                getattr(a, method).remote()
                for r, a in enumerate(self._actors)
                if r not in self._dead
            ]
            done, not_done = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as error:
                    logger.warning(
                        "%s worker group: %s failed: %s", self.role, method, describe_error(error)
                    )
            if not_done:
                logger.warning(
                    "%s worker group: %s did not finish on %d rank(s) in %g s",
                    self.role,
                    method,
                    len(not_done),
                    timeout_s,
                )
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        for group in self._groups:
            try:
                remove_placement_group(group)
            except Exception as error:  # already gone with its creator
                logger.warning("removing a placement group failed: %s", error)
        self._actors, self._groups = [], []

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


__all__ = [
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerRestartError",
    "current_worker",
]
