"""Tests of cleanup.py on the real file system: no mocks, trees as hostile tests leave them.

Mode-000 directories only stop a remover that is not root, so those trees are built and removed
by an unprivileged process: when the tests run as root, a forked child switches to uid/gid 65534
(`run_unprivileged`); otherwise the test's own uid is already unprivileged. A tree that cannot be
removed at all (to test the trash fallback) needs a directory the remover neither owns nor is
root over: root makes one, the unprivileged child fails on it. Those tests skip, with the reason,
where the uid cannot be switched (not root, or a user namespace that maps no other uid).
"""

from __future__ import annotations

import os
import pathlib
import socket
import stat
import sys
import threading
import time
import traceback

import pytest

from dockyard_rl.sandbox import cleanup

NOBODY = 65534
_DIR = os.O_RDONLY | os.O_DIRECTORY


def make_deep(
    parent: pathlib.Path | str,
    name: str | bytes,
    depth: int,
    *,
    modes: dict[int, int] | None = None,
    file_every: int = 0,
) -> None:
    """Creates `name` under `parent`, `depth` directories deep (name/d/d/...), with dir_fd so
    that no path is ever longer than one name. `modes` maps a level (0 = `name`) to the mode it
    ends with; `file_every` puts a file `f` in every n-th level."""
    modes = modes or {}
    fd = os.open(parent, _DIR)
    os.mkdir(name, dir_fd=fd)
    child = os.open(name, _DIR, dir_fd=fd)
    os.close(fd)
    fd = child
    for level in range(depth):
        if file_every and level % file_every == 0:
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        if level + 1 < depth:
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", _DIR, dir_fd=fd)
        else:
            child = -1
        if level in modes:
            os.fchmod(fd, modes[level])  # after its child exists: later levels go through fds
        os.close(fd)
        fd = child


def run_unprivileged(workdir: pathlib.Path, function) -> None:
    """Runs `function()` with `workdir` as the current directory, as an unprivileged user that
    owns `workdir`: a forked child as uid/gid 65534 when we are root, else in-process."""
    if os.geteuid() != 0:
        previous = os.getcwd()
        os.chdir(workdir)
        try:
            function()
        finally:
            os.chdir(previous)
        return
    os.chown(workdir, NOBODY, NOBODY)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        message = "OK"
        try:
            os.close(read_fd)
            os.chdir(workdir)  # as root: the path's ancestors need not be open to 65534
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError as error:
                message = f"SKIP cannot switch to uid {NOBODY} here: {error}"
            else:
                function()
        except BaseException:  # noqa: BLE001 — report everything to the parent
            message = traceback.format_exc()
        finally:
            os.write(write_fd, message.encode(errors="replace"))
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    if message.startswith("SKIP "):
        pytest.skip(message[5:])
    assert message == "OK", message


@pytest.fixture(autouse=True)
def remove_leftovers(tmp_path):
    """A failed test leaves trees pytest's own clean-up (recursive) cannot remove."""
    yield
    if os.path.lexists(tmp_path):
        assert cleanup.remove_tree(tmp_path) is None


def assert_gone(path: pathlib.Path) -> None:
    assert not os.path.lexists(path), os.listdir(path.parent)


# --- depth and permissions -----------------------------------------------------------------------


