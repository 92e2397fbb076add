"""The runner's protection of test code while the tests run (runner_bootstrap.py, run for real
under bubblewrap): test files bound read-only, test modules verified when pytest imports them,
before each test and after the run, plugin registration judged by code identity, and the
runner's lazy imports taken from site-packages.

Each attack lives in the package under test (`calc/__init__.py`, imported by the tests during
collection, as a patch would put it) and tries to make `test_probe` pass although it asserts
something false. The outcome must be either tampering evidence or an honest failure; controls
(decorated, inherited, parametrized, class-based tests) must pass with no tampering record.
"""

import hashlib
import textwrap

import pytest

from dockyard_rl.sandbox import grading, isolation, runner
from dockyard_rl.sandbox.task import FailureKind, RewardMode, TestOutcome
from dockyard_rl.sandbox.testing_repos import toy_worktree

LIMITS = runner.RunnerLimits(
    isolation.SandboxLimits(wall_timeout_s=60, cpu_s=60, memory_bytes=2 * 1024**3),
    worktree_size_bytes=64 * 1024**2,
    max_report_bytes=4 * 1024**2,
    max_report_testcases=10_000,
)

# The test every attack wants to turn green: it fails honestly.
FAILING_TEST = """\
import calc


def test_probe():
    assert calc.answer() == 42
"""
TARGET = "tests/test_probe.py::test_probe"
# ... and with a harmless test first, which calls the attack's `arm()` while it runs.
_TWO_TESTS = """\
import calc


def test_first():
    calc.arm()


def test_probe():
    assert calc.answer() == 42
"""


@pytest.fixture
def worktree(tmp_path):
    return toy_worktree(tmp_path)


def _run(
    tmp_path,
    worktree,
    package_code,
    *,
    files=None,
    test=FAILING_TEST,
    patched=None,
    args=("tests/test_probe.py",),
):
    """Writes the attack into calc/__init__.py (after `def answer(): return 0`), the test file
    and `files`, then runs the test file the way pipeline.py does: protected files bound
    read-only and verified. Returns (grade, evidence)."""
    (worktree / "calc" / "__init__.py").write_text(
        "def answer():\n    return 0\n\n\n" + textwrap.dedent(package_code)
    )
    (worktree / "tests" / "test_probe.py").write_text(textwrap.dedent(test))
    for name, text in (files or {}).items():
        (worktree / name).parent.mkdir(parents=True, exist_ok=True)
        (worktree / name).write_text(textwrap.dedent(text))
    read_only, verified = runner.protected_test_files(worktree, ["tests/test_probe.py"])
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    result, evidence = runner.run_pytest(
        list(args),
        worktree,
        scratch,
        LIMITS,
        canaries=True,
        patched_files=patched if patched is not None else ["calc/__init__.py"],
        read_only_files=read_only,
        verified_files=verified,
    )
    grade = grading.grade_run([TARGET], [], evidence, RewardMode.BINARY)
    print(result.output[-4000:])  # shown when a test fails
    return grade, evidence


def _tamper(evidence):
    return [record.get("what") for record in evidence.records.records("tamper")]


def _assert_not_forged(grade, evidence, *, tampering=True):
    assert not grade.resolved, (grade, _tamper(evidence))
    if tampering:
        assert grade.failure_kind is FailureKind.TAMPERING, (grade, _tamper(evidence))
    else:
        assert grade.failure_kind in (FailureKind.TAMPERING, FailureKind.TESTS_FAILED), grade


def test_protected_files_are_read_only_mounts_and_digested(tmp_path, worktree):
    (worktree / "tests" / "conftest.py").write_text("")
    (worktree / "setup.cfg").write_text("[metadata]\nname = calc\n")
    read_only, verified = runner.protected_test_files(worktree, ["tests/test_ops.py", "gone.py"])
    assert read_only == ["setup.cfg", "tests/conftest.py", "tests/test_ops.py"]
    data = (worktree / "tests" / "test_ops.py").read_bytes()
    assert verified == {
        "tests/conftest.py": hashlib.sha256(b"").hexdigest(),
        "tests/test_ops.py": hashlib.sha256(data).hexdigest(),
    }


