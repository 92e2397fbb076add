"""The join CLI as a deployment runs it: a head and a node, each its own process on 127.0.0.1,
seen by a driver with their role labels and resources, and both exiting 0 on SIGTERM."""

import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

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
    temp_dir = tempfile.mkdtemp(prefix="dyj", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DOCKYARD_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(sys.path),
        RAY_TMPDIR=temp_dir,
        RAY_AUTH_TOKEN=secrets.token_hex(32),
    )
    yield env
    shutil.rmtree(temp_dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Join:
    """One `join` process; `wait_started` returns its first stdout line."""

    def __init__(self, env, role, *args):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dockyard_rl.cluster.join", *args],
            env={**env, "DOCKYARD_FLEET_ROLE": role},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines = queue.Queue()
        threading.Thread(
            target=lambda: [self._lines.put(line) for line in self.process.stdout], daemon=True
        ).start()

    def wait_started(self, timeout=120) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            self.process.kill()
            raise AssertionError(
                f"join did not start: {self.process.stderr.read()[-2000:]}"
            ) from None

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def test_a_node_joins_a_head_with_its_label_and_both_stop_cleanly(env):
    port = _free_port()
    head = _Join(env, "inference", "--head", "--port", str(port), "--num-cpus", "1")
    node = None
    try:
        assert head.wait_started().startswith("join: inference head ")
        node = _Join(
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
