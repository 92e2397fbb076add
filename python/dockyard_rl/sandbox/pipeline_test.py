"""End-to-end scoring with real git, real pytest and real bubblewrap — no mocks.

The hostile patches below each try one way of getting a reward without fixing the bug (or of
hurting the executor); every one must end in an unresolved Verdict, never an exception.
"""

import dataclasses
import json
import pathlib
import signal
import socket
import threading
import time

import pytest

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.task import ApplyMethod, FailureKind, RewardMode, TestOutcome
from dockyard_rl.sandbox.testing_repos import (
    OPS_BASE,
    OPS_FIXED,
    TEST_MUL_TABLE,
    TEST_OPS_FIXED,
    make_toy_repo,
)
from dockyard_rl.utils.config import from_dict

# The capability screen (step 4b) would refuse most hostile patches below before they run; it is
# off here so that each run-time layer is tested on its own (capability_screen_test tests the
# screen, test_the_capability_screen_is_on_by_default its place in the pipeline).
CONFIG = pipeline.PipelineConfig(
    timeout_s=60,
    cpu_time_s=60,
    memory_bytes=2 * 1024**3,
    max_num_processes=64,
    max_log_bytes=16 * 1024,
    capability_screen=False,
)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("pipeline") / "toy")


@pytest.fixture(scope="module")
def work_root(tmp_path_factory):
    return tmp_path_factory.mktemp("work")


def _score(toy, work_root, patch, config=CONFIG, **spec_kwargs):
    verdict = pipeline.score_task(toy.spec(patch, **spec_kwargs), config, work_root)
    assert list((work_root / "tasks").iterdir()) == []  # the task directory was cleaned up
    return verdict


def _ops_with(prelude: str, fixed: bool = False) -> dict[str, str]:
    """calc/ops.py with hostile code run at import (i.e. during pytest's collection)."""
    return {"calc/ops.py": prelude + "\n\n" + (OPS_FIXED if fixed else OPS_BASE)}


# Hostile code reports what it saw by printing at once; the tests that use this run pytest with
# -s (no capture), since the runner leaves with os._exit and atexit handlers never run.
_SAY = (
    "import os as _os\n"
    "class _Lines(list):\n"
    "    def append(self, line):\n"
    "        _os.write(1, (line + '\\n').encode())\n"
    "_LINES = _Lines()\n"
)
_UNCAPTURED = "python -m pytest -s tests/test_ops.py tests/test_mul_table.py"


def _assert_not_resolved(verdict):
    assert not verdict.resolved and verdict.reward == 0.0
    assert verdict.fail_to_pass and all(
        o != TestOutcome.PASSED for o in verdict.fail_to_pass.values()
    )


# --- the four basic outcomes ------------------------------------------------------------------


def test_gold_patch_is_resolved(toy, work_root):
    verdict = _score(toy, work_root, toy.gold_patch)
    assert verdict.resolved and verdict.reward == 1.0, verdict.log_tail
    assert verdict.apply_method == ApplyMethod.GIT_APPLY
    # The executor's must-fail canary makes every honest run exit 1.
    assert verdict.test_exit_code == 1 and not verdict.timed_out
    assert verdict.failure_kind == FailureKind.NONE and verdict.failure_detail == ""
    assert set(verdict.fail_to_pass.values()) == {TestOutcome.PASSED}
    assert set(verdict.pass_to_pass.values()) == {TestOutcome.PASSED}
    assert "tests/test_mul_table.py::test_table[2 x 3]" in verdict.fail_to_pass
    assert {"checkout", "apply", "tests", "total"} <= set(verdict.timings_s)
    assert verdict.integrity_violation == ()


def test_empty_patch_is_not_resolved(toy, work_root):
    verdict = _score(toy, work_root, "")
    _assert_not_resolved(verdict)
    assert verdict.apply_method == ApplyMethod.EMPTY and verdict.test_exit_code == 1
    assert set(verdict.fail_to_pass.values()) == {TestOutcome.FAILED}
    assert set(verdict.pass_to_pass.values()) == {TestOutcome.PASSED}


