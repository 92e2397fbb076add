"""Shared-memory segments in /dev/shm: names that carry their owner, and reclaiming what dead
processes left behind.

A process that is SIGKILLed (OOM killer, `kill -9`, Ray killing a worker and its children, a
Bazel timeout) unlinks nothing: every segment it created stays in /dev/shm, a tmpfs, and keeps
its memory until someone removes the file or the machine reboots. Two kinds appear in our runs:

- `dockyard-<kind>-o<pid>.<start>.<pidns>-...`: ours (weight_sync/ipc_zmq.py's refit buckets,
  one file per bucket). `owner_tag()` puts the creating process's pid, its start time (field 22
  of /proc/<pid>/stat: clock ticks since boot) and its pid namespace in the name. /dev/shm is
  emptied at boot, so these name exactly one process for the file's whole life, even after the
  pid is reused; the namespace matters because a test under Bazel's linux-sandbox (or a process
  in a container sharing /dev/shm) has pids of its own namespace.
- `psm_<hex>`: Python's `multiprocessing.shared_memory`, made by vLLM's shm_broadcast
  `MessageQueue` rings (the engine core's RPC broadcast ring, `VLLM_MQ_MAX_CHUNK_BYTES_MB` x 10
  = 160 MiB, and each worker's 240 MiB response ring). vLLM unlinks them in `__del__` and
  Python's resource tracker unlinks them when their creator dies, but neither runs when the
  creator and its resource tracker are killed together. Their names say nothing of the owner.
- `sem.mp-<random>`: the named POSIX semaphores of `multiprocessing` locks and queues made with
  the "spawn" context (32 bytes each), unlinked by the same resource tracker.
  (Ray's object store unlinks its own files right after mapping them: nothing of Ray's shows.)

`reclaim_stale_segments()` removes, and only removes:

1. an owner-tagged `dockyard-*` segment of our pid namespace whose owner is dead: no process
   has its pid, or the process that has it started at another time (the pid was reused). A
   segment whose owner is alive is never touched, whoever it belongs to (another run on the same
   machine keeps its own).
2. any other segment of a kind we create (`psm_*`, `sem.mp-*`, `dockyard-*` names from before
   owner tags or of another pid namespace) only when all of these hold: this process sees every
   process of the machine (`sees_every_process`: not so inside a sandbox or container, where
   nothing untagged is ever reclaimed); the file belongs to our uid; its mtime (set
   when it is created or resized) is at least `min_age_s` old (so a segment between its creation
   and its first mapping is safe); and no live process maps it (/proc/*/maps) or holds it open
   (/proc/*/fd). A process whose /proc entries we may not read runs as another user: it cannot
   open our 0600 `psm_*` files unless it is root, and we do not reclaim while some process of
   our own uid is unreadable (except pid 1, init or a container's supervisor, which a container
   may hide even from root). Anything else in /dev/shm (other programs' files and semaphores,
   locks) is not ours and is never considered.

The rule for untagged segments assumes that whoever needs a segment keeps it mapped or open,
which is how vLLM's rings and Python's `SharedMemory` objects work (the creator maps it for the
object's lifetime). It would misjudge a program that creates a `psm_*` segment, unmaps it and
reopens it by name more than `min_age_s` later with no process holding it in between.

Called at start-up by the launcher (python/launch/grpo_swe.py) and, for its own owner-tagged
segments only, by the ipc_zmq sender. On a normal shutdown, the vLLM engine actor
(models/generation/vllm_engine_actor.py) notes its engine's segments (`segments_of_tree`) and
unlinks them once no process maps them (`unlink_unused`): vLLM's engine core unlinks its RPC
ring only when the ring is garbage-collected, and Ray SIGKILLs the actor and its children
(Python's resource tracker among them) right after the shutdown call.
tools/python/pytest_main.py uses `segments_in_use` and `descendants` to fail a test target that
leaves segments behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
# Prefixes of the segments this project creates, directly or through vLLM.
DOCKYARD_PREFIX = "dockyard-"
PSM_PREFIX = "psm_"
SEMAPHORE_PREFIX = "sem.mp-"
RECLAIMABLE_PREFIXES = (DOCKYARD_PREFIX, PSM_PREFIX, SEMAPHORE_PREFIX)
# An untagged segment younger than this is left alone: its creator may not have mapped it yet.
DEFAULT_MIN_AGE_S = 60.0

_OWNER_TAG = re.compile(r"-o(\d+)\.(\d+)\.(\d+)-")

logger = logging.getLogger(__name__)


def process_start_time(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":  # a zombie has died; it maps nothing any more
        return None
    return int(fields[19])  # field 22 of the whole line


def pid_namespace() -> int:
    """Inode of this process's pid namespace: pids mean something only inside one."""
    return os.stat("/proc/self/ns/pid").st_ino


