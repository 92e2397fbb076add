"""Picks the data-plane implementation from the `data_plane` config section.

    plane = create_data_plane(parse_data_plane_config(yaml_dict.get("data_plane")))

`None` (`data_plane: null`, the default) gives the in-memory plane with the default limits
(the colocated path: producer and trainer in one process). Otherwise `config.transport` names
the implementation; it is imported only when chosen (ray_direct imports Ray).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from dockyard_rl.data_plane.config import TRANSPORTS, DataPlaneConfig, parse_data_plane_config
from dockyard_rl.data_plane.interfaces import DataPlane

# transport name -> (module, class); one module per implementation.
_IMPLEMENTATIONS = {
    "in_memory": ("dockyard_rl.data_plane.in_memory", "InMemoryDataPlane"),
    "ray_direct": ("dockyard_rl.data_plane.ray_direct", "RayDirectDataPlane"),
}
assert set(_IMPLEMENTATIONS) == set(TRANSPORTS)


def data_plane_names() -> list[str]:
    """The valid `data_plane.transport` values."""
    return sorted(_IMPLEMENTATIONS)


def create_data_plane(
    config: DataPlaneConfig | Mapping[str, Any] | None, name: str | None = None
) -> DataPlane:
    """The data plane for `config`; call `connect` on it next.

    Args:
        config: a DataPlaneConfig, the raw `data_plane` mapping (validated here), or None for
            the in-memory path.
        name: a name for logs and Ray group names (default: random).

    Raises:
        ValueError: an invalid config (the message names the key and lists valid transports).
    """
    if config is not None and not isinstance(config, DataPlaneConfig):
        config = parse_data_plane_config(config)
    if config is None:
        config = DataPlaneConfig(transport="in_memory")
    if config.transport not in _IMPLEMENTATIONS:  # only if TRANSPORTS and this table drift
        raise ValueError(
            f"data_plane.transport: unknown {config.transport!r}; valid: "
            f"{', '.join(data_plane_names())}"
        )
    module_name, class_name = _IMPLEMENTATIONS[config.transport]
    implementation: Callable[..., DataPlane] = getattr(
        importlib.import_module(module_name), class_name
    )
    return implementation(config, name=name)