def test_wrong_patch_reports_per_test_outcomes(toy, work_root):
    verdict = _score(toy, work_root, toy.wrong_patch, reward_mode=RewardMode.PASS_RATE)
    assert not verdict.resolved
    assert set(verdict.fail_to_pass.values()) == {TestOutcome.PASSED}
    assert (
        verdict.pass_to_pass["tests/test_ops.py::test_sub[five minus three]"] == TestOutcome.FAILED
    )
    assert verdict.pass_to_pass["tests/test_ops.py::test_add"] == TestOutcome.PASSED
    assert verdict.reward == pytest.approx(7 / 8)


def test_patch_that_does_not_apply_is_reported(toy, work_root):
    verdict = _score(toy, work_root, toy.conflicting_patch)
    _assert_not_resolved(verdict)
    assert verdict.apply_method == ApplyMethod.FAILED and verdict.test_exit_code is None
    assert "did not apply" in verdict.log_tail


# --- hostile patches --------------------------------------------------------------------------


def test_editing_a_held_out_test_scores_zero_without_running(toy, work_root):
    patch = toy.patch_for(
        {"calc/ops.py": OPS_FIXED, "tests/test_ops.py": "def test_add():\n    pass\n"}
    )
    verdict = _score(toy, work_root, patch)
    _assert_not_resolved(verdict)
    assert verdict.integrity_violation == ("tests/test_ops.py",)
    assert verdict.apply_method == ApplyMethod.NOT_ATTEMPTED and verdict.test_exit_code is None


def test_conftest_forcing_passes_is_a_violation(toy, work_root):
    conftest = (
        "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    for name in ("conftest.py", "tests/conftest.py"):
        verdict = _score(toy, work_root, toy.patch_for({name: conftest}))
        _assert_not_resolved(verdict)
        assert verdict.integrity_violation == (name,)


def test_fake_passed_lines_and_exit_zero(toy, work_root):
    # After the real run, print a fake all-green summary and force exit status 0 from atexit:
    # the runner leaves with os._exit before atexit handlers could run, so the honest failures
    # stand.
    prelude = (
        "import atexit, os\n"
        "def _lie():\n"
        "    os.write(1, b'tests/test_ops.py::test_mul PASSED\\n')\n"
        "    os._exit(0)\n"
        "atexit.register(_lie)\n"
    )
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude)))
    _assert_not_resolved(verdict)
    assert verdict.failure_kind == FailureKind.TESTS_FAILED
    assert "tests/test_ops.py::test_mul PASSED" not in verdict.log_tail
    assert verdict.test_exit_code == 1
    assert {"exit_hook: atexit", "forced_exit: os._exit"} <= set(verdict.screening_flags)


def test_exit_zero_during_collection(toy, work_root):
    prelude = "import os\nos._exit(0)\n"
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude, fixed=True)))
    _assert_not_resolved(verdict)
    assert verdict.test_exit_code == 0
    assert verdict.failure_kind == FailureKind.REPORT_UNTRUSTED
    assert "before the runner finished" in verdict.failure_detail


def test_replaced_stdout_printing_passes(toy, work_root):
    # SWE-bench #601: replace sys.stdout so the log only ever says PASSED.
    prelude = (
        "import sys\n"
        "class _Liar:\n"
        "    def write(self, text):\n"
        "        sys.__stdout__.write(text.replace('FAILED', 'PASSED').replace('F', '.'))\n"
        "    def flush(self):\n"
        "        sys.__stdout__.flush()\n"
        "    def __getattr__(self, name):\n"
        "        return getattr(sys.__stdout__, name)\n"
        "sys.stdout = _Liar()\n"
    )
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude)))
    _assert_not_resolved(verdict)
    assert verdict.test_exit_code == 1
    assert set(verdict.fail_to_pass.values()) == {TestOutcome.FAILED}


