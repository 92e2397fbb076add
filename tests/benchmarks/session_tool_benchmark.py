"""Tool-call latency in an executor session: p50 / p90 per tool, through the real service.

    tools/bazel run //tests/benchmarks:session_tool_benchmark [-- --num-calls 100 --num-runs 3]

Opens a session on the toy repository (sandbox/testing_repos.py) through a started executor
(HTTP on 127.0.0.1, the async client, the real session manager) and times each call from the
client's side: `--num-calls` views (files and directories, varied ranges), literal searches and
regex searches over the tree, replaces, and `--num-runs` run_tests (pytest under bubblewrap).
The baseline row is GET /healthz on the same connection: the HTTP round trip every call pays.
The goal is p50 <= 50 ms for view and search on this machine (an agent calls them every turn).

Not a test: nothing is asserted beyond every call answering ok (a figure from failed calls would
mislead).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

from dockyard_rl.sandbox import testing_executor, testing_repos
from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.sessions import SessionConfig

_VIEWS = (
    {"path": "calc/ops.py"},
    {"path": "calc/ops.py", "start_line": 10, "end_line": 14},
    {"path": "tests/test_ops.py", "start_line": 5},
    {"path": "."},
    {"path": "tests"},
)
_SEARCHES = (
    {"pattern": "def "},
    {"pattern": "return", "path": "calc"},
    {"pattern": "clamp"},
)
_REGEX_SEARCHES = (
    {"pattern": r"def \w+\(", "regex": True},
    {"pattern": r"assert \w+\(\d", "regex": True, "path": "tests"},
)


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return statistics.median(ordered) * 1000, p90 * 1000


async def _measure(url: str, toy: testing_repos.ToyRepo, num_calls: int, num_runs: int):
    rows: dict[str, list[float]] = {}
    async with ExecutorClient(url) as client:
        session_id = await client.open_session(toy.spec(""), "benchmark")

        async def timed(name: str, call) -> None:
            started = time.perf_counter()
            result = await call()
            rows.setdefault(name, []).append(time.perf_counter() - started)
            if isinstance(result, dict):
                return
            assert result.ok, f"{name}: {result.error}"

        for index in range(num_calls):
            await timed("healthz (HTTP floor)", client.healthz)
            args = _VIEWS[index % len(_VIEWS)]
            await timed("view", lambda a=args: client.call_tool(session_id, "view", a))
            args = _SEARCHES[index % len(_SEARCHES)]
            await timed("search", lambda a=args: client.call_tool(session_id, "search", a))
            args = _REGEX_SEARCHES[index % len(_REGEX_SEARCHES)]
            await timed("search (regex)", lambda a=args: client.call_tool(session_id, "search", a))
            old, new = ("return max(", "return  max(")[:: 1 if index % 2 == 0 else -1]
            await timed(
                "replace",
                lambda o=old, n=new: client.call_tool(
                    session_id, "replace", {"path": "calc/ops.py", "old": o, "new": n}
                ),
            )
        for _ in range(num_runs):
            await timed(
                "run_tests (bubblewrap)",
                lambda: client.call_tool(session_id, "run_tests", {"tests": ["tests/test_ops.py"]}),
            )
        await timed("diff", lambda: _diff(client, session_id))
        await client.close_session(session_id)
    return rows


async def _diff(client: ExecutorClient, session_id: str) -> dict:
    return {"patch": await client.session_diff(session_id)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-calls", type=int, default=100, help="calls per host-side tool")
    parser.add_argument("--num-runs", type=int, default=3, help="run_tests calls")
    args = parser.parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp(prefix="session-benchmark-"))
    toy = testing_repos.make_toy_repo(root / "toy")
    config = testing_executor.make_config(
        root,
        sessions=SessionConfig(
            max_turns=10 * (args.num_calls + args.num_runs), max_output_bytes=64 * 1024**2
        ),
    )

    async def run():
        async with running_server(config) as server:
            return await _measure(server.url, toy, args.num_calls, args.num_runs)

    rows = asyncio.run(run())
    print(f"session tool-call latency, client side ({args.num_calls} calls per host-side tool)")
    print(f"{'call':<24}{'n':>6}{'p50 ms':>10}{'p90 ms':>10}")
    for name, samples in rows.items():
        p50, p90 = _percentiles(samples)
        print(f"{name:<24}{len(samples):>6}{p50:>10.1f}{p90:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
