"""Ray for every process of a deployment: fleet roles, node labels, placement, NCCL environment.

Every process declares its role in DOCKYARD_FLEET_ROLE (driver | trainer | inference | sandbox)
and calls `init_ray(cluster_config)`:

- driver with an address (`cluster.address`, else RAY_ADDRESS): connects to that cluster.
- driver without one: starts a local single-node cluster on 127.0.0.1 (local_ray) that plays
  every role: its node carries the label `dockyard.io/fleet=all`, and every fleet's label
  selector is `in(<role>,all)`, so each fleet's placement groups may land on it.
- trainer / inference / sandbox: starts a Ray node on this machine that joins the cluster at the
  address, labelled `dockyard.io/fleet=<role>`, with the resources of `cluster.node` (the join
  CLI, join.py, is this as a blocking container entry point; `start_node(head=True)` starts a
  head). Such a process does not connect a driver.

A Ray node carries one value per label key, so "every role" is a value of its own (`all`) that
every fleet's selector lists; Ray 2.60's selector supports `in(a,b)`. Its C++ parser does not
trim spaces: "in(trainer, all)" would look for " all", so selectors are written without spaces.

Placement: `place_fleet(role, bundles, cluster_config)` creates one placement group whose bundles
all select the role's nodes (`bundle_label_selector`), with the fleet's strategy (trainer SPREAD,
inference PACK, sandbox SPREAD by default), and waits at most `cluster.placement_timeout_s`: a
fleet that cannot be placed raises `PlacementTimeoutError` naming the role, the bundles asked
for, and what the role's nodes have and have free; the pending group is removed.

Environment of a fleet's actors: `fleet_runtime_env(role, cluster_config)` is the runtime_env
that carries the fleet's NCCL settings (`cluster.fleets.<role>.nccl_env`), DOCKYARD_FLEET_ROLE,
and PYTHONPATH with the driver's import roots (so actors import dockyard_rl from where the driver
does; on other machines that path must exist, e.g. the same container image).

Token auth: joining or connecting to a cluster needs its token (RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token on every node; nodes.require_shared_token); a token this
process would make up is useless to the others, so that is a ValueError.

Not covered: Ray client (ray://) addresses, autoscaling, node draining, changing a running
node's labels or resources.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from dockyard_rl.cluster.config import FLEET_ROLES, ROLE_ENV, ROLES, ClusterConfig, parse_address
from dockyard_rl.cluster.local_ray import (
    EVERY_ROLE,
    FLEET_LABEL,
    init_local_ray,
    loopback_resolution,
)
from dockyard_rl.cluster.nodes import (
    DEFAULT_HEAD_PORT,
    RayNode,
    require_shared_token,
    start_ray_node,
)
from dockyard_rl.utils.addresses import is_loopback


class PlacementTimeoutError(ValueError):
    """A fleet's placement group was not placed within `cluster.placement_timeout_s`: the cluster
    lacks nodes or resources for it (a deployment / config problem found at setup)."""

    def __init__(self, message: str, role: str, bundles: list[dict[str, float]]):
        super().__init__(message)
        self.role = role
        self.bundles = bundles


def fleet_role(environ: Mapping[str, str] = os.environ) -> str:
    """This process's role from DOCKYARD_FLEET_ROLE; ValueError when missing or unknown."""
    role = environ.get(ROLE_ENV)
    if role not in ROLES:
        state = "is not set" if role is None else f"is {role!r}"
        raise ValueError(
            f"{ROLE_ENV} {state}; every process of a deployment declares its role "
            f"before init_ray(): one of {', '.join(ROLES)}"
        )
    return role


def node_labels(role: str) -> dict[str, str]:
    """Labels of a node started by a process of `role` (EVERY_ROLE for the local cluster)."""
    if role not in (*ROLES, EVERY_ROLE):
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    return {FLEET_LABEL: role}


def label_selector(role: str) -> dict[str, str]:
    """The label selector of fleet `role`'s bundles: its own nodes and the every-role node."""
    if role not in FLEET_ROLES:
        raise ValueError(f"{role!r} has no fleet; fleets: {', '.join(FLEET_ROLES)}")
    return {FLEET_LABEL: f"in({role},{EVERY_ROLE})"}  # no spaces (module docstring)


@dataclasses.dataclass
class RayContext:
    """What `init_ray` did: `node` is the node this process started (None for a driver that
    connected to an existing cluster); `connected`: this process is a Ray driver."""

    role: str
    address: str
    connected: bool
    node: RayNode | None = None

    def shutdown(self) -> None:
        """Disconnects the driver and stops a node started here; safe to repeat."""
        if self.connected:
            import ray

            ray.shutdown()
            self.connected = False
        if self.node is not None:
            self.node.stop()