def test_5000_levels_with_unreadable_and_read_only_levels_unprivileged(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()

    def build_and_remove():
        # Levels at mode 000 (cannot be opened), 0300 (cannot be listed), 0500 (cannot be
        # written), at the top, in the middle and at the bottom.
        make_deep(
            ".",
            "tree",
            5000,
            file_every=250,
            modes={
                0: 0o500,
                1: 0o000,
                10: 0o000,
                2500: 0o300,
                2501: 0o500,
                4998: 0o000,
                4999: 0o000,
            },
        )
        assert cleanup.remove_tree(pathlib.Path("tree")) is None
        assert not os.path.lexists("tree")

    run_unprivileged(workdir, build_and_remove)
    assert os.listdir(workdir) == []


def test_12000_levels_is_removed_in_seconds(tmp_path):
    make_deep(tmp_path, "tree", 12000, file_every=1000, modes={0: 0o000, 6000: 0o000})
    start = time.monotonic()
    assert cleanup.remove_tree(tmp_path / "tree") is None
    assert time.monotonic() - start < 30
    assert_gone(tmp_path / "tree")


def test_wide_tree_of_many_subdirectories(tmp_path):
    tree = tmp_path / "tree"
    for index in range(1000):
        (tree / f"dir{index}" / "sub").mkdir(parents=True)
        (tree / f"dir{index}" / "sub" / "file").write_text("x")
    assert cleanup.remove_tree(tree) is None
    assert_gone(tree)


# --- what a tree may hold ------------------------------------------------------------------------


def test_symlinks_are_never_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sentinel").write_text("keep me")
    (outside / "sub" / "inner").write_text("keep me too")
    os.chmod(outside / "sub", 0o500)  # a remover following links would chmod it back to 0700
    tree = tmp_path / "tree"
    make_deep(tmp_path, "tree", 50)
    deep = tree / "/".join(["d"] * 30)
    for where in (tree, deep):
        os.symlink(outside, where / "to_outside_dir")
        os.symlink(outside / "sentinel", where / "to_outside_file")
        os.symlink(outside / "sub", where / "to_read_only_dir")
        os.symlink("/", where / "to_root")
        os.symlink("/nonexistent/dangling", where / "dangling")
        os.symlink("..", where / "to_parent")  # a loop for a walker that follows links
    root_entries = sorted(os.listdir("/"))
    assert cleanup.remove_tree(tree) is None
    assert_gone(tree)
    assert (outside / "sentinel").read_text() == "keep me"
    assert (outside / "sub" / "inner").read_text() == "keep me too"
    assert stat.S_IMODE(os.stat(outside / "sub").st_mode) == 0o500
    assert sorted(os.listdir("/")) == root_entries
    assert os.path.exists(sys.executable)


def test_special_files_and_odd_names(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    os.mkfifo(tree / "fifo")  # opening it would block: it must only be unlinked
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tree / "sock"))
    tree_fd = os.open(tree, _DIR)
    try:
        bad = b"\xff\xfe-not-utf8"
        os.mkdir(bad, dir_fd=tree_fd)
        os.close(os.open(bad + b"/" + bad, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=tree_fd))
        longest = b"n" * 255  # NAME_MAX
        os.mkdir(longest, dir_fd=tree_fd)
        os.close(os.open(longest + b"/" + longest, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=tree_fd))
        os.mkfifo(longest + b"/fifo", dir_fd=tree_fd)
        os.close(
            os.open(b"\n-newline \\ and space", os.O_WRONLY | os.O_CREAT, 0o000, dir_fd=tree_fd)
        )
    finally:
        os.close(tree_fd)
    assert cleanup.remove_tree(tree) is None
    assert_gone(tree)


def test_the_path_itself_a_symlink_removes_only_the_link(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "sentinel").write_text("keep me")
    link = tmp_path / "link"
    os.symlink(target, link)
    assert cleanup.remove_tree(link) is None
    assert_gone(link)
    assert (target / "sentinel").read_text() == "keep me"


def test_a_file_a_missing_path_and_a_symlink_to_root(tmp_path):
    (tmp_path / "file").write_text("x")
    os.chmod(tmp_path / "file", 0)
    assert cleanup.remove_tree(tmp_path / "file") is None
    assert_gone(tmp_path / "file")
    assert cleanup.remove_tree(tmp_path / "missing") is None
    assert cleanup.remove_tree(tmp_path / "missing" / "below") is None
    os.symlink("/", tmp_path / "root")
    assert cleanup.remove_tree(tmp_path / "root") is None
    assert_gone(tmp_path / "root")
    assert os.path.isdir("/") and os.path.exists(sys.executable)


def test_refuses_dot_and_dot_dot(tmp_path):
    (tmp_path / "sub").mkdir()
    assert "refusing" in cleanup.remove_tree(tmp_path / "sub" / "..")
    assert "refusing" in cleanup.remove_tree(pathlib.Path("/"))
    assert (tmp_path / "sub").is_dir()


