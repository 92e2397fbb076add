"""The test runner's entry point INSIDE the sandbox: starts pytest isolated and reports on it.

This file is executed by the sandboxed interpreter as a script
(`python -s -P -B <runner dir>/runner_bootstrap.py`, or without -P for a task image's older
interpreter); it imports nothing from dockyard_rl and only the standard library and pytest, and
runs on Python 3.8 or later (audit hooks). The executor side is `sandbox/runner.py`, which builds
the sandbox, feeds this script its settings and reads what it reports.

What it does, in order (the order is the point):
1. Reads its settings (JSON) from stdin, then points stdin at /dev/null. Nothing of the run's
   secrets (report path, suite nonce, canary names, result fds) is in argv, the environment or a
   file the tests can read: they live in this process's memory only.
2. Copies the read-only source tree (`source_dir`, the patched worktree on the host) into the
   size-capped tmpfs at `worktree_dir`, iteratively (no recursion limit). A full tmpfs ends the
   run with a `setup_error` record of kind "disk_limit".
3. Imports pytest, pluggy and the builtin plugins from site-packages while nothing of the
   worktree is on sys.path (`-P`: no script dir; `-s`: no user site; the executor's environment
   sets PYTEST_DISABLE_PLUGIN_AUTOLOAD, so no entry-point plugin loads), and snapshots the
   identity of every attribute of those modules and of their classes.
4. Installs an audit hook (before any repository code is imported) that records writes,
   renames and deletions of the report file from anywhere but pytest's own JUnit writer, and
   notes introspection that tampering needs (gc.get_objects / get_referrers, ctypes).
5. Puts the worktree first on sys.path (what `python -m pytest` in the worktree does) and runs
   `pytest.main` in-process with `RunnerPlugin`, which
   - adds two canary tests from an executor-owned file with an unpredictable name (one must
     pass, one must fail) after collection and deselection, at the end of the run;
   - streams one JSON line per test phase as it finishes (outcome from the report, plus whether
     the phase really raised, read from the CallInfo) on the events fd;
   - flags plugins registered by anything but pytest itself, and changes to the runner's
     objects (checked after every test and at the end);
   - after pytest's JUnit writer ran, sends the report's bytes on the report fd and a
     `session_end` record with their sha256.
6. Sends an `exit` record (pytest's exit code, the report's digest now) and leaves with
   `os._exit`, captured at start-up, so atexit handlers registered by the tests never run.

Records (one JSON object per line on the events fd): setup_error, test, collect_error, plugin,
tamper, note, session_end, exit. The executor cross-checks them with the report, the canaries
and the real exit status (`sandbox/grading.py`).

Not covered, and cannot be from inside the process: code under test runs in this interpreter
and can in principle read this process's memory, close or forge the result fds and rewrite
anything. This script makes the generic tricks visible; the residual risk is an attacker that
reimplements this protocol exactly (docs/sandbox.md, "threat model").
"""

import errno
import hashlib
import inspect
import io
import json
import os
import pathlib
import shutil
import stat
import sys
import tempfile

# Captured before any untrusted code runs: later rebinding of these names cannot stop the report.
_write = os.write
_exit = os._exit
_basename = os.path.basename
_getframe = sys._getframe
_dumps = json.dumps

_MAX_RECORDS_PER_KIND = 200
_COPY_CHUNK = 1 << 20
_SETUP_FAILED_EXIT = 3
_PROTECTED_PREFIXES = ("pytest", "_pytest", "pluggy")
# Attributes pytest itself rebinds while it runs: assertion-rewriting state, lazily built doctest
# classes, the debugger's session state.
_MUTABLE_ATTRIBUTES = {
    ("_pytest.assertion.util", "_reprcompare"),
    ("_pytest.assertion.util", "_assertion_pass"),
    ("_pytest.assertion.util", "_config"),
    ("_pytest.doctest", "RUNNER_CLASS"),
    ("_pytest.doctest", "CHECKER_CLASS"),
    ("_pytest.debugging.pytestPDB", "_saved"),
    ("_pytest.debugging.pytestPDB", "_recursive_debug"),
    ("_pytest.debugging.pytestPDB", "_wrapped_pdb_cls"),
}
# ... and those its own plugins set once while configuring (legacypath, debugging). The runner
# compares against its start-up snapshot when the session starts, allowing exactly these, then
# takes a fresh snapshot for the rest of the run.
_CONFIGURE_CHANGES = {
    ("_pytest.config.Config", "_getini_unknown_type"),
    ("_pytest.debugging.pytestPDB", "_pluginmanager"),
    ("_pytest.debugging.pytestPDB", "_config"),
}