@pytest.mark.parametrize(
    "operation",
    [
        "open(PATH, 'w').write(FAKE)",
        "open(PATH, 'r+').truncate(0)",
        "os.remove(PATH)",
        "os.rename(PATH, PATH + '.old')",
        "os.chmod(PATH, 0o666)",
    ],
)
def test_test_files_cannot_be_changed_on_disk(tmp_path, worktree, operation):
    # Rewriting the test before pytest reads it would make it pass; the mount refuses.
    grade, evidence = _run(
        tmp_path,
        worktree,
        f"""
        import os
        PATH = os.path.join(os.path.dirname(__file__), "..", "tests", "test_probe.py")
        FAKE = "def test_probe():\\n    pass\\n"
        try:
            {operation}
            RESULT = "changed"
        except OSError as error:
            RESULT = type(error).__name__
        """,
    )
    assert not grade.resolved
    assert grade.failure_kind is FailureKind.TESTS_FAILED, (grade, _tamper(evidence))
    assert evidence.records.tests[TARGET] is TestOutcome.FAILED


def test_renaming_the_test_folder_and_planting_a_fake_is_caught(tmp_path, worktree):
    # The mount point cannot move, but its folder might (without root); the fake file at the
    # old path does not compile to the trusted code.
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import os
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            os.rename(os.path.join(here, "tests"), os.path.join(here, "tests_old"))
            os.mkdir(os.path.join(here, "tests"))
            with open(os.path.join(here, "tests", "test_probe.py"), "w") as f:
                f.write("def test_probe():\\n    pass\\n")
        except OSError:
            pass
        """,
    )
    _assert_not_forged(grade, evidence, tampering=False)


def test_planted_bytecode_for_the_test_module_is_never_read(tmp_path, worktree):
    # pytest's assertion rewriter reads __pycache__/*.pyc even under -B; the runner points the
    # cache at a folder that cannot exist.
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import importlib.util, marshal, os, sys
        from _pytest.assertion import rewrite
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source_path = os.path.join(here, "tests", "test_probe.py")
        with open(source_path, "rb") as f:
            real = f.read()
        fake = compile("def test_probe():\\n    pass\\n", source_path, "exec")
        cache = rewrite.get_cache_dir(__import__("pathlib").Path(source_path))
        try:
            os.makedirs(cache, exist_ok=True)
            pyc = cache / ("test_probe" + rewrite.PYC_TAIL)
            rewrite._write_pyc_fp
            with open(pyc, "wb") as f:
                rewrite._write_pyc_fp(f, importlib.util.source_hash(real), fake)
        except (OSError, AttributeError, TypeError):
            pass
        """,
    )
    _assert_not_forged(grade, evidence, tampering=False)


def test_fake_test_module_in_sys_modules_is_tampering(tmp_path, worktree):
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import sys, types
        fake = types.ModuleType("test_probe")
        fake.__file__ = __file__.replace("calc/__init__.py", "tests/test_probe.py")
        exec("def test_probe():\\n    pass\\n", fake.__dict__)
        sys.modules["test_probe"] = fake
        sys.modules["tests.test_probe"] = fake
        """,
    )
    _assert_not_forged(grade, evidence)


def test_meta_path_finder_compiling_another_test_is_tampering(tmp_path, worktree):
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import importlib.abc, importlib.util, sys

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                code = compile("def test_probe():\\n    pass\\n", module.__file__, "exec")
                exec(code, module.__dict__)

        class _Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.endswith("test_probe"):
                    origin = __file__.replace("calc/__init__.py", "tests/test_probe.py")
                    return importlib.util.spec_from_file_location(name, origin, loader=_Loader())
                return None

        sys.meta_path.insert(0, _Finder())
        """,
        files={"tests/conftest.py": "import calc\n"},
    )
    _assert_not_forged(grade, evidence)


@pytest.mark.parametrize(
    "swap",
    [
        # a plain rebinding of the module's test function
        "module.test_probe = lambda: None\n",
        # functools.wraps makes the fake look like the test (name, __wrapped__, __module__);
        # what it runs is not the test's code
        "real = module.test_probe\n"
        "@functools.wraps(real)\n"
        "def test_probe():\n"
        "    return None\n"
        "module.test_probe = test_probe\n",
        # the function object kept, its code replaced
        "module.test_probe.__code__ = (lambda: None).__code__\n",
    ],
    ids=["rebound", "wrapped-chain", "code-swap"],
)
def test_test_function_swapped_after_collection_is_tampering(tmp_path, worktree, swap):
    # arm() runs inside an earlier test; the swap must not turn test_probe green.
    arm = (
        "import functools, sys\n\n\n"
        "def arm():\n"
        "    for name, module in list(sys.modules.items()):\n"
        "        if name.endswith('test_probe'):\n"
        + textwrap.indent(swap, " " * 12)
        + "    return 0\n"
    )
    grade, evidence = _run(tmp_path, worktree, arm, test=_TWO_TESTS)
    _assert_not_forged(grade, evidence)


