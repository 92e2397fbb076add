"""Running an untrusted command under bubblewrap with rlimits, a wall-clock kill and bounded output.

`run_sandboxed(argv, writable_dirs=..., limits=...)` is the one entry point; the scoring pipeline
uses it to run a repository's tests on a model-written patch. Treat the command as hostile.

What the sandbox enforces (each line is a bubblewrap flag or an rlimit, set up in `_bwrap_argv`):
- No network: `--unshare-net` (only a down loopback device exists inside).
- Filesystem, deny by default: bwrap's root is an empty tmpfs holding only the host's /usr (and
  the /bin, /lib... links into it), the dynamic loader's files from /etc, generated
  /etc/passwd, group, hosts and nsswitch.conf (no host accounts or names), a private /dev and
  /proc, a private size-capped /tmp, and what the caller adds: the interpreter's prefixes
  read-only, and the mounts the test runner needs (runner.py: the patched worktree read-only, a
  size-capped tmpfs it is copied into, the runner's own files). The executor's work root, mirror
  cache, task sets, task repositories, home directories and every other host path simply do not
  exist inside. `hidden_paths` additionally cover with an empty tmpfs anything that lies inside
  a bound tree (e.g. a work root under an interpreter prefix).
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
- Extra channels: `OutputChannel` pipes carry the test runner's records and report out of the
  sandbox; stdin can carry the runner's settings in (so they appear in no argv, file or
  environment variable).

Not covered: disk usage inside `writable_dirs` is bounded per file (RLIMIT_FSIZE) but not in
total (the scoring pipeline binds none: its worktree is a size-capped tmpfs); no seccomp filter
(kernel attack surface is the host kernel's); CPU and memory are per-process rlimits, not cgroup
limits. What is bound is readable: /usr and the interpreter's prefixes (its site-packages
included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import secrets
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

# Fresh sandbox uids are drawn from this range (root mode). It lies far above the uids of real
# accounts and of the usual subordinate-id ranges (100000-165535), so it collides with nothing.
_SANDBOX_UID_BASE = 2_000_000_000
_SANDBOX_UID_SPAN = 100_000_000
_NOBODY = 65534

# After the kill, how long we keep draining the output pipe before giving up on it.
_DRAIN_AFTER_KILL_S = 5.0
_READ_CHUNK_BYTES = 64 * 1024


# Added to the niceness of every sandboxed process (nice(1) in the sandbox's command chain).
SANDBOX_NICENESS = 10


class SandboxUnavailableError(RuntimeError):
    """bubblewrap (or prlimit/setpriv) is missing or cannot create namespaces on this host."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. All are enforced per sandbox run; see the module docstring for how."""

    wall_timeout_s: float = 600.0
    cpu_s: int = 600  # RLIMIT_CPU, per process
    memory_bytes: int = 4 * 1024**3  # RLIMIT_AS, per process
    num_processes: int = 256  # RLIMIT_NPROC, for the sandbox's uid
    file_size_bytes: int = 256 * 1024**2  # RLIMIT_FSIZE
    num_open_files: int = 1024  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 1024  # kept head + tail of stdout/stderr
    tmp_size_bytes: int = 256 * 1024**2  # size of the private /tmp tmpfs

    def __post_init__(self):
        for name in (
            "cpu_s",
            "memory_bytes",
            "num_processes",
            "file_size_bytes",
            "num_open_files",
            "max_output_bytes",
            "tmp_size_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if (
            isinstance(self.wall_timeout_s, bool)
            or not isinstance(self.wall_timeout_s, (int, float))
            or not self.wall_timeout_s > 0
        ):
            raise ValueError(
                f"wall_timeout_s: must be a positive number of seconds, got {self.wall_timeout_s!r}"
            )


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # the command's exit status (128+N when killed by signal N inside);
    # None when we killed it at the wall-clock deadline
    timed_out: bool
    output: str  # bounded head + tail of stdout/stderr (utf-8, errors replaced)
    num_output_bytes: int  # how many bytes the command wrote in total
    wall_s: float
    sandbox_uid: int  # the kernel uid the command ran as


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
            self._tail += data[-self._tail_limit :]
            # Trim lazily (at twice the limit) so a stream of small writes stays linear.
            if len(self._tail) > 2 * self._tail_limit:
                del self._tail[: -self._tail_limit]

    def text(self) -> str:
        tail = bytes(self._tail[-self._tail_limit :])
        kept = len(self._head) + len(tail)
        middle = b""
        if self.num_bytes > kept:
            middle = f"\n[... {self.num_bytes - kept} bytes of output omitted ...]\n".encode()
        return (bytes(self._head) + middle + tail).decode("utf-8", errors="replace")