def test_network_connection_is_blocked(toy, work_root):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    # The "fix" only works if the code can phone home.
    prelude = (
        _SAY + "import socket\n"
        "_ONLINE = False\n"
        f"for _host in [('127.0.0.1', {port}), ('1.1.1.1', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(_host, timeout=2).sendall(b'escaped')\n"
        "        _ONLINE = True\n"
        "    except OSError as error:\n"
        "        _LINES.append(f'NETWORK BLOCKED {_host} {error}')\n"
    )
    ops = OPS_BASE.replace(
        "    return a + b\n\n\ndef clamp", "    return a * b if _ONLINE else a + b\n\n\ndef clamp"
    )
    verdict = _score(
        toy,
        work_root,
        toy.patch_for({"calc/ops.py": prelude + "\n\n" + ops}),
        test_command=_UNCAPTURED,
    )
    _assert_not_resolved(verdict)
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()
    assert verdict.log_tail.count("NETWORK BLOCKED") == 2, verdict.log_tail[-2000:]


def test_writes_outside_the_worktree_are_blocked(toy, work_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    mirrors = work_root / "mirrors"
    targets = [
        str(outside / "marker"),
        "/etc/dockyard_marker",
        str(mirrors / "planted"),
        str(work_root / "planted"),
        "/usr/lib/planted",
    ]
    prelude = (
        _SAY + "import subprocess\n"
        "_ESCAPED = False\n"
        f"for _path in {targets!r}:\n"
        "    try:\n"
        "        open(_path, 'w').write('x')\n"
        "        _ESCAPED = True\n"
        "    except OSError as error:\n"
        "        _LINES.append(f'WRITE BLOCKED {_path} {type(error).__name__}')\n"
        "_LINES.append('HISTORY ' + repr(subprocess.run(\n"
        "    ['git', 'log', '--all', '--format=%s'], capture_output=True,\n"
        "    text=True).stdout.split()))\n"
    )
    ops = OPS_BASE.replace(
        "    return a + b\n\n\ndef clamp", "    return a * b if _ESCAPED else a + b\n\n\ndef clamp"
    )
    verdict = _score(
        toy,
        work_root,
        toy.patch_for({"calc/ops.py": prelude + "\n\n" + ops}),
        test_command=_UNCAPTURED,
    )
    _assert_not_resolved(verdict)
    for target in targets:
        assert not pathlib.Path(target).exists(), target
    assert "fix mul" not in verdict.log_tail  # the future commit is not in the worktree's git
    assert verdict.log_tail.count("WRITE BLOCKED") == len(targets), verdict.log_tail[-2000:]
    # `git log --all` inside the sandbox sees the base commit and nothing after it.
    assert "HISTORY ['introduce', 'mul']" in verdict.log_tail, verdict.log_tail[:3000]


def test_fork_bomb_is_killed_at_the_limit(toy, work_root):
    prelude = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    config = pipeline.PipelineConfig(
        **{**CONFIG.__dict__, "timeout_s": 3.0, "max_num_processes": 32}
    )
    start = time.monotonic()
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude, fixed=True)), config)
    _assert_not_resolved(verdict)
    assert verdict.timed_out and verdict.test_exit_code is None
    assert time.monotonic() - start < 20


def test_endless_loop_is_killed_at_the_task_timeout(toy, work_root):
    ops = OPS_BASE.replace(
        "    return a + b\n\n\ndef clamp", "    while True:\n        pass\n\n\ndef clamp"
    )
    start = time.monotonic()
    verdict = _score(toy, work_root, toy.patch_for({"calc/ops.py": ops}), timeout_s=2.0)
    _assert_not_resolved(verdict)
    assert verdict.timed_out and verdict.failure_kind == FailureKind.TIMEOUT
    # The task's baseline finishes in time: the limit is the patch's failure, not masked.
    assert not verdict.limit_outcome and "charged to the patch" in verdict.failure_detail
    assert time.monotonic() - start < 30
    assert "wall-clock limit" in verdict.log_tail


