"""Entry point of the task executor service.

    tools/bazel run //python/dockyard_rl/sandbox:executor -- [--host 127.0.0.1] [--port 9090]
        [--workers N] [--work-dir DIR] [--db FILE] [--max-queue N] [--max-patch-bytes N]
        [--max-infra-attempts N] [--default-timeout-s S] [--auth-token-file FILE]
        [--image-cache-dir DIR] [--image-cache-max-bytes N]
    python -m dockyard_rl.sandbox.executor ...   (the same, without Bazel; the image uses this)

Flags map one-to-one onto ExecutorConfig keys (config.py holds the defaults and the validation);
--default-timeout-s sets `pipeline.timeout_s`; --image-cache-dir and --image-cache-max-bytes set
the task images' cache (`pipeline.image_cache_dir`, `pipeline.image_cache_max_bytes`).
The bearer token is never a flag: command lines are visible to every user of the machine (`ps`).
It comes from `--auth-token-file` or the DOCKYARD_EXECUTOR_TOKEN environment variable.

Once listening, prints one line `dockyard executor listening on http://HOST:PORT` to stdout (with
the bound port when --port 0), which scripts and tests wait for. SIGTERM and SIGINT shut down
gracefully (see server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Mapping

from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import RunningServer, serve
from dockyard_rl.utils.config import from_dict

TOKEN_ENV_VAR = "DOCKYARD_EXECUTOR_TOKEN"

# flag dest -> ExecutorConfig key
_FLAG_KEYS = {
    "host": "host",
    "port": "port",
    "workers": "num_workers",
    "work_dir": "work_dir",
    "db": "db_path",
    "max_queue": "max_queue",
    "max_patch_bytes": "max_patch_bytes",
    "max_infra_attempts": "max_infra_attempts",
    "retry_backoff_s": "retry_backoff_s",
    "shutdown_grace_s": "shutdown_grace_s",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="executor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind; 0 = any free port (default 9090)")
    parser.add_argument("--workers", type=int, help="tasks scored at once (default 0.75 x cores)")
    parser.add_argument(
        "--work-dir", help="mirrors and worktrees (default ~/.cache/dockyard_rl/executor)"
    )
    parser.add_argument("--db", help="SQLite task records (default <work-dir>/tasks.sqlite3)")
    parser.add_argument("--max-queue", type=int, help="queued tasks before 429")
    parser.add_argument("--max-patch-bytes", type=int, help="largest patch / test_patch (413)")
    parser.add_argument(
        "--max-infra-attempts", type=int, help="scoring attempts per task before infra_error"
    )
    parser.add_argument("--retry-backoff-s", type=float, help="delay before the first retry")
    parser.add_argument(
        "--default-timeout-s", type=float, help="test-run wall clock when a task names none"
    )
    parser.add_argument(
        "--shutdown-grace-s", type=float, help="how long shutdown waits for running tasks"
    )
    parser.add_argument(
        "--image-cache-dir", help="unpacked task images (default <work-dir>/images)"
    )
    parser.add_argument(
        "--image-cache-max-bytes",
        type=int,
        help="size of the task image cache before LRU eviction (default 20 GiB)",
    )
    parser.add_argument(
        "--auth-token-file",
        type=pathlib.Path,
        help=f"file holding the bearer token (else ${TOKEN_ENV_VAR}; none = no "
        f"authentication, allowed only on a loopback host)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser.parse_args(argv)


def token_from_environment(environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token in $DOCKYARD_EXECUTOR_TOKEN (stripped), None when unset or empty. The
    executor serves with it; clients (the synthesizer, the validator) send it."""
    return environ.get(TOKEN_ENV_VAR, "").strip() or None


def config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> ExecutorConfig:
    """Flags (and the token source) -> a validated ExecutorConfig; ValueError names the key."""
    data = {
        key: getattr(args, dest)
        for dest, key in _FLAG_KEYS.items()
        if getattr(args, dest) is not None
    }
    pipeline = {
        key: value
        for key, value in (
            ("timeout_s", args.default_timeout_s),
            ("image_cache_dir", args.image_cache_dir),
            ("image_cache_max_bytes", args.image_cache_max_bytes),
        )
        if value is not None
    }
    if pipeline:
        data["pipeline"] = pipeline
    if args.auth_token_file is not None:
        try:
            data["auth_token"] = args.auth_token_file.read_text().strip()
        except OSError as error:
            raise ValueError(
                f"--auth-token-file: cannot read {args.auth_token_file}: {error.strerror}"
            ) from None
    elif token_from_environment(environ):
        data["auth_token"] = token_from_environment(environ)
    return from_dict(ExecutorConfig, data, key_path="executor")


async def _run(config: ExecutorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    def ready(server: RunningServer) -> None:
        print(f"dockyard executor listening on {server.url}", flush=True)

    await serve(config, stop, on_ready=ready)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args, dict(os.environ))
    except ValueError as error:
        print(f"executor: invalid configuration: {error}", file=sys.stderr)
        return 2
    asyncio.run(_run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
