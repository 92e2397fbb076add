"""A multi-node deployment on one machine: the smoke recipe trains on a cluster whose nodes are
started the way a deployment starts them (the join CLI, one process per node, each labelled with
its fleet role), and every fleet's actors land on nodes of that fleet with the recipe's strategy.

The cluster: a head labelled `driver` (no CPUs, so no fleet can land there), two trainer nodes,
one inference node and one sandbox node, all on 127.0.0.1 with a private token and RAY_TMPDIR.
The launcher runs as a separate process, the deployment's driver, pointed at the head by
`cluster.address`; the recipe is configs/smoke_cpu.yaml with the tiny random model and toy tasks
(so 2 steps take a minute, not the real model's ten), dp_size 2, and each fleet's strategy set to
one that is not its default.

After the run, a second driver reads Ray's control store (GCS): every actor the run created (the
policy ranks, the engine, the executor) ran on a node of its fleet, the two trainer ranks on two
different nodes (STRICT_SPREAD), and every placement group the run made has its fleet's strategy
from the recipe.

Not covered: several machines (the nodes share one kernel, so transports that need a separate
host, e.g. NCCL over InfiniBand, are not exercised), node failure (cluster/bootstrap_test covers
placement errors).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

from dockyard_rl.cluster.testing_cluster import JoinProcess, free_port, join_environment
from dockyard_rl.sandbox import testing_repos

WORKSPACE = pathlib.Path(__file__).absolute().parents[1]
SMOKE_RECIPE = WORKSPACE / "configs" / "smoke_cpu.yaml"
# None is a fleet's default (SPREAD, PACK, SPREAD): a fleet that never saw the recipe's
# `cluster` section would place with its default, and the check below would see it.
STRATEGIES = {"trainer": "STRICT_SPREAD", "inference": "STRICT_PACK", "sandbox": "PACK"}
# The class names of each fleet's actors, as Ray records them.
FLEET_ACTORS = {
    "trainer": "DTensorPolicyWorker",
    "inference": "VllmEngineActor",
    "sandbox": "ExecutorActor",
}

# Run as a driver of the cluster after the launcher exits: every actor (dead ones included) and
# every placement group (removed ones included) the control store still holds.
_INSPECT = """
import json, sys, ray
from ray._private import state
from dockyard_rl.cluster.bootstrap import init_ray
from dockyard_rl.cluster.config import ClusterConfig
init_ray(ClusterConfig(address=sys.argv[1]), log_to_driver=False)
nodes = {n["NodeID"]: n["Labels"].get("dockyard.io/fleet") for n in ray.nodes()}
actors = [
    {"class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
    for a in state.actors().values()
]
groups = [
    {"strategy": g["strategy"], "nodes": sorted(set(g["bundles_to_node_id"].values())),
     "state": g["state"]}
    for g in ray.util.placement_group_table().values()
]
print(json.dumps({"nodes": nodes, "actors": actors, "groups": groups}))
"""


@pytest.fixture(scope="module")
def cluster():
    """(head address, environment for the cluster's processes, role -> node ids)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[JoinProcess] = []
    with join_environment() as env:
        try:
            head = JoinProcess(env, "driver", "--head", "--port", str(port), "--num-cpus", "0")
            nodes.append(head)
            ids = {"driver": [_node_id(head)]}
            # One at a time: raylets registering at once overload the head's GCS on 2 cores.
            # The trainer nodes have room for both ranks each: only the strategy keeps them apart.
            for role, cpus in (("trainer", 2), ("trainer", 2), ("inference", 2), ("sandbox", 1)):
                nodes.append(JoinProcess(env, role, "--address", address, "--num-cpus", str(cpus)))
                ids.setdefault(role, []).append(_node_id(nodes[-1]))
            yield address, env, ids
        finally:
            for node in reversed(nodes):
                node.stop()


def _node_id(node: JoinProcess) -> str:
    line = node.wait_started()  # "join: <role> head|node <node id> at ..."
    assert line.startswith(f"join: {node.role} "), line
    return line.split()[3]


def _recipe(tmp: pathlib.Path, address: str) -> pathlib.Path:
    """configs/smoke_cpu.yaml for this cluster, the tiny model and toy tasks, 2 steps."""
    recipe = yaml.safe_load(SMOKE_RECIPE.read_text())
    train, val = testing_repos.write_toy_tasks(
        tmp / "tasks", train=["toy_a", "toy_b"], val=["toy_v"]
    )
    recipe["grpo"].update(max_num_steps=2, val_at_end=False, run_name="multi_node")
    recipe["policy"].update(model="tiny-llama", dp_size=2, micro_batch_size=4)
    recipe["generation"].update(
        model="tiny-llama", max_model_len=1024, kv_cache_memory_bytes="64MiB", max_tokens=16
    )
    recipe["data"].update(train_path=str(train), validation_path=str(val))
    recipe["data"].pop("validation_fraction", None)
    recipe["data"]["prompt"].update(patch_format="diff", max_context_tokens=512)
    recipe.pop("synthesis", None)
    recipe["executor"]["work_dir"] = str(tmp / "executor")
    recipe["cluster"] = {
        "address": address,
        "placement_timeout_s": 300,
        "fleets": {role: {"strategy": strategy} for role, strategy in STRATEGIES.items()},
    }
    recipe["checkpointing"] = {"enabled": False}
    recipe["logger"] = {"log_dir": str(tmp / "results"), "console": False}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_two_smoke_steps_on_four_labelled_nodes_place_each_fleet_on_its_nodes(cluster, tmp_path):
    address, env, node_ids = cluster
    recipe = _recipe(tmp_path, address)
    launch = subprocess.run(
        [sys.executable, str(WORKSPACE / "python/launch/grpo_swe.py"), "--config", str(recipe)],
        env={**env, "DOCKYARD_FLEET_ROLE": "driver"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-5000:]
    metrics = [
        json.loads(line)
        for line in (tmp_path / "results/multi_node/metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics if "train/reward_mean" in m] == [1, 2]

    inspect = subprocess.run(
        [sys.executable, "-c", _INSPECT, address],
        env={**env, "DOCKYARD_FLEET_ROLE": "driver"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    seen = json.loads(inspect.stdout)
    role_of = seen["nodes"]
    assert sorted(role_of.values()) == ["driver", "inference", "sandbox", "trainer", "trainer"]
    for role, class_name in FLEET_ACTORS.items():
        placed = [a["node"] for a in seen["actors"] if a["class"] == class_name]
        expected = 2 if role == "trainer" else 1
        assert len(placed) == expected, (class_name, seen["actors"])
        assert {role_of[node] for node in placed} == {role}, (class_name, placed, role_of)
        assert set(placed) <= set(node_ids[role])
        if role == "trainer":  # spread over two nodes, each with room for both ranks
            assert len(set(placed)) == 2, placed
    # Nothing of the run landed on the driver's head.
    assert all(role_of[a["node"]] != "driver" for a in seen["actors"]), seen["actors"]
    # Every placement group the run made carries its fleet's strategy from the recipe.
    assert seen["groups"], "the control store recorded no placement group"
    for group in seen["groups"]:
        (role,) = {role_of[node] for node in group["nodes"]} or {None}
        assert group["strategy"] == STRATEGIES[role], group
