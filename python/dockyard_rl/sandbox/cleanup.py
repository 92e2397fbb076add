"""Removing directory trees that untrusted code wrote: `remove_tree`, `empty_trash`,
`remove_stale_task_dirs`. None of them raises; each reports what it could not remove.

    error = remove_tree(task_dir, trash_dir=trash_path(work_root))  # None = gone
    if error:
        logger.warning("%s", error)  # the task dir was moved to the trash, or the message says not

Why this exists: a task directory holds whatever the tests under test left behind, and a patch must
not be able to turn its own verdict into an infrastructure error or stop the executor from starting
again (the attack catalogue's "own verdict an infrastructure error" class). `shutil.rmtree` recurses
in Python (Python 3.11), so a directory nested a few thousand levels deep raises RecursionError; its
`onerror` hook cannot repair a directory it could not open. This module walks the tree iteratively
instead.

How (one file descriptor held at a time, so neither depth nor PATH_MAX nor RLIMIT_NOFILE
limits it):
- Every operation is relative to an open directory (`dir_fd=`), never a long path. A directory
  is opened with O_NOFOLLOW|O_DIRECTORY, so a symlink is never entered: removing a link never
  touches its target, a link to "/" is just unlinked. Going back up uses `..` of the current
  directory and checks that it is the same directory (device, inode) we came down from; if a
  directory was moved or removed under us, the walk restarts from the top (bounded), so a
  concurrent rename can never lead the walk outside the tree.
- Directories that lost their permission bits (mode 000, 0500, ...) get u+rwx back: with
  fchmod on the open directory, or, when it cannot even be opened for reading, through an O_PATH
  descriptor (chmod of /proc/self/fd/N, which never follows a symlink). This works for trees we
  own, or as root for any owner (the executor is root over the sandbox's uid).
- Mount points inside the tree are not crossed (the sandbox cannot mount on the host, but the
  tree could be somebody's bind mount): they are reported and the removal fails.
- Names are handled as the kernel gives them (non-UTF-8 bytes survive Python's surrogate
  escapes); entries that vanish concurrently count as removed.

GNU `rm -rf` would also handle depth and symlinks (it uses fts with fd-relative operations), but
as a non-root user it cannot remove a tree with a mode-000 directory (it does not chmod), and it
reports failures only as text; doing the walk here keeps the permission repair, the mount-point
and identity checks, and the error reporting in one place, without a subprocess per task.

When removal fails anyway (a directory owned by someone we are not root over, a mount point),
`remove_tree(..., trash_dir=...)` renames what is left into the trash directory (same file
system: one atomic rename), so the caller's path is free again; `empty_trash` retries later.
The executor's trash is `<work_root>/trash` (`trash_path`).

Not covered: files with the immutable or append-only attribute (chattr +i/+a; setting them needs
CAP_LINUX_IMMUTABLE, which the sandbox never has) and trees on another file system than the
trash (the rename fails with EXDEV and the message says so).
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import secrets
import stat

__all__ = ["TRASH_DIR_NAME", "empty_trash", "remove_stale_task_dirs", "remove_tree", "trash_path"]

logger = logging.getLogger(__name__)

TASKS_DIR_NAME = "tasks"  # <work_root>/tasks/task-*: one directory per task being scored
TASK_DIR_PREFIX = "task-"
TRASH_DIR_NAME = "trash"  # <work_root>/trash: leftovers that could not be removed

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_RESTARTS = 16  # walks restarted from the top after a directory moved under us
_MAX_RESCANS = 1000  # directories listed again because an entry appeared after the listing
_MAX_ERRORS_KEPT = 5  # messages kept per removal (the count of all of them is reported)


def trash_path(work_root: pathlib.Path) -> pathlib.Path:
    """The executor's trash directory: on the same file system as its task directories."""
    return pathlib.Path(work_root).expanduser() / TRASH_DIR_NAME


class _Restart(Exception):
    """The tree changed under the walk (a directory moved or vanished): start again from the top."""