def test_concurrent_removers_both_succeed(tmp_path):
    # Entries vanish under each remover while it works: each must take that as removed.
    tree = tmp_path / "tree"
    tree.mkdir()
    for index in range(20):
        make_deep(tree, f"branch{index}", 150, file_every=3)
    results: list[str | None] = []

    def remove():
        results.append(cleanup.remove_tree(tree))

    threads = [threading.Thread(target=remove) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [None, None, None]
    assert_gone(tree)


def test_directories_moved_during_the_walk(tmp_path):
    # A process still running moves subtrees between two parents while the remover walks them:
    # the walk's way back up (`..`) then leads to a different directory than it came from, and
    # it must start again from the top rather than carry on there.
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "p0").mkdir()
    (tree / "p1").mkdir()
    for index in range(10):
        make_deep(tree / "p0", f"c{index}", 300, file_every=5)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    os.symlink(outside, tree / "p1" / "link")
    stop = threading.Event()

    def move_back_and_forth():
        while not stop.is_set():
            try:
                for index in range(10):
                    os.rename(tree / "p0" / f"c{index}", tree / "p1" / f"c{index}")
                    os.rename(tree / "p1" / f"c{index}", tree / "p0" / f"c{index}")
            except OSError:
                return  # the remover got there first

    mover = threading.Thread(target=move_back_and_forth)
    mover.start()
    try:
        assert cleanup.remove_tree(tree) is None
    finally:
        stop.set()
        mover.join()
    assert_gone(tree)
    assert (outside / "sentinel").read_text() == "keep me"


# --- the trash fallback --------------------------------------------------------------------------


