"""Tests of the executor's session API (sessions.py, its routes in http_app.py, the client).

Real everything: git repositories from testing_repos, bubblewrap for run_tests, a started
executor and the async client over HTTP for the API, a real executor process killed and started
again for the restart. The scoring of a session's diff goes through the normal pipeline.
"""

import asyncio
import os
import pathlib
import signal
import threading
import time

import aiohttp
import pytest

from dockyard_rl.sandbox import pipeline, sessions, testing_executor, testing_repos
from dockyard_rl.sandbox.client import ExecutorClient, ExecutorRequestError
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.sessions import SessionConfig, SessionManager, SessionNotFoundError

FIX_OLD = "def mul(a, b):\n    return a + b"
FIX_NEW = "def mul(a, b):\n    return a * b"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return testing_repos.make_toy_repo(tmp_path_factory.mktemp("repos") / "toy")


def make_manager(tmp_path, max_patch_bytes=1 << 20, **session_config) -> SessionManager:
    manager = SessionManager(
        SessionConfig(**session_config),
        pipeline.PipelineConfig(),
        tmp_path / "work",
        max_patch_bytes,
    )
    manager.start()
    return manager


@pytest.fixture
def manager(tmp_path):
    manager = make_manager(tmp_path)
    yield manager
    manager.stop()


def session_dir(manager: SessionManager, session_id: str) -> pathlib.Path:
    (found,) = manager.sessions_dir.glob(f"{session_id}-*")
    return found


# -- the round trip over HTTP, scored by the normal pipeline ------------------------------------


def test_round_trip_over_http_and_the_diff_resolves(tmp_path, toy):
    config = testing_executor.make_config(tmp_path)

    async def scenario():
        async with running_server(config) as server, ExecutorClient(server.url) as client:
            session_id = await client.open_session(toy.spec(toy.gold_patch), "episode-1")
            assert session_id == "episode-1"
            listing = await client.call_tool(session_id, "view", {"path": "."})
            assert listing.ok and listing.output.split("\n") == ["calc/", "tests/"]
            # The held-out test file of the test patch does not exist in the session.
            hidden = await client.call_tool(session_id, "view", {"path": "tests/test_mul_table.py"})
            assert not hidden.ok and "does not exist" in hidden.error
            found = await client.call_tool(session_id, "search", {"pattern": "def mul"})
            assert found.ok and found.output == "calc/ops.py:12:def mul(a, b):"
            lines = await client.call_tool(
                session_id, "view", {"path": "calc/ops.py", "start_line": 12, "end_line": 13}
            )
            assert lines.output == "   12\tdef mul(a, b):\n   13\t    return a + b"
            edit = await client.call_tool(
                session_id, "replace", {"path": "calc/ops.py", "old": FIX_OLD, "new": FIX_NEW}
            )
            assert edit.ok and "return a * b" in edit.output
            test = "from calc.ops import mul\n\n\ndef test_mine():\n    assert mul(3, 4) == 12\n"
            wrote = await client.call_tool(
                session_id, "write_file", {"path": "tests/test_mine.py", "content": test}
            )
            assert wrote.ok and wrote.output.startswith("created tests/test_mine.py")
            run = await client.call_tool(
                session_id, "run_tests", {"tests": ["tests/test_mine.py::test_mine"]}
            )
            assert run.ok and "1 passed" in run.output, run.output
            assert "pytest exit status 0" in run.output
            assert run.budget["cpu_s_left"] < config.sessions.max_cpu_s
            default_run = await client.call_tool(session_id, "run_tests", {})
            assert default_run.ok and "5 passed" in default_run.output, default_run.output
            info = await client._request("GET", f"/session/{session_id}")
            assert info["turns_used"] == 8 and info["budget"]["turns_left"] == 64 - 8
            patch = await client.session_diff(session_id)
            assert "+    return a * b" in patch and "tests/test_mine.py" in patch
            assert "__pycache__" not in patch and ".pytest_cache" not in patch
            await client.close_session(session_id)
            await client.close_session(session_id)  # already gone: not an error
            with pytest.raises(ExecutorRequestError) as closed:
                await client.call_tool(session_id, "view", {"path": "."})
            assert closed.value.status == 404 and "closed" in closed.value.message
            assert list(server.executor.sessions.sessions_dir.iterdir()) == []
            # The diff, submitted as a normal task, is scored by the normal pipeline.
            result = await client.score(toy.spec(patch), poll_interval_s=0.1, timeout_s=120)
            return result

    result = asyncio.run(scenario())
    assert result.verdict is not None and result.verdict.resolved, result.verdict


