"""Starting a Ray node on this machine: the head of a new cluster, or a node joining one.

    node = start_ray_node(cluster_config.node, "trainer", {"dockyard.io/fleet": "trainer"},
                          address="10.0.0.1:6379")
    ...
    node.stop()

bootstrap.start_node (role → labels) and the join CLI are built on this. It runs Ray's node
launcher (ray._private.node.Node, what `ray start` and ray.cluster_utils.Cluster run) in this
process rather than `ray start`, because `ray start` rewrites a loopback address to the
machine's outward IP (local_ray.loopback_resolution), and refuses worker nodes when told not to.
The node's Ray processes are children of this process: they stop with `RayNode.stop()` or when
it exits (Ray's reaper covers a crash).

The node's IP: `cluster.node.ip_address`, else 127.0.0.1 for a head or for a node joining a
loopback head, else the IP through which this machine reaches the head (as `ray start` picks it).
The dashboard is off; ports Ray would fix by default are random where two nodes of one machine
would clash.

Token auth: every node of a multi-node cluster needs the cluster's token (local_ray's sources 2-4:
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token). A token this process would make up is
useless to the others, so that is a ValueError (unless RAY_AUTH_MODE=disabled).

Not covered: object store / spilling settings, resource isolation (cgroups), Ray client servers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from dockyard_rl.cluster.config import NodeConfig, parse_address
from dockyard_rl.cluster.local_ray import AUTH_MODE, ensure_ray_auth_token, loopback_resolution
from dockyard_rl.utils.addresses import is_loopback

DEFAULT_HEAD_PORT = 6379


@dataclasses.dataclass
class RayNode:
    """A Ray node (raylet and, for a head, the GCS) started by this process."""

    role: str
    address: str  # the cluster's GCS address, HOST:PORT
    node_id: str
    ip_address: str
    head: bool
    _node: Any = dataclasses.field(repr=False)

    def dead_processes(self) -> list[str]:
        """Names of this node's Ray processes that exited (empty while it is healthy)."""
        return [kind for kind, _ in self._node.dead_processes()] if self._node else []

    def stop(self) -> None:
        """Stops this node's processes; safe to repeat."""
        node, self._node = self._node, None
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


def require_shared_token(what: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Makes sure `what` (joining / connecting / a head) finds the cluster's shared token, and
    turns token auth on for this process and the Ray processes it starts; ValueError if none."""
    probe = dict(environ)
    if ensure_ray_auth_token(probe) == "disabled":
        return
    if probe != dict(environ):  # ensure_ray_auth_token made up a token: nobody else has it
        raise ValueError(
            f"{what} needs the cluster's Ray token: set RAY_AUTH_TOKEN or "
            "RAY_AUTH_TOKEN_PATH, or write it to ~/.ray/auth_token, on every node "
            "(`ray get-auth-token --generate` makes one); or RAY_AUTH_MODE=disabled"
        )
    if environ.get(AUTH_MODE) is None:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        # Sets RAY_AUTH_MODE=token and refreshes Ray's cached config in this process.
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def start_ray_node(
    node_cfg: NodeConfig,
    role: str,
    labels: Mapping[str, str],
    *,
    address: str | None = None,
    head: bool = False,
    port: int = DEFAULT_HEAD_PORT,
    temp_dir: str | None = None,
    environ: MutableMapping[str, str] = os.environ,
) -> RayNode:
    """Starts a node with `labels` and `node_cfg`'s resources (module docstring): joining
    `address`, or with `head=True` a head whose GCS listens on `port`. ValueError for a bad
    address, both or neither of address / head, or no shared token."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    if head == (address is not None):
        raise ValueError(
            "start a node with address= to join a cluster, or head=True to start one, not both"
        )
    if head:
        require_shared_token("a head node that other nodes join", environ)
        ip_address = node_cfg.ip_address or "127.0.0.1"
    else:
        host, _ = parse_address(address, "cluster.address")
        require_shared_token(f"joining the Ray cluster at {address}", environ)
        ip_address = node_cfg.ip_address or ("127.0.0.1" if is_loopback(host) else None)
        if ip_address is None:
            from ray._private.services import get_node_ip_address

            ip_address = get_node_ip_address(address)
    params = RayParams(
        gcs_address=address,
        node_ip_address=ip_address,
        num_cpus=node_cfg.num_cpus,
        num_gpus=node_cfg.num_gpus,
        memory=node_cfg.memory,
        resources=dict(node_cfg.resources),
        labels=dict(labels),
        temp_dir=temp_dir,
        include_dashboard=False,
        dashboard_agent_listen_port=None,
        gcs_server_port=port if head else None,
    )
    with loopback_resolution(ip_address):
        node = Node(params, head=head, shutdown_at_exit=True, spawn_reaper=True)
    return RayNode(
        role=role,
        address=node.gcs_address,
        node_id=node.node_id,
        ip_address=node.node_ip_address,
        head=head,
        _node=node,
    )


__all__ = ["DEFAULT_HEAD_PORT", "RayNode", "require_shared_token", "start_ray_node"]
