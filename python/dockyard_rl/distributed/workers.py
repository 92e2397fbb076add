"""What a worker group, its workers and its callers share (worker_group.py builds on it):

- `WorkerInfo`: a worker's place (role, rank, world size, local rank, torch.distributed master),
  given to the worker's constructor and put in its environment as torch's env:// variables;
  `current_worker()` reads it back inside the worker.
- The errors of calls on ranked workers: `WorkerError` (rank, method, cause), `WorkerDiedError`
  (the process is gone), `WorkerRestartError` (restart limit reached).
- `gather`: waits for one call per rank and fails fast: the first failure raises; the other
  calls are left to finish (worker_group.py's docstring says why they are not cancelled).

Not covered: retrying calls (a failed call is reported, never repeated).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any


class WorkerError(RuntimeError):
    """A call on a worker group failed: `rank`, `method`, `cause` (text) name what and where."""

    def __init__(self, message: str, rank: int, method: str, cause: str):
        super().__init__(message)
        self.rank, self.method, self.cause = rank, method, cause


class WorkerDiedError(WorkerError):
    """The worker's process is gone (killed, crashed, exited, node lost)."""


class WorkerRestartError(WorkerError):
    """A rank died more often than its group may restart it."""


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    role: str
    rank: int
    world_size: int
    local_rank: int  # among the group's workers on the same node
    local_world_size: int
    master_addr: str  # rank 0's node
    master_port: int
    node_id: str

    def env_vars(self) -> dict[str, str]:
        """torch.distributed's env:// variables for this worker."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def current_worker() -> WorkerInfo:
    """Inside a worker: its WorkerInfo, from the environment its group gave it."""
    import ray

    env = os.environ
    return WorkerInfo(
        role=env["DOCKYARD_FLEET_ROLE"],
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        node_id=ray.get_runtime_context().get_node_id(),
    )


def node_address_and_free_port() -> tuple[str, int]:
    """This Ray node's IP and a TCP port free on it now (run on the node in question)."""
    import ray

    address = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return address, sock.getsockname()[1]


def describe_error(error: BaseException) -> str:
    """ "Type: message" of what a worker raised (Ray's wrapping removed), one line."""
    import ray

    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:800]}"


def worker_error(rank: int, role: str, method: str, error: Exception) -> WorkerError:
    """The WorkerError for `error` raised by `method` on `rank` (WorkerDiedError when the
    worker's process is gone; an unreachable-for-now actor is not dead)."""
    import ray

    cause = describe_error(error)
    if isinstance(error, ray.exceptions.RayActorError) and not isinstance(
        error, ray.exceptions.ActorUnavailableError
    ):
        return WorkerDiedError(
            f"{role} worker group: rank {rank} died during {method} "
            f"({cause}); group.restart_dead_workers() re-creates it",
            rank,
            method,
            cause,
        )
    return WorkerError(
        f"{role} worker group: {method} failed on rank {rank}: {cause}", rank, method, cause
    )


def gather(
    refs: list[tuple[int, Any]], role: str, method: str, timeout_s: float | None
) -> list[Any]:
    """Results of (rank, ref) pairs, by rank; fails fast (module docstring). `timeout_s` bounds
    the whole wait (WorkerError naming the ranks that did not answer)."""
    import ray

    pending = {ref: rank for rank, ref in refs}
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not done:
            ranks = sorted(pending.values())
            raise WorkerError(
                f"{role} worker group: {method} on rank(s) {ranks} gave no answer "
                f"within {timeout_s:g} s",
                ranks[0],
                method,
                "timeout",
            )
        rank = pending.pop(done[0])
        try:
            results[rank] = ray.get(done[0])
        except Exception as error:
            raise worker_error(rank, role, method, error) from error
    return [results[rank] for rank in sorted(results)]


__all__ = [
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "WorkerRestartError",
    "current_worker",
    "describe_error",
    "gather",
    "node_address_and_free_port",
    "worker_error",
]