def test_http_open_is_idempotent_and_bounded(tmp_path, toy):
    config = testing_executor.make_config(tmp_path, sessions=SessionConfig(max_sessions=1))
    body = {**toy.spec("").to_dict(), "session_id": "s-1"}
    body.pop("task_id")

    async def scenario(http, server):
        url = server.url
        async with http.post(f"{url}/session/open", json=body) as response:
            assert response.status == 201
            first = await response.json()
        assert first["session_id"] == "s-1" and first["budget"]["turns_left"] == 64
        assert first["idle_timeout_s"] == 600.0
        async with http.post(f"{url}/session/open", json=body) as response:
            assert response.status == 200 and (await response.json())["session_id"] == "s-1"
        other = {**body, "instance_id": "other__task-2"}
        async with http.post(f"{url}/session/open", json=other) as response:
            assert response.status == 409
        async with http.post(f"{url}/session/open", json={**body, "session_id": "s-2"}) as response:
            assert response.status == 429 and response.headers["Retry-After"]
            assert "max_sessions" in (await response.json())["error"]
        for bad, field in (
            ({**body, "session_id": "../etc"}, "session_id"),
            ({**body, "base_commit": "not-a-commit"}, "base_commit"),
            ({**body, "repo": "ext::sh -c evil"}, "repo"),
            ({k: v for k, v in body.items() if k != "repo"}, "repo"),
        ):
            async with http.post(f"{url}/session/open", json=bad) as response:
                assert response.status == 400, bad
                assert (await response.json())["field"] == field
        async with http.post(f"{url}/session/open", data=b"[1, 2]") as response:
            assert response.status == 400
        call = f"{url}/session/s-1/call"
        async with http.post(call, data=b"not json") as response:
            assert response.status == 400
        async with http.post(call, json={"tool": 3}) as response:
            assert response.status == 400 and (await response.json())["field"] == "tool"
        async with http.post(call, json={"tool": "frobnicate", "args": {}}) as response:
            answer = await response.json()
            assert response.status == 200 and not answer["ok"] and "unknown tool" in answer["error"]
        async with http.post(f"{url}/session/nope/call", json={"tool": "view"}) as response:
            assert response.status == 404 and "unknown session" in (await response.json())["error"]
        async with http.get(f"{url}/session/nope/diff") as response:
            assert response.status == 404
        async with http.delete(f"{url}/session/s-1") as response:
            assert response.status == 200 and (await response.json()) == {"closed": True}
        async with http.delete(f"{url}/session/s-1") as response:
            assert response.status == 404 and "closed" in (await response.json())["error"]

    testing_executor.serve_and(config, testing_executor.score, scenario)


def test_the_diff_is_capped_and_leaves_caches_out(tmp_path, toy):
    manager = make_manager(tmp_path, max_patch_bytes=2000)
    try:
        manager.open(toy.spec(""), "s")
        for path in ("calc/__pycache__/ops.cpython-311.pyc", ".pytest_cache/v/x", "calc/x.pyc"):
            assert manager.call("s", "write_file", {"path": path, "content": "cache"}).ok
        assert manager.diff("s") == ""
        assert manager.call("s", "write_file", {"path": "big.txt", "content": "x\n" * 2000}).ok
        with pytest.raises(sessions.DiffTooLargeError, match="max_patch_bytes = 2000"):
            manager.diff("s")
        # The checkout's own index is never written: the diff works on a copy.
        index = session_dir(manager, "s") / "git" / "index"
        before = index.stat().st_mtime_ns
        manager.call("s", "write_file", {"path": "big.txt", "content": "small\n"})
        assert "+small" in manager.diff("s")
        assert index.stat().st_mtime_ns == before
    finally:
        manager.stop()


