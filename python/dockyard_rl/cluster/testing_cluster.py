"""A simulated multi-node Ray cluster with fleet-role labels, for tests (all on 127.0.0.1).

    with fleet_cluster([("trainer", 1), ("trainer", 1), ("inference", 2)]) as cluster:
        ctx = cluster.connect()          # bootstrap.init_ray as the driver
        cluster.nodes["trainer"]         # node ids of the trainer nodes
        ...

The head is labelled `driver` and has no CPUs, so nothing of a fleet can land on it. Every node
is a real raylet (ray.cluster_utils.Cluster); a node takes a few seconds to start, so share one
cluster per test module. Isolation from other Ray users of the machine: a private RAY_TMPDIR (Ray
would otherwise write the cluster's address to /tmp/ray/ray_current_cluster, where a plain
`ray.init()` of someone else would find it) and a fresh token (RAY_AUTH_TOKEN, token mode on) that
every node and the driver share. Both are restored on exit.

The nodes of a deployment are separate processes of the join CLI instead (join.py):

    with join_environment() as env:
        head = JoinProcess(env, "driver", "--head", "--port", str(port), "--num-cpus", "0")
        head.wait_started()              # "join: driver head <node id> at 127.0.0.1 in ..."
        ...
        head.stop()                      # SIGTERM: 0 after a clean stop

Not covered: GPUs (use `resources` to stand in for accelerators), node failure injection beyond
`remove_node`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dockyard_rl.cluster.bootstrap import RayContext, init_ray, node_labels
from dockyard_rl.cluster.config import ROLE_ENV, ClusterConfig
from dockyard_rl.cluster.local_ray import loopback_resolution
from dockyard_rl.utils.config import from_dict

NodeSpec = tuple  # (role, num_cpus) or (role, num_cpus, {custom resource: amount})


class FleetCluster:
    def __init__(self, cluster, nodes: dict[str, list[str]]):
        self.cluster = cluster
        self.nodes = nodes  # role -> node ids (hex), in the order given
        self.address: str = cluster.address

    def config(self, **overrides: Any) -> ClusterConfig:
        """A ClusterConfig pointing at this cluster; `overrides` are config keys (nested dicts)."""
        return from_dict(ClusterConfig, {"address": self.address, **overrides}, "cluster")

    def connect(self, **overrides: Any) -> RayContext:
        """Connects this process to the cluster as the driver (init_ray)."""
        return init_ray(self.config(**overrides), environ={**os.environ, ROLE_ENV: "driver"})

    def role_of(self, node_id: str) -> str:
        return next(role for role, ids in self.nodes.items() if node_id in ids)

    def add_node(self, role: str, num_cpus: int, resources: Mapping[str, float] | None = None):
        with loopback_resolution():
            node = self.cluster.add_node(
                num_cpus=num_cpus,
                node_ip_address="127.0.0.1",
                labels=node_labels(role),
                resources=dict(resources or {}),
            )
        self.nodes.setdefault(role, []).append(node.node_id)
        return node


@contextlib.contextmanager
def fleet_cluster(specs: Sequence[NodeSpec]) -> Iterator[FleetCluster]:
    """A Cluster with one labelled node per spec (module docstring); torn down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    # Short: Ray's Unix socket paths live under it (108-byte limit).
    temp_dir = tempfile.mkdtemp(prefix="dyc", dir="/tmp")
    os.environ.update(
        RAY_TMPDIR=temp_dir, RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_AUTH_MODE="token"
    )
    from ray._raylet import Config

    Config.initialize("")  # Ray caches its auth mode; let this process see token mode
    cluster = None
    try:
        with loopback_resolution():
            cluster = Cluster(
                initialize_head=True,
                head_node_args=dict(
                    num_cpus=0,
                    node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    labels=node_labels("driver"),
                ),
            )
        fleet = FleetCluster(cluster, {"driver": [cluster.head_node.node_id]})
        for role, num_cpus, *resources in specs:
            fleet.add_node(role, num_cpus, resources[0] if resources else None)
        yield fleet
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        Config.initialize("")
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def join_environment() -> Iterator[dict[str, str]]:
    """The environment for `join` processes (and drivers) of one private cluster on this
    machine: this process's, minus RAY_* / DOCKYARD_* settings, plus this process's import path,
    a private RAY_TMPDIR and a fresh shared token. The folder is removed on exit."""
    temp_dir = tempfile.mkdtemp(prefix="dyj", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DOCKYARD_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(sys.path),
        RAY_TMPDIR=temp_dir,
        RAY_AUTH_TOKEN=secrets.token_hex(32),
    )
    try:
        yield env
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class JoinProcess:
    """One `join` CLI process (a Ray node of `role`, as a deployment starts it), in a session
    of its own. `wait_started` returns its first stdout line:
    `join: <role> head|node <node id> at <ip> in cluster <address>`."""

    def __init__(self, env: Mapping[str, str], role: str, *args: str):
        self.role = role
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dockyard_rl.cluster.join", *args],
            env={**env, ROLE_ENV: role},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def wait_started(self, timeout: float = 180) -> str:
        """The first stdout line; AssertionError with the process's stderr if none came."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            self.process.kill()
            assert self.process.stderr is not None
            raise AssertionError(
                f"{self.role} join did not start: {self.process.stderr.read()[-3000:]}"
            ) from None

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, then its exit status (None if it had exited already); after `timeout`
        seconds its whole session is killed."""
        if self.process.poll() is not None:
            return None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()


__all__ = ["FleetCluster", "JoinProcess", "fleet_cluster", "free_port", "join_environment"]