def check_available() -> None:
    """Raises SandboxUnavailableError with a fix when bwrap/prlimit/setpriv are missing or when
    bubblewrap cannot create its namespaces here (e.g. nested inside another sandbox)."""
    for tool, package in (
        ("bwrap", "bubblewrap"),
        ("prlimit", "util-linux"),
        ("setpriv", "util-linux"),
    ):
        if shutil.which(tool) is None:
            raise SandboxUnavailableError(
                f"`{tool}` is not on PATH; install Debian's `{package}` package (tools/bazel "
                f"installs bubblewrap) — the sandbox refuses to run untrusted code without it"
            )
    if _root_behind_user_namespace():
        raise SandboxUnavailableError(
            "running as uid 0 inside a user namespace that maps it to the host's root (e.g. "
            "inside Bazel's linux-sandbox, started by root): the sandbox could neither switch to "
            "an unprivileged uid nor enforce RLIMIT_NPROC (root is exempt), so fork bombs would "
            "not be contained; run as real root or as a regular user (Bazel: tags = "
            '["no-sandbox"])'
        )
    probe = subprocess.run(
        _bwrap_argv(
            ["true"],
            writable_dirs=(),
            hidden_paths=(),
            readonly_paths=(),
            limits=SandboxLimits(),
            uid=_pick_uid(),
            cwd=pathlib.Path("/"),
        ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap cannot create its sandbox on this host (exit {probe.returncode}): "
            f"{probe.stdout.decode(errors='replace').strip()[:500]}; it needs unprivileged user "
            f"namespaces or root, and cannot run nested inside another sandbox that forbids "
            f'mounting /proc (run Bazel tests with tags = ["no-sandbox"])'
        )


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


# The host's system view, read-only: programs and libraries. Nothing else of the host exists in
# the sandbox unless a caller binds it (deny by default: bwrap's root is an empty tmpfs).
_SYSTEM_DIRS = ("/usr",)
# Merged-/usr systems have these as symlinks into /usr; older ones as directories.
_SYSTEM_LINKS_OR_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What the dynamic loader, locale and time functions read from /etc; no host accounts, hostnames,
# credentials or configuration.
# Top-level entries of an image's root that the sandbox makes itself (or leaves out: /sys).
_NOT_FROM_IMAGE = frozenset({"dev", "proc", "tmp", "sys", "run"})
_SYSTEM_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
)


@dataclasses.dataclass(frozen=True)
class Mount:
    """One extra mount of the sandbox's filesystem view, at `dest` inside the sandbox.

    kind "ro" / "rw": bind the host path `source` read-only / writable; "tmpfs": an empty tmpfs of
    `size_bytes` with mode `perms` (octal string); "dir": a directory of mode `perms` made inside
    an earlier mount (a tmpfs), e.g. the folder of a file bound read-only into it."""

    kind: str
    dest: pathlib.Path
    source: pathlib.Path | None = None
    size_bytes: int | None = None
    perms: str = "0755"

    def __post_init__(self):
        if self.kind not in ("ro", "rw", "tmpfs", "dir"):
            raise ValueError(f"Mount.kind: must be ro, rw, tmpfs or dir, got {self.kind!r}")
        if not self.dest.is_absolute() or (
            self.source is not None and not self.source.is_absolute()
        ):
            raise ValueError(f"sandbox paths must be absolute, got {self}")
        if (self.kind in ("tmpfs", "dir")) != (self.source is None):
            raise ValueError(f"Mount: a tmpfs or dir has no source, a bind needs one, got {self}")