def _cluster_address(cluster_config: ClusterConfig, environ: Mapping[str, str]) -> str | None:
    if cluster_config.address is not None:
        return cluster_config.address
    address = environ.get("RAY_ADDRESS") or None
    if address is not None:
        parse_address(address, "RAY_ADDRESS")
    return address


def init_ray(
    cluster_config: ClusterConfig,
    *,
    environ: MutableMapping[str, str] = os.environ,
    **init_kwargs: Any,
) -> RayContext:
    """Starts or joins Ray as this process's role requires (module docstring).

    A driver that is already connected gets a context for that connection (no-op).
    `init_kwargs` go to ray.init (drivers only: log_to_driver, namespace, ...).

    Raises:
        ValueError: DOCKYARD_FLEET_ROLE missing or unknown; a fleet role without an address;
            a bad RAY_ADDRESS; no shared token for a multi-node cluster.
    """
    import ray

    if not isinstance(cluster_config, ClusterConfig):
        raise ValueError(
            f"init_ray needs a ClusterConfig, got {type(cluster_config).__name__}; "
            "build it with from_dict(ClusterConfig, yaml['cluster'], 'cluster')"
        )
    role = fleet_role(environ)
    address = _cluster_address(cluster_config, environ)
    if role != "driver":
        if address is None:
            raise ValueError(
                f"cluster.address: a {role} node joins an existing cluster; set "
                "cluster.address or RAY_ADDRESS to the head's HOST:PORT (only the "
                "driver starts a local cluster)"
            )
        node = start_node(cluster_config, role, address=address, environ=environ)
        return RayContext(role=role, address=node.address, connected=False, node=node)
    if ray.is_initialized():
        return RayContext(role=role, address=ray.get_runtime_context().gcs_address, connected=True)
    node_cfg = cluster_config.node
    if address is None:
        # The local cluster plays every role (module docstring).
        resources = {
            k: v
            for k, v in (
                ("num_cpus", node_cfg.num_cpus),
                ("num_gpus", node_cfg.num_gpus),
                ("_memory", node_cfg.memory),
            )
            if v is not None
        }
        init_local_ray(
            labels=node_labels(EVERY_ROLE),
            resources=dict(node_cfg.resources),
            **resources,
            **init_kwargs,
        )
        return RayContext(role=role, address=ray.get_runtime_context().gcs_address, connected=True)
    require_shared_token(f"connecting to the Ray cluster at {address}", environ)
    host, _ = parse_address(address, "cluster.address")
    ip_address = "127.0.0.1" if is_loopback(host) else node_cfg.ip_address
    with loopback_resolution(host):
        ray.init(address=address, _node_ip_address=ip_address, **init_kwargs)
    return RayContext(role=role, address=address, connected=True)


