"""Test-only memory pressure on vLLM engines: a busy machine, and a worker that holds memory.

- `HeldMemory`: a helper process that takes a large allocation (every page written) and holds it
  until released: a trainer or another test beside the engine. `squeeze_bytes` sizes it from this
  machine's memory (half of it by default: 12 GiB on our 24 GiB machines), so the tests fit on
  other machines too.
- `BallastWorkerExtension`: our worker extension, from a module whose import makes vLLM's worker
  process hold `DOCKYARD_TEST_WORKER_BALLAST_BYTES` extra bytes. vLLM imports the extension class
  by its qualified name in each worker process before it loads the model and sizes the KV cache
  (`WorkerWrapperBase.init_worker`), so the ballast is in the worker's resident memory exactly when
  vLLM's automatic CPU sizing subtracts that memory (requested memory minus the worker's RSS).
  Select it with `VllmGeneration(config, worker_extension_cls=BALLAST_WORKER_EXTENSION_CLS,
  engine_env={BALLAST_BYTES_ENV: str(num_bytes)})`. A driver that imports this module for its
  names allocates nothing unless it has that variable set itself.

Pages are written, not just allocated: untouched pages of a zeroed allocation count neither in a
process's RSS nor against the machine's available memory.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import psutil

from dockyard_rl.models.generation.config import format_bytes
from dockyard_rl.models.generation.vllm_worker_extension import VllmWorkerExtension

BALLAST_BYTES_ENV = "DOCKYARD_TEST_WORKER_BALLAST_BYTES"
BALLAST_WORKER_EXTENSION_CLS = (
    "dockyard_rl.models.generation.memory_pressure.BallastWorkerExtension"
)


def _allocate(num_bytes: int) -> bytearray | None:
    if num_bytes <= 0:
        return None
    ballast = bytearray(num_bytes)
    ballast[:: mmap.PAGESIZE] = b"\x01" * len(range(0, num_bytes, mmap.PAGESIZE))
    return ballast


# Held for the life of the process (a vLLM worker, when the variable is set).
_BALLAST = _allocate(int(os.environ.get(BALLAST_BYTES_ENV, "0")))


class BallastWorkerExtension(VllmWorkerExtension):
    """Our worker extension, unchanged; importing its module took the ballast."""


def squeeze_bytes(fraction_of_total: float = 0.5, leave_available: int = 6 << 30) -> int:
    """`fraction_of_total` of this machine's memory, but leaving at least `leave_available` bytes
    of what is available now (for the engines and the test itself); 0 when nothing is left."""
    memory = psutil.virtual_memory()
    return max(
        0, min(int(fraction_of_total * memory.total), int(memory.available) - leave_available)
    )


_HOLDER = """
import mmap, sys
n = int(sys.argv[1])
held = bytearray(n)
held[::mmap.PAGESIZE] = b"\\x01" * len(range(0, n, mmap.PAGESIZE))
print("held", flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
"""


class HeldMemory:
    """A helper process holding `num_bytes` (pages written) from construction to `release()`."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes
        start = time.monotonic()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(num_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._process.stdout.readline()  # "" if it died (e.g. out of memory)
        if line.strip() != "held":
            self.release()
            raise RuntimeError(
                f"the memory holder did not take {num_bytes} bytes (exit code "
                f"{self._process.returncode})"
            )
        self.seconds_to_take = time.monotonic() - start

    @property
    def held(self) -> bool:
        return self._process.poll() is None

    def rss_bytes(self) -> int:
        return psutil.Process(self._process.pid).memory_info().rss if self.held else 0

    def release(self) -> None:
        """Frees the memory (the process exits). Idempotent."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> HeldMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def process_tree_rss(pid: int) -> dict[int, int]:
    """pid -> RSS of `pid` and all its descendants (e.g. an engine actor and vLLM's processes)."""
    root = psutil.Process(pid)
    rss = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            rss[process.pid] = process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return rss


def describe_squeeze(squeeze: HeldMemory, budget_description: str) -> str:
    """One line for a test's log: what the helper holds, what is left, the engine's budget."""
    memory = psutil.virtual_memory()
    return (
        f"another process holds {format_bytes(squeeze.rss_bytes())} of "
        f"{format_bytes(memory.total)} (taken in {squeeze.seconds_to_take:.1f} s); "
        f"{format_bytes(memory.available)} available now; {budget_description}"
    )
