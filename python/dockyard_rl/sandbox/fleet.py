"""The sandbox fleet under Ray: task executors started as actors on the sandbox nodes.

    fleet = SandboxFleet(executor_config, cluster_config, num_executors=1)
    fleet.urls            # ["http://127.0.0.1:40123"]: what SweEnvironment's executor_url takes
    fleet.shutdown()

Each `ExecutorActor` runs the executor service (server.running_server: HTTP + scoring worker
threads) on its own event-loop thread inside a Ray actor of the sandbox fleet (a `WorkerGroup`
of role "sandbox": nodes labelled for it, SPREAD by default), so the GRPO driver and the trajectory
collector reach it over HTTP like any executor. On a single machine the actor binds 127.0.0.1; on
a sandbox node of a cluster it binds that node's address, which `ExecutorConfig` allows only with
an auth token (the code under test is untrusted).

For a deployment that runs executors itself (`tools/bazel run //python/dockyard_rl/sandbox:executor`
on its own machines, or behind a load balancer), set `env.executor_url` instead and start no fleet.

Not covered: load-balancing several executors from one environment (SweEnvironment takes one
URL; the first executor's is used), restarting a crashed executor (its tasks are in its SQLite
store and re-run on the next start with the same work_dir).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.distributed.worker_group import WorkerGroup
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.utils.addresses import is_loopback


class ExecutorActor:
    """One executor service in a Ray actor (module docstring)."""

    def __init__(self, config: ExecutorConfig):
        import ray

        if not is_loopback(config.host):
            # Bind this node's own address, the one the other fleets reach it at.
            config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self._config = config
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._url: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="executor", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from dockyard_rl.sandbox.server import serve

        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()

        def on_ready(server) -> None:
            self._url = server.url
            self._ready.set()

        try:
            self._loop.run_until_complete(serve(self._config, self._stop, on_ready=on_ready))
        except BaseException as error:  # reported by url()
            self._error = error
            self._ready.set()

    def url(self, timeout_s: float = 120.0) -> str:
        """The executor's URL once it serves; raises what made it fail to start."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the executor did not start within {timeout_s:g} s")
        if self._error is not None:
            raise RuntimeError(f"the executor failed to start: {self._error}") from self._error
        return self._url

    def shutdown(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(self._config.shutdown_grace_s + 10)


class SandboxFleet:
    """`num_executors` executor actors of the sandbox fleet; `urls` lists where they serve.

    Raises:
        PlacementTimeoutError (ValueError): the sandbox fleet cannot be placed.
        WorkerError: an executor failed to start (its cause is named).
    """

    def __init__(
        self,
        config: ExecutorConfig,
        cluster_config: ClusterConfig,
        *,
        num_executors: int = 1,
        cpus_per_executor: float = 1.0,
    ):
        self._group = WorkerGroup(
            ExecutorActor,
            num_executors,
            "sandbox",
            cluster_config,
            bundle={"CPU": cpus_per_executor},
            max_concurrency=4,
            worker_args=lambda info: ((config,), {}),
        )
        try:
            self.urls: list[str] = self._group.call_all("url")
        except BaseException:
            self._group.shutdown()
            raise

    def shutdown(self) -> None:
        """Stops the executors (running tasks get `shutdown_grace_s`). Safe to repeat."""
        self._group.shutdown(method="shutdown")