class OutputChannel:
    """A pipe out of the sandbox: the command inherits the write end as fd `child_fd` (the same
    number inside), and run_sandboxed hands every chunk read from it to `sink` as it arrives.
    The sink must bound its own memory."""

    def __init__(self, sink: Callable[[bytes], None]):
        self.read_fd, self.child_fd = os.pipe()
        os.set_inheritable(self.read_fd, False)
        self.sink = sink

    def close(self) -> None:
        for fd in (self.read_fd, self.child_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self.child_fd = -1


def _etc_files(uid: int) -> dict[str, bytes]:
    """Generated /etc files: one account for the sandbox's uid, loopback names only."""
    return {
        "/etc/passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:/tmp:"
        f"/bin/sh\n".encode(),
        "/etc/group": f"root:x:0:\nsandbox:x:{uid}:\n".encode(),
        "/etc/hosts": b"127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n",
        "/etc/nsswitch.conf": b"passwd: files\ngroup: files\nhosts: files\n",
    }


def _within(path: pathlib.Path, roots: Sequence[pathlib.Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _bind_host_system(args: list[str], etc_fds: Mapping[str, int]) -> list[pathlib.Path]:
    """The host's /usr (and the /bin, /lib... links), the loader's /etc files and the generated
    /etc files; returns the trees bound."""
    bound: list[pathlib.Path] = []
    for path in _SYSTEM_DIRS:
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
            bound.append(pathlib.Path(path))
    for path in _SYSTEM_LINKS_OR_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            bound.append(pathlib.Path(path))
    # bwrap makes missing mount points' parents 0700, which the sandbox uid could not traverse.
    args += ["--perms", "0755", "--dir", "/etc"]
    for path in _SYSTEM_ETC:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path, fd in etc_fds.items():
        args += ["--perms", "0644", "--ro-bind-data", str(fd), path]
    return bound


def _bind_image_root(
    args: list[str], root: pathlib.Path, etc_fds: Mapping[str, int]
) -> list[pathlib.Path]:
    """An unpacked image's root filesystem, read-only, entry by entry on bwrap's tmpfs root (so
    the caller's mount points outside it can still be made); /dev, /proc, /tmp, /sys and /run
    are not taken from the image. The generated /etc files replace the image's own where it has
    them (a file cannot be added to a read-only /etc). Returns the trees bound."""
    bound: list[pathlib.Path] = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        dest = "/" + entry.name
        if entry.name in _NOT_FROM_IMAGE:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry.path), dest]
        elif entry.is_dir() or entry.is_file():
            args += ["--ro-bind", entry.path, dest]
            bound.append(pathlib.Path(dest))
    for path, fd in etc_fds.items():
        inside = root / path.lstrip("/")
        if os.path.isfile(inside) and not os.path.islink(inside):
            args += ["--perms", "0644", "--ro-bind-data", str(fd), path]
    return bound


def _bwrap_argv(
    argv: Sequence[str],
    *,
    writable_dirs: Sequence[pathlib.Path],
    hidden_paths: Sequence[pathlib.Path],
    readonly_paths: Sequence[pathlib.Path],
    limits: SandboxLimits,
    uid: int,
    cwd: pathlib.Path,
    mounts: Sequence[Mount] = (),
    etc_fds: Mapping[str, int] | None = None,
    root: pathlib.Path | None = None,
) -> list[str]:
    as_root = is_real_root()
    args = [
        "bwrap",
        "--die-with-parent",
        "--new-session",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
    ]
    if not as_root:
        args += ["--unshare-user", "--uid", str(_NOBODY), "--gid", str(_NOBODY)]
    if root is not None:
        bound = _bind_image_root(args, root, etc_fds or {})
    else:
        bound = _bind_host_system(args, etc_fds or {})
    args += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        # 1777 like a real /tmp: bwrap's default 0755 root-owned tmpfs is not writable by
        # the sandbox uid in root mode.
        "--perms",
        "1777",
        "--size",
        str(limits.tmp_size_bytes),
        "--tmpfs",
        "/tmp",
    ]
    every = (
        [Mount("ro", p, p) for p in readonly_paths]
        + list(mounts)
        + [Mount("rw", p, p) for p in writable_dirs]
    )
    # Parents before children: a mount at /a/b must come after the one at /a.
    every.sort(key=lambda mount: len(mount.dest.parts))
    created: set[pathlib.Path] = set()
    for mount in every:
        for ancestor in reversed(mount.dest.parents):
            # Mount points outside every bound tree are made on bwrap's root tmpfs, 0755 so that
            # the sandbox uid can traverse them (bwrap would make them 0700 in some versions).
            if ancestor == pathlib.Path("/") or ancestor in created or _within(ancestor, bound):
                continue
            created.add(ancestor)
            args += ["--perms", "0755", "--dir", str(ancestor)]
        if mount.kind == "dir":
            args += ["--perms", mount.perms, "--dir", str(mount.dest)]
        elif mount.kind == "tmpfs":
            args += [
                "--perms",
                mount.perms,
                "--size",
                str(mount.size_bytes or limits.tmp_size_bytes),
                "--tmpfs",
                str(mount.dest),
            ]
        else:
            args += [
                "--ro-bind" if mount.kind == "ro" else "--bind",
                str(mount.source),
                str(mount.dest),
            ]
        bound.append(mount.dest)
        created.add(mount.dest)
    # Paths that must stay invisible although they lie inside something bound (the executor's
    # work root inside an interpreter prefix, say) are covered with an empty tmpfs.
    for path in sorted(hidden_paths):
        if (
            _within(path, bound)
            and path.is_dir()
            and not path.is_symlink()
            and not any(_within(mount.dest, [path]) for mount in every)
        ):
            args += ["--perms", "0755", "--size", str(1024 * 1024), "--tmpfs", str(path)]
    args += [
        "--chdir",
        str(cwd),
        "--",
        "prlimit",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_bytes}",
        f"--nproc={limits.num_processes}",
        f"--fsize={limits.file_size_bytes}",
        f"--nofile={limits.num_open_files}",
        "--",
    ]
    # The tests run niced: on a busy host the executor's own threads (its HTTP server answering
    # /healthz, its host-side checks) are scheduled first. Only where the system view has `nice`.
    system_root = root if root is not None else pathlib.Path("/")
    if any((system_root / p).is_file() for p in ("usr/bin/nice", "bin/nice")):
        args += ["nice", "-n", str(SANDBOX_NICENESS)]
    if as_root:
        args += [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            "--",
        ]
    return args + list(argv)


