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
import functools
import hashlib
import inspect
import io
import itertools
import json
import operator
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


def copy_tree(source, dest, mounted=frozenset()):
    """Copies `source` into the existing directory `dest`, without recursion (shutil.copytree
    recurses, and a patch can nest directories past Python's recursion limit) and without following
    symlinks; keeps file modes. `mounted`: paths under `dest` the sandbox already bound read-only
    (the test files): left as they are, and their folders, which the sandbox made, are reused.
    Raises OSError (ENOSPC when the tmpfs is full)."""
    pending = [(source, dest)]
    while pending:
        src_dir, dst_dir = pending.pop()
        with os.scandir(src_dir) as entries:
            for entry in entries:
                target = os.path.join(dst_dir, entry.name)
                if target in mounted:
                    continue
                if entry.is_symlink():
                    os.symlink(os.readlink(entry.path), target)
                elif entry.is_dir(follow_symlinks=False):
                    if not os.path.isdir(target):
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


def _group(label, holder, pairs):
    """One snapshot entry: (label, holder, attribute names, objects). Objects are kept (not ids)
    so that an id cannot be reused by a replacement; a group is compared in one C-level pass."""
    pairs = list(pairs)
    return (label, holder, tuple(a for a, _ in pairs), tuple(v for _, v in pairs))


def snapshot_runner():
    """Snapshot groups (see _group) for every attribute of the runner's modules and of their
    classes, plus the few functions the report's writing and the exit go through."""
    import builtins

    modules = protected_modules()
    snapshot = [_group("sys.modules", sys.modules, modules.items())]
    for name, module in modules.items():
        items = [
            (attr, value)
            for attr, value in list(vars(module).items())
            if (name, attr) not in _MUTABLE_ATTRIBUTES
        ]
        snapshot.append(_group(name, module, items))
        for _, value in items:
            if isinstance(value, type) and getattr(value, "__module__", "") == name:
                label = f"{name}.{value.__qualname__}"
                snapshot.append(
                    _group(
                        label,
                        value,
                        (
                            (attr, class_value)
                            for attr, class_value in list(vars(value).items())
                            if (label, attr) not in _MUTABLE_ATTRIBUTES
                        ),
                    )
                )
    for module, attrs in (
        (builtins, ("open", "print", "__import__")),
        (io, ("open", "FileIO")),
        (os, ("_exit", "write", "open", "replace", "rename")),
        (sys, ("exit", "pycache_prefix")),
    ):
        snapshot.append(_group(module.__name__, module, ((a, getattr(module, a)) for a in attrs)))
    return snapshot


# The modules (and their classes) a test's call and its report go through: checked right before
# and right after each test of the task's files (the whole snapshot is checked less often).
_CALL_PATH_MODULES = (
    "_pytest.runner",
    "_pytest.python.Function",
    "_pytest.reports",
    "_pytest.outcomes",
    "_pytest.unittest.TestCaseFunction",
    "pluggy._hooks",
    "pluggy._callers",
    "pluggy._manager",
    "pluggy._result",
)


def call_path_groups(snapshot):
    """The groups of a runner snapshot that belong to _CALL_PATH_MODULES."""
    return [
        group
        for group in snapshot
        if any(group[0] == m or group[0].startswith(m + ".") for m in _CALL_PATH_MODULES)
    ]


# The hooks through which a test runs and its outcome is reported: their callers and
# implementations are instance objects (no module attribute), so they get a snapshot of their own.
_RESULT_HOOKS = (
    "pytest_runtest_protocol",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_runtest_teardown",
    "pytest_pyfunc_call",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_report_teststatus",
    "pytest_sessionfinish",
)


def _attributes(obj):
    """An object's attributes: its __dict__, or its __slots__ (pluggy's hook objects)."""
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    return {
        name: getattr(obj, name)
        for name in getattr(type(obj), "__slots__", ())
        if hasattr(obj, name)
    }


class _Implementations:
    """A hook caller's implementation list as one snapshot holder: attribute "list"."""

    def __init__(self, caller):
        self.caller = caller

    def get(self, attr, default):
        return tuple(self.caller.get_hookimpls()) if attr == "list" else default