# --- limits are the patch's failure unless the task's baseline hits them too -----------------


def _assert_charged(verdict, kind):
    _assert_not_resolved(verdict)
    assert verdict.failure_kind == kind, (verdict.failure_kind, verdict.failure_detail)
    assert not verdict.limit_outcome


def test_spinning_into_the_cpu_limit_is_the_patchs_failure(toy, work_root):
    ops = OPS_BASE.replace(
        "    return a + b\n\n\ndef clamp", "    while True:\n        pass\n\n\ndef clamp"
    )
    config = dataclasses.replace(CONFIG, cpu_time_s=2)
    verdict = _score(toy, work_root, toy.patch_for({"calc/ops.py": ops}), config=config)
    assert not verdict.timed_out and verdict.test_exit_code == 128 + signal.SIGXCPU
    _assert_charged(verdict, FailureKind.CPU_LIMIT)
    assert "charged to the patch" in verdict.failure_detail
    assert not _score(toy, work_root, "").limit_outcome  # an ordinary failure is not one


def test_sleeping_past_the_wall_clock_is_the_patchs_failure(toy, work_root):
    # The hedge the second attack catalogue tries: sleep out the clock whenever the fix is not
    # there.
    ops = OPS_BASE.replace(
        "def mul(a, b):\n", "def mul(a, b):\n    import time\n    time.sleep(60)\n"
    )
    verdict = _score(toy, work_root, toy.patch_for({"calc/ops.py": ops}), timeout_s=2.0)
    assert verdict.timed_out
    _assert_charged(verdict, FailureKind.TIMEOUT)


def test_hanging_in_collection_is_the_patchs_failure(toy, work_root):
    verdict = _score(
        toy, work_root, toy.patch_for(_ops_with("import time\ntime.sleep(600)\n")), timeout_s=2.0
    )
    assert verdict.timed_out
    _assert_charged(verdict, FailureKind.TIMEOUT)


@pytest.mark.parametrize(
    "sent, kind",
    [
        (signal.SIGKILL, FailureKind.REPORT_UNTRUSTED),
        (signal.SIGSEGV, FailureKind.REPORT_UNTRUSTED),
        # A forged CPU-limit status: named as one, charged like one.
        (signal.SIGXCPU, FailureKind.CPU_LIMIT),
    ],
)
def test_killing_itself_with_a_signal_is_the_patchs_failure(toy, work_root, sent, kind):
    prelude = f"import os, signal\nos.kill(os.getpid(), {int(sent)})\n"
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude, fixed=True)))
    assert not verdict.timed_out and verdict.test_exit_code == 128 + sent
    _assert_charged(verdict, kind)


def test_a_task_whose_baseline_hits_the_limit_is_masked_and_the_baseline_is_cached(toy, work_root):
    # A held-out test that always sleeps past the clock: no patch can finish this task here, so
    # a limit outcome says nothing about the patch.
    slow_tests = toy.patch_for(
        {
            "tests/test_ops.py": TEST_OPS_FIXED,
            "tests/test_mul_table.py": TEST_MUL_TABLE,
            "tests/test_slow.py": "import time\n\n\ndef test_slow():\n    time.sleep(60)\n",
        }
    )
    sleeper = OPS_BASE.replace(
        "def mul(a, b):\n", "def mul(a, b):\n    import time\n    time.sleep(60)\n"
    )
    verdicts = [
        pipeline.score_task(
            dataclasses.replace(
                toy.spec(patch, timeout_s=1.5, instance_id=f"slow-{index}"), test_patch=slow_tests
            ),
            CONFIG,
            work_root,
        )
        for index, patch in enumerate(["", toy.gold_patch, toy.patch_for({"calc/ops.py": sleeper})])
    ]
    for verdict in verdicts:
        assert verdict.failure_kind == FailureKind.TIMEOUT and verdict.reward == 0.0
        assert verdict.limit_outcome, verdict.failure_detail
        assert "baseline" in verdict.failure_detail and "hits a limit too" in verdict.failure_detail
    # The baseline ran for the first submission only.
    assert ["baseline" in verdict.timings_s for verdict in verdicts] == [True, False, False]