class Reporter:
    """Writes records to the events fd; never raises (a closed fd is itself evidence)."""

    def __init__(self, fd):
        self.fd = fd
        self.counts = {}

    def send(self, event, /, **fields):
        count = self.counts.get(event, 0)
        if count >= _MAX_RECORDS_PER_KIND and event in ("tamper", "note"):
            return
        self.counts[event] = count + 1
        fields["event"] = event
        self.send_bytes(self.fd, (_dumps(fields, default=str) + "\n").encode("utf-8", "replace"))

    def send_bytes(self, fd, data):
        try:
            view = memoryview(data)
            while view:
                view = view[_write(fd, view) :]
        except OSError:
            pass


def copy_tree(source, dest):
    """Copies `source` into the existing directory `dest`, without recursion (shutil.copytree
    recurses, and a patch can nest directories past Python's recursion limit) and without following
    symlinks; keeps file modes. Raises OSError (ENOSPC when the tmpfs is full)."""
    pending = [(source, dest)]
    while pending:
        src_dir, dst_dir = pending.pop()
        with os.scandir(src_dir) as entries:
            for entry in entries:
                target = os.path.join(dst_dir, entry.name)
                if entry.is_symlink():
                    os.symlink(os.readlink(entry.path), target)
                elif entry.is_dir(follow_symlinks=False):
                    os.mkdir(target, 0o755)
                    pending.append((entry.path, target))
                elif entry.is_file(follow_symlinks=False):
                    with open(entry.path, "rb") as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, _COPY_CHUNK)
                    os.chmod(
                        target,
                        stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode) | stat.S_IWUSR,
                    )


def protected_modules():
    return {
        name: module
        for name, module in list(sys.modules.items())
        if module is not None and name.split(".")[0] in _PROTECTED_PREFIXES
    }


def snapshot_runner():
    """[(label, holder, attribute, object)] for every attribute of the runner's modules and of
    their classes, plus the few functions the report's writing and the exit go through. Objects
    are kept (not ids) so that an id cannot be reused by a replacement."""
    import builtins

    snapshot = []
    for name, module in protected_modules().items():
        snapshot.append(("sys.modules", sys.modules, name, module))
        for attr, value in list(vars(module).items()):
            if (name, attr) in _MUTABLE_ATTRIBUTES:
                continue
            snapshot.append((name, module, attr, value))
            if isinstance(value, type) and getattr(value, "__module__", "") == name:
                label = f"{name}.{value.__qualname__}"
                for class_attr, class_value in list(vars(value).items()):
                    if (label, class_attr) not in _MUTABLE_ATTRIBUTES:
                        snapshot.append((label, value, class_attr, class_value))
    for module, attrs in (
        (builtins, ("open", "print", "__import__")),
        (io, ("open", "FileIO")),
        (os, ("_exit", "write", "open", "replace", "rename")),
        (sys, ("exit",)),
    ):
        for attr in attrs:
            snapshot.append((module.__name__, module, attr, getattr(module, attr)))
    return snapshot


def changed_runner_objects(snapshot, allowed=frozenset()):
    """Labels of the snapshot's attributes that were rebound or deleted since, but `allowed`
    ((label, attribute) pairs)."""
    missing = object()
    changed = []
    for label, holder, attr, value in snapshot:
        current = (
            holder.get(attr, missing)
            if isinstance(holder, dict)
            else vars(holder).get(attr, missing)
        )
        if current is not value and (label, attr) not in allowed:
            changed.append(f"{label}.{attr} was {'deleted' if current is missing else 'replaced'}")
    return changed