def make_undeletable(workdir: pathlib.Path) -> None:
    """workdir/tree (owned by the remover-to-be, uid 65534) holding locked/file, owned by root:
    65534 can neither delete the file nor chmod the directory. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory the unprivileged remover cannot delete")
    tree = workdir / "tree"
    make_deep(workdir, "tree", 300, modes={5: 0o000})
    (tree / "locked").mkdir()
    (tree / "locked" / "file").write_text("root's")
    for directory, subdirs, files in os.walk(workdir):
        if pathlib.Path(directory) != tree / "locked":
            for name in [*subdirs, *files]:
                os.lchown(os.path.join(directory, name), NOBODY, NOBODY)
    os.lchown(tree / "locked", 0, 0)
    os.lchown(tree / "locked" / "file", 0, 0)


def test_a_tree_that_cannot_be_removed_is_moved_to_the_trash(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    make_undeletable(workdir)

    def remove_as_nobody():
        message = cleanup.remove_tree(pathlib.Path("tree"))
        assert message is not None and "Permission denied" in message, message
        assert os.path.isdir("tree")  # what could be removed is gone, the rest is reported
        assert not os.path.lexists("tree/d"), "the removable part should be gone"
        message = cleanup.remove_tree(pathlib.Path("tree"), trash_dir=pathlib.Path("trash"))
        assert message is not None and "moved it to" in message, message
        assert not os.path.lexists("tree")  # the caller's path is free
        (left,) = os.listdir("trash")
        assert left.startswith("tree-") and os.listdir(f"trash/{left}/locked") == ["file"]
        # Still not removable by this user: empty_trash says so and never raises.
        problem = cleanup.empty_trash(pathlib.Path("trash"))
        assert problem is not None and "1 of 1 entries left" in problem, problem

    run_unprivileged(workdir, remove_as_nobody)
    # Root (the executor's real position over the sandbox uid) empties it.
    assert cleanup.empty_trash(workdir / "trash") is None
    assert os.listdir(workdir / "trash") == []


def test_trash_failure_is_reported_not_raised(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    make_undeletable(workdir)
    (workdir / "trash").write_text("a file where the trash directory should be")
    os.lchown(workdir / "trash", NOBODY, NOBODY)

    def remove_as_nobody():
        message = cleanup.remove_tree(pathlib.Path("tree"), trash_dir=pathlib.Path("trash"))
        assert message is not None and "moving it to the trash failed too" in message, message

    run_unprivileged(workdir, remove_as_nobody)


def test_empty_trash_of_a_missing_directory(tmp_path):
    assert cleanup.empty_trash(tmp_path / "nothing") is None


# --- start-up: leftovers of a killed executor ----------------------------------------------------


def make_pathological_work_root(work_root: pathlib.Path, outside: pathlib.Path) -> None:
    tasks = work_root / "tasks"
    tasks.mkdir(parents=True)
    make_deep(tasks, "task-deep", 5000, file_every=500, modes={0: 0o000, 1: 0o000, 4000: 0o000})
    os.symlink(outside, tasks / "task-link")
    (tasks / "task-file").write_text("not a directory")
    make_deep(tasks, "task-wide", 3, modes={0: 0o500})
    os.symlink("/", tasks / "task-wide" / "root")
    (work_root / "trash").mkdir()
    make_deep(work_root / "trash", "task-old-abc", 2000, modes={100: 0o000})
    (work_root / "mirrors").mkdir()
    (work_root / "mirrors" / "keep").write_text("mirror")
    (tasks / "not-a-task").mkdir()


def test_remove_stale_task_dirs_on_pathological_leftovers(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    work_root = tmp_path / "work"
    make_pathological_work_root(work_root, outside)
    assert cleanup.remove_stale_task_dirs(work_root) == 4
    assert sorted(os.listdir(work_root / "tasks")) == ["not-a-task"]
    assert os.listdir(work_root / "trash") == []
    assert (work_root / "mirrors" / "keep").read_text() == "mirror"
    assert (outside / "sentinel").read_text() == "keep me"
    assert cleanup.remove_stale_task_dirs(tmp_path / "never-created") == 0


def test_remove_stale_task_dirs_moves_what_it_cannot_remove_to_the_trash(tmp_path, caplog):
    workdir = tmp_path / "work"
    workdir.mkdir()
    make_undeletable(workdir)
    (workdir / "tasks").mkdir()
    os.rename(workdir / "tree", workdir / "tasks" / "task-locked")
    os.lchown(workdir / "tasks", NOBODY, NOBODY)

    def start_as_nobody():
        assert cleanup.remove_stale_task_dirs(pathlib.Path(".")) == 1
        assert os.listdir("tasks") == []
        assert len(os.listdir("trash")) == 1

    run_unprivileged(workdir, start_as_nobody)


def test_executor_starts_cleanly_over_a_pathological_leftover(tmp_path):
    """A restart of the real TaskExecutor on a work dir a killed executor left in the worst
    state a patch can cause: it starts, scores, and the leftovers are gone."""
    from dockyard_rl.sandbox.config import ExecutorConfig
    from dockyard_rl.sandbox.task import ApplyMethod, TaskSpec, TaskStatus, Verdict
    from dockyard_rl.sandbox.task_executor import TaskExecutor

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    work_dir = tmp_path / "work"
    make_pathological_work_root(work_dir, outside)

    def no_op_score(spec: TaskSpec, work_root: pathlib.Path) -> Verdict:
        return Verdict(
            resolved=False,
            reward=0.0,
            fail_to_pass={},
            pass_to_pass={},
            apply_method=ApplyMethod.EMPTY,
            integrity_violation=(),
            test_exit_code=None,
            timed_out=False,
            timings_s={},
            log_tail="",
        )

    config = ExecutorConfig(
        host="127.0.0.1",
        port=0,
        num_workers=1,
        work_dir=str(work_dir),
        retry_backoff_s=0.0,
        shutdown_grace_s=5.0,
    )
    executor = TaskExecutor(config, no_op_score)
    try:
        executor.start()
        assert sorted(os.listdir(work_dir / "tasks")) == ["not-a-task"]
        assert not os.listdir(work_dir / "trash")
        assert (outside / "sentinel").read_text() == "keep me"
        spec = TaskSpec(
            instance_id="x__y-1",
            repo=str(tmp_path),
            base_commit="abc1234",
            patch="",
            test_patch="diff --git a/t b/t\n",
            fail_to_pass=(),
            pass_to_pass=(),
            task_id="after-restart",
        )
        executor.submit(spec)
        deadline = time.monotonic() + 10
        while executor.get("after-restart").status is not TaskStatus.FINISHED:
            assert time.monotonic() < deadline, executor.get("after-restart")
            time.sleep(0.01)
    finally:
        executor.stop()