def test_the_baseline_cache_runs_once_per_key_and_stays_bounded():
    cache = pipeline._BaselineCache()
    calls = []
    started = threading.Event()

    def run():
        calls.append(1)
        started.set()
        time.sleep(0.2)  # the other threads arrive while it runs
        return FailureKind.TIMEOUT

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_run(("k",), 2, run)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and results == [FailureKind.TIMEOUT] * 4

    def fail():
        raise pipeline.InfrastructureError("the sandbox could not start")

    with pytest.raises(pipeline.InfrastructureError):
        cache.get_or_run(("x",), 2, fail)
    assert cache.get_or_run(("x",), 2, lambda: None) is None  # a failed run is not remembered
    cache.get_or_run(("y",), 2, lambda: None)
    # Bounded: ("k",) was the least recently used of three, so it is run again.
    assert cache.get_or_run(("k",), 2, lambda: FailureKind.CPU_LIMIT) is FailureKind.CPU_LIMIT


# --- nothing the patch controls becomes an infrastructure error --------------------------------


def test_a_patch_that_is_not_unicode_text_is_invalid(toy, work_root):
    # JSON lets a client send lone surrogates; no file or UTF-8 encoder accepts them.
    patch = toy.patch_for({"calc/ops.py": OPS_FIXED}) + "+# \udcff\n"
    verdict = _score(toy, work_root, patch)
    _assert_not_resolved(verdict)
    assert verdict.failure_kind == FailureKind.PATCH_INVALID
    assert verdict.apply_method == ApplyMethod.NOT_ATTEMPTED and verdict.test_exit_code is None


def test_a_patch_parser_that_raises_makes_the_patch_invalid(toy, work_root, monkeypatch):
    # Stands for a parser bug some hostile patch text triggers (the parsers are fuzzed in their
    # own tests): the pipeline still answers with a verdict.
    def crash(patch):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(pipeline.screening, "screen_patch", crash)
    verdict = _score(toy, work_root, toy.gold_patch)
    _assert_not_resolved(verdict)
    assert verdict.failure_kind == FailureKind.PATCH_INVALID and "RecursionError" in (
        verdict.failure_detail
    )


def test_a_grader_that_raises_is_an_untrusted_report():
    def crash():
        raise KeyError("a record field the grader did not expect")

    grade = pipeline._grade_safely(crash)
    assert not grade.resolved and grade.reward == 0.0
    assert grade.failure_kind == FailureKind.REPORT_UNTRUSTED and "KeyError" in grade.detail


def test_odd_file_names_are_verdicts_in_valid_text(toy, work_root):
    ok = {
        "calc/ops.py": OPS_FIXED,
        "calc/\udcffodd.py": "x = 1\n",  # the byte 0xff: not UTF-8
        "calc/new\nline.py": "y = 2\n",
        "calc/\u00fcml\u00e4ut \u2603.py": "z = 3\n",
        "calc/" + "d/" * 300 + "deep.py": "w = 4\n",
        "calc/" + "n" * 250 + ".py": "v = 5\n",
        "calc/-rf": "dash\n",
        "calc/*?[": "glob\n",
        "calc/:(top)x": "pathspec magic\n",
    }
    verdict = _score(toy, work_root, toy.patch_for(ok))
    assert verdict.resolved, verdict.failure_detail
    refused = _score(toy, work_root, toy.patch_for({**ok, "\udcffodd.pth": "import os\n"}))
    _assert_not_resolved(refused)
    assert refused.failure_kind == FailureKind.INTEGRITY_VIOLATION
    assert refused.integrity_violation == ("\\xffodd.pth",)
    json.dumps(refused.to_dict(), ensure_ascii=False).encode("utf-8")  # no lone surrogate left


