"""Entry point of every `py_pytest_test` target: runs pytest on the test's own file(s).

Bazel passes the test files as arguments (their runfiles paths). Results go to Bazel's
XML_OUTPUT_FILE as JUnit XML, so `bazel test` reports per-test-case results. A file that
collects no test is a failure (pytest exit code 5), never a silent pass.

/dev/shm is left as it was found: pytest runs in a child process while this one watches the
shared-memory segments that appear in /dev/shm (a tmpfs: a leaked segment holds memory until
reboot). After pytest and its processes have exited, a segment fails the target when all hold:

- it is new (its name, or its inode, was not there when the target started);
- it is this target's: during the run it was mapped or open in this process tree (sampled every
  `SAMPLE_INTERVAL_S` from /proc), or its name carries the owner tag of a process of the tree
  (dockyard_rl/utils/shared_memory.py: pid, start time and pid namespace). Other targets run
  in parallel under Bazel, and their segments are never blamed on this one;
- it is not one of the files system tools keep there on purpose (`PERSISTENT_SYSTEM_FILES`:
  podman's lock file);
- no live process maps it or holds it open, after up to `GRACE_S` for the tree's processes to
  finish their teardown (this process is a child subreaper, so orphaned grandchildren, e.g. an
  engine core whose Ray worker was killed, stay in the tree and are waited for).

Such a segment is reported with its size, then unlinked (nobody can use it any more), and the
target fails even when every test passed. A segment made and leaked between two samples by a
short-lived process escapes the check (it errs towards passing, never blames another target).
"""

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from dockyard_rl.utils import shared_memory

NO_TESTS_COLLECTED = 5
LEAKED_SHARED_MEMORY = 3  # pytest's own codes are 0-5; a run that passed but leaked gets this
SAMPLE_INTERVAL_S = 0.5
GRACE_S = 20.0
_CHILD_ENV = "DOCKYARD_PYTEST_MAIN_CHILD"
# Files system tools keep in /dev/shm on purpose, for every later run: podman's lock file
# (created by the first podman command on a machine, e.g. sandbox_image_test's on a fresh one,
# and reused by all later ones). Never a leak, never removed.
PERSISTENT_SYSTEM_FILES = frozenset({"libpod_lock"})
_PR_SET_CHILD_SUBREAPER = 36


def run_pytest(argv: list[str]) -> int:
    args = ["-p", "no:cacheprovider", "-v", "-rs", "--color=no"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
    # Bazel's test sharding: run only this shard's share of the test cases.
    exit_code = pytest.main(args + argv)
    if exit_code == NO_TESTS_COLLECTED:
        print(
            "pytest collected no tests: a test target must run at least one test.", file=sys.stderr
        )
    return int(exit_code)


def _snapshot() -> dict[str, int]:
    """name -> inode of every entry of /dev/shm."""
    entries = {}
    for name in os.listdir(shared_memory.SHM_DIR):
        try:
            entries[name] = os.stat(os.path.join(shared_memory.SHM_DIR, name)).st_ino
        except FileNotFoundError:
            pass
    return entries


class _ShmWatch:
    """Which new /dev/shm segments this process tree used (module docstring)."""

    def __init__(self):
        self._baseline = _snapshot()  # before pytest starts
        self._child_pid = -1
        self._namespace = shared_memory.pid_namespace()
        self.ours: dict[str, int] = {}  # name -> inode
        self._tree_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def new_entries(self) -> dict[str, int]:
        return {
            name: inode for name, inode in _snapshot().items() if self._baseline.get(name) != inode
        }

    def sample(self) -> set[int]:
        """Records the tree's uses of new segments; returns the tree's live pids."""
        pids = shared_memory.descendants(os.getpid())
        _reap_orphans(pids - {self._child_pid})
        self._tree_pids |= pids
        new = self.new_entries()
        if new:
            used = shared_memory.segments_in_use(pids).in_use
            for name, inode in new.items():
                owner = shared_memory.segment_owner(name)
                if name in used or (
                    owner is not None
                    and owner[2] == self._namespace  # pids of other namespaces mean nothing here
                    and owner[0] in self._tree_pids
                ):
                    self.ours[name] = inode
        return pids

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def start(self, child: subprocess.Popen) -> None:
        self._child_pid = child.pid
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def leaked(self) -> dict[str, int]:
        """Our new segments still in /dev/shm that no live process maps or holds: name -> size."""
        deadline = time.monotonic() + GRACE_S
        while True:
            alive = [p for p in self.sample() if shared_memory.process_start_time(p) is not None]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(SAMPLE_INTERVAL_S)  # processes of the tree are still tearing down
        remaining = {
            n: i
            for n, i in self.new_entries().items()
            if self.ours.get(n) == i and n not in PERSISTENT_SYSTEM_FILES
        }
        if not remaining:
            return {}
        in_use = shared_memory.segments_in_use().in_use
        sizes = {}
        for name in sorted(set(remaining) - in_use):
            try:
                sizes[name] = os.stat(os.path.join(shared_memory.SHM_DIR, name)).st_size
            except FileNotFoundError:
                continue
        return sizes


def _reap_orphans(pids: set[int]) -> None:
    """Waits for the orphans reparented to this subreaper that have exited (zombies)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # a grandchild, not ours to wait for


def _report(leaked: dict[str, int]) -> None:
    lines = [
        f"/dev/shm was not left as found: {len(leaked)} shared-memory segment(s) made by this "
        "test's processes remain, mapped by no live process (a process was killed before it "
        "unlinked them, or an engine/sender was not shut down):"
    ]
    lines += [f"  /dev/shm/{name}  {size / 2**20:.1f} MiB" for name, size in leaked.items()]
    lines.append("They are removed now; fix the test or the code that leaks them.")
    print("\n".join(lines), file=sys.stderr)
    for name in leaked:
        try:
            os.unlink(os.path.join(shared_memory.SHM_DIR, name))
        except FileNotFoundError:
            pass


def main() -> int:
    if os.environ.pop(_CHILD_ENV, None):  # not inherited by the tests' own processes
        return run_pytest(sys.argv[1:])
    # Orphans of the tree (a killed worker's children) are reparented here, not to init.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    watch = _ShmWatch()
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
        env={**os.environ, _CHILD_ENV: "1"},
    )
    watch.start(child)
    try:
        exit_code = child.wait()
    except KeyboardInterrupt:
        child.terminate()
        exit_code = child.wait()
    watch.stop()
    leaked = watch.leaked()
    if leaked:
        _report(leaked)
        return exit_code or LEAKED_SHARED_MEMORY
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
