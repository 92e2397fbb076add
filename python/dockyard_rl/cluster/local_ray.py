"""Starting Ray on this machine only, with token authentication on and nothing written to ~/.ray.

    init_local_ray(num_cpus=2)        # ray.init on 127.0.0.1, no dashboard; idempotent
    ...
    ray.shutdown()

Every process of the project that starts a local Ray cluster (the vLLM worker, the DTensor
policy, tests and benchmarks) goes through `init_local_ray`; nothing calls `ray.init` directly.

Ray 2.60 turns token authentication on for every new local cluster and, when it finds no token,
writes a new one to `~/.ray/auth_token`. On a machine that never ran Ray that write fails inside
Bazel's sandbox (the home directory is read-only there), and elsewhere it leaves a long-lived
credential behind. `ensure_ray_auth_token` decides where the token comes from instead, in this
order (`RAY_AUTH_*` are Ray's own variables):

1. `RAY_AUTH_MODE=disabled`: no token; the operator opted out (Ray warns at start-up).
2. `RAY_AUTH_TOKEN` set: that token.
3. `RAY_AUTH_TOKEN_PATH` set: that file; it must exist and hold a token (ValueError otherwise).
4. `~/.ray/auth_token` exists: Ray's default file, as `ray get-auth-token --generate` writes it.
   Multi-node clusters share their token this way (or through 2 or 3) on every node.
5. Otherwise a fresh random token (256 bits) for this cluster alone, put in `RAY_AUTH_TOKEN` of
   this process: the cluster's processes inherit it, nothing is written to disk, and nothing
   outside this process tree can connect.

Token authentication stays on in every case but 1. Not covered: joining a multi-node cluster
(its token must be distributed by the operator, case 2-4).
"""

from __future__ import annotations

import os
import pathlib
import secrets
from collections.abc import MutableMapping

AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def default_token_path() -> pathlib.Path:
    """Where Ray looks for a token when no variable names one."""
    return pathlib.Path.home() / ".ray" / "auth_token"


def ensure_ray_auth_token(environ: MutableMapping[str, str] = os.environ) -> str:
    """Makes sure a local Ray start finds a token without writing one (module docstring).
    Returns the source used: "disabled", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "home" or
    "generated". Raises ValueError for a RAY_AUTH_TOKEN_PATH that holds no token."""
    if environ.get(AUTH_MODE, "").lower() == "disabled":
        return "disabled"
    if environ.get(AUTH_TOKEN):
        return AUTH_TOKEN
    if environ.get(AUTH_TOKEN_PATH):
        path = pathlib.Path(environ[AUTH_TOKEN_PATH])
        try:
            holds_token = bool(path.read_text().strip())
        except OSError as error:
            raise ValueError(f"{AUTH_TOKEN_PATH}={path}: cannot read the Ray token ({error}); "
                             f"point it at a file holding the cluster's token, or unset it") \
                from None
        if not holds_token:
            raise ValueError(f"{AUTH_TOKEN_PATH}={path}: the file is empty; write the cluster's "
                             f"token into it (`ray get-auth-token`), or unset it")
        return AUTH_TOKEN_PATH
    try:
        if default_token_path().read_text().strip():
            return "home"
    except OSError:
        pass
    environ[AUTH_TOKEN] = secrets.token_hex(32)
    return "generated"


def init_local_ray(**init_kwargs) -> None:
    """`ray.init` for a cluster on this machine only (127.0.0.1, no dashboard), after
    `ensure_ray_auth_token`; a no-op when Ray is already initialised in this process (the caller
    started or joined a cluster). `init_kwargs` go to ray.init (num_cpus, log_to_driver, ...)."""
    import ray

    if ray.is_initialized():
        return
    ensure_ray_auth_token()
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, **init_kwargs)