def test_huge_output_is_bounded(toy, work_root):
    prelude = (
        "import atexit, os\n"
        "def _flood():\n"
        "    line = b'spam ' * 209716 + b'\\n'\n"  # ~1 MiB a line, 100 MiB in all
        "    for _ in range(100):\n"
        "        os.write(1, line)\n"
        "atexit.register(_flood)\n"
    )
    start = time.monotonic()
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude)))
    _assert_not_resolved(verdict)
    assert len(verdict.log_tail.encode()) <= CONFIG.max_log_bytes + 1024
    assert "bytes of output omitted" in verdict.log_tail
    assert time.monotonic() - start < 30
    # The flood does not confuse grading: the same flood with the real fix still resolves.
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude, fixed=True)))
    assert verdict.resolved, verdict.log_tail[-2000:]


def test_report_rewritten_by_a_plugin_the_repository_registers(toy, work_root):
    # An adaptive forger: finds the running pytest Config through the garbage collector,
    # registers a plugin that rewrites the report after pytest wrote it (all passed, this run's
    # suite name read from the config) and forces exit status 0.
    prelude = """\
import gc, os

class _Forger:
    def _finish(self, session):
        config = session.config
        path = config.option.xmlpath
        suite = config.getini("junit_suite_name")
        cases = "".join(f'<testcase classname="{i.nodeid.split("::")[0][:-3].replace("/", ".")}" '
                        f'name="{i.name}" />' for i in session.items)
        with open(path, "w") as handle:
            handle.write(f'<testsuites><testsuite name="{suite}">{cases}</testsuite></testsuites>')
        os._exit(0)

# Named at run time, so that no hook is visible in the source.
setattr(_Forger, "pytest_" + "sessionfinish", _Forger._finish)
for _obj in gc.get_objects():
    if type(_obj).__name__ == "Config" and hasattr(_obj, "pluginmanager"):
        _obj.pluginmanager.register(_Forger(), "forger")
        break
"""
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude)))
    _assert_not_resolved(verdict)
    assert verdict.failure_kind == FailureKind.TAMPERING, verdict.failure_detail
    assert "plugin 'forger' registered by repository code" in verdict.failure_detail
    assert "introspection: gc.get_objects" in verdict.screening_flags


def test_canned_reports_in_the_repository_and_exit_zero(toy, work_root):
    canned = (
        '<testsuites><testsuite name="pytest"><testcase classname="tests.test_ops" '
        'name="test_mul" /></testsuite></testsuites>\n'
    )
    # Reports committed into the repository, where a naive harness might pick them up.
    files = {
        **_ops_with("import os\nos._exit(0)\n"),
        "junit.xml": canned,
        "report.xml": canned,
        "tests/junit.xml": canned,
    }
    verdict = _score(toy, work_root, toy.patch_for(files))
    _assert_not_resolved(verdict)
    assert verdict.apply_method == ApplyMethod.GIT_APPLY
    assert verdict.failure_kind == FailureKind.REPORT_UNTRUSTED


# --- errors and configuration -----------------------------------------------------------------


def test_infrastructure_failures_raise(toy, work_root):
    spec = toy.spec(toy.gold_patch)
    unreachable = type(spec)(**{**spec.__dict__, "repo": "https://127.0.0.1:9/nothing.git"})
    with pytest.raises(pipeline.InfrastructureError):
        pipeline.score_task(unreachable, CONFIG, work_root)
    unknown = type(spec)(**{**spec.__dict__, "base_commit": "0" * 40})
    with pytest.raises(pipeline.InfrastructureError, match="not found"):
        pipeline.score_task(unknown, CONFIG, work_root)
    assert list((work_root / "tasks").iterdir()) == []


