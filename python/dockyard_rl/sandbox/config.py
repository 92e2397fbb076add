"""Configuration of the task executor service (`ExecutorConfig`).

Covers the service's own knobs: where it listens, how many tasks it scores at once, how many it
queues, how large a patch it accepts, the optional bearer token, where it keeps task records and
worktrees, and how it retries infrastructure failures. How one task is scored (the default test
timeout, rlimits, the mirror cache) is the nested `pipeline` section (pipeline.PipelineConfig, which
holds those defaults and validates them). Multi-turn agent sessions are the nested `sessions`
section (sessions.SessionConfig: how many at once, idle timeout, per-session budgets).

Security note: the executor runs code a model wrote. Binding anything but a loopback address
exposes it to the network, so a non-loopback `host` requires `auth_token`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from dockyard_rl.sandbox.pipeline import PipelineConfig
from dockyard_rl.sandbox.sessions import SessionConfig
from dockyard_rl.utils.addresses import is_loopback
from dockyard_rl.utils.config import is_int, is_number, require


def default_num_workers() -> int:
    """0.75 x the CPUs this process may run on (its affinity mask, which containers narrow), >= 1.

    Scoring is subprocess-heavy (git, pytest under bubblewrap); a quarter of the cores stays free
    for the service itself, git's own threads and the tests' interpreter start-up.
    """
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not every platform has affinity masks
        num_cpus = os.cpu_count() or 1
    return max(1, int(0.75 * num_cpus))


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    """The executor service's settings; build with `from_dict(ExecutorConfig, data, "executor")`."""

    host: str = "127.0.0.1"
    port: int = 9090  # 0 picks a free port (tests); the bound one is logged
    num_workers: int = dataclasses.field(default_factory=default_num_workers)
    max_queue: int = 1024  # queued (not running) tasks before POST answers 429
    max_patch_bytes: int = 1 << 20  # limit for `patch` and for `test_patch`, each (413)
    auth_token: str | None = None  # when set, /task/* requires `Authorization: Bearer ...`
    work_dir: str = "~/.cache/dockyard_rl/executor"  # mirrors and per-task worktrees live here
    db_path: str | None = None  # task records; None -> <work_dir>/tasks.sqlite3
    max_infra_attempts: int = 3  # scoring attempts per task before INFRA_ERROR
    retry_backoff_s: float = 2.0  # delay before the 2nd attempt; doubles after each
    retry_after_s: int = 5  # Retry-After header of a 429 (queue full)
    shutdown_grace_s: float = 30.0  # how long a shutdown waits for running tasks
    # Scoring one task; `pipeline.timeout_s` is the test-run wall clock when a task names none.
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    # Multi-turn agent sessions (sessions.SessionConfig: max_sessions, idle_timeout_s, budgets).
    sessions: SessionConfig = dataclasses.field(default_factory=SessionConfig)

    def __post_init__(self) -> None:
        require(
            isinstance(self.host, str) and bool(self.host),
            "host",
            f"must be a host name or IP address, got {self.host!r}",
        )
        require(
            is_loopback(self.host) or self.auth_token is not None,
            "host",
            f"{self.host!r} is not a loopback address; the executor runs untrusted code, so "
            f"serving beyond this machine requires auth_token to be set",
        )
        require(
            is_int(self.port) and 0 <= self.port <= 65535,
            "port",
            f"must be an integer in [0, 65535] (0 = any free port), got {self.port!r}",
        )
        require(
            is_int(self.num_workers) and self.num_workers >= 1,
            "num_workers",
            f"must be an integer >= 1, got {self.num_workers!r}",
        )
        require(
            is_int(self.max_queue) and self.max_queue >= 1,
            "max_queue",
            f"must be an integer >= 1, got {self.max_queue!r}",
        )
        require(
            is_int(self.max_patch_bytes) and self.max_patch_bytes >= 1,
            "max_patch_bytes",
            f"must be an integer >= 1, got {self.max_patch_bytes!r}",
        )
        if self.auth_token is not None:
            # A short token is guessable by brute force against an endpoint that runs code.
            require(
                isinstance(self.auth_token, str)
                and len(self.auth_token) >= 16
                and not any(c.isspace() for c in self.auth_token),
                "auth_token",
                "must be a string of at least 16 characters without whitespace "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), "
                "or null to disable authentication",
            )
        require(
            isinstance(self.work_dir, str) and bool(self.work_dir),
            "work_dir",
            f"must be a directory path, got {self.work_dir!r}",
        )
        require(
            self.db_path is None or (isinstance(self.db_path, str) and bool(self.db_path)),
            "db_path",
            f"must be a file path or null (= <work_dir>/tasks.sqlite3), got {self.db_path!r}",
        )
        require(
            is_int(self.max_infra_attempts) and self.max_infra_attempts >= 1,
            "max_infra_attempts",
            f"must be an integer >= 1 (1 = never retry), got {self.max_infra_attempts!r}",
        )
        require(
            is_number(self.retry_backoff_s) and self.retry_backoff_s >= 0,
            "retry_backoff_s",
            f"must be a number of seconds >= 0, got {self.retry_backoff_s!r}",
        )
        require(
            is_int(self.retry_after_s) and self.retry_after_s >= 1,
            "retry_after_s",
            f"must be an integer number of seconds >= 1, got {self.retry_after_s!r}",
        )
        require(
            is_number(self.shutdown_grace_s) and self.shutdown_grace_s >= 0,
            "shutdown_grace_s",
            f"must be a number of seconds >= 0, got {self.shutdown_grace_s!r}",
        )
        require(
            isinstance(self.pipeline, PipelineConfig),
            "pipeline",
            f"must be a mapping of pipeline settings, got {self.pipeline!r}",
        )
        require(
            isinstance(self.sessions, SessionConfig),
            "sessions",
            f"must be a mapping of session settings, got {self.sessions!r}",
        )

    @property
    def work_path(self) -> pathlib.Path:
        return pathlib.Path(self.work_dir).expanduser()

    @property
    def db_file(self) -> pathlib.Path:
        if self.db_path is None:
            return self.work_path / "tasks.sqlite3"
        return pathlib.Path(self.db_path).expanduser()
