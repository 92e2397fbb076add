"""The join CLI as a deployment runs it: a head and a node, each its own process on 127.0.0.1,
seen by a driver with their role labels and resources, and both exiting 0 on SIGTERM."""

import json
import subprocess
import sys
import textwrap

import pytest

from dockyard_rl.cluster.testing_cluster import JoinProcess, free_port, join_environment

_DRIVER = textwrap.dedent("""
    import json, sys, ray
    from dockyard_rl.cluster.bootstrap import init_ray
    from dockyard_rl.cluster.config import ClusterConfig
    init_ray(ClusterConfig(address=sys.argv[1]), log_to_driver=False)
    print(json.dumps([[n["Labels"].get("dockyard.io/fleet"), n["NodeID"],
                       n["NodeManagerAddress"], n["Resources"]]
                      for n in ray.nodes() if n["Alive"]]))
    """)


@pytest.fixture
def env():
    with join_environment() as env:
        yield env


def test_a_node_joins_a_head_with_its_label_and_both_stop_cleanly(env):
    port = free_port()
    head = JoinProcess(env, "inference", "--head", "--port", str(port), "--num-cpus", "1")
    node = None
    try:
        assert head.wait_started().startswith("join: inference head ")
        node = JoinProcess(
            env,
            "sandbox",
            "--address",
            f"127.0.0.1:{port}",
            "--num-cpus",
            "1",
            "--resources",
            '{"sandbox_slot": 2}',
        )
        started = node.wait_started()
        assert started.startswith("join: sandbox node ") and "at 127.0.0.1" in started
        node_id = started.split()[3]
        seen = subprocess.run(
            [sys.executable, "-c", _DRIVER, f"127.0.0.1:{port}"],
            env={**env, "DOCKYARD_FLEET_ROLE": "driver"},
            text=True,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert seen.returncode == 0, seen.stderr[-3000:]
        nodes = {label: (nid, ip, res) for label, nid, ip, res in json.loads(seen.stdout)}
        assert set(nodes) == {"inference", "sandbox"}
        assert nodes["sandbox"][0] == node_id
        assert nodes["sandbox"][2]["sandbox_slot"] == 2 and nodes["sandbox"][2]["CPU"] == 1
        assert {ip for _, ip, _ in nodes.values()} == {"127.0.0.1"}
        assert node.stop() == 0
        node = None
        assert head.stop() == 0
    finally:
        for process in (node, head):
            if process is not None and process.process.poll() is None:
                process.process.kill()


@pytest.mark.parametrize(
    "role, args, message",
    [
        (None, ["--head"], "DOCKYARD_FLEET_ROLE is not set"),
        ("trainer", [], "pass --address HOST:PORT (or set RAY_ADDRESS)"),
        ("trainer", ["--address", "127.0.0.1"], 'cluster.address: must be "HOST:PORT"'),
        ("trainer", ["--address", "127.0.0.1:1", "--num-cpus", "-2"], "cluster.node.num_cpus"),
        ("trainer", ["--address", "127.0.0.1:1", "--resources", "slot"], "--resources: not JSON"),
    ],
)
def test_bad_input_exits_2_with_the_problem_named(env, role, args, message):
    if role is not None:
        env = {**env, "DOCKYARD_FLEET_ROLE": role}
    result = subprocess.run(
        [sys.executable, "-m", "dockyard_rl.cluster.join", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def test_joining_without_the_clusters_token_is_an_error(env, tmp_path):
    env = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    env.update(HOME=str(tmp_path), DOCKYARD_FLEET_ROLE="trainer")
    result = subprocess.run(
        [sys.executable, "-m", "dockyard_rl.cluster.join", "--address", "127.0.0.1:1"],
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "needs the cluster's Ray token: set RAY_AUTH_TOKEN" in result.stderr