def test_malformed_tasks_are_value_errors(toy, work_root):
    spec = toy.spec(toy.gold_patch)
    for field, value in [
        ("base_commit", "HEAD"),
        ("repo", "ext::sh -c id"),
        ("test_patch", "not a diff"),
    ]:
        with pytest.raises(ValueError, match=field):
            pipeline.score_task(type(spec)(**{**spec.__dict__, field: value}), CONFIG, work_root)


def test_custom_test_command(toy, work_root):
    verdict = _score(
        toy,
        work_root,
        toy.gold_patch,
        test_command="python -m pytest -p no:cacheprovider tests/test_ops.py",
    )
    # Only test_ops.py ran: the table tests are missing, so not resolved.
    assert not verdict.resolved
    assert verdict.fail_to_pass["tests/test_ops.py::test_mul"] == TestOutcome.PASSED
    assert verdict.fail_to_pass["tests/test_mul_table.py::test_table[2 x 3]"] == TestOutcome.MISSING


@pytest.mark.parametrize(
    "key, value",
    [
        ("timeout_s", 0),
        ("cpu_time_s", -1),
        ("memory_bytes", 1024),
        ("max_num_processes", 1.5),
        ("max_num_open_files", 4),
        ("max_log_bytes", True),
        ("cache_dir", ""),
        ("max_baseline_entries", 0),
        ("capability_screen", "yes"),
    ],
)
def test_config_is_validated(key, value):
    with pytest.raises(ValueError, match=f"pipeline.{key}"):
        from_dict(pipeline.PipelineConfig, {key: value}, "pipeline")


def test_config_from_yaml_dict():
    config = from_dict(pipeline.PipelineConfig, {"timeout_s": 10, "cache_dir": "/x"}, "pipeline")
    assert config.limits(None).wall_timeout_s == 10 and config.limits(2.5).wall_timeout_s == 2.5
    assert config.cache_path(pathlib.Path("/w")) == pathlib.Path("/x")
    assert pipeline.PipelineConfig().cache_path(pathlib.Path("/w")) == pathlib.Path("/w/mirrors")


@pytest.mark.parametrize(
    "extra, kind",
    [
        # File mode 000 (git apply accepts it; the tree and the sandbox must still read it).
        (
            "diff --git a/calc/x.py b/calc/x.py\nnew file mode 100000\n--- /dev/null\n"
            "+++ b/calc/x.py\n@@ -0,0 +1 @@\n+x = 1\n",
            FailureKind.NONE,
        ),
        # A folder where a held-out test file must go.
        (
            "diff --git a/tests/test_mul_table.py/x b/tests/test_mul_table.py/x\n"
            "new file mode 100644\n--- /dev/null\n+++ b/tests/test_mul_table.py/x\n"
            "@@ -0,0 +1 @@\n+x = 1\n",
            FailureKind.INTEGRITY_VIOLATION,
        ),
        # Attributes that would make git re-encode the held-out files it restores.
        (
            "diff --git a/.gitattributes b/.gitattributes\nnew file mode 100644\n"
            "--- /dev/null\n+++ b/.gitattributes\n@@ -0,0 +1 @@\n"
            "+* text eol=crlf working-tree-encoding=UTF-16\n",
            FailureKind.INTEGRITY_VIOLATION,
        ),
    ],
)
def test_tree_tricks_on_the_git_paths_are_verdicts(toy, work_root, extra, kind):
    verdict = _score(toy, work_root, toy.gold_patch + extra)
    assert verdict.failure_kind == kind, verdict.failure_detail
    assert verdict.resolved == (kind == FailureKind.NONE)


def test_the_capability_screen_is_on_by_default(toy, work_root):
    prelude = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    config = dataclasses.replace(CONFIG, capability_screen=True)
    assert pipeline.PipelineConfig().capability_screen
    verdict = _score(toy, work_root, toy.patch_for(_ops_with(prelude, fixed=True)), config)
    _assert_not_resolved(verdict)
    assert verdict.failure_kind == FailureKind.UNSAFE_CAPABILITY and not verdict.limit_outcome
    assert verdict.test_exit_code is None  # refused before any test ran
