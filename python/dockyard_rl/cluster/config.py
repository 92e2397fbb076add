"""The `cluster` config section: where Ray runs, what this node offers, how each fleet is placed.

    cluster:
      address: null              # "HOST:PORT" of the head's GCS; null: $RAY_ADDRESS, else a
                                 # local single-node cluster (driver only)
      placement_timeout_s: 60    # a fleet that cannot be placed within this fails at setup
      node:                      # what THIS node offers when this process starts a Ray node
        ip_address: null         # null: 127.0.0.1 for a local cluster or a loopback head,
                                 # else Ray's detection
        num_cpus: null           # null: Ray detects
        num_gpus: null
        memory: null             # bytes or "64GiB"; null: Ray detects
        resources: {}            # custom resources, e.g. {sandbox_slot: 8}
      fleets:
        trainer:   {strategy: SPREAD, max_worker_restarts: 2, nccl_env: {...}}
        inference: {strategy: PACK,   max_worker_restarts: 2, nccl_env: {...}}
        sandbox:   {strategy: SPREAD, max_worker_restarts: 2, nccl_env: {...}}

Built with `from_dict(ClusterConfig, yaml.get("cluster"), "cluster")`; every value is checked
here, so a typo or a bad value fails at start-up with the key named. Defaults live in the
dataclasses below and nowhere else; the inference fleet's only differs in `strategy` (PACK: one
engine's tensor-parallel ranks on one node), hence its own subclass.

`strategy` is Ray's placement-group strategy for one group of the fleet (PACK, SPREAD,
STRICT_PACK, STRICT_SPREAD). PACK and SPREAD are preferences Ray honours when it can; the
STRICT_ forms fail placement instead of bending (e.g. STRICT_PACK for TP ranks that must share
NVLink).

`nccl_env` becomes environment variables of that fleet's actors (bootstrap.fleet_runtime_env),
so NCCL is configured by the deployment, never inside the training loop. Each field maps to one
variable; `extra` takes any other NCCL_* / TORCH_NCCL_* variable. `heartbeat_timeout_s` is also
the timeout of the fleet's torch process groups (`process_group_timeout`, read by the policy
ranks when they call init_process_group): a collective that hangs longer fails instead of
blocking forever, on gloo (CPU) as on NCCL.

Who reads what: the DTensor policy's ranks or the jax policy's actor (trainer fleet) and the vLLM
engines (inference fleet) are WorkerGroups, placed by bootstrap.place_fleet (the fleet's
`strategy`, waiting at most `placement_timeout_s`) with bootstrap.fleet_runtime_env (the fleet's
`nccl_env`); the executors the loop starts (section `executor`) are the sandbox fleet. A recipe
that sets `cluster.fleets.sandbox` with `executor: null` (the executors then run outside the loop)
fails at load time (algorithms/grpo_config.py), since nothing would read it.

Not covered: autoscaling, heterogeneous per-node config files (each node process passes its own
`node` values, e.g. through the join CLI's flags), Ray client (ray://) addresses.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import re
from collections.abc import Mapping

from dockyard_rl.utils.byte_sizes import parse_byte_size
from dockyard_rl.utils.config import is_int, is_number, require

ROLE_ENV = "DOCKYARD_FLEET_ROLE"
# Every process of a deployment declares one of these in DOCKYARD_FLEET_ROLE.
ROLES = ("driver", "trainer", "inference", "sandbox")
# The roles that have nodes and placement groups of their own (the driver only orchestrates).
FLEET_ROLES = ("trainer", "inference", "sandbox")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
_NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_")
# What `nccl_env.heartbeat_timeout_s` becomes in a fleet actor's environment.
HEARTBEAT_TIMEOUT_ENV = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
# Binary units only: "GB" would leave open whether 10**9 or 2**30 was meant.
# Custom resource names: what `ray start --resources` accepts, minus Ray's own names.
_RESOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")
_RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def parse_address(value: str, key: str) -> tuple[str, int]:
    """("host", port) from "HOST:PORT"; ValueError naming `key` otherwise."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    require(
        bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536,
        key,
        f'must be "HOST:PORT" (the head\'s GCS address, e.g. "10.0.0.1:6379"), got {value!r}',
    )
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Resources of the Ray node this process starts (a local cluster, or a node joining one)."""

    ip_address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    # Bytes or a string with a binary unit ("64GiB"); normalised to int bytes.
    memory: int | str | None = None
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ip_address is not None:
            try:
                ipaddress.ip_address(self.ip_address)
            except ValueError:
                require(
                    False,
                    "ip_address",
                    f'must be an IP address such as "127.0.0.1" or '
                    f"null (detect), got {self.ip_address!r}",
                )
        for key in ("num_cpus", "num_gpus"):
            value = getattr(self, key)
            require(
                value is None or (is_int(value) and value >= 0),
                key,
                f"must be an int >= 0 or null (Ray detects), got {value!r}",
            )
        if self.memory is not None:
            object.__setattr__(self, "memory", parse_byte_size(self.memory, "memory"))
        require(
            isinstance(self.resources, Mapping),
            "resources",
            f"must be a mapping of resource name to amount, got {self.resources!r}",
        )
        for name, amount in self.resources.items():
            require(
                isinstance(name, str)
                and bool(_RESOURCE_NAME.fullmatch(name))
                and name not in _RAY_RESOURCES,
                f"resources.{name}",
                f"custom resource names are identifiers other than {_RAY_RESOURCES} "
                "(set those with num_cpus / num_gpus / memory)",
            )
            require(
                is_number(amount) and amount >= 0,
                f"resources.{name}",
                f"must be a number >= 0, got {amount!r}",
            )
        object.__setattr__(self, "resources", dict(self.resources))


@dataclasses.dataclass(frozen=True)
class NcclEnvConfig:
    """NCCL settings of one fleet's actors; null leaves NCCL's own default (variable unset)."""

    socket_ifname: str | None = None  # NCCL_SOCKET_IFNAME, e.g. "eth0" or "^lo,docker"
    ib_hca: str | None = None  # NCCL_IB_HCA, e.g. "mlx5_0,mlx5_1"
    ib_disable: bool | None = None  # NCCL_IB_DISABLE (true: sockets instead of IB)
    ib_timeout: int | None = None  # NCCL_IB_TIMEOUT: 4.096 us * 2**value per IB retry
    heartbeat_timeout_s: int | None = None  # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (hung collective)
    debug: str | None = None  # NCCL_DEBUG
    extra: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("socket_ifname", "ib_hca"):
            value = getattr(self, key)
            require(
                value is None or (isinstance(value, str) and value.strip() != ""),
                key,
                f"must be a non-empty string or null, got {value!r}",
            )
        require(
            self.ib_disable is None or isinstance(self.ib_disable, bool),
            "ib_disable",
            f"must be true, false or null, got {self.ib_disable!r}",
        )
        require(
            self.ib_timeout is None or (is_int(self.ib_timeout) and 1 <= self.ib_timeout <= 31),
            "ib_timeout",
            f"must be an int in [1, 31] (an exponent) or null, got {self.ib_timeout!r}",
        )
        require(
            self.heartbeat_timeout_s is None
            or (is_int(self.heartbeat_timeout_s) and self.heartbeat_timeout_s > 0),
            "heartbeat_timeout_s",
            f"must be an int > 0 or null, got {self.heartbeat_timeout_s!r}",
        )
        require(
            self.debug is None or self.debug in NCCL_DEBUG_LEVELS,
            "debug",
            f"must be one of {', '.join(NCCL_DEBUG_LEVELS)} or null, got {self.debug!r}",
        )
        require(
            isinstance(self.extra, Mapping),
            "extra",
            f"must be a mapping of variable name to value, got {self.extra!r}",
        )
        for name, value in self.extra.items():
            require(
                isinstance(name, str) and name.startswith(_NCCL_PREFIXES),
                f"extra.{name}",
                f"only variables starting with {' or '.join(_NCCL_PREFIXES)} belong here",
            )
            require(
                isinstance(value, (str, int)) and not isinstance(value, bool),
                f"extra.{name}",
                f"must be a string or an int, got {value!r}",
            )
        object.__setattr__(self, "extra", {k: str(v) for k, v in self.extra.items()})
        clashes = sorted(set(self.extra) & set(self._named_env_vars()))
        require(not clashes, "extra", f"{clashes} are also set by their own keys; keep one")

    def env_vars(self) -> dict[str, str]:
        """The environment variables these settings stand for (unset ones omitted)."""
        return {**self._named_env_vars(), **self.extra}

    def _named_env_vars(self) -> dict[str, str]:
        named = {
            "NCCL_SOCKET_IFNAME": self.socket_ifname,
            "NCCL_IB_HCA": self.ib_hca,
            "NCCL_IB_DISABLE": None if self.ib_disable is None else str(int(self.ib_disable)),
            "NCCL_IB_TIMEOUT": None if self.ib_timeout is None else str(self.ib_timeout),
            HEARTBEAT_TIMEOUT_ENV: (
                None if self.heartbeat_timeout_s is None else str(self.heartbeat_timeout_s)
            ),
            "NCCL_DEBUG": self.debug,
        }
        return {name: value for name, value in named.items() if value is not None}


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """Placement and environment of one fleet (trainer and sandbox use these defaults)."""

    strategy: str = "SPREAD"
    # How often one rank of a worker group may be re-created after it died.
    max_worker_restarts: int = 2
    nccl_env: NcclEnvConfig = dataclasses.field(default_factory=NcclEnvConfig)

    def __post_init__(self) -> None:
        require(
            self.strategy in STRATEGIES,
            "strategy",
            f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}",
        )
        require(
            is_int(self.max_worker_restarts) and self.max_worker_restarts >= 0,
            "max_worker_restarts",
            f"must be an int >= 0, got {self.max_worker_restarts!r}",
        )


@dataclasses.dataclass(frozen=True)
class InferenceFleetConfig(FleetConfig):
    """The inference fleet: PACK keeps one engine's tensor-parallel ranks on one node."""

    strategy: str = "PACK"


