"""Tests of `create_data_plane`: null -> in-memory, names, config errors."""

import pytest

from dockyard_rl.data_plane.config import DataPlaneConfig
from dockyard_rl.data_plane.factory import create_data_plane, data_plane_names
from dockyard_rl.data_plane.in_memory import InMemoryDataPlane


def test_null_config_gives_the_in_memory_plane():
    plane = create_data_plane(None)
    assert isinstance(plane, InMemoryDataPlane)
    assert plane.config == DataPlaneConfig(transport="in_memory")


def test_explicit_in_memory_keeps_its_settings():
    plane = create_data_plane({"transport": "in_memory", "max_in_flight_batches": 3})
    assert isinstance(plane, InMemoryDataPlane)
    assert plane.config.max_in_flight_batches == 3


def test_ray_direct_is_imported_only_when_chosen():
    plane = create_data_plane(DataPlaneConfig(transport="ray_direct"), name="x")
    assert type(plane).__name__ == "RayDirectDataPlane"
    assert plane.name == "x"


def test_names_and_errors():
    assert data_plane_names() == ["in_memory", "ray_direct"]
    with pytest.raises(ValueError, match=r"^data_plane\.transport: unknown transport 'shm'"):
        create_data_plane({"transport": "shm"})
    with pytest.raises(ValueError, match=r"^data_plane: unknown key\(s\) 'capacity'"):
        create_data_plane({"capacity": 3})