def test_an_edit_in_the_checkouts_second_that_keeps_size_and_inode_is_in_the_diff(manager, toy):
    # `a + b` -> `a * b` in place: same size, same inode, and (git compares whole seconds) the
    # same mtime and ctime as the checkout recorded when made within its second. Only git's
    # racy-entry check, which compares the entry with the index file's own mtime, finds such a
    # change. The diff once copied the index with a fresh mtime, which defeats that check: taken
    # a second later, the agent's fix came back as an empty diff and was scored as no patch.
    old, new = "def mul(a, b):\n    return a + b", "def mul(a, b):\n    return a * b"
    for attempt in range(5):
        session_id = f"racy{attempt}"
        manager.open(toy.spec(""), session_id)
        ops = session_dir(manager, session_id) / "tree" / "calc" / "ops.py"
        before = ops.stat()
        assert manager.call(
            session_id, "replace", {"path": "calc/ops.py", "old": old, "new": new}
        ).ok
        after = ops.stat()
        assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
        if int(after.st_ctime) == int(before.st_ctime):
            break  # the edit fell within the checkout's second: the case to test
        manager.close(session_id)
    else:
        pytest.skip("5 edits missed the checkout's second (a very slow machine)")
    time.sleep(1.1)  # the diff's index copy is made a second later
    assert "+    return a * b" in manager.diff(session_id)


# -- isolation ------------------------------------------------------------------------------


def test_run_tests_cannot_reach_the_git_dir_or_write_outside_the_tree(manager, toy):
    manager.open(toy.spec(""), "iso")
    directory = session_dir(manager, "iso")
    tree, git_dir = directory / "tree", directory / "git"
    assert (git_dir / "HEAD").is_file() and not (tree / ".git").exists()
    escape = f"""\
import os, pathlib


def test_escape():
    report = [
        f"git_dir_visible={{os.path.exists({str(git_dir)!r})}}",
        f"testbed_git={{os.path.exists('/testbed/.git')}}",
        f"work_root_visible={{os.path.exists({str(manager.work_root)!r})}}",
    ]
    for target in ({str(directory / "escape.txt")!r}, {str(tree / "escape.txt")!r}, "/escape.txt"):
        try:
            with open(target, "w") as sink:
                sink.write("x")
            report.append("wrote " + target)
        except OSError as error:
            report.append("refused " + type(error).__name__)
    pathlib.Path("/testbed/planted.txt").write_text("x")
    os.symlink("/etc/passwd", "/testbed/planted_link")
    raise AssertionError("REPORT " + " ".join(report))
"""
    assert manager.call("iso", "write_file", {"path": "tests/test_escape.py", "content": escape}).ok
    result = manager.call("iso", "run_tests", {"tests": ["tests/test_escape.py"]})
    assert result.ok, result.error
    report = next(line for line in result.output.split("\n") if "REPORT git_dir" in line)
    assert "git_dir_visible=False" in report and "testbed_git=False" in report, report
    assert "work_root_visible=False" in report, report
    assert "wrote" not in report, report
    for leftover in (directory / "escape.txt", tree / "escape.txt", pathlib.Path("/escape.txt")):
        assert not leftover.exists()
    # The tests ran on a copy: what they wrote in /testbed did not reach the session's tree.
    assert not (tree / "planted.txt").exists() and not os.path.lexists(tree / "planted_link")
    assert "tests/test_escape.py" in manager.diff("iso")


def test_planted_symlinks_are_never_followed(manager, toy):
    manager.open(toy.spec(""), "links")
    tree = session_dir(manager, "links") / "tree"
    os.symlink("calc/ops.py", tree / "inside_link.py")
    os.symlink("/etc", tree / "etc_link")
    os.symlink("/", tree / "calc" / "root_link")
    ops_before = (tree / "calc" / "ops.py").read_text()
    refused = [
        ("view", {"path": "inside_link.py"}),
        ("view", {"path": "etc_link/passwd"}),
        ("view", {"path": "calc/root_link/etc"}),
        ("replace", {"path": "inside_link.py", "old": "def mul", "new": "def evil"}),
        ("write_file", {"path": "inside_link.py", "content": "x"}),
        ("write_file", {"path": "etc_link/evil", "content": "x"}),
        ("search", {"pattern": "root", "path": "etc_link"}),
        ("run_tests", {"tests": ["etc_link/passwd"]}),
    ]
    for tool, args in refused:
        result = manager.call("links", tool, args)
        assert not result.ok and "symbolic link" in result.error, (tool, args, result)
    assert (tree / "calc" / "ops.py").read_text() == ops_before
    assert not pathlib.Path("/etc/evil").exists()
    listing = manager.call("links", "view", {"path": "."}).output.split("\n")
    assert "etc_link@" in listing and "inside_link.py@" in listing
    found = manager.call("links", "search", {"pattern": "def mul"}).output
    assert found == "calc/ops.py:12:def mul(a, b):"  # the link to ops.py is not searched