def snapshot_hooks(manager):
    """Snapshot groups for the plugin manager's attributes and those of the result hooks'
    callers and implementations, and each caller's implementation list. Take it once no plugin
    may join any more."""
    groups = [_group("plugin manager", manager, _attributes(manager).items())]
    for name in _RESULT_HOOKS:
        caller = getattr(manager.hook, name, None)
        if caller is None:
            continue
        groups.append(_group(f"hook {name}", caller, _attributes(caller).items()))
        implementations = tuple(caller.get_hookimpls())
        groups.append(_group(f"hook {name}", _Implementations(caller), [("list", implementations)]))
        for impl in implementations:
            label = f"hook {name} of {impl.plugin_name!r}"
            groups.append(_group(label, impl, _attributes(impl).items()))
    return groups


def changed_runner_objects(snapshot, allowed=frozenset()):
    """Labels of the snapshot's attributes that were rebound or deleted since, but `allowed`
    ((label, attribute) pairs). Implementation lists compare by value (a new list each time)."""
    missing = object()
    changed = []
    for label, holder, attrs, values in snapshot:
        if isinstance(holder, (dict, _Implementations)):
            get = holder.get
        elif hasattr(holder, "__dict__"):
            get = vars(holder).get
        else:  # a __slots__ object (pluggy's hook callers and implementations)
            get = functools.partial(getattr, holder)
        currents = list(map(get, attrs, itertools.repeat(missing)))
        if isinstance(holder, _Implementations):
            if currents[0] != values[0]:
                changed.append(f"{label}: its implementations were changed")
            continue
        if all(map(operator.is_, currents, values)):
            continue
        for attr, value, current in zip(attrs, values, currents):
            if current is not value and (label, attr) not in allowed:
                state = "deleted" if current is missing else "replaced"
                changed.append(f"{label}.{attr} was {state}")
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


# ----------------------------------------------------------------------------------------------
# Test code provenance. Decisions never rest on names an object carries (a code object's
# co_filename, a function's __module__ or __qualname__): code is trusted by IDENTITY (the code
# objects of pytest, pluggy and this runner, collected before any repository code ran) or by
# EQUALITY with code compiled here from the trusted source (the read-only copy of the patched
# tree, checked against the executor's sha256 of every test file and conftest).

# Modules the runner may import lazily, imported while nothing of the worktree is on sys.path, so
# that a module of the repository cannot stand in for them later.
_LAZY_RUNNER_IMPORTS = (
    "bdb",
    "cmd",
    "code",
    "codeop",
    "decimal",
    "difflib",
    "doctest",
    "faulthandler",
    "fractions",
    "pdb",
    "pprint",
    "tracemalloc",
    "unittest",
    "unittest.mock",
    "exceptiongroup",
    "iniconfig",
    "packaging",
    "packaging.version",
    "pygments",
    "pygments.formatters",
    "pygments.lexers",
    "tomli",
    "colorama",
)


def import_runner_closure():
    """Imports every submodule of _pytest and the modules in _LAZY_RUNNER_IMPORTS that exist in
    this interpreter (an image's may lack some)."""
    import importlib
    import pkgutil

    import _pytest

    names = [
        info.name
        for info in pkgutil.walk_packages(_pytest.__path__, "_pytest.")
        if not info.name.startswith("_pytest._py.")  # pytest's vendored py: imported on demand
    ] + list(_LAZY_RUNNER_IMPORTS)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent or unusable here: then nothing imports it either
            pass


def nested_codes(code):
    """`code` and every code object in its constants, iteratively."""
    found, pending = [], [code]
    while pending:
        current = pending.pop()
        found.append(current)
        pending.extend(c for c in current.co_consts if isinstance(c, type(code)))
    return found


def codes_of_namespace(namespace, into):
    """Adds to `into` (id -> code) the code of every function reachable from the dict
    `namespace`: its functions, and the functions, static/class methods and properties of its
    classes (one level), with their nested code."""
    pending = list(namespace.values())
    seen_classes = set()
    while pending:
        value = pending.pop()
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            pending.extend(f for f in (value.fget, value.fset, value.fdel) if f is not None)
            continue
        code = getattr(value, "__code__", None) if inspect.isfunction(value) else None
        if code is not None:
            for nested in nested_codes(code):
                into[id(nested)] = nested
        elif isinstance(value, type) and id(value) not in seen_classes:
            seen_classes.add(id(value))
            pending.extend(vars(value).values())