@dataclasses.dataclass(frozen=True)
class FleetsConfig:
    trainer: FleetConfig = dataclasses.field(default_factory=FleetConfig)
    inference: InferenceFleetConfig = dataclasses.field(default_factory=InferenceFleetConfig)
    sandbox: FleetConfig = dataclasses.field(default_factory=FleetConfig)

    def of(self, role: str) -> FleetConfig:
        """The config of fleet `role`; ValueError for a role without a fleet."""
        # Spelled out (not getattr): each fleet's section is read here, for every caller.
        fleets: dict[str, FleetConfig] = {
            "trainer": self.trainer,
            "inference": self.inference,
            "sandbox": self.sandbox,
        }
        if role not in fleets:
            raise ValueError(f"{role!r} is not a fleet; fleets: {', '.join(FLEET_ROLES)}")
        return fleets[role]


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    address: str | None = None
    placement_timeout_s: float = 60.0
    node: NodeConfig = dataclasses.field(default_factory=NodeConfig)
    fleets: FleetsConfig = dataclasses.field(default_factory=FleetsConfig)

    def __post_init__(self) -> None:
        if self.address is not None:
            parse_address(self.address, "address")
        require(
            is_number(self.placement_timeout_s) and self.placement_timeout_s > 0,
            "placement_timeout_s",
            f"must be a number of seconds > 0, got {self.placement_timeout_s!r}",
        )
        for key, cls in (("node", NodeConfig), ("fleets", FleetsConfig)):
            require(
                isinstance(getattr(self, key), cls),
                key,
                f"must be a mapping (see dockyard_rl.cluster.config), got {getattr(self, key)!r}",
            )


def process_group_timeout(
    environ: Mapping[str, str] | None = None,
) -> datetime.timedelta | None:
    """The timeout for a torch process group of a fleet actor: its fleet's
    `nccl_env.heartbeat_timeout_s`, which reaches the actor as TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
    (bootstrap.fleet_runtime_env); None (torch's default) when unset. `environ`: os.environ."""
    value = (os.environ if environ is None else environ).get(HEARTBEAT_TIMEOUT_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(
            f"{HEARTBEAT_TIMEOUT_ENV}={value!r}: must be a whole number of seconds > 0 "
            "(set it with cluster.fleets.<role>.nccl_env.heartbeat_timeout_s)"
        )
    return datetime.timedelta(seconds=int(value))


__all__ = [
    "ClusterConfig",
    "HEARTBEAT_TIMEOUT_ENV",
    "FLEET_ROLES",
    "FleetConfig",
    "FleetsConfig",
    "InferenceFleetConfig",
    "NcclEnvConfig",
    "NodeConfig",
    "ROLES",
    "ROLE_ENV",
    "STRATEGIES",
    "parse_address",
    "process_group_timeout",
]