def _hostile_cases():
    big = sessions.MAX_FILE_BYTES + 1
    return [
        ("view", {"path": "/etc/passwd"}, "absolute"),
        ("view", {"path": "../../etc/passwd"}, "'..'"),
        ("view", {"path": "calc/../../x"}, "'..'"),
        ("view", {"path": ".git/config"}, ".git"),
        ("view", {"path": "calc/.GIT"}, ".git"),
        ("write_file", {"path": "sub/.git/hooks/pre-commit", "content": "x"}, ".git"),
        ("view", {"path": "calc\x00/ops.py"}, "NUL"),
        ("view", {"path": 42}, "must be a string"),
        ("view", {"path": ["calc"]}, "must be a string"),
        ("view", {}, "must be a string"),
        ("view", {"path": "\udc80"}, "Unicode"),
        ("view", {"path": "a/" * 600}, "longer than"),
        ("view", {"path": "calc/ops.py", "start_line": "1"}, "integer"),
        ("view", {"path": "calc/ops.py", "start_line": True}, "integer"),
        ("view", {"path": "calc/ops.py", "start_line": 0}, ">= 1"),
        ("view", {"path": "calc/ops.py", "start_line": 5, "end_line": 2}, "end_line"),
        ("view", {"path": "calc/ops.py", "start_line": 10_000}, "past the end"),
        ("view", {"path": "nope.py"}, "does not exist"),
        ("view", {"path": "nope/deeper.py"}, "does not exist"),
        ("view", {"path": "calc/ops.py/x"}, "not a directory"),
        ("view", {"path": "blob.bin"}, "binary"),
        ("view", {"path": "huge.txt"}, "limit"),
        ("view", {"path": "fifo"}, "not a regular file"),
        ("search", {"pattern": "(a|aa)+$", "regex": True, "path": "long.txt"}, "more than"),
        ("search", {"pattern": "(", "regex": True}, "not a valid regular expression"),
        ("search", {"pattern": ""}, "must not be empty"),
        ("search", {"pattern": None}, "must be a string"),
        ("search", {"pattern": "x", "regex": "yes"}, "true or false"),
        ("search", {"pattern": "x" * 2000}, "longer than"),
        ("search", {"pattern": "x", "path": "/"}, "absolute"),
        ("replace", {"path": "calc/ops.py", "old": "return a + b", "new": "x"}, "occurs 2 times"),
        ("replace", {"path": "calc/ops.py", "old": "no such text", "new": "x"}, "0 occurrences"),
        ("replace", {"path": "calc/ops.py", "old": "", "new": "x"}, "must not be empty"),
        ("replace", {"path": "calc/ops.py", "old": "def add", "new": 3}, "must be a string"),
        ("replace", {"path": "calc", "old": "x", "new": "y"}, "not a regular file"),
        ("replace", {"path": "blob.bin", "old": "x", "new": "y"}, "binary"),
        ("write_file", {"path": "x.txt", "content": "a" * big}, "limit"),
        ("write_file", {"path": "x.txt", "content": None}, "must be a string"),
        ("write_file", {"path": "x.txt", "content": "\ud800"}, "Unicode"),
        ("write_file", {"path": "calc", "content": "x"}, "directory"),
        ("write_file", {"path": ".", "content": "x"}, "repository root"),
        ("write_file", {"path": "calc/ops.py/x", "content": "x"}, "not a directory"),
        ("run_tests", {"tests": ["-p", "evil"]}, "starts with '-'"),
        ("run_tests", {"tests": ["--rootdir=/"]}, "starts with '-'"),
        ("run_tests", {"tests": ["../outside.py"]}, "'..'"),
        ("run_tests", {"tests": ["/etc/passwd"]}, "absolute"),
        ("run_tests", {"tests": "tests/test_ops.py"}, "list"),
        ("run_tests", {"tests": []}, "list"),
        ("run_tests", {"tests": [7]}, "non-empty string"),
        ("run_tests", {"tests": ["tests/missing.py::t"]}, "does not exist"),
        ("run_tests", {"tests": ["x"] * 100}, "at most"),
        ("frobnicate", {}, "unknown tool"),
        (None, {}, "unknown tool"),
        ("view", ["calc"], "JSON object"),
        ("view", {"path": "calc", "bogus": 1}, "unknown argument"),
    ]