class _Errors:
    """The first few error messages of one removal, and how many there were."""

    def __init__(self):
        self.messages: list[str] = []
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < _MAX_ERRORS_KEPT:
            self.messages.append(message)

    def summary(self) -> str:
        more = self.count - len(self.messages)
        return "; ".join(self.messages) + (f" (and {more} more)" if more > 0 else "")


class _Frame:
    """One directory on the walk's path: its name in its parent, its identity, and the names of
    the subdirectories still to empty (None until listed)."""

    __slots__ = ("name", "ident", "pending", "failed")

    def __init__(self, name: str, ident: tuple[int, int]):
        self.name = name
        self.ident = ident
        self.pending: list[str] | None = None
        self.failed = False  # something below could not be removed: do not try to rmdir this


def _describe(name: str) -> str:
    return repr(os.fsencode(name))[1:]  # bytes repr: readable for any name, UTF-8 or not


def _make_usable(fd: int) -> None:
    """u+rwx on an open directory, so that it can be listed and its entries removed."""
    mode = os.fstat(fd).st_mode
    if mode & stat.S_IRWXU != stat.S_IRWXU:
        try:
            os.fchmod(fd, stat.S_IMODE(mode) | stat.S_IRWXU)
        except PermissionError:
            pass  # not ours and we are not root: the removals below report what is left