class Guard:
    """The audit hook's state: which file is the report and which code may write it."""

    def __init__(self, reporter, report_path):
        self.reporter = reporter
        self.report_name = _basename(report_path)
        self.writer_codes = set()
        self.busy = False

    def _from_writer(self):
        frame = _getframe(2)
        depth = 0
        while frame is not None and depth < 64:
            if frame.f_code in self.writer_codes:
                return True
            frame = frame.f_back
            depth += 1
        return False

    def __call__(self, event, args):
        if self.busy:
            return
        if event == "open":
            path, mode, flags = args
            if not isinstance(path, (str, bytes)):
                return
            if self.report_name not in os.fsdecode(path):
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC)
            )
            if writes:
                self.busy = True
                try:
                    if not self._from_writer():
                        self.reporter.send(
                            "tamper",
                            what="the report file was opened for "
                            "writing outside pytest's JUnit writer",
                        )
                finally:
                    self.busy = False
        elif event in (
            "os.rename",
            "os.remove",
            "os.truncate",
            "os.link",
            "os.symlink",
            "os.chmod",
            "os.utime",
            "shutil.move",
            "shutil.copyfile",
        ):
            for arg in args[:2]:
                if isinstance(arg, (str, bytes)) and self.report_name in os.fsdecode(arg):
                    self.reporter.send("tamper", what=f"{event} on the report file")
                    return
        elif (
            event == "object.__setattr__"
            and len(args) > 1
            and args[1] == "__code__"
            and callable(args[0])
        ):
            # Swapping a function's code rewrites a test without touching its file. (Only code:
            # the stdlib itself rebinds __defaults__ of its own functions.)
            self.reporter.send(
                "tamper",
                what=f"{args[1]} of {getattr(args[0], '__qualname__', '?')}"
                f" was replaced at run time",
            )
        elif event in (
            "gc.get_objects",
            "gc.get_referrers",
            "gc.get_referents",
        ) or event.startswith("ctypes."):
            self.reporter.send("note", what=event)


def make_plugin(pytest, settings, reporter, snapshot, report_path):
    canary_path = settings["canary_path"]
    patched = {
        os.path.join(settings["worktree_dir"], path) for path in settings.get("patched_files", ())
    }
    must_pass, must_fail = settings["canary_names"]
    raised = {}
    pytest_dirs = tuple(
        os.path.dirname(os.path.dirname(m.__file__)) + os.sep
        for m in (pytest, sys.modules["pluggy"])
    )
    import pluggy
    from _pytest.config import PytestPluginManager

    register_codes = {pluggy.PluginManager.register.__code__, PytestPluginManager.register.__code__}

    class CanaryItem(pytest.Item):
        def __init__(self, *, must_fail_, **kwargs):
            super().__init__(**kwargs)
            self.must_fail = must_fail_

        def runtest(self):
            if self.must_fail:
                raise AssertionError(f"{self.name}: expected value differs")

        def reportinfo(self):
            return self.path, None, self.name

    class CanaryFile(pytest.File):
        def collect(self):
            yield CanaryItem.from_parent(self, name=must_pass, must_fail_=False)
            yield CanaryItem.from_parent(self, name=must_fail, must_fail_=True)

    class RunnerPlugin:
        def __init__(self):
            self.tests_since_check = 0
            self.snapshot = snapshot
            self.reported = set()

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionstart(self, session):
            # Configuring is over (plugins set up, root conftests loaded): from the start-up
            # snapshot only pytest's own configure-time changes are allowed; then re-snapshot.
            self.check_runner(allowed=_CONFIGURE_CHANGES)
            self.snapshot = snapshot_runner()

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_collection_modifyitems(self, session, config, items):
            result = yield
            # Added after every other implementation ran, so deselection (-k, -m, --deselect)
            # cannot drop them, and last, so that -x stops at a real failure first. They are not
            # command-line arguments: those would change pytest's rootdir and ini-file search.
            if settings["canaries"]:
                canary_file = CanaryFile.from_parent(session, path=pathlib.Path(canary_path))
                items[:] = [item for item in items if not isinstance(item, CanaryItem)] + list(
                    canary_file.collect()
                )
            return result

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_makereport(self, item, call):
            report = yield
            excinfo = call.excinfo
            raised[(item.nodeid, call.when)] = excinfo is not None and not excinfo.errisinstance(
                pytest.skip.Exception
            )
            return report

        def pytest_runtest_logreport(self, report):
            reporter.send(
                "test",
                nodeid=report.nodeid,
                when=report.when,
                outcome=report.outcome,
                raised=raised.pop((report.nodeid, report.when), None),
            )
            if report.when == "teardown":
                self.tests_since_check += 1
                # Every test for small suites, then every 25th: the check walks ~10^4 objects.
                if self.tests_since_check <= 50 or self.tests_since_check % 25 == 0:
                    self.check_runner()

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_call(self, item):
            # A test must run its own code, and see the real runner, not substitutes planted by
            # code the patch changed (e.g. a package that rewrites the test module importing it).
            module = getattr(item, "module", None)
            module_file = getattr(module, "__file__", None)
            obj = getattr(item, "obj", None)
            try:
                code = getattr(inspect.unwrap(obj), "__code__", None) if obj is not None else None
            except Exception:  # noqa: BLE001 - unwrap of a hostile object
                code = None
            if code is not None and code.co_filename in patched and code.co_filename != module_file:
                reporter.send(
                    "tamper",
                    what=f"{item.nodeid} runs code from "
                    f"{code.co_filename}, a file the patch changed",
                )
            namespace = getattr(module, "__dict__", {})
            for name in _PROTECTED_PREFIXES:
                if name in namespace and namespace[name] is not sys.modules.get(name):
                    reporter.send(
                        "tamper",
                        what=f"{item.nodeid}: its module's {name!r} is not the real {name} module",
                    )

        def pytest_collectreport(self, report):
            if report.failed:
                reporter.send("collect_error", nodeid=report.nodeid)

        def pytest_plugin_registered(self, plugin, plugin_name, manager):
            frame = _getframe(1)
            while frame is not None and frame.f_code not in register_codes:
                frame = frame.f_back
            if frame is None:
                return  # a historic replay, not a registration happening now
            while frame is not None and frame.f_code in register_codes:
                frame = frame.f_back
            caller = frame.f_code.co_filename if frame is not None else ""
            if not caller.startswith(pytest_dirs) and caller != __file__:
                reporter.send("tamper", what=f"plugin {plugin_name!r} registered from {caller}")

        def check_runner(self, allowed=frozenset(), against=None):
            for change in changed_runner_objects(against or self.snapshot, allowed):
                if change not in self.reported and len(self.reported) < 20:
                    self.reported.add(change)
                    reporter.send("tamper", what=f"runner object changed: {change}")

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_sessionfinish(self, session, exitstatus):
            result = yield
            # pytest's JUnit writer (an inner implementation) has written the report by now.
            self.check_runner()
            data = read_report(report_path)
            reporter.send_bytes(settings["report_fd"], data)
            reporter.send(
                "session_end",
                exitstatus=int(session.exitstatus),
                report_sha256=hashlib.sha256(data).hexdigest(),
                num_report_bytes=len(data),
                disk=disk_usage(settings),
            )
            return result

    return RunnerPlugin()


