"""The `cluster` config section: defaults, per-fleet defaults under partial YAML, NCCL variables,
and bad values failing with the full key named."""

import pytest

from dockyard_rl.cluster.config import ClusterConfig, NcclEnvConfig, process_group_timeout
from dockyard_rl.utils.config import from_dict


def _build(data):
    return from_dict(ClusterConfig, data, "cluster")


def test_defaults():
    config = _build(None)
    assert config.address is None and config.placement_timeout_s == 60
    assert config.node.num_cpus is None and config.node.resources == {}
    fleets = config.fleets
    assert (fleets.trainer.strategy, fleets.inference.strategy, fleets.sandbox.strategy) == (
        "SPREAD",
        "PACK",
        "SPREAD",
    )
    assert all(fleets.of(r).nccl_env.env_vars() == {} for r in ("trainer", "inference", "sandbox"))


def test_a_partial_fleet_section_keeps_that_fleets_defaults():
    config = _build(
        {
            "fleets": {"inference": {"nccl_env": {"debug": "INFO"}}},
            "node": {"memory": "1.5 GiB", "num_gpus": 8, "resources": {"sandbox_slot": 16}},
            "address": "10.0.0.1:6379",
        }
    )
    assert config.fleets.inference.strategy == "PACK"
    assert config.fleets.inference.nccl_env.env_vars() == {"NCCL_DEBUG": "INFO"}
    assert config.node.memory == 3 << 29 and config.node.num_gpus == 8
    assert config.node.resources == {"sandbox_slot": 16}


def test_nccl_keys_map_to_their_variables():
    env = NcclEnvConfig(
        socket_ifname="eth0",
        ib_hca="mlx5_0",
        ib_disable=False,
        ib_timeout=22,
        heartbeat_timeout_s=600,
        debug="WARN",
        extra={"NCCL_NVLS_ENABLE": 0},
    ).env_vars()
    assert env == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_TIMEOUT": "22",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
        "NCCL_DEBUG": "WARN",
        "NCCL_NVLS_ENABLE": "0",
    }


@pytest.mark.parametrize(
    "data, message",
    [
        ({"address": "head"}, 'cluster.address: must be "HOST:PORT"'),
        ({"address": "head:0"}, 'cluster.address: must be "HOST:PORT"'),
        (
            {"placement_timeout_s": 0},
            "cluster.placement_timeout_s: must be a number of seconds > 0",
        ),
        ({"placement_timeout_s": True}, "cluster.placement_timeout_s"),
        ({"node": {"num_cpus": -1}}, "cluster.node.num_cpus: must be an int >= 0"),
        ({"node": {"num_gpus": 1.5}}, "cluster.node.num_gpus: must be an int >= 0"),
        ({"node": {"memory": "64GB"}}, "cluster.node.memory: must be an int of bytes or a string"),
        ({"node": {"ip_address": "head-0"}}, "cluster.node.ip_address: must be an IP address"),
        ({"node": {"resources": {"GPU": 1}}}, "cluster.node.resources.GPU: custom resource names"),
        (
            {"node": {"resources": {"slot": -1}}},
            "cluster.node.resources.slot: must be a number >= 0",
        ),
        (
            {"node": {"cpus": 1}},
            "cluster.node: unknown key(s) 'cpus'; valid keys: ip_address, memory",
        ),
        (
            {"fleets": {"trainer": {"strategy": "spread"}}},
            "cluster.fleets.trainer.strategy: must be one of PACK, SPREAD, STRICT_PACK, "
            "STRICT_SPREAD",
        ),
        (
            {"fleets": {"learner": {}}},
            "cluster.fleets: unknown key(s) 'learner'; valid keys: inference, sandbox, trainer",
        ),
        (
            {"fleets": {"sandbox": {"max_worker_restarts": -1}}},
            "cluster.fleets.sandbox.max_worker_restarts: must be an int >= 0",
        ),
        (
            {"fleets": {"inference": {"nccl_env": {"debug": "LOUD"}}}},
            "cluster.fleets.inference.nccl_env.debug: must be one of VERSION, WARN, INFO, TRACE",
        ),
        (
            {"fleets": {"trainer": {"nccl_env": {"ib_timeout": 40}}}},
            "cluster.fleets.trainer.nccl_env.ib_timeout: must be an int in [1, 31]",
        ),
        (
            {"fleets": {"trainer": {"nccl_env": {"ib_disable": "yes"}}}},
            "cluster.fleets.trainer.nccl_env.ib_disable: must be true, false or null",
        ),
        (
            {"fleets": {"trainer": {"nccl_env": {"extra": {"CUDA_VISIBLE_DEVICES": "0"}}}}},
            "cluster.fleets.trainer.nccl_env.extra.CUDA_VISIBLE_DEVICES: only variables starting "
            "with",
        ),
        (
            {
                "fleets": {
                    "trainer": {"nccl_env": {"debug": "INFO", "extra": {"NCCL_DEBUG": "WARN"}}}
                }
            },
            "cluster.fleets.trainer.nccl_env.extra: ['NCCL_DEBUG'] are also set by their own keys",
        ),
        ({"fleets": "SPREAD"}, "cluster.fleets: expected a mapping"),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ValueError) as error:
        _build(data)
    assert str(error.value).startswith(message), str(error.value)


def test_fleet_lookup_rejects_the_driver():
    with pytest.raises(ValueError, match="'driver' is not a fleet; fleets: trainer, inference"):
        _build(None).fleets.of("driver")


def test_heartbeat_timeout_is_the_process_group_timeout_of_the_fleets_actors():
    # What a rank reads back from the environment fleet_runtime_env gave it.
    env = NcclEnvConfig(heartbeat_timeout_s=90).env_vars()
    assert process_group_timeout(env).total_seconds() == 90
    assert process_group_timeout({}) is None  # unset: torch's default
    with pytest.raises(ValueError, match="nccl_env.heartbeat_timeout_s"):
        process_group_timeout({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "soon"})
