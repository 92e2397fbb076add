"""Running an untrusted command under bubblewrap with rlimits, a wall-clock kill and bounded output.

`run_sandboxed(argv, writable_dirs=..., limits=...)` is the one entry point; the scoring pipeline
uses it to run a repository's tests on a model-written patch. Treat the command as hostile.

What the sandbox enforces (each line is a bubblewrap flag or an rlimit, set up in `_bwrap_argv`):
- No network: `--unshare-net` (only a down loopback device exists inside).
- Filesystem: the host root is bound read-only (`--ro-bind / /`); `/tmp` is a private size-capped
  tmpfs; `/run` is an empty tmpfs (host unix sockets live in /tmp and /run, and a network
  namespace does not cut off filesystem sockets); `hidden_paths` (the executor's work root with the other tasks' worktrees, the mirror
  cache holding the repositories' future history, /root, /home) are covered by empty tmpfs mounts;
  the only host directories the command can write are `writable_dirs` (the task's worktree and
  the private results directory), bound back at their own paths.
- Identity: when the executor runs as real root — uid 0 of the initial user namespace, as in the
  production image — bwrap itself runs as root
  WITHOUT a user namespace and the command is started through `setpriv` under a fresh random,
  otherwise unused uid/gid (no supplementary groups, no capabilities, no_new_privs). We do not use
  `--unshare-user --uid 65534` in that case on purpose: run by root, that maps the sandbox's
  "nobody" to kernel uid 0, which (a) still owns every root-owned file on the read-only root
  (/etc/shadow, /root) and (b) is exempt from RLIMIT_NPROC (the kernel never applies it to the
  root user), so a fork bomb would not be stopped. A fresh uid per run also means concurrent
  sandboxes count their processes separately and cannot signal or ptrace each other. When the
  executor is not root, `--unshare-user --uid 65534 --gid 65534` is used (the kernel uid is then
  the executor's own unprivileged uid; RLIMIT_NPROC counts all of that user's processes). uid 0
  inside a user namespace that maps to the host's root (Bazel's linux-sandbox run by root) fits
  neither mode, and the sandbox refuses to run there (`SandboxUnavailableError`).
- Processes: new pid, ipc, uts (and cgroup, when possible) namespaces; `--new-session` (no
  terminal injection); `--die-with-parent`. When the command's first process exits, or when we
  kill bwrap, the pid namespace is torn down and the kernel kills every process left in it, so
  no forked child outlives the run.
- rlimits, applied by `prlimit` inside the sandbox just before the command (soft = hard, so the
  command cannot raise them): CPU seconds per process, address space, number of processes, file
  size, open files.
- Wall clock: bwrap is started in its own process group; at the deadline the group is SIGKILLed
  (and with it, through --die-with-parent and the pid namespace, the whole sandbox).
- Output: stdout and stderr share one pipe that is read incrementally; only a bounded head and
  tail are kept (`BoundedOutput`), so gigabytes of output cost neither memory nor disk.

Not covered: disk usage inside the writable directories is bounded per file (RLIMIT_FSIZE) but
not in total; no seccomp filter (kernel attack surface is the host kernel's); CPU and memory are
per-process rlimits, not cgroup limits. The host's read-only root is visible except for the
hidden paths, so world-readable host files can be read (but not sent anywhere: no network).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

# Fresh sandbox uids are drawn from this range (root mode). It lies far above the uids of real
# accounts and of the usual subordinate-id ranges (100000-165535), so it collides with nothing.
_SANDBOX_UID_BASE = 2_000_000_000
_SANDBOX_UID_SPAN = 100_000_000
_NOBODY = 65534

# After the kill, how long we keep draining the output pipe before giving up on it.
_DRAIN_AFTER_KILL_S = 5.0
_READ_CHUNK_BYTES = 64 * 1024


class SandboxUnavailableError(RuntimeError):
    """bubblewrap (or prlimit/setpriv) is missing or cannot create namespaces on this host."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. All are enforced per sandbox run; see the module docstring for how."""

    wall_timeout_s: float = 600.0
    cpu_s: int = 600                        # RLIMIT_CPU, per process
    memory_bytes: int = 4 * 1024**3         # RLIMIT_AS, per process
    num_processes: int = 256                # RLIMIT_NPROC, for the sandbox's uid
    file_size_bytes: int = 256 * 1024**2    # RLIMIT_FSIZE
    num_open_files: int = 1024              # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 1024       # kept head + tail of stdout/stderr
    tmp_size_bytes: int = 256 * 1024**2     # size of the private /tmp tmpfs

    def __post_init__(self):
        for name in ("cpu_s", "memory_bytes", "num_processes", "file_size_bytes",
                     "num_open_files", "max_output_bytes", "tmp_size_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if isinstance(self.wall_timeout_s, bool) or not isinstance(self.wall_timeout_s,
                                                                     (int, float)) \
                or not self.wall_timeout_s > 0:
            raise ValueError(f"wall_timeout_s: must be a positive number of seconds, got "
                             f"{self.wall_timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None     # the command's exit status (128+N when killed by signal N inside);
                              # None when we killed it at the wall-clock deadline
    timed_out: bool
    output: str               # bounded head + tail of stdout/stderr (utf-8, errors replaced)
    num_output_bytes: int     # how many bytes the command wrote in total
    wall_s: float
    sandbox_uid: int          # the kernel uid the command ran as


class BoundedOutput:
    """Keeps the first `max_bytes // 2` and the last `max_bytes - max_bytes // 2` bytes written."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be positive, got {max_bytes}")
        self._head_limit = max_bytes // 2
        self._tail_limit = max_bytes - self._head_limit
        self._head = bytearray()
        self._tail = bytearray()
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self.num_bytes += len(data)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data[-self._tail_limit:]
            # Trim lazily (at twice the limit) so a stream of small writes stays linear.
            if len(self._tail) > 2 * self._tail_limit:
                del self._tail[:-self._tail_limit]

    def text(self) -> str:
        tail = bytes(self._tail[-self._tail_limit:])
        kept = len(self._head) + len(tail)
        middle = b""
        if self.num_bytes > kept:
            middle = f"\n[... {self.num_bytes - kept} bytes of output omitted ...]\n".encode()
        return (bytes(self._head) + middle + tail).decode("utf-8", errors="replace")


def check_available() -> None:
    """Raises SandboxUnavailableError with a fix when bwrap/prlimit/setpriv are missing or when
    bubblewrap cannot create its namespaces here (e.g. nested inside another sandbox)."""
    for tool, package in (("bwrap", "bubblewrap"), ("prlimit", "util-linux"),
                          ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            raise SandboxUnavailableError(
                f"`{tool}` is not on PATH; install Debian's `{package}` package (tools/bazel "
                f"installs bubblewrap) — the sandbox refuses to run untrusted code without it")
    if _root_behind_user_namespace():
        raise SandboxUnavailableError(
            "running as uid 0 inside a user namespace that maps it to the host's root (e.g. "
            "inside Bazel's linux-sandbox, started by root): the sandbox could neither switch to "
            "an unprivileged uid nor enforce RLIMIT_NPROC (root is exempt), so fork bombs would "
            "not be contained; run as real root or as a regular user (Bazel: tags = "
            "[\"no-sandbox\"])")
    probe = subprocess.run(
        _bwrap_argv(["true"], writable_dirs=(), hidden_paths=(), readonly_paths=(),
                    limits=SandboxLimits(), uid=_pick_uid(), cwd=pathlib.Path("/")),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30,
        check=False)
    if probe.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap cannot create its sandbox on this host (exit {probe.returncode}): "
            f"{probe.stdout.decode(errors='replace').strip()[:500]}; it needs unprivileged user "
            f"namespaces or root, and cannot run nested inside another sandbox that forbids "
            f"mounting /proc (run Bazel tests with tags = [\"no-sandbox\"])")


def is_real_root() -> bool:
    """Root of the initial user namespace (may switch to any uid). Root inside another tool's user
    namespace (Bazel's linux-sandbox maps only uid 0) cannot, and uses the user-namespace mode."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as uid_map:
            return [line.split() for line in uid_map] == [["0", "0", "4294967295"]]
    except OSError:
        return False


def _root_behind_user_namespace() -> bool:
    """Are we uid 0 in a user namespace that maps us to the parent's uid 0 (e.g. inside Bazel's
    linux-sandbox started by root)? Then the sandbox's kernel uid would be root, which the kernel
    exempts from RLIMIT_NPROC, and we cannot switch to another uid: refuse to run."""
    if os.geteuid() != 0 or is_real_root():
        return False
    try:
        with open("/proc/self/uid_map") as uid_map:
            return any(line.split()[:2] == ["0", "0"] for line in uid_map)
    except OSError:
        return False


def _pick_uid() -> int:
    if is_real_root():
        return _SANDBOX_UID_BASE + secrets.randbelow(_SANDBOX_UID_SPAN)
    return os.geteuid()


def _ancestor_dirs(path: pathlib.Path, hidden_paths: Sequence[pathlib.Path]) -> list[str]:
    """Ancestors of `path` (top-down) that lie strictly inside a hidden (tmpfs) path: they do not
    exist on the tmpfs, and bubblewrap would create them 0700, which the sandbox uid could not
    traverse; we create them 0755 ourselves."""
    dirs = []
    for ancestor in reversed(path.parents):
        if any(hidden in ancestor.parents for hidden in hidden_paths):
            dirs.append(str(ancestor))
    return dirs


def _bwrap_argv(argv: Sequence[str], *, writable_dirs: Sequence[pathlib.Path],
                hidden_paths: Sequence[pathlib.Path], readonly_paths: Sequence[pathlib.Path],
                limits: SandboxLimits, uid: int, cwd: pathlib.Path) -> list[str]:
    as_root = is_real_root()
    # /tmp and /run are always replaced: they hold the host's unix sockets (dbus, X11, agents),
    # which a network namespace does not cut off (only abstract sockets are per-namespace).
    hidden = [pathlib.Path("/tmp")]
    for path in sorted([pathlib.Path("/run"), *hidden_paths]):
        if not path.is_dir() or path.is_symlink():
            continue
        # A path below one already hidden is hidden with it (and mounting a tmpfs there would
        # make bubblewrap create its mount point on the outer tmpfs with a restrictive mode).
        if not any(path == h or h in path.parents for h in hidden):
            hidden.append(path)
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if not as_root:
        args += ["--unshare-user", "--uid", str(_NOBODY), "--gid", str(_NOBODY)]
    args += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
             # 1777 like a real /tmp: bwrap's default 0755 root-owned tmpfs is not writable by
             # the sandbox uid in root mode.
             "--perms", "1777", "--size", str(limits.tmp_size_bytes), "--tmpfs", "/tmp"]
    for path in hidden[1:]:
        args += ["--perms", "0755", "--size", str(1024 * 1024), "--tmpfs", str(path)]
    created: set[str] = set()
    for path, flag in [(p, "--ro-bind") for p in readonly_paths] + \
                      [(p, "--bind") for p in writable_dirs]:
        for ancestor in _ancestor_dirs(path, hidden):
            if ancestor not in created:
                created.add(ancestor)
                args += ["--perms", "0755", "--dir", ancestor]
        args += [flag, str(path), str(path)]
    args += ["--chdir", str(cwd), "--",
             "prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
             f"--as={limits.memory_bytes}", f"--nproc={limits.num_processes}",
             f"--fsize={limits.file_size_bytes}", f"--nofile={limits.num_open_files}", "--"]
    if as_root:
        args += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--no-new-privs", "--"]
    return args + list(argv)


def _chown_tree(root: pathlib.Path, uid: int) -> None:
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def run_sandboxed(argv: Sequence[str], *, writable_dirs: Sequence[pathlib.Path],
                  limits: SandboxLimits, cwd: pathlib.Path,
                  hidden_paths: Sequence[pathlib.Path] = (),
                  readonly_paths: Sequence[pathlib.Path] = (),
                  env: Mapping[str, str] | None = None) -> SandboxResult:
    """Runs `argv` in a fresh sandbox and returns its exit code and bounded output. Never raises
    for anything the command does; raises SandboxUnavailableError when bwrap cannot start and
    ValueError for bad arguments.

    `writable_dirs` must be absolute, existing directories; as root they are chowned to the run's
    fresh uid (the caller throws them away afterwards). `readonly_paths` are bound back read-only
    when they lie under a hidden path (e.g. the Python interpreter under /root). `env` replaces the
    environment (default: a minimal PATH/HOME/LANG).
    """
    for path in list(writable_dirs) + list(readonly_paths) + list(hidden_paths) + [cwd]:
        if not path.is_absolute():
            raise ValueError(f"sandbox paths must be absolute, got {str(path)!r}")
    for path in writable_dirs:
        if not path.is_dir():
            raise ValueError(f"writable_dirs: {str(path)!r} is not an existing directory")
    if not argv:
        raise ValueError("argv: must name a command")
    if shutil.which("bwrap") is None or _root_behind_user_namespace():
        check_available()  # raises with the fix
    uid = _pick_uid()
    if is_real_root():
        for path in writable_dirs:
            _chown_tree(path, uid)
    if env is None:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    command = _bwrap_argv(argv, writable_dirs=writable_dirs, hidden_paths=hidden_paths,
                          readonly_paths=readonly_paths, limits=limits, uid=uid, cwd=cwd)
    output = BoundedOutput(limits.max_output_bytes)
    status_read, status_write = os.pipe()
    command = command[:1] + ["--json-status-fd", str(status_write)] + command[1:]
    start = time.monotonic()
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, env=dict(env),
                                   start_new_session=True, pass_fds=(status_write,))
    except OSError as error:
        os.close(status_read)
        raise SandboxUnavailableError(f"cannot start bwrap: {error}") from error
    finally:
        os.close(status_write)
    deadline = start + limits.wall_timeout_s
    timed_out = False
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    eof = False
    status = ""
    try:
        while not eof:
            now = time.monotonic()
            if now >= deadline:
                if not timed_out:
                    timed_out = True
                    _kill_group(process)
                    deadline = now + _DRAIN_AFTER_KILL_S
                else:
                    break  # killed and still not closed: give up on the pipe
            for _, _ in poller.poll(max(1, int((deadline - now) * 1000))):
                try:
                    chunk = os.read(fd, _READ_CHUNK_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:
                    eof = True
                    break
                output.write(chunk)
        if not timed_out:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            _kill_group(process)
        process.wait()
    finally:
        if process.poll() is None:
            _kill_group(process)
            process.wait()
        process.stdout.close()
        status = _read_status(status_read)
    wall_s = time.monotonic() - start
    exit_code = None if timed_out else process.returncode
    if exit_code is not None and exit_code < 0:
        exit_code = 128 - exit_code  # bwrap itself killed by a signal from outside
    if not timed_out and "child-pid" not in status:
        # bwrap reports the child's pid on the status fd once the sandbox is set up; without it
        # the sandbox itself failed (missing namespace support, bad mount), not the command.
        raise SandboxUnavailableError(f"bwrap could not set up the sandbox (exit {exit_code}): "
                                      f"{output.text().strip()[:500]}")
    return SandboxResult(exit_code=exit_code, timed_out=timed_out, output=output.text(),
                         num_output_bytes=output.num_bytes, wall_s=wall_s, sandbox_uid=uid)


def _read_status(fd: int) -> str:
    """Reads bwrap's JSON status lines (a few hundred bytes at most) and closes the fd."""
    chunks = []
    try:
        os.set_blocking(fd, False)
        while sum(map(len, chunks)) < 65536:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    # bwrap leads its own process group (start_new_session); killing the group kills bwrap, and
    # --die-with-parent plus the pid namespace take every sandboxed process with it.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
