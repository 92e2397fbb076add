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
(its token must be distributed by the operator, case 2-4; see bootstrap.py).

Three Ray 2.60 behaviours `init_local_ray` works around:

- `ray.init()` replaces the process's SIGTERM handling: Ray's C++ failure handler prints a stack
  and, in a process as busy as the launcher's (vLLM, torch, gloo threads), ends it with SIGABRT
  before Python unwinds, so no `finally` runs, the fleets are never closed and the node's
  DashboardAgent and RuntimeEnvAgent outlive it (PPID 1). A Python SIGTERM handler the program
  installed before (the launcher's, which raises SystemExit) is put back after `ray.init`.

- `ray.init()` without an address connects to the cluster named in `/tmp/ray/ray_current_cluster`
  (written by `ray start` and by `ray.cluster_utils.Cluster`), even a stale one or another
  user's: a local start passes address="local" (RAY_ADDRESS still wins, as Ray documents).
- Ray rewrites a loopback address (127.0.0.1, localhost) given to `ray.init` or `ray start` into
  the machine's outward IP ("make sure localhost isn't resolved to the loopback ip"), so
  `_node_ip_address="127.0.0.1"` alone still binds every Ray server to that IP, reachable from
  other machines. `loopback_resolution()` makes Ray's node-IP lookup answer 127.0.0.1 for the
  duration of the call: the switch Ray itself uses where it does not support multi-node
  clusters (`ray_constants.ENABLE_RAY_CLUSTER`, set by RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import signal
import threading
from collections.abc import Iterator, MutableMapping

from dockyard_rl.utils.addresses import is_loopback

AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"

# The node label that places fleets (bootstrap.py), and the value of a node that hosts every
# fleet: what a local single-node cluster is.
FLEET_LABEL = "dockyard.io/fleet"
EVERY_ROLE = "all"


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
            raise ValueError(
                f"{AUTH_TOKEN_PATH}={path}: cannot read the Ray token ({error}); "
                f"point it at a file holding the cluster's token, or unset it"
            ) from None
        if not holds_token:
            raise ValueError(
                f"{AUTH_TOKEN_PATH}={path}: the file is empty; write the cluster's "
                f"token into it (`ray get-auth-token`), or unset it"
            )
        return AUTH_TOKEN_PATH
    try:
        if default_token_path().read_text().strip():
            return "home"
    except OSError:
        pass
    environ[AUTH_TOKEN] = secrets.token_hex(32)
    return "generated"


@contextlib.contextmanager
def loopback_resolution(host: str = "127.0.0.1") -> Iterator[None]:
    """While active, Ray resolves "this node's IP" to 127.0.0.1 instead of the outward IP, so a
    loopback address given to ray.init stays loopback (module docstring). A no-op for a
    non-loopback `host`. Only for the duration of a ray.init / node start: once connected, Ray
    takes the node IP from the node it joined."""
    if not is_loopback(host):
        yield
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def init_local_ray(**init_kwargs) -> None:
    """`ray.init` for a cluster on this machine only (127.0.0.1, no dashboard), after
    `ensure_ray_auth_token`; a no-op when Ray is already initialised in this process (the caller
    started or joined a cluster). `init_kwargs` go to ray.init (num_cpus, log_to_driver, labels,
    ...). The node is labelled as hosting every fleet (`dockyard.io/fleet=all`) unless `labels`
    say otherwise, so worker groups of every role can be placed on it. RAY_ADDRESS, when set,
    makes this a connection to that cluster (Ray's rule)."""
    import ray

    if ray.is_initialized():
        return
    ensure_ray_auth_token()
    init_kwargs.setdefault("labels", {FLEET_LABEL: EVERY_ROLE})
    with loopback_resolution(), program_sigterm_handler_kept():
        ray.init(
            address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **init_kwargs
        )


@contextlib.contextmanager
def program_sigterm_handler_kept() -> Iterator[None]:
    """Puts back, on exit, the Python SIGTERM handler that was installed on entry (module
    docstring: ray.init replaces it with one that aborts a busy process). Only a handler the
    program chose is kept: with Python's default (or none, or outside the main thread, where
    handlers cannot be set) whatever the body installed stays."""
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(handler):
            signal.signal(signal.SIGTERM, handler)