def _chown_tree(root: pathlib.Path, uid: int) -> None:
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _data_fd(data: bytes) -> int:
    """A pipe's read end already holding `data` (small: it must fit the pipe buffer)."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)
    finally:
        os.close(write_fd)
    return read_fd


def run_sandboxed(
    argv: Sequence[str],
    *,
    writable_dirs: Sequence[pathlib.Path],
    limits: SandboxLimits,
    cwd: pathlib.Path,
    hidden_paths: Sequence[pathlib.Path] = (),
    readonly_paths: Sequence[pathlib.Path] = (),
    mounts: Sequence[Mount] = (),
    env: Mapping[str, str] | None = None,
    stdin_data: bytes | None = None,
    channels: Sequence[OutputChannel] = (),
    root: pathlib.Path | None = None,
) -> SandboxResult:
    """Runs `argv` in a fresh sandbox and returns its exit code and bounded output. Never raises
    for anything the command does; raises SandboxUnavailableError when bwrap cannot start and
    ValueError for bad arguments.

    The filesystem view is deny-by-default: the host's /usr (with the /bin, /lib... links), the
    loader's files from /etc, generated /etc/passwd, group, hosts and nsswitch.conf, a private
    /dev, /proc and size-capped /tmp, and only what the caller adds: `readonly_paths` (bound at
    their own path, e.g. the interpreter), `mounts`, and `writable_dirs` (absolute existing
    directories bound writable at their own path; as root they are chowned to the run's fresh
    uid, the caller throws them away afterwards). `hidden_paths` are covered with an empty tmpfs
    when they lie inside something bound. `env` replaces the environment (default: a minimal
    PATH/HOME/LANG). `stdin_data` is what the command reads on stdin (default: /dev/null).
    `channels` are extra pipes out of the sandbox, read concurrently with the output; this
    function closes them. `root`: an unpacked image's root filesystem (images.py) replaces the
    host's /usr and /etc files as the read-only system view; its top-level entries are bound
    read-only, except /dev, /proc, /tmp, /sys and /run, and `prlimit` (and `setpriv`, as root)
    must be on the image's PATH (util-linux).
    """
    try:
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
        if root is not None and not root.is_dir():
            raise ValueError(f"root: {str(root)!r} is not an existing directory")
        return _run(
            argv,
            writable_dirs=writable_dirs,
            limits=limits,
            cwd=cwd,
            hidden_paths=hidden_paths,
            readonly_paths=readonly_paths,
            mounts=mounts,
            env=env,
            stdin_data=stdin_data,
            channels=channels,
            root=root,
        )
    finally:
        for channel in channels:
            channel.close()


def _run(
    argv,
    *,
    writable_dirs,
    limits,
    cwd,
    hidden_paths,
    readonly_paths,
    mounts,
    env,
    stdin_data,
    channels,
    root,
) -> SandboxResult:
    uid = _pick_uid()
    if is_real_root():
        for path in writable_dirs:
            _chown_tree(path, uid)
    if env is None:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    etc_fds = {
        path: _data_fd(data)
        for path, data in _etc_files(uid if is_real_root() else _NOBODY).items()
    }
    stdin_read = None
    if stdin_data is not None:
        stdin_read, stdin_write = os.pipe()
        writer = threading.Thread(
            target=_feed, args=(stdin_write, stdin_data), daemon=True, name="sandbox-stdin"
        )
    command = _bwrap_argv(
        argv,
        writable_dirs=writable_dirs,
        hidden_paths=hidden_paths,
        readonly_paths=readonly_paths,
        limits=limits,
        uid=uid,
        cwd=cwd,
        mounts=mounts,
        etc_fds=etc_fds,
        root=root,
    )
    output = BoundedOutput(limits.max_output_bytes)
    status_read, status_write = os.pipe()
    command = command[:1] + ["--json-status-fd", str(status_write)] + command[1:]
    child_fds = (status_write, *etc_fds.values(), *(c.child_fd for c in channels))
    start = time.monotonic()
    try:
        process = subprocess.Popen(
            command,
            stdin=stdin_read if stdin_read is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            pass_fds=child_fds,
        )
    except OSError as error:
        os.close(status_read)
        if stdin_read is not None:
            os.close(stdin_write)
        raise SandboxUnavailableError(f"cannot start bwrap: {error}") from error
    finally:
        for fd in (status_write, *etc_fds.values(), *(c.child_fd for c in channels)):
            os.close(fd)
        for channel in channels:
            channel.child_fd = -1
        if stdin_read is not None:
            os.close(stdin_read)
    if stdin_data is not None:
        writer.start()
    deadline = start + limits.wall_timeout_s
    timed_out = False
    sinks = {process.stdout.fileno(): output.write}
    sinks.update({channel.read_fd: channel.sink for channel in channels})
    poller = select.poll()
    for fd in sinks:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    open_fds = set(sinks)
    status = ""
    try:
        while open_fds:
            now = time.monotonic()
            if now >= deadline:
                if not timed_out:
                    timed_out = True
                    _kill_group(process)
                    deadline = now + _DRAIN_AFTER_KILL_S
                else:
                    break  # killed and still not closed: give up on the pipes
            for fd, _ in poller.poll(max(1, int((deadline - now) * 1000))):
                try:
                    chunk = os.read(fd, _READ_CHUNK_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    continue
                sinks[fd](chunk)
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
        raise SandboxUnavailableError(
            f"bwrap could not set up the sandbox (exit {exit_code}): {output.text().strip()[:500]}"
        )
    return SandboxResult(
        exit_code=exit_code,
        timed_out=timed_out,
        output=output.text(),
        num_output_bytes=output.num_bytes,
        wall_s=wall_s,
        sandbox_uid=uid,
    )


def _feed(fd: int, data: bytes) -> None:
    """Writes `data` to `fd` and closes it; a command that never reads stdin just loses it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass
    finally:
        os.close(fd)


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
