import pytest

from dockyard_rl.utils.config import from_dict
from dockyard_rl.weight_sync.config import WeightSyncConfig
from dockyard_rl.weight_sync.factory import resolve_transport
from dockyard_rl.weight_sync.transport_registry import transport_module


def test_defaults_and_byte_sizes():
    config = from_dict(WeightSyncConfig, {"bucket_size_bytes": "64MiB"}, "weight_sync")
    assert config.transport == "auto" and config.bucket_size_bytes == 64 << 20


@pytest.mark.parametrize(
    "data, message",
    [
        ({"transport": "nccl"}, "weight_sync.transport: must be one of auto, collective"),
        ({"bucket_size_bytes": 1000}, "weight_sync.bucket_size_bytes: must be a multiple of 256"),
        ({"bucket_size_bytes": "1GB"}, "weight_sync.bucket_size_bytes"),
        ({"sync_timeout_s": 0}, "weight_sync.sync_timeout_s: must be a number of seconds > 0"),
        ({"peer_timeout_s": 500}, "weight_sync.peer_timeout_s: must be <= sync_timeout_s"),
        ({"http_host": " "}, "weight_sync.http_host"),
        ({"bogus": 1}, "unknown key(s) 'bogus'"),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(WeightSyncConfig, data, "weight_sync")


def test_auto_picks_ipc_on_one_node_and_collective_across_nodes():
    auto = WeightSyncConfig()
    assert resolve_transport(auto, "a", ["a", "a"]) == "ipc_zmq"
    assert resolve_transport(auto, "a", ["a", "b"]) == "collective"
    assert resolve_transport(auto, None, ["a"]) == "collective"
    assert resolve_transport(WeightSyncConfig(transport="http"), "a", ["a"]) == "http"


def test_unknown_transport_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: collective, ipc_zmq, http, object_store"):
        transport_module("auto")
