"""bootstrap against a simulated cluster on 127.0.0.1 (one per module): roles and labels, each
fleet on its own nodes, SPREAD / PACK, an unplaceable fleet failing within its timeout, the NCCL
runtime_env reaching actors; and the local single-node cluster playing every role (subprocess)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from dockyard_rl.cluster import bootstrap
from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.cluster.testing_cluster import fleet_cluster


@pytest.fixture(scope="module")
def cluster():
    with fleet_cluster(
        [("trainer", 1), ("trainer", 1), ("inference", 2), ("sandbox", 1, {"sandbox_slot": 2})]
    ) as fleet:
        fleet.connect()
        yield fleet


def _nodes_of(group) -> list[str]:
    table = placement_group_table(group)
    return [table["bundles_to_node_id"][i] for i in range(len(table["bundles"]))]


@pytest.mark.parametrize(
    "environ, message",
    [
        ({}, "DOCKYARD_FLEET_ROLE is not set"),
        ({"DOCKYARD_FLEET_ROLE": "learner"}, "DOCKYARD_FLEET_ROLE is 'learner'"),
    ],
)
def test_a_missing_or_unknown_role_is_an_error_naming_the_variable_and_the_roles(environ, message):
    for call in (
        lambda: bootstrap.fleet_role(environ),
        lambda: bootstrap.init_ray(ClusterConfig(), environ=dict(environ)),
    ):
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "driver, trainer, inference, sandbox" in str(error.value)


def test_a_fleet_node_needs_an_address():
    with pytest.raises(ValueError, match="cluster.address: a trainer node joins an existing"):
        bootstrap.init_ray(ClusterConfig(), environ={"DOCKYARD_FLEET_ROLE": "trainer"})


def test_selectors_name_the_role_and_the_every_role_node():
    assert bootstrap.label_selector("inference") == {"dockyard.io/fleet": "in(inference,all)"}
    assert bootstrap.node_labels("sandbox") == {"dockyard.io/fleet": "sandbox"}
    with pytest.raises(ValueError, match="'driver' has no fleet"):
        bootstrap.label_selector("driver")


def test_the_driver_connected_and_nodes_carry_their_role(cluster):
    labels = {n["NodeID"]: n["Labels"].get("dockyard.io/fleet") for n in ray.nodes()}
    for role, ids in cluster.nodes.items():
        assert all(labels[node_id] == role for node_id in ids)
    # Everything is on loopback (Ray would otherwise rewrite 127.0.0.1 to the outward IP).
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def test_every_fleet_lands_only_on_its_nodes_with_its_strategy(cluster):
    config = cluster.config()
    trainer = bootstrap.place_fleet("trainer", [{"CPU": 1}] * 2, config)
    inference = bootstrap.place_fleet("inference", [{"CPU": 1}] * 2, config)
    sandbox = bootstrap.place_fleet("sandbox", [{"CPU": 1, "sandbox_slot": 1}], config)
    try:
        trainer_nodes = _nodes_of(trainer)
        # SPREAD: one shard per trainer node.
        assert sorted(trainer_nodes) == sorted(cluster.nodes["trainer"])
        # PACK: both ranks of the engine on the one inference node.
        assert _nodes_of(inference) == cluster.nodes["inference"] * 2
        assert _nodes_of(sandbox) == cluster.nodes["sandbox"]
        assert placement_group_table(inference)["strategy"] == "PACK"
        assert placement_group_table(trainer)["strategy"] == "SPREAD"
    finally:
        for group in (trainer, inference, sandbox):
            remove_placement_group(group)


def test_an_unplaceable_fleet_fails_within_its_timeout_naming_role_and_shortfall(cluster):
    config = cluster.config(placement_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(bootstrap.PlacementTimeoutError) as error:
        # Three trainer CPUs asked, two exist (the inference node's are not the trainer's).
        bootstrap.place_fleet("trainer", [{"CPU": 1}] * 3, config)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert isinstance(error.value, ValueError) and error.value.role == "trainer"
    assert message.startswith("trainer fleet cannot be placed: 3 bundle(s) [{'CPU': 1.0}")
    assert "placement_timeout_s=2 s" in message and "Missing: {CPU: 1}" in message
    assert message.count("(trainer): has {CPU: 1}, free {CPU: 1}") == 2
    # The pending group was removed: the trainer CPUs are free again.
    group = bootstrap.place_fleet("trainer", [{"CPU": 1}] * 2, config)
    remove_placement_group(group)


def test_a_resource_no_node_of_the_role_has_is_named(cluster):
    with pytest.raises(bootstrap.PlacementTimeoutError) as error:
        bootstrap.place_fleet(
            "inference", [{"sandbox_slot": 1}], cluster.config(placement_timeout_s=1)
        )
    assert "Missing: {sandbox_slot: 1}" in str(error.value)
    assert "(inference): has {sandbox_slot: 0}" in str(error.value)


def test_nccl_settings_reach_the_fleets_actors_as_runtime_env(cluster):
    config = cluster.config(
        fleets={
            "trainer": {
                "nccl_env": {
                    "socket_ifname": "lo",
                    "ib_disable": True,
                    "debug": "WARN",
                    "extra": {"NCCL_P2P_LEVEL": "NVL"},
                }
            }
        }
    )
    runtime_env = bootstrap.fleet_runtime_env("trainer", config, {"MY_FLAG": "1"})
    group = bootstrap.place_fleet("trainer", [{"CPU": 1}], config)
    try:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=1)
        def environment():
            import dockyard_rl.cluster.bootstrap  # noqa: F401  (PYTHONPATH carries the project)

            return {
                k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "DOCKYARD_", "MY_"))
            }

        seen = ray.get(
            environment.options(
                runtime_env=runtime_env, scheduling_strategy=PlacementGroupSchedulingStrategy(group)
            ).remote(),
            timeout=120,
        )
    finally:
        remove_placement_group(group)
    assert seen == {
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_DEBUG": "WARN",
        "NCCL_P2P_LEVEL": "NVL",
        "DOCKYARD_FLEET_ROLE": "trainer",
        "MY_FLAG": "1",
    }
    with pytest.raises(ValueError, match=r"cluster.fleets.trainer.nccl_env, not from call"):
        bootstrap.fleet_runtime_env("trainer", config, {"NCCL_DEBUG": "INFO"})


def test_the_local_cluster_plays_every_role(tmp_path):
    # A driver without an address starts its own cluster: one node that every fleet can use.
    script = textwrap.dedent("""
        import ray
        from dockyard_rl.cluster import bootstrap
        from dockyard_rl.cluster.config import ClusterConfig
        from dockyard_rl.utils.config import from_dict
        from ray.util.placement_group import placement_group_table
        config = from_dict(ClusterConfig, {"placement_timeout_s": 30, "node": {
            "num_cpus": 3, "resources": {"sandbox_slot": 1}}}, "cluster")
        context = bootstrap.init_ray(config, log_to_driver=False)
        [node] = ray.nodes()
        assert node["Resources"]["CPU"] == 3 and node["Resources"]["sandbox_slot"] == 1
        print("label", node["Labels"]["dockyard.io/fleet"], node["NodeManagerAddress"])
        for role in ("trainer", "inference", "sandbox"):
            group = bootstrap.place_fleet(role, [{"CPU": 1}], config)
            assert placement_group_table(group)["bundles_to_node_id"][0] == node["NodeID"]
            print("placed", role)
        context.shutdown()
        """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_TMPDIR"}
    env.update(
        DOCKYARD_FLEET_ROLE="driver", HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path)
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "label all 127.0.0.1" in result.stdout
    for role in ("trainer", "inference", "sandbox"):
        assert f"placed {role}" in result.stdout