def owner_tag(pid: int | None = None) -> str:
    """`o<pid>.<start time>.<pid namespace>` of process `pid` (default: this one; it must be in
    this process's pid namespace), for a segment's name."""
    pid = os.getpid() if pid is None else pid
    start = process_start_time(pid)
    if start is None:
        raise ValueError(f"no running process {pid}")
    return f"o{pid}.{start}.{pid_namespace()}"


def segment_owner(name: str) -> tuple[int, int, int] | None:
    """(pid, start time, pid namespace) of an owner-tagged dockyard segment name, else None."""
    if not name.startswith(DOCKYARD_PREFIX):
        return None
    match = _OWNER_TAG.search(name)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3))) if match else None


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that started as `pid` at `start` is still running."""
    return process_start_time(pid) == start


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def sees_every_process(attempts: int = 5) -> bool:
    """Whether /proc shows every thread the kernel runs, i.e. no process is hidden from us.

    Inside a nested pid namespace (Bazel's linux-sandbox runs each test in one; containers do
    too) /proc shows only that namespace, while /proc/loadavg's thread count is the kernel's.
    Counts move while we count: true only when the kernel's count is the same before and after
    our count and equals it, on one of `attempts` tries."""
    for _ in range(attempts):
        before = _kernel_threads()
        visible = 0
        for pid in _pids():
            try:
                visible += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
        if before == visible == _kernel_threads():
            return True
    return False


def _kernel_threads() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[1])


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` (children, their children, ...), from /proc's ppid fields."""
    children: dict[int, list[int]] = {}
    for child in _pids():
        try:
            with open(f"/proc/{child}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(child)
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


@dataclasses.dataclass
class SegmentUse:
    """What a scan of /proc found: segment names mapped or open, and who could not be read."""

    in_use: set[str]
    # uids of processes whose maps/fds we could not read (another user's, without privilege).
    unreadable_uids: set[int]


def segments_in_use(pids: Iterable[int] | None = None, shm_dir: str = SHM_DIR) -> SegmentUse:
    """Names of files in `shm_dir` that processes `pids` (default: all) map or hold open.

    Files are matched by inode, not by the path /proc shows: glibc's `sem_open` maps a
    temporary file and then links it under the semaphore's name (`sem.mp-*`), so the mapping
    names a deleted file that is the same inode."""
    prefix = shm_dir.rstrip("/") + "/"
    shm_dev = os.stat(shm_dir).st_dev
    by_inode: dict[int, str] = {}
    for name in os.listdir(shm_dir):
        try:
            by_inode[os.stat(os.path.join(shm_dir, name)).st_ino] = name
        except FileNotFoundError:
            pass
    in_use: set[str] = set()
    unreadable: set[int] = set()
    for pid in _pids() if pids is None else pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if prefix not in line:
                        continue
                    # address perms offset major:minor inode path
                    _, _, _, device, inode = line.split(None, 5)[:5]
                    major, minor = (int(part, 16) for part in device.split(":"))
                    if os.makedev(major, minor) == shm_dev and int(inode) in by_inode:
                        in_use.add(by_inode[int(inode)])
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    if not os.readlink(os.path.join(fd_dir, fd)).startswith(prefix):
                        continue
                    st = os.stat(os.path.join(fd_dir, fd))
                except OSError:
                    continue  # closed meanwhile
                if st.st_dev == shm_dev and st.st_ino in by_inode:
                    in_use.add(by_inode[st.st_ino])
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile: it holds nothing
        except PermissionError:
            if pid == 1:
                continue  # init, or a container's supervisor: maps no segment of ours
            try:
                unreadable.add(os.stat(f"/proc/{pid}").st_uid)
            except OSError:
                pass
    return SegmentUse(in_use, unreadable)


def segments_of_tree(pid: int, prefixes: tuple[str, ...] = RECLAIMABLE_PREFIXES) -> set[str]:
    """Segments of ours (by prefix) that process `pid` or a process below it maps or holds."""
    use = segments_in_use(descendants(pid) | {pid})
    return {name for name in use.in_use if name.startswith(prefixes)}


def unlink_unused(names: Iterable[str], wait_s: float = 0.0, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks those of `names` that no live process maps or holds open, waiting up to `wait_s`
    for their users to exit; returns the names unlinked. For the segments of a process tree
    that has just been shut down (`segments_of_tree` before, this after): the creator's own
    clean-up may not have run."""
    pending = set(names)
    unlinked: list[str] = []
    deadline = time.monotonic() + wait_s
    while pending:
        pending = {name for name in pending if os.path.exists(os.path.join(shm_dir, name))}
        unused = pending - segments_in_use(shm_dir=shm_dir).in_use
        for name in sorted(unused):
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                continue  # its creator unlinked it meanwhile
            unlinked.append(name)
        pending -= unused
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if pending:
        logger.warning("shared-memory segments still in use, left in place: %s", sorted(pending))
    if unlinked:
        logger.info("unlinked shared-memory segments left by exited processes: %s", unlinked)
    return unlinked


def segment_names(
    prefixes: tuple[str, ...] = RECLAIMABLE_PREFIXES, shm_dir: str = SHM_DIR
) -> set[str]:
    """The entries of `shm_dir` whose names start with one of `prefixes` (default: the kinds
    this module reclaims)."""
    return {name for name in os.listdir(shm_dir) if name.startswith(prefixes)}


def stale_segments(
    min_age_s: float = DEFAULT_MIN_AGE_S,
    prefixes: tuple[str, ...] = RECLAIMABLE_PREFIXES,
    shm_dir: str = SHM_DIR,
) -> dict[str, str]:
    """Segments of `shm_dir` that the module docstring's rules call stale: name -> why."""
    stale: dict[str, str] = {}
    untagged: list[str] = []
    namespace = pid_namespace()
    for name in sorted(segment_names(prefixes, shm_dir)):
        owner = segment_owner(name)
        if owner is not None and owner[2] == namespace:
            if not owner_alive(owner[0], owner[1]):
                stale[name] = f"its owner, process {owner[0]}, is dead"
        else:  # no owner, or one in another pid namespace: its pid means nothing here
            untagged.append(name)
    if not untagged:
        return stale
    uid, now = os.getuid(), time.time()
    candidates = []
    for name in untagged:
        try:
            st = os.stat(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue
        if st.st_uid == uid and now - st.st_mtime >= min_age_s:
            candidates.append(name)
    if not candidates:
        return stale
    if not sees_every_process():
        logger.info(
            "not reclaiming untagged segments in %s: processes of other pid namespaces are "
            "hidden from this one (a sandbox or container) and may use them",
            shm_dir,
        )
        return stale
    use = segments_in_use(shm_dir=shm_dir)
    if uid in use.unreadable_uids:
        logger.warning(
            "not reclaiming untagged segments in %s: a process of this user could not be inspected",
            shm_dir,
        )
        return stale
    for name in candidates:
        if name not in use.in_use:
            stale[name] = f"no live process maps or holds it, unchanged for {min_age_s:g}s or more"
    return stale


def reclaim_stale_segments(
    min_age_s: float = DEFAULT_MIN_AGE_S,
    prefixes: tuple[str, ...] = RECLAIMABLE_PREFIXES,
    shm_dir: str = SHM_DIR,
) -> list[str]:
    """Unlinks the stale segments (module docstring: the rules); returns their names.

    Safe to call at any time from any process: it never removes a segment whose owner is alive
    or that a live process maps. Call at start-up, before creating new segments.
    """
    reclaimed = []
    freed = 0
    for name, why in stale_segments(min_age_s, prefixes, shm_dir).items():
        path = os.path.join(shm_dir, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            continue  # reclaimed by someone else meanwhile
        except PermissionError as error:
            logger.warning("cannot reclaim stale segment %s: %s", path, error)
            continue
        reclaimed.append(name)
        freed += size
        logger.info("reclaimed stale shared-memory segment %s (%d bytes): %s", path, size, why)
    if reclaimed:
        logger.warning(
            "reclaimed %d stale shared-memory segments (%.1f MiB) left in %s by dead processes",
            len(reclaimed),
            freed / 2**20,
            shm_dir,
        )
    return reclaimed
