"""Entry point of a Ray node of a deployment: joins a cluster (or starts its head) with this
process's fleet role as the node's label, then blocks like a container's main process.

    DOCKYARD_FLEET_ROLE=trainer tools/bazel run //python/dockyard_rl/cluster:join -- \\
        --address 10.0.0.1:6379 --num-gpus 8
    DOCKYARD_FLEET_ROLE=driver  tools/bazel run //python/dockyard_rl/cluster:join -- --head

The role comes from DOCKYARD_FLEET_ROLE (driver | trainer | inference | sandbox; a head started
for the driver carries `driver`, so no fleet lands on it). The address comes from --address, else
RAY_ADDRESS. The node's resources are the `cluster.node` config keys as flags, validated the same
way. Every node needs the cluster's Ray token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
~/.ray/auth_token), the head included, so the others can join it.

Exit status: 0 after SIGTERM or SIGINT (the node's Ray processes are stopped first), 1 when one
of the node's Ray processes died, 2 for a bad role, flag or config value (message on stderr).

Not covered: reading the project's YAML (a node needs only these few values), restarting dead
Ray processes (the orchestrator restarts the container).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from dockyard_rl.cluster.bootstrap import DEFAULT_HEAD_PORT, fleet_role, start_node
from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.utils.config import from_dict


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="join", description="Start a Ray node labelled with DOCKYARD_FLEET_ROLE and block."
    )
    parser.add_argument("--head", action="store_true", help="start the head of a new cluster")
    parser.add_argument("--address", help="HOST:PORT of the head to join (default: RAY_ADDRESS)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_HEAD_PORT,
        help="GCS port of a head (default %(default)s)",
    )
    parser.add_argument(
        "--node-ip-address",
        help="this node's IP (default: 127.0.0.1 for a "
        "head or a loopback cluster, else Ray's detection)",
    )
    parser.add_argument("--num-cpus", type=int)
    parser.add_argument("--num-gpus", type=int)
    parser.add_argument("--memory", help='bytes or a size such as "64GiB"')
    parser.add_argument(
        "--resources", default="{}", help="custom resources as JSON, e.g. '{\"sandbox_slot\": 8}'"
    )
    parser.add_argument("--temp-dir", help="Ray's session directory (default Ray's)")
    return parser


def _config(args: argparse.Namespace) -> ClusterConfig:
    try:
        resources = json.loads(args.resources)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--resources: not JSON ({error}), e.g. '{{\"sandbox_slot\": 8}}'"
        ) from None
    memory = int(args.memory) if args.memory and args.memory.isdigit() else args.memory
    node = {
        "ip_address": args.node_ip_address,
        "num_cpus": args.num_cpus,
        "num_gpus": args.num_gpus,
        "memory": memory,
        "resources": resources,
    }
    return from_dict(ClusterConfig, {"address": args.address, "node": node}, "cluster")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        role = fleet_role()
        if args.address is None and not args.head:
            args.address = os.environ.get("RAY_ADDRESS") or None
        if (args.address is None) != args.head:
            raise ValueError(
                "pass --address HOST:PORT (or set RAY_ADDRESS) to join a cluster, "
                "or --head to start one; not both"
            )
        config = _config(args)
        node = start_node(
            config,
            role,
            address=config.address,
            head=args.head,
            port=args.port,
            temp_dir=args.temp_dir,
        )
    except ValueError as error:
        print(f"join: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    # Ray's node launcher exits with status 1 on SIGTERM; a container being stopped is a clean
    # shutdown here, so take the signals over (the node is stopped below either way).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    kind = "head" if args.head else "node"
    print(
        f"join: {role} {kind} {node.node_id} at {node.ip_address} in cluster {node.address}",
        flush=True,
    )
    status = 0
    while not stop.wait(1.0):
        dead = node.dead_processes()
        if dead:
            print(
                f"join: Ray processes of this node exited: {', '.join(dead)}; stopping",
                file=sys.stderr,
                flush=True,
            )
            status = 1
            break
    node.stop()
    print(f"join: {role} {kind} {node.node_id} stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