def test_hostile_tool_inputs_are_observations(manager, toy):
    manager.open(toy.spec(""), "hostile")
    tree = session_dir(manager, "hostile") / "tree"
    (tree / "blob.bin").write_bytes(b"\x00\x01binary\x00" * 10)
    (tree / "huge.txt").write_bytes(b"x" * (sessions.MAX_FILE_BYTES + 1))
    (tree / "long.txt").write_text("a" * 5000 + "!\n")
    os.mkfifo(tree / "fifo")
    for tool, args, expected in _hostile_cases():
        started = time.monotonic()
        result = manager.call("hostile", tool, args)
        assert not result.ok, (tool, args, result.output[:200])
        assert expected in result.error, (tool, args, result.error)
        assert result.output == "" and not result.exhausted
        # Bounded, not fast: (a|aa)+$ on 5000 a's would run for ages without the regex
        # timeout; the margin is for a loaded machine (no timing claims in tests).
        assert time.monotonic() - started < sessions.SEARCH_TIME_S + 60.0
    assert not (tree / "x.txt").exists() and not (tree / "sub").exists()
    assert manager.info("hostile")["turns_used"] == len(_hostile_cases())


# -- budgets, expiry, limits ----------------------------------------------------------------


def test_turn_and_output_budgets_exhaust(tmp_path, toy):
    manager = make_manager(tmp_path, max_turns=3, max_output_bytes=300)
    try:
        manager.open(toy.spec(""), "turns")
        assert manager.call("turns", "view", {"path": "."}).budget["turns_left"] == 2
        assert not manager.call("turns", "view", {"path": "nope"}).ok  # refused calls count
        last = manager.call("turns", "view", {"path": "."})
        assert last.ok and last.exhausted and last.budget["turns_left"] == 0
        after = manager.call("turns", "view", {"path": "."})
        assert not after.ok and after.exhausted and "turns budget is spent" in after.error
        assert manager.info("turns")["turns_used"] == 3  # nothing ran
        assert manager.diff("turns") == ""  # the diff stays available

        manager.open(toy.spec(""), "output")
        big = manager.call("output", "view", {"path": "calc/ops.py"})
        assert big.ok and big.truncated and big.exhausted
        assert big.budget["output_bytes_left"] == 0
        assert "output budget is spent" in big.output
        assert not manager.call("output", "view", {"path": "."}).ok
    finally:
        manager.stop()


def test_cpu_and_wall_budgets_exhaust(tmp_path, toy):
    manager = make_manager(tmp_path, max_cpu_s=2.0, max_wall_s=60.0)
    try:
        manager.open(toy.spec(""), "cpu")
        slow = "import time\n\n\ndef test_slow():\n    time.sleep(30)\n"
        manager.call("cpu", "write_file", {"path": "tests/test_slow.py", "content": slow})
        started = time.monotonic()
        result = manager.call("cpu", "run_tests", {"tests": ["tests/test_slow.py"]})
        # Killed at the 2-s budget, long before the test's 30-s sleep (margin for a loaded
        # machine; the footer says which limit).
        assert time.monotonic() - started < 25
        assert result.ok and "wall-clock limit" in result.output, result.output
        assert result.exhausted and result.budget["cpu_s_left"] == 0
        refused = manager.call("cpu", "view", {"path": "."})
        assert not refused.ok and "test-time" in refused.error
    finally:
        manager.stop()
    manager = make_manager(tmp_path / "wall", max_wall_s=0.5)
    try:
        manager.open(toy.spec(""), "wall")
        time.sleep(0.6)
        result = manager.call("wall", "view", {"path": "."})
        assert not result.ok and result.exhausted and "wall-clock budget" in result.error
    finally:
        manager.stop()