def trusted_runner_codes(main_globals):
    """id -> code for pytest, _pytest, pluggy, importlib's bootstrap and this script. Call before
    any repository code runs."""
    codes = {}
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        if name.split(".")[0] in _PROTECTED_PREFIXES or name.startswith("importlib"):
            codes_of_namespace(vars(module), codes)
    codes_of_namespace(main_globals, codes)
    return codes


def qualified_codes(module_code):
    """[(qualified name, code)] of a module's code and everything nested in it, named as
    __qualname__ names functions and classes ("C.test_x", "f.<locals>.g"). Computed from the
    nesting (co_qualname is Python 3.11+ only): a class body is a code without CO_NEWLOCALS."""
    newlocals = inspect.CO_NEWLOCALS
    found, pending = [], [(module_code, None, False)]
    while pending:
        code, qualname, is_function = pending.pop()
        found.append((qualname or "<module>", code))
        for child in code.co_consts:
            if not isinstance(child, type(code)):
                continue
            if qualname is None:
                child_name = child.co_name
            elif is_function:
                child_name = f"{qualname}.<locals>.{child.co_name}"
            else:
                child_name = f"{qualname}.{child.co_name}"
            pending.append((child, child_name, bool(child.co_flags & newlocals)))
    return found


def import_bindings(tree):
    """{name: (module, attribute or None, level)} for the names a module binds once, by an
    import statement at its top level, and nowhere else (no other assignment, definition, import,
    deletion or `global` of that name anywhere in the file): what that name must still be bound
    to once the module ran. `import a.b` binds "a" to module "a"; `import a.b as c` binds "c" to
    "a.b"; `from m import x as y` binds "y" to attribute "x" of "m" (level: leading dots)."""
    import ast

    candidates, seen = {}, {}
    for statement in tree.body:
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    candidates.setdefault(alias.asname, []).append((alias.name, None, 0))
                else:
                    top = alias.name.split(".")[0]
                    candidates.setdefault(top, []).append((top, None, 0))
        elif isinstance(statement, ast.ImportFrom) and statement.module is not None:
            for alias in statement.names:
                if alias.name != "*":
                    name = alias.asname or alias.name
                    candidates.setdefault(name, []).append(
                        (statement.module, alias.name, statement.level)
                    )
    for node in ast.walk(tree):
        names = ()
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names = (node.id,)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = (node.name,)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names = tuple(node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = tuple(
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if alias.name != "*"
            )
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names = (node.name,)
        elif isinstance(node, ast.alias):
            continue
        for name in names:
            seen[name] = seen.get(name, 0) + 1
    return {
        name: bound[0]
        for name, bound in candidates.items()
        if len(bound) == 1 and seen.get(name, 0) == 1
    }


def bound_by_import(module_name, attribute, level, package):
    """What the import statement binds now (from sys.modules), or None when it cannot tell."""
    if level:
        if not package:
            return None
        parts = package.split(".")
        if level - 1 > len(parts) - 1:
            return None
        base = ".".join(parts[: len(parts) - (level - 1)])
        module_name = f"{base}.{module_name}" if module_name else base
    module = sys.modules.get(module_name)
    if module is None:
        return None
    if attribute is None:
        return (module,)
    value = vars(module).get(attribute, _MISSING) if hasattr(module, "__dict__") else _MISSING
    if value is _MISSING:
        value = sys.modules.get(f"{module_name}.{attribute}", _MISSING)
    return None if value is _MISSING else (value,)


_MISSING = object()


class TestSources:
    """The trusted source of the test files and conftests, and the code pytest must have made
    of them.

    `verified`: {repository path: sha256 of its content} from the executor. The content is read
    from the read-only source tree at start-up and checked against that digest; the code is
    compiled at start-up, before any repository code runs, both as pytest's assertion rewriter
    makes it and plain (`--assert=plain`, PYTEST_DONT_REWRITE), with the path pytest will use.
    """

    def __init__(self, settings, rewrite_asserts):
        self.worktree = settings["worktree_dir"]
        self.rewrite_asserts = rewrite_asserts
        self.problems = []
        self.codes_by_path = {}  # absolute path in the worktree -> {qualname: [code, ...]}
        self.all_codes = set()  # every code compiled from trusted source (compared by equality)
        # ... of it, what can be a decorator's wrapper: functions defined inside functions. (A
        # top-level test is no wrapper: pointing its __wrapped__ at another test proves nothing.)
        self.decorator_codes = set()
        self.content = {}  # absolute path in the worktree -> trusted bytes
        self.imports = {}  # absolute path -> import_bindings of its trusted source
        import ast

        for relative, digest in sorted(settings.get("verified_files", {}).items()):
            path = os.path.join(self.worktree, relative)
            try:
                with open(os.path.join(settings["source_dir"], relative), "rb") as handle:
                    source = handle.read()
            except OSError as error:
                self.problems.append(f"{relative}: unreadable in the trusted tree ({error})")
                continue
            if hashlib.sha256(source).hexdigest() != digest:
                self.problems.append(f"{relative}: differs from the executor's copy")
                continue
            self.content[path] = source
            by_name = self.codes_by_path.setdefault(path, {})
            variants = []
            try:
                variants.append(compile(source, path, "exec", dont_inherit=True))
                tree = ast.parse(source, filename=path)
                self.imports[path] = import_bindings(tree)
                rewrite_asserts(tree, source, path, None)
                variants.append(compile(tree, path, "exec", dont_inherit=True))
            except Exception as error:  # noqa: BLE001 - a syntax error fails collection anyway
                self.problems.append(f"{relative}: cannot be compiled here ({error!r})")
            for module_code in variants:
                for qualname, code in qualified_codes(module_code):
                    self.all_codes.add(code)
                    by_name.setdefault(qualname, []).append(code)
                    if "<locals>" in qualname:
                        self.decorator_codes.add(code)
        self.patched = {
            os.path.join(self.worktree, path) for path in settings.get("patched_files", ())
        }
        self.source_dir = settings["source_dir"]
        self.unpatched = {}  # absolute path -> set of codes compiled from its trusted source

    def unpatched_qualname(self, code):
        """The qualified name of `code` when it equals code compiled from the trusted source of
        a repository file the patch did not change (a helper module or a base class of the
        tests), else None. The file is found from co_filename, but equality makes the name
        harmless: a lie names a file whose code is something else."""
        path = code.co_filename
        if not isinstance(path, str) or path in self.patched:
            return None
        relative = os.path.relpath(path, self.worktree)
        if relative.startswith(os.pardir) or not relative.endswith(".py"):
            return None
        if path not in self.unpatched:
            names, module_codes = {}, []
            try:
                import ast

                with open(os.path.join(self.source_dir, relative), "rb") as handle:
                    source = handle.read()
                module_codes.append(compile(source, path, "exec", dont_inherit=True))
                tree = ast.parse(source, filename=path)
                self.rewrite_asserts(tree, source, path, None)
                module_codes.append(compile(tree, path, "exec", dont_inherit=True))
            except Exception:  # noqa: BLE001 - unreadable or not Python: nothing trusted there
                pass
            for module_code in module_codes:
                names.update((c, q) for q, c in qualified_codes(module_code))
            self.unpatched[path] = names
        return self.unpatched[path].get(code)

    def is_verified(self, path):
        return os.fspath(path) in self.codes_by_path

    def expected(self, path, qualname):
        return self.codes_by_path.get(os.fspath(path), {}).get(qualname, ())

    def is_decorator_code(self, code):
        """Code of a function defined inside a function, in a test file or an unpatched file."""
        if code in self.decorator_codes:
            return True
        qualname = self.unpatched_qualname(code)
        return qualname is not None and "<locals>" in qualname


class TrustedModuleCodes:
    """Code objects of modules loaded from outside the worktree (the interpreter's own
    site-packages and standard library, bound read-only), for decorators such as mock.patch or
    hypothesis.given whose wrappers stand between pytest and a test function. A module counts
    when its file lies under a prefix of the start-up sys.path; its code is collected on first
    use and kept."""

    def __init__(self, trusted_prefixes):
        self.prefixes = tuple(p for p in trusted_prefixes if p)
        self.codes = {}
        self.modules_done = set()

    def contains(self, code):
        if id(code) in self.codes and self.codes[id(code)] is code:
            return True
        for module in list(sys.modules.values()):
            if module is None or id(module) in self.modules_done:
                continue
            file = vars(module).get("__file__") if hasattr(module, "__dict__") else None
            if not isinstance(file, str) or not os.path.realpath(file).startswith(self.prefixes):
                continue
            self.modules_done.add(id(module))
            codes_of_namespace(vars(module), self.codes)
        return id(code) in self.codes and self.codes[id(code)] is code


def _wrapped(function):
    """The next callable of a decorator chain: a partial's func, or __wrapped__ from the
    object's own dict (never through a hostile __getattr__)."""
    if isinstance(function, functools.partial):
        return function.func
    namespace = getattr(function, "__dict__", None)
    return namespace.get("__wrapped__") if isinstance(namespace, dict) else None


def check_test_callable(function, is_target, sources, external):
    """None when `function` runs a code object for which `is_target(code)` holds, possibly under
    wrappers that are themselves trusted code (decorators of the test files or of unpatched
    files, or installed ones); else what is wrong."""
    if inspect.ismethod(function):
        function = function.__func__
    for _ in range(16):
        if function is None:
            break
        if inspect.isfunction(function):
            code = function.__code__
            if is_target(code):
                return None
            if not sources.is_decorator_code(code) and not external.contains(code):
                return "runs code that is neither its file's nor a trusted decorator's"
        elif not isinstance(function, functools.partial):
            return f"is a {type(function).__name__}, not the function its file defines"
        function = _wrapped(function)
    return "does not reach the function its file defines"


def make_plugin(pytest, settings, reporter, snapshot, report_path, sources, trusted_codes):
    """The runner's pytest plugin. `sources`: TestSources; `trusted_codes`: id -> code of pytest,
    pluggy and this script (trusted_runner_codes)."""
    canary_path = settings["canary_path"]
    must_pass, must_fail = settings["canary_names"]
    raised = {}
    import pluggy
    from _pytest.config import PytestPluginManager

    register_codes = {
        id(code): code
        for code in (pluggy.PluginManager.register.__code__, PytestPluginManager.register.__code__)
    }
    conftests = {path for path in sources.codes_by_path if _basename(path) == "conftest.py"}
    external = TrustedModuleCodes(settings.get("trusted_prefixes", ()))

    def is_identical(code, codes):
        return codes.get(id(code)) is code

    def frame_trusted(code):
        return is_identical(code, trusted_codes) or code in sources.all_codes

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
            self.session_started = False
            self.hook_snapshot = []
            self.call_path = []
            self.modules = {}  # verified test file -> the module object pytest imported
            self.namespaces = {}  # ... -> its functions, classes and modules at import
            self.items = []

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionstart(self, session):
            # Configuring is over (plugins set up, root conftests loaded): from the start-up
            # snapshot only pytest's own configure-time changes are allowed; then re-snapshot.
            self.check_runner(allowed=_CONFIGURE_CHANGES)
            self.snapshot = snapshot_runner()
            self.call_path = call_path_groups(self.snapshot)
            self.session_started = True
            for problem in sources.problems:
                reporter.send("tamper", what=f"test source: {problem}")

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
            self.items = list(items)
            # Collection is over: no plugin joins from here on (pytest_plugin_registered), so
            # the result hooks' callers and implementations must stay as they are.
            self.hook_snapshot = snapshot_hooks(config.pluginmanager)
            return result

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_makereport(self, item, call):
            if call.when == "call" and sources.is_verified(os.fspath(getattr(item, "path", ""))):
                # Right after a test of the task ran, before its report is made: runner objects
                # patched during the call and restored before the teardown check are seen here.
                self.check_call_path()
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
            # Just before a test's own code runs: it must be the code of its (read-only,
            # verified) file, and see the real runner, not substitutes planted by code the patch
            # changed.
            self.check_item(item, "when it ran")
            if sources.is_verified(os.fspath(getattr(item, "path", ""))):
                # ... and the runner that will call it is the real one (patched during an earlier
                # test's teardown or this test's setup, say).
                self.check_call_path()
            module = getattr(item, "module", None)
            namespace = getattr(module, "__dict__", {})
            for name in _PROTECTED_PREFIXES:
                if name in namespace and namespace[name] is not sys.modules.get(name):
                    reporter.send(
                        "tamper",
                        what=f"{item.nodeid}: its module's {name!r} is not the real {name} module",
                    )

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_make_collect_report(self, collector):
            report = yield
            # Right after pytest imported a test module: its functions must be those compiled
            # from the file's trusted source, whatever loaded it (a planted .pyc, a meta path
            # finder, a module put in sys.modules, a rewritten file).
            if isinstance(collector, pytest.Module) and sources.is_verified(collector.path):
                if not report.failed:
                    self.verify_module(collector)
            return report

        def verify_module(self, collector):
            path = os.fspath(collector.path)
            try:
                module = collector.obj
                namespace = vars(module)
            except Exception:  # noqa: BLE001 - an object that is no module
                reporter.send("tamper", what=f"{path}: pytest's module object is not a module")
                return
            for qualname, codes in sources.codes_by_path[path].items():
                if "." in qualname or "<" in qualname or qualname not in namespace:
                    continue
                value = namespace[qualname]
                if inspect.isfunction(value):
                    problem = check_test_callable(
                        value, lambda code, codes=codes: code in codes, sources, external
                    )
                    if problem:
                        reporter.send("tamper", what=f"{path}: {qualname} {problem}")
            # Names its imports bound must still be what those imports bind: not a wrapper put
            # in the test's namespace by code that ran while (or right after) it was imported.
            package = namespace.get("__package__")
            for name, (module_name, attribute, level) in sources.imports.get(path, {}).items():
                if name not in namespace:
                    continue
                expected = bound_by_import(module_name, attribute, level, package)
                if expected is not None and namespace[name] is not expected[0]:
                    reporter.send(
                        "tamper",
                        what=f"{path}: {name!r} is not what its import statement binds",
                    )
            self.modules[path] = module
            self.namespaces[path] = {
                name: value
                for name, value in list(namespace.items())
                if inspect.isfunction(value) or isinstance(value, type) or inspect.ismodule(value)
            }

        def check_item(self, item, when, checked_modules=None):
            """Reports a test of a verified file whose module, namespace or function is not the
            one verified at import. `checked_modules`: paths whose namespace was already
            compared in this pass (the check after the run compares each module once)."""
            path = os.fspath(getattr(item, "path", ""))
            if not isinstance(item, pytest.Function) or not sources.is_verified(path):
                return  # doctests and the canaries have no function of a test file
            module = self.modules.get(path)
            if module is None:
                reporter.send("tamper", what=f"{item.nodeid}: its module was never verified")
                return
            if getattr(item, "module", None) is not module:
                reporter.send("tamper", what=f"{item.nodeid}: its module was replaced {when}")
                return
            # The item must run through pytest's own runtest (or a conftest's, whose code is
            # trusted by equality): no method or property of its class shadowed on the instance.
            item_class = type(item)
            runtest = getattr(item_class, "runtest", None)
            runtest_code = getattr(runtest, "__code__", None)
            if runtest_code is None or not frame_trusted(runtest_code):
                reporter.send("tamper", what=f"{item.nodeid}: its runtest is not pytest's {when}")
            for key in _attributes(item):
                if isinstance(getattr(item_class, key, None), (property, type(runtest))):
                    reporter.send("tamper", what=f"{item.nodeid}: its {key} was overridden {when}")
            namespace = vars(module)
            if checked_modules is None or path not in checked_modules:
                if checked_modules is not None:
                    checked_modules.add(path)
                for name, value in self.namespaces[path].items():
                    if namespace.get(name) is not value:
                        reporter.send(
                            "tamper",
                            what=f"{item.nodeid}: its module's {name!r} was rebound {when}",
                        )
            names = [node.name for node in item.listchain() if isinstance(node, pytest.Class)] + [
                getattr(item, "originalname", None) or item.name
            ]
            expected = sources.expected(path, ".".join(names))
            try:
                function = item.obj
            except Exception:  # noqa: BLE001 - a hostile attribute
                function = None
            if function is None:
                problem = "has no function"
            else:

                def is_target(code):
                    if expected:
                        return any(code == candidate for candidate in expected)
                    # Not defined under its own name in its file (inherited from a base class,
                    # or made by a factory: `test_a = make_test(1)`): code of a test file or of
                    # a file the patch did not change.
                    return code in sources.all_codes or sources.unpatched_qualname(code) is not None

                problem = check_test_callable(function, is_target, sources, external)
                unbound = function.__func__ if inspect.ismethod(function) else function
                if (
                    problem is None
                    and expected
                    and inspect.isfunction(unbound)
                    and is_target(unbound.__code__)
                    and unbound.__globals__ is not namespace
                ):
                    problem = "runs with another module's globals"
            if problem:
                reporter.send("tamper", what=f"{item.nodeid} {problem} ({when})")

        def pytest_collectreport(self, report):
            if report.failed:
                reporter.send("collect_error", nodeid=report.nodeid)

        def pytest_plugin_registered(self, plugin, plugin_name, manager):
            frame = _getframe(1)
            while frame is not None and not is_identical(frame.f_code, register_codes):
                frame = frame.f_back
            if frame is None:
                return  # a historic replay, not a registration happening now
            while frame is not None and is_identical(frame.f_code, register_codes):
                frame = frame.f_back
            # Every caller down to the runner's start must be pytest's, pluggy's, this runner's
            # or the trusted code of a test file or conftest: repository code anywhere in the
            # chain (a package calling pluginmanager.register or import_plugin) is tampering.
            while frame is not None:
                if not frame_trusted(frame.f_code) and frame.f_back is not None:
                    reporter.send(
                        "tamper", what=f"plugin {plugin_name!r} registered by repository code"
                    )
                    return
                frame = frame.f_back
            # During the session only conftests the executor saw may join (one created at run
            # time in a folder collected later is refused), and no plugin module.
            if self.session_started and inspect.ismodule(plugin):
                if plugin_name not in conftests:
                    reporter.send(
                        "tamper",
                        what=f"plugin module {plugin_name!r} registered during the session",
                    )

        def check_runner(self, allowed=frozenset(), against=None):
            changes = changed_runner_objects(against or self.snapshot, allowed)
            if against is None:
                changes += changed_runner_objects(self.hook_snapshot)
            self.report_changes(changes)

        def check_call_path(self):
            """The cheap check around each test: the call path's objects and the result hooks."""
            self.report_changes(
                changed_runner_objects(self.call_path) + changed_runner_objects(self.hook_snapshot)
            )

        def report_changes(self, changes):
            for change in changes:
                if change not in self.reported and len(self.reported) < 20:
                    self.reported.add(change)
                    reporter.send("tamper", what=f"runner object changed: {change}")

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_sessionfinish(self, session, exitstatus):
            result = yield
            # pytest's JUnit writer (an inner implementation) has written the report by now.
            self.check_runner()
            # The tests whose outcomes make the verdict, once more after the run: same module,
            # same functions, and their files still hold the trusted source.
            checked_modules = set()
            for item in self.items:
                self.check_item(item, "after the run", checked_modules)
            for path, content in sources.content.items():
                if read_report(path) != content:
                    reporter.send("tamper", what=f"{path} changed during the run")
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
    mounted = frozenset(os.path.join(worktree, path) for path in settings.get("mounted_files", ()))
    try:
        copy_tree(settings["source_dir"], worktree, mounted)
    except OSError as error:
        kind = "disk_limit" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "copy_failed"
        reporter.send("setup_error", kind=kind, detail=f"copying the worktree: {error}")
        _exit(_SETUP_FAILED_EXIT)
    os.chdir(worktree)
    report_dir = tempfile.mkdtemp(prefix="r", dir=settings["report_parent"])
    report_path = os.path.join(report_dir, settings["report_name"])

    import pytest
    from _pytest import junitxml
    from _pytest.assertion.rewrite import rewrite_asserts

    if settings.get("protect_test_code", True):
        import_runner_closure()
        # pytest's assertion rewriter reads cached bytecode of test modules even under -B: point
        # the cache at a folder that does not exist in the read-only runner directory, so no
        # .pyc planted at run time is ever read.
        sys.pycache_prefix = os.path.join(here, "no-bytecode")
    inside = os.path.realpath(worktree) + os.sep
    settings["trusted_prefixes"] = sorted(
        prefix
        for prefix in {os.path.realpath(p) + os.sep for p in sys.path if p and os.path.isabs(p)}
        if not prefix.startswith(inside) and not inside.startswith(prefix)
    )
    sources = TestSources(settings, rewrite_asserts)
    trusted_codes = trusted_runner_codes(globals())
    snapshot = snapshot_runner()
    guard = Guard(reporter, report_path)
    guard.writer_codes.add(junitxml.LogXML.pytest_sessionfinish.__code__)
    plugin = make_plugin(pytest, settings, reporter, snapshot, report_path, sources, trusted_codes)
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
