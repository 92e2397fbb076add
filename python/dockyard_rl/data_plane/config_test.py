"""Tests of the `data_plane` config section."""

import pytest

from dockyard_rl.data_plane.config import DataPlaneConfig, parse_data_plane_config


def test_null_means_the_in_memory_path():
    assert parse_data_plane_config(None) is None


def test_defaults_and_values():
    assert parse_data_plane_config({}) == DataPlaneConfig()
    cfg = parse_data_plane_config(
        {"transport": "in_memory", "max_in_flight_batches": 8, "backpressure_timeout_s": 1.5}
    )
    assert (cfg.transport, cfg.max_in_flight_batches, cfg.backpressure_timeout_s) == (
        "in_memory",
        8,
        1.5,
    )


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"transport": "zmq"},
            r"^data_plane\.transport: unknown transport 'zmq'; valid: in_memory, ray_direct",
        ),
        ({"tensor_transport": "tcp"}, r"^data_plane\.tensor_transport: unknown tensor transport"),
        (
            {"max_in_flight_batches": 0},
            r"^data_plane\.max_in_flight_batches: must be an integer >= 1",
        ),
        ({"max_in_flight_batches": True}, r"^data_plane\.max_in_flight_batches: "),
        ({"backpressure_timeout_s": 0}, r"^data_plane\.backpressure_timeout_s: must be a number"),
        ({"transfer_timeout_s": "fast"}, r"^data_plane\.transfer_timeout_s: "),
        ({"receive_timeout_s": -1}, r"^data_plane\.receive_timeout_s: "),
        (
            {"max_metadata_bytes": 200_000},
            r"^data_plane\.max_metadata_bytes: must be an integer in",
        ),
        ({"max_in_flight": 2}, r"^data_plane: unknown key\(s\) 'max_in_flight'; valid keys: "),
        (["ray_direct"], r"^data_plane: expected a mapping"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_data_plane_config(raw)