def start_node(
    cluster_config: ClusterConfig,
    role: str,
    *,
    address: str | None = None,
    head: bool = False,
    port: int = DEFAULT_HEAD_PORT,
    temp_dir: str | None = None,
    environ: MutableMapping[str, str] = os.environ,
) -> RayNode:
    """Starts a Ray node of `role` on this machine, labelled with the role and offering
    `cluster.node`'s resources: a worker node joining `address`, or with `head=True` the head of
    a new cluster listening on `port` (nodes.start_ray_node)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    return start_ray_node(
        cluster_config.node,
        role,
        node_labels(role),
        address=address,
        head=head,
        port=port,
        temp_dir=temp_dir,
        environ=environ,
    )


# ------------------------------------------------------------------------------------ placement


def place_fleet(
    role: str,
    bundles: Sequence[Mapping[str, float]],
    cluster_config: ClusterConfig,
    *,
    strategy: str | None = None,
    name: str = "",
):
    """A ready placement group for fleet `role`: `bundles` on the role's nodes with the fleet's
    strategy (or `strategy`). Raises PlacementTimeoutError after `placement_timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    fleet = cluster_config.fleets.of(role)
    bundles = [{key: float(value) for key, value in bundle.items()} for bundle in bundles]
    if not bundles or not all(bundles):
        raise ValueError(
            f"{role} fleet: a placement group needs >= 1 bundle, each asking for "
            f"some resource, got {bundles}"
        )
    strategy = strategy or fleet.strategy
    group = placement_group(
        bundles,
        strategy=strategy,
        name=name,
        bundle_label_selector=[label_selector(role)] * len(bundles),
    )
    ready, _ = ray.wait([group.ready()], timeout=cluster_config.placement_timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    raise PlacementTimeoutError(
        f"{role} fleet cannot be placed: {len(bundles)} bundle(s) {bundles} with strategy "
        f"{strategy} found no room within cluster.placement_timeout_s="
        f"{cluster_config.placement_timeout_s:g} s. {_describe_role_nodes(role, bundles)}",
        role,
        bundles,
    )


def _fmt(resources: Mapping[str, float]) -> str:
    items = []
    for key, value in sorted(resources.items()):
        shown = f"{value / 2**30:.1f}GiB" if key == "memory" else f"{value:g}"
        items.append(f"{key}: {shown}")
    return "{" + ", ".join(items) + "}"


def _describe_role_nodes(role: str, bundles: list[dict[str, float]]) -> str:
    """What the nodes that may host `role` have and have free, and what is missing."""
    import ray
    from ray._private.state import available_resources_per_node

    free_by_node = available_resources_per_node()
    nodes = [
        n
        for n in ray.nodes()
        if n.get("Alive") and n.get("Labels", {}).get(FLEET_LABEL) in (role, EVERY_ROLE)
    ]
    asked = {key: sum(b.get(key, 0.0) for b in bundles) for key in {k for b in bundles for k in b}}

    def relevant(resources: Mapping[str, float]) -> dict[str, float]:
        return {k: resources.get(k, 0.0) for k in asked}

    if not nodes:
        where = (
            f"No live node is labelled {FLEET_LABEL}={role} (or {EVERY_ROLE}): start nodes "
            f"with {ROLE_ENV}={role} (//python/dockyard_rl/cluster:join)."
        )
        return f"{where} Asked in total: {_fmt(asked)}."
    lines, free_total = [], dict.fromkeys(asked, 0.0)
    for node in nodes:
        free = relevant(free_by_node.get(node["NodeID"], {}))
        for key, value in free.items():
            free_total[key] += value
        lines.append(
            f"node {node['NodeID'][:8]} @{node['NodeManagerAddress']} "
            f"({node['Labels'][FLEET_LABEL]}): has {_fmt(relevant(node['Resources']))}"
            f", free {_fmt(free)}"
        )
    missing = {k: asked[k] - free_total[k] for k in asked if asked[k] > free_total[k]}
    verdict = (
        f"Missing: {_fmt(missing)}"
        if missing
        else "Enough in total, but not in the shape the strategy needs (each bundle must fit "
        "on one node; STRICT_PACK needs one node for all, STRICT_SPREAD one per bundle)"
    )
    return (
        f"Nodes for {role}: " + "; ".join(lines) + f". Asked in total {_fmt(asked)}, free "
        f"{_fmt(free_total)}. {verdict}. Add {role} nodes or resources, or ask for less."
    )


# ------------------------------------------------------------------------------ actor environment


def import_roots() -> list[str]:
    """Directories an actor needs on its path to import what this process imports from the
    project: dockyard_rl's parent and, when built, the `_dockyard_kernels` extension's folder."""
    import dockyard_rl

    roots = [str(pathlib.Path(dockyard_rl.__file__).resolve().parent.parent)]
    try:
        import _dockyard_kernels  # built by Bazel; optional

        roots.append(str(pathlib.Path(_dockyard_kernels.__file__).resolve().parent))
    except ImportError:
        pass
    return roots


def nccl_env_vars(role: str, cluster_config: ClusterConfig) -> dict[str, str]:
    """NCCL_* / TORCH_NCCL_* variables of fleet `role` from `cluster.fleets.<role>.nccl_env`."""
    return cluster_config.fleets.of(role).nccl_env.env_vars()


def fleet_runtime_env(
    role: str, cluster_config: ClusterConfig, env_vars: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The runtime_env of fleet `role`'s actors (module docstring); `env_vars` are added (they
    may not set NCCL variables: those belong in the config). Role "driver" is for the driver's
    own helper actors (async GRPO's trajectory collector): no fleet, so no NCCL settings."""
    env_vars = dict(env_vars or {})
    nccl = sorted(k for k in env_vars if k.startswith(("NCCL_", "TORCH_NCCL_")))
    if nccl:
        raise ValueError(
            f"{nccl}: NCCL settings come from cluster.fleets.{role}.nccl_env, not from call sites"
        )
    python_path = [
        *import_roots(),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    return {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(python_path)),
            ROLE_ENV: role,
            **(nccl_env_vars(role, cluster_config) if role in FLEET_ROLES else {}),
            **env_vars,
        }
    }


__all__ = [
    "DEFAULT_HEAD_PORT",
    "EVERY_ROLE",
    "FLEET_LABEL",
    "PlacementTimeoutError",
    "RayContext",
    "RayNode",
    "fleet_role",
    "fleet_runtime_env",
    "import_roots",
    "init_ray",
    "label_selector",
    "nccl_env_vars",
    "node_labels",
    "place_fleet",
    "start_node",
]