def test_plugin_registered_from_code_disguised_as_pytest_is_tampering(tmp_path, worktree):
    # The registering frame's code claims pytest's own file name; identity says otherwise.
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import _pytest.main
        SOURCE = '''
        import gc, pluggy
        class _Green:
            def pytest_runtest_logreport(self, report):
                report.outcome = "passed"
        for manager in [o for o in gc.get_objects() if isinstance(o, pluggy.PluginManager)]:
            manager.register(_Green(), "green")
        '''
        exec(compile(SOURCE, _pytest.main.__file__, "exec"), {})
        """,
        files={"tests/conftest.py": "import calc\n"},
    )
    _assert_not_forged(grade, evidence)


def test_conftest_created_at_run_time_is_tampering(tmp_path, worktree):
    # A conftest written into a folder pytest collects later is loaded by pytest's own code.
    conftest = "def pytest_runtest_logreport(report):\\n    report.outcome = 'passed'\\n"
    grade, evidence = _run(
        tmp_path,
        worktree,
        f"""
        import os
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            with open(os.path.join(here, "tests", "zlater", "conftest.py"), "w") as f:
                f.write("{conftest}")
        except OSError:
            pass
        """,
        files={"tests/zlater/test_later.py": "def test_later():\n    pass\n"},
        args=["tests"],
    )
    _assert_not_forged(grade, evidence)
    assert any("registered during the session" in what for what in _tamper(evidence))


def test_runner_lazy_imports_come_from_site_packages(tmp_path, worktree):
    # pytest imports difflib, pdb, unittest, ... lazily; a module of the repository with that
    # name must not stand in for them once the worktree is on sys.path.
    shadow = "def __getattr__(name):\n    raise SystemExit(0)\n"
    grade, evidence = _run(
        tmp_path,
        worktree,
        "",
        files={"difflib.py": shadow, "pprint.py": shadow, "unittest/__init__.py": shadow},
        test="""\
        def test_probe():
            assert [1, 2, 3] == [1, 2, 4]
        """,
    )
    assert not grade.resolved and grade.failure_kind is FailureKind.TESTS_FAILED, (
        grade,
        _tamper(evidence),
    )


def test_honest_tests_of_every_shape_pass_without_tampering(tmp_path, worktree):
    # Decorators (local, functools.wraps, mock.patch), class tests, parametrized tests, a test
    # inherited from an unpatched helper module, fixtures from a conftest.
    (worktree / "tests" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef forty_two():\n    return 42\n"
    )
    (worktree / "tests" / "base.py").write_text(
        "class Base:\n    def test_inherited(self):\n        assert 1 + 1 == 2\n"
    )
    grade, evidence = _run(
        tmp_path,
        worktree,
        "",
        test="""\
        import functools
        from unittest import mock

        import pytest

        from tests.base import Base

        import calc


        def deco(function):
            @functools.wraps(function)
            def wrapper(*args, **kwargs):
                return function(*args, **kwargs)
            return wrapper


        @deco
        def test_decorated(forty_two):
            assert forty_two == 42


        @mock.patch("calc.answer", return_value=42)
        def test_probe(answer):
            assert calc.answer() == 42


        @pytest.mark.parametrize("value", [1, 2])
        def test_param(value):
            assert value in (1, 2)


        class TestInClass:
            def test_method(self):
                assert True


        class TestInherits(Base):
            pass


        def make_test(value):
            def test():
                assert value in (1, 2)

            return test


        test_made_1 = make_test(1)
        """,
        patched=[],
    )
    assert _tamper(evidence) == []
    assert grade.resolved, grade
    outcomes = evidence.records.tests
    for node in (
        "tests/test_probe.py::test_decorated",
        "tests/test_probe.py::test_param[1]",
        "tests/test_probe.py::TestInClass::test_method",
        "tests/test_probe.py::TestInherits::test_inherited",
        "tests/test_probe.py::test_made_1",
    ):
        assert outcomes[node] is TestOutcome.PASSED, (node, outcomes)


def test_runner_patched_between_checks_is_tampering(tmp_path, worktree):
    # Patched during the target's setup (after the last check), restored by the patched method
    # itself once the target test is skipped: seen at the target's call.
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import _pytest.python as python

        def arm():
            original = python.Function.runtest

            def runtest(self):
                if self.name == "test_probe":
                    python.Function.runtest = original
                    return None
                return original(self)

            python.Function.runtest = runtest
        """,
        test="""\
        import pytest

        import calc


        @pytest.fixture
        def armed():
            calc.arm()


        def test_probe(armed):
            assert calc.answer() == 42
        """,
    )
    _assert_not_forged(grade, evidence)


