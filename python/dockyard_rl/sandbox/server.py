"""The task executor service, running: a `TaskExecutor` (task_executor.py) behind its HTTP app
(http_app.py) on a socket.

- `running_server(config, score_fn)`: starts both (with `config.port = 0` the OS picks a free
  port; `RunningServer.url` has the bound one) and shuts both down on exit.
- `serve(config, stop)`: runs the service until `stop` is set; the entry point (executor.py) sets
  it on SIGTERM / SIGINT, the sandbox fleet's actors (fleet.py) when they shut down.
- `executor_url(url, ...)`: for command-line tools that score tasks: the URL of an executor
  running elsewhere, or of one started here for the duration.

Shutdown: the HTTP server stops first (in-flight requests finish), then workers finish their
current task within `shutdown_grace_s`; a task still running after that is put back to QUEUED
without spending its attempt, so the next start re-runs it (`TaskExecutor.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pathlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.http_app import create_app
from dockyard_rl.sandbox.metrics import ImageStatsFn
from dockyard_rl.sandbox.task_executor import ScoreFn, TaskExecutor

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunningServer:
    url: str  # http://host:port, with the port actually bound
    executor: TaskExecutor


@contextlib.asynccontextmanager
async def running_server(
    config: ExecutorConfig,
    score_fn: ScoreFn | None = None,
    *,
    image_stats: ImageStatsFn | None = None,
) -> AsyncIterator[RunningServer]:
    """Starts the executor and its HTTP server; on exit shuts both down gracefully.

    With `config.port = 0` the OS picks a free port; `RunningServer.url` has the bound one.
    `image_stats` is passed to TaskExecutor.
    """
    executor = TaskExecutor(config, score_fn, image_stats=image_stats)
    executor.start()
    # HTTP requests here are short (no handler waits on scoring), so shutdown need not wait long;
    # lingering_time bounds how long the server drains the rest of a body it refused with 413.
    runner = web.AppRunner(
        create_app(executor),
        handle_signals=False,
        access_log=None,
        shutdown_timeout=5.0,
        lingering_time=1.0,
    )
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield RunningServer(url=f"http://{_url_host(host)}:{port}", executor=executor)
    finally:
        await runner.cleanup()  # stop accepting, finish in-flight requests
        await asyncio.to_thread(executor.stop)


@contextlib.asynccontextmanager
async def executor_url(
    url: str | None, *, work_dir: pathlib.Path, num_workers: int, max_log_bytes: int | None = None
) -> AsyncIterator[str]:
    """For command-line tools that score tasks: `url` itself when given (an executor running
    elsewhere), else the URL of an executor started here on 127.0.0.1 (a free port) for the
    duration, with `num_workers` workers and its records and worktrees under `work_dir`. Patches
    up to 16 MiB are accepted; `max_log_bytes` sets how much test output verdicts keep."""
    if url:
        yield url
        return
    pipeline_config = (
        pipeline.PipelineConfig()
        if max_log_bytes is None
        else pipeline.PipelineConfig(max_log_bytes=max_log_bytes)
    )
    config = ExecutorConfig(
        port=0,
        num_workers=num_workers,
        work_dir=str(work_dir),
        max_patch_bytes=16 * 1024 * 1024,
        retry_backoff_s=1.0,
        pipeline=pipeline_config,
    )
    async with running_server(config) as server:
        logger.info("executor with %d workers at %s", num_workers, server.url)
        yield server.url


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve(
    config: ExecutorConfig,
    stop: asyncio.Event,
    score_fn: ScoreFn | None = None,
    on_ready: Callable[[RunningServer], None] | None = None,
) -> None:
    """Runs the service until `stop` is set (the entry point sets it on SIGTERM / SIGINT)."""
    async with running_server(config, score_fn) as server:
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