def read_report(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def disk_usage(settings):
    usage = {}
    for name in ("worktree_dir", "tmp_dir"):
        try:
            info = os.statvfs(settings[name])
            usage[name] = {
                "free": info.f_bavail * info.f_frsize,
                "total": info.f_blocks * info.f_frsize,
            }
        except OSError:
            pass
    return usage


def main():
    # Without -P (an image's interpreter older than 3.11) the script's own folder is first on
    # sys.path; it holds only this file and the canary file, but nothing should import from it.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    settings = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd in (settings["events_fd"], settings["report_fd"]):
        os.set_inheritable(fd, False)
    reporter = Reporter(settings["events_fd"])
    worktree = settings["worktree_dir"]
    try:
        copy_tree(settings["source_dir"], worktree)
    except OSError as error:
        kind = "disk_limit" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "copy_failed"
        reporter.send("setup_error", kind=kind, detail=f"copying the worktree: {error}")
        _exit(_SETUP_FAILED_EXIT)
    os.chdir(worktree)
    report_dir = tempfile.mkdtemp(prefix="r", dir=settings["report_parent"])
    report_path = os.path.join(report_dir, settings["report_name"])

    import pytest
    from _pytest import junitxml

    snapshot = snapshot_runner()
    guard = Guard(reporter, report_path)
    guard.writer_codes.add(junitxml.LogXML.pytest_sessionfinish.__code__)
    plugin = make_plugin(pytest, settings, reporter, snapshot, report_path)
    sys.addaudithook(guard)

    # From here on, repository code may run.
    sys.path.insert(0, worktree)
    args = list(settings["pytest_args"])
    args += [
        f"--junitxml={report_path}",
        "-o",
        f"junit_suite_name={settings['suite_name']}",
        "-o",
        "junit_family=xunit1",
        "-p",
        "no:cacheprovider",
    ]
    code = pytest.main(args, plugins=[plugin])
    # pytest undid its configure-time patches when it unconfigured: compare with start-up.
    plugin.check_runner(allowed=_CONFIGURE_CHANGES, against=snapshot)
    data = read_report(report_path)
    reporter.send("exit", code=int(code), report_sha256=hashlib.sha256(data).hexdigest())
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - the tests may have replaced or closed them
        pass
    _exit(int(code))


if __name__ == "__main__":
    main()