_FIND_ITEM = """
import sys

def _item():
    frame = sys._getframe()
    while frame is not None:
        item = frame.f_locals.get("item")
        if item is not None and hasattr(item, "session"):
            return item
        frame = frame.f_back
"""


@pytest.mark.parametrize(
    "arm",
    [
        # an instance attribute shadows pytest's runtest for the next test
        "for other in _item().session.items:\n"
        "    if other.name == 'test_probe':\n"
        "        other.runtest = lambda: None\n",
        # the test function cached on the item
        "for other in _item().session.items:\n"
        "    if other.name == 'test_probe':\n"
        "        other._obj = lambda: None\n",
        # pytest's implementation of pytest_pyfunc_call, held by pluggy's HookImpl
        "for impl in _item().ihook.pytest_pyfunc_call.get_hookimpls():\n"
        "    impl.function = lambda pyfuncitem: True\n",
        # the plugin manager's hook executor
        "manager = _item().config.pluginmanager\n"
        "inner = manager._inner_hookexec\n"
        "def green(name, methods, kwargs, firstresult):\n"
        "    if name == 'pytest_pyfunc_call':\n"
        "        return True\n"
        "    return inner(name, methods, kwargs, firstresult)\n"
        "manager._inner_hookexec = green\n",
    ],
    ids=["item-runtest", "item-obj", "hookimpl-function", "inner-hookexec"],
)
def test_run_time_objects_reached_through_frames_are_checked(tmp_path, worktree, arm):
    grade, evidence = _run(
        tmp_path,
        worktree,
        _FIND_ITEM + "\n\ndef arm():\n" + textwrap.indent(arm, "    "),
        test=_TWO_TESTS,
    )
    _assert_not_forged(grade, evidence)


def test_imported_names_rebound_in_the_test_module_are_tampering(tmp_path, worktree):
    # The package stays buggy; what the test module's `from calc import answer` bound is swapped
    # for a wrapper returning an object equal to everything, right after the module ran.
    grade, evidence = _run(
        tmp_path,
        worktree,
        """
        import sys

        class _Anything:
            def __eq__(self, other):
                return True

        def _wrap(function):
            return lambda *args, **kwargs: _Anything()

        class _AfterImport:
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name.endswith("test_probe"):
                    sys.meta_path.remove(_AfterImport)
                    import importlib.util
                    spec = importlib.util.find_spec(name)
                    real_exec = spec.loader.exec_module

                    def exec_module(module):
                        real_exec(module)
                        module.answer = _wrap(module.answer)

                    spec.loader.exec_module = exec_module
                    return spec
                return None

        sys.meta_path.insert(0, _AfterImport)
        """,
        files={"tests/conftest.py": "import calc\n"},
        test="""\
        from calc import answer


        def test_probe():
            assert answer() == 42
        """,
    )
    _assert_not_forged(grade, evidence)
    assert any("what its import statement binds" in what for what in _tamper(evidence))


def test_honest_imports_in_every_form_are_not_tampering(tmp_path, worktree):
    grade, evidence = _run(
        tmp_path,
        worktree,
        "answer = lambda: 42\n",
        test="""\
        import os.path
        import calc as c
        from calc import answer
        from unittest import mock
        from os import path as os_path

        try:
            import not_installed_anywhere
        except ImportError:
            not_installed_anywhere = None


        def test_probe():
            assert answer() == 42 and c.answer() == 42 and os.path and os_path and mock
        """,
    )
    assert _tamper(evidence) == []
    assert grade.resolved, grade


def test_a_conftests_own_item_class_is_trusted(tmp_path, worktree):
    # A repository's conftest may define its own Function subclass; its runtest is trusted code
    # (equal to what the hashed conftest compiles to), not tampering.
    (worktree / "tests" / "conftest.py").write_text(
        "import pytest\n\n\n"
        "class CountingFunction(pytest.Function):\n"
        "    def runtest(self):\n"
        "        super().runtest()\n\n\n"
        "def pytest_pycollect_makeitem(collector, name, obj):\n"
        "    if name.startswith('test_') and callable(obj):\n"
        "        return [CountingFunction.from_parent(collector, name=name)]\n"
    )
    grade, evidence = _run(tmp_path, worktree, "answer = lambda: 42\n", patched=[])
    assert _tamper(evidence) == []
    assert grade.resolved, grade