def test_idle_sessions_expire_and_max_sessions_holds(tmp_path, toy):
    manager = make_manager(tmp_path, idle_timeout_s=0.3, max_sessions=2)
    try:
        manager.open(toy.spec(""), "a")
        manager.open(toy.spec(""), "b")
        with pytest.raises(sessions.TooManySessionsError):
            manager.open(toy.spec(""), "c")
        directory = session_dir(manager, "a")
        deadline = time.monotonic() + 10
        while manager.num_open and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.num_open == 0 and not directory.exists()
        with pytest.raises(SessionNotFoundError, match="expired: idle for more than 0.3 s"):
            manager.call("a", "view", {"path": "."})
        manager.open(toy.spec(""), "c")  # room again
    finally:
        manager.stop()


def test_calls_on_one_session_queue_and_sessions_run_in_parallel(tmp_path, toy):
    manager = make_manager(tmp_path)
    try:
        manager.open(toy.spec(""), "busy")
        manager.open(toy.spec(""), "free")
        slow = "import time\n\n\ndef test_slow():\n    time.sleep(3)\n"
        manager.call("busy", "write_file", {"path": "tests/test_slow.py", "content": slow})

        async def scenario():
            run = asyncio.create_task(
                manager.call_async("busy", "run_tests", {"tests": ["tests/test_slow.py"]})
            )
            await asyncio.sleep(0.5)
            started = time.monotonic()
            other = await manager.call_async("free", "view", {"path": "."})
            other_s = time.monotonic() - started
            same = await manager.call_async("busy", "view", {"path": "."})
            same_s = time.monotonic() - started
            return await run, other, other_s, same, same_s

        run, other, other_s, same, same_s = asyncio.run(scenario())
        assert run.ok and "1 passed" in run.output
        # Another session is not held up; the same session's call waited for the run. Ordered,
        # not timed: both are slower on a loaded machine.
        assert other.ok and same.ok and other_s < same_s
        assert same_s > 1.5
    finally:
        manager.stop()


# -- restart --------------------------------------------------------------------------------


def test_a_restarted_executor_has_no_sessions_left(tmp_path, toy):
    work_dir = tmp_path / "work"
    sessions_dir = work_dir / sessions.SESSIONS_DIR_NAME

    async def open_one(url):
        async with ExecutorClient(url, max_attempts=1) as client:
            await client.open_session(toy.spec(""), "survivor")
            result = await client.call_tool("survivor", "write_file", {"path": "f", "content": "x"})
            assert result.ok

    async def gone(url):
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/session/survivor") as response:
                return response.status

    process, url = testing_executor.start_executor_process(work_dir)
    try:
        asyncio.run(open_one(url))
        assert len(list(sessions_dir.iterdir())) == 1
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert len(list(sessions_dir.iterdir())) == 1  # a killed executor leaves its session behind
    process, url = testing_executor.start_executor_process(work_dir)
    try:
        assert list(sessions_dir.iterdir()) == []
        assert asyncio.run(gone(url)) == 404
    finally:
        process.terminate()
        process.wait()


def test_config_checks_name_the_key():
    for key, value in (
        ("max_sessions", 0),
        ("idle_timeout_s", -1),
        ("max_turns", 1.5),
        ("max_cpu_s", float("nan")),
        ("max_tool_output_bytes", 100),
    ):
        with pytest.raises(ValueError, match=key):
            SessionConfig(**{key: value})


def test_threads_are_not_leaked_by_stop(tmp_path, toy):
    before = threading.active_count()
    manager = make_manager(tmp_path)
    manager.open(toy.spec(""), "t")
    manager.call("t", "view", {"path": "."})
    manager.stop()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before
    assert list(manager.sessions_dir.iterdir()) == []
