"""Picks the policy backend named by `policy.backend` and builds it.

The one constructor signature every backend implements (so the driver never special-cases one):

    Backend(cfg: PolicyConfig, *, cache_dir: str | os.PathLike | None = None,
            resume_from: str | os.PathLike | None = None) -> PolicyInterface

plus, for backends that run as Ray actors of the trainer fleet (`CLUSTER_BACKENDS`: both),
`cluster_config: ClusterConfig | None = None`.

- `cfg`: the validated `policy` section (models/policy/config.py).
- `cache_dir`: the model zoo's cache directory for zoo names in `cfg.model` (None: the zoo's
  default, `$DOCKYARD_MODEL_CACHE` or ~/.cache/dockyard_rl/models).
- `resume_from`: a directory written by the same backend's `save_checkpoint`, restored during
  construction (None: start from `cfg.model`'s weights).
- `cluster_config`: the recipe's `cluster` section. The dtensor ranks, and the jax backend's one
  actor, are the trainer fleet: placed by distributed/worker_group.py with
  `cluster.fleets.trainer.strategy` and the fleet's node labels within
  `cluster.placement_timeout_s`, with the fleet's environment (`nccl_env`).
Construction loads the weights and fails fast with ValueError naming the key: `policy.model` not
a zoo name or HF directory, `resume_from` missing / incomplete / for another model, and resources
that cannot hold `policy.dp_size` ranks.

Backends (imported lazily, so a driver using one never imports the other's framework):
  dtensor  dockyard_rl.models.policy.dtensor_policy.DTensorPolicy   (torch FSDP2, Ray actors)
  jax      dockyard_rl.models.policy.jax_fleet.JaxFleetPolicy       (flax.nnx, jax Mesh, one
           Ray actor holding jax_policy.JaxPolicy; the driver never imports jax)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable

from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.models.policy.config import PolicyConfig
from dockyard_rl.models.policy.interfaces import PolicyInterface

# backend name -> (module, class); the keys must equal config.BACKENDS.
POLICY_BACKENDS: dict[str, tuple[str, str]] = {
    "dtensor": ("dockyard_rl.models.policy.dtensor_policy", "DTensorPolicy"),
    "jax": ("dockyard_rl.models.policy.jax_fleet", "JaxFleetPolicy"),
}
# The backends that start Ray actors of the trainer fleet, so take `cluster_config`.
CLUSTER_BACKENDS = ("dtensor", "jax")


def create_policy(
    cfg: PolicyConfig,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    resume_from: str | os.PathLike[str] | None = None,
    cluster_config: ClusterConfig | None = None,
) -> PolicyInterface:
    """Builds the backend `cfg.backend` names (see the module docstring for the arguments).

    Raises:
        ValueError: `cfg` is not a PolicyConfig, `policy.backend` is unknown (the message lists
            the valid names) or its module is not part of this installation, or the backend's
            own setup checks fail.
    """
    if not isinstance(cfg, PolicyConfig):
        raise ValueError(
            f"create_policy needs a PolicyConfig, got {type(cfg).__name__}; build "
            "it with from_dict(PolicyConfig, yaml['policy'], 'policy')"
        )
    if cfg.backend not in POLICY_BACKENDS:
        raise ValueError(
            f"policy.backend: unknown backend {cfg.backend!r}; valid: {', '.join(POLICY_BACKENDS)}"
        )
    module_name, class_name = POLICY_BACKENDS[cfg.backend]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # the backend exists but one of its own imports is missing: show that
        available = [
            name
            for name, (mod, _) in POLICY_BACKENDS.items()
            if importlib.util.find_spec(mod) is not None
        ]
        raise ValueError(
            f"policy.backend: {cfg.backend!r} is not available in this "
            f"installation (no module {module_name}); available: "
            f"{', '.join(available)}"
        ) from None
    # Only the options the caller set are passed on, so a backend that does not take one yet
    # still builds with the defaults.
    options: dict[str, object] = {
        key: value
        for key, value in (("cache_dir", cache_dir), ("resume_from", resume_from))
        if value is not None
    }
    if cluster_config is not None and cfg.backend in CLUSTER_BACKENDS:
        options["cluster_config"] = cluster_config
    backend: Callable[..., PolicyInterface] = getattr(module, class_name)
    return backend(cfg, **options)