def _open_dir(parent_fd: int, name: str) -> int:
    """Opens directory `name` of `parent_fd` without following a symlink, repairing its mode when
    it cannot be read. Raises OSError (NotADirectoryError / ELOOP for a non-directory)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        # Not readable (mode 000, 0300, ...): an O_PATH descriptor needs no permission on the
        # directory itself, and chmod through /proc/self/fd acts on exactly that inode.
        path_fd = os.open(name, _PATH_FLAGS, dir_fd=parent_fd)
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", stat.S_IRWXU)
        finally:
            os.close(path_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        _make_usable(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink(dir_fd: int, name: str, errors: _Errors) -> str:
    """Unlinks a non-directory. Returns "gone", "dir" (it is a directory now) or "failed"."""
    for attempt in range(2):
        try:
            os.unlink(name, dir_fd=dir_fd)
            return "gone"
        except FileNotFoundError:
            return "gone"
        except IsADirectoryError:
            return "dir"  # replaced by a directory since it was listed
        except PermissionError as error:
            if attempt == 0:
                _make_usable(dir_fd)  # the directory may have lost u+wx since we opened it
                continue
            errors.add(f"{_describe(name)}: {error.strerror}")
        except OSError as error:
            errors.add(f"{_describe(name)}: {error.strerror}")
            break
    return "failed"


def _list_and_unlink(fd: int, frame: _Frame, errors: _Errors) -> None:
    """Lists the directory `fd`: removes every non-directory, queues the subdirectories."""
    frame.pending = []
    try:
        # Listed in full before anything is removed: no reliance on how getdents behaves while
        # the directory changes.
        with os.scandir(fd) as listing:
            entries = list(listing)
    except OSError as error:
        errors.add(f"{_describe(frame.name)}: cannot list: {error.strerror}")
        frame.failed = True
        return
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)  # d_type, or an lstat when unknown
        except FileNotFoundError:
            continue
        except OSError:
            is_dir = False  # let unlink tell
        if is_dir:
            frame.pending.append(entry.name)
            continue
        outcome = _unlink(fd, entry.name, errors)
        if outcome == "dir":
            frame.pending.append(entry.name)
        elif outcome == "failed":
            frame.failed = True


def _remove_directory(
    top_parent_fd: int, top_name: str, top_stat: os.stat_result, errors: _Errors
) -> bool:
    """Empties and removes directory `top_name` of `top_parent_fd`. Returns whether it is gone;
    raises _Restart when the tree moved under the walk."""
    root_dev = top_stat.st_dev
    try:
        cur = _open_dir(top_parent_fd, top_name)
    except FileNotFoundError:
        return True
    except (NotADirectoryError, OSError) as error:
        if isinstance(error, NotADirectoryError) or error.errno == errno.ELOOP:
            raise _Restart() from None  # replaced by a non-directory since the lstat
        errors.add(f"{_describe(top_name)}: cannot open: {error.strerror}")
        return False
    try:
        opened = os.fstat(cur)
        if (opened.st_dev, opened.st_ino) != (top_stat.st_dev, top_stat.st_ino):
            raise _Restart()
        stack = [_Frame(top_name, (opened.st_dev, opened.st_ino))]
        num_rescans = 0
        while True:
            frame = stack[-1]
            if frame.pending is None:
                _list_and_unlink(cur, frame, errors)
            if frame.pending:
                child = frame.pending.pop()
                try:
                    child_fd = _open_dir(cur, child)
                except FileNotFoundError:
                    continue
                except OSError as error:
                    if isinstance(error, NotADirectoryError) or error.errno == errno.ELOOP:
                        # Replaced by a file or a symlink since it was listed.
                        if _unlink(cur, child, errors) == "failed":
                            frame.failed = True
                        continue
                    errors.add(f"{_describe(child)}: cannot open: {error.strerror}")
                    frame.failed = True
                    continue
                child_stat = os.fstat(child_fd)
                if child_stat.st_dev != root_dev:
                    os.close(child_fd)
                    errors.add(f"{_describe(child)}: a mount point; not crossed")
                    frame.failed = True
                    continue
                stack.append(_Frame(child, (child_stat.st_dev, child_stat.st_ino)))
                os.close(cur)
                cur = child_fd
                continue

            # `frame` is empty (or holds what could not be removed): leave it.
            stack.pop()
            if not stack:
                os.close(cur)
                cur = -1
                if frame.failed:
                    return False
                try:
                    os.rmdir(top_name, dir_fd=top_parent_fd)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
                        raise _Restart() from None  # something appeared after the listing
                    errors.add(f"{_describe(top_name)}: {error.strerror}")
                    return False
                return True
            try:
                parent_fd = os.open("..", _DIR_FLAGS, dir_fd=cur)
            except FileNotFoundError:
                raise _Restart() from None  # `cur` itself was removed under us
            parent_stat = os.fstat(parent_fd)
            if (parent_stat.st_dev, parent_stat.st_ino) != stack[-1].ident:
                os.close(parent_fd)
                raise _Restart()  # `cur` was moved elsewhere: never continue from there
            os.close(cur)
            cur = parent_fd
            if frame.failed:
                stack[-1].failed = True
                continue
            try:
                os.rmdir(frame.name, dir_fd=cur)
            except FileNotFoundError:
                pass
            except OSError as error:
                if error.errno in (errno.ENOTEMPTY, errno.EEXIST) and num_rescans < _MAX_RESCANS:
                    num_rescans += 1
                    stack[-1].pending = None  # list the parent again: it finds the child again
                else:
                    errors.add(f"{_describe(frame.name)}: {error.strerror}")
                    stack[-1].failed = True
    finally:
        if cur >= 0:
            os.close(cur)


def _remove_entry(parent_fd: int, name: str, errors: _Errors) -> bool:
    """Removes entry `name` of directory `parent_fd`, whatever it is. Returns whether it is gone."""
    for _ in range(_MAX_RESTARTS):
        try:
            entry_stat = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        if not stat.S_ISDIR(entry_stat.st_mode):
            outcome = _unlink(parent_fd, name, errors)
            if outcome == "dir":
                continue  # replaced by a directory: look again
            return outcome == "gone"
        try:
            return _remove_directory(parent_fd, name, entry_stat, errors)
        except _Restart:
            continue
    errors.add(f"the tree kept changing; gave up after {_MAX_RESTARTS} restarts")
    return False


def _remove(path: pathlib.Path) -> str | None:
    name = path.name
    if name in ("", ".", ".."):
        return f"refusing to remove {str(path)!r}: not a plain directory entry"
    try:
        parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # no parent, no entry
    except OSError as error:
        return f"cannot open its parent directory: {error.strerror}"
    errors = _Errors()
    try:
        if _remove_entry(parent_fd, name, errors):
            return None
    except OSError as error:
        errors.add(f"{error.strerror or error}")
    finally:
        os.close(parent_fd)
    return errors.summary() or "not removed"


def _move_to_trash(path: pathlib.Path, trash_dir: pathlib.Path) -> pathlib.Path:
    """Renames `path` into `trash_dir` under a fresh name (atomic; same file system). Raises
    OSError."""
    trash_dir = pathlib.Path(trash_dir)
    trash_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = trash_dir / f"{path.name}-{secrets.token_hex(8)}"
    os.rename(path, target)  # a fresh name: never replaces anything
    return target


def remove_tree(path: pathlib.Path, *, trash_dir: pathlib.Path | None = None) -> str | None:
    """Removes `path` and everything below it (module docstring). Never raises.

    `path` may be a directory (any depth, any modes, symlinks anywhere: none is followed), a
    symlink (only the link is removed) or any other file; a missing path counts as removed. Its
    parent directories are trusted: they are the caller's.

    Returns None when `path` is gone, else a message saying what is left and why. With
    `trash_dir` (on the same file system), a tree that cannot be removed is renamed into it so
    that `path` is free, and the message says where it went; `empty_trash` retries it later.
    """
    path = pathlib.Path(path)
    try:
        problem = _remove(path)
    except Exception as error:  # noqa: BLE001 — the contract is "never raises"
        problem = f"unexpected {type(error).__name__}: {error}"
    if problem is None:
        return None
    message = f"cannot remove {str(path)!r}: {problem}"
    if trash_dir is None:
        return message
    try:
        target = _move_to_trash(path, trash_dir)
    except Exception as error:  # noqa: BLE001
        return f"{message}; moving it to the trash failed too: {error}"
    return f"{message}; moved it to {str(target)!r}"


def empty_trash(trash_dir: pathlib.Path) -> str | None:
    """Removes everything in `trash_dir` (the directory itself stays). Never raises; returns None
    when the trash is empty (or absent) afterwards, else what is left."""
    trash_dir = pathlib.Path(trash_dir)
    try:
        names = os.listdir(trash_dir)
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"cannot list the trash {str(trash_dir)!r}: {error.strerror}"
    problems = [
        problem
        for problem in (remove_tree(trash_dir / name) for name in names)
        if problem is not None
    ]
    if not problems:
        return None
    shown = "; ".join(problems[:_MAX_ERRORS_KEPT])
    more = len(problems) - _MAX_ERRORS_KEPT
    return f"{len(problems)} of {len(names)} entries left in the trash: {shown}" + (
        f" (and {more} more)" if more > 0 else ""
    )


def remove_stale_task_dirs(work_root: pathlib.Path) -> int:
    """Deletes the task directories a killed executor left under `<work_root>/tasks` and empties
    `<work_root>/trash`. Returns how many task directories were left over.

    Never raises, whatever the leftovers hold: a task directory that cannot be removed is moved
    to the trash (the tasks directory is free either way) and logged, so the executor always
    starts. Only safe before any task of this work root runs: call it once at executor start-up
    (one executor owns a work root). Mirrors are kept: they are shared and verified on use.
    """
    work_root = pathlib.Path(work_root).expanduser()
    trash_dir = trash_path(work_root)
    problem = empty_trash(trash_dir)  # earlier runs' leftovers first: their retry
    if problem is not None:
        logger.warning("%s", problem)
    tasks_dir = work_root / TASKS_DIR_NAME
    try:
        stale = sorted(name for name in os.listdir(tasks_dir) if name.startswith(TASK_DIR_PREFIX))
    except FileNotFoundError:
        return 0
    except OSError as error:
        logger.error("cannot list %s for leftover task directories: %s", tasks_dir, error)
        return 0
    for name in stale:
        problem = remove_tree(tasks_dir / name, trash_dir=trash_dir)
        if problem is not None:
            logger.error("leftover task directory: %s", problem)
    return len(stale)
