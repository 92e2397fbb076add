import pytest

from dockyard_rl.sandbox import screening
from dockyard_rl.sandbox.testing_repos import make_toy_repo


def _patch(added: list[str], removed: tuple[str, ...] = (), context: str = "x = 0") -> str:
    body = [f"-{line}" for line in removed] + [f"+{line}" for line in added] + [f" {context}"]
    return (
        f"diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
        f"@@ -1,{len(removed) + 1} +1,{len(added) + 1} @@\n" + "\n".join(body) + "\n"
    )


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("screening") / "toy")


def test_an_ordinary_fix_is_not_flagged(toy):
    assert screening.screen_patch(toy.gold_patch) == ()
    assert screening.screen_patch(toy.wrong_patch) == ()
    assert screening.screen_patch("") == ()
    ordinary = _patch(
        [
            "import sys",
            "def main(argv=None):",
            "    args = parse(argv)",
            "    if args.bad:",
            "        sys.exit(2)",
            "    signal = 3",
            "    return exit_code(args)",
            "import pytest  # noqa",
            "    option = config_option(1)",
            "    junction = 1",
        ]
    )
    assert screening.screen_patch(ordinary) == ()


@pytest.mark.parametrize(
    "line, flag",
    [
        ("from _pytest.reports import TestReport", "runner_internals: _pytest"),
        ("from _pytest.reports import TestReport", "runner_internals: TestReport"),
        ("import pluggy", "runner_internals: pluggy"),
        ("def pytest_runtest_makereport(item, call):", "runner_internals: pytest_runtest_"),
        ("def pytest_sessionfinish(session):", "runner_internals: pytest_sessionfinish"),
        ("def pytest_collection_modifyitems(items):", "runner_internals: pytest_collection"),
        ("CallInfo.from_call = fake", "runner_internals: CallInfo"),
        ("config.pluginmanager.register(Evil())", "runner_internals: pluginmanager"),
        ("@pytest.hookimpl(hookwrapper=True)", "runner_internals: hookimpl"),
        ("path = config.option.xmlpath", "runner_internals: config.option"),
        ("path = config.option.xmlpath", "report_path: xmlpath"),
        ("opt = request.config.getoption('--junitxml')", "report_path: junitxml"),
        ("from _pytest.junitxml import LogXML", "report_path: LogXML"),
        ("name = ini['junit_suite_name']", "report_path: junit"),
        ("report = 'junit_xml'", "report_path: junit_xml"),
        ("args = sys.argv[1:]", "process_arguments: sys.argv"),
        ("args = sys.orig_argv", "process_arguments: orig_argv"),
        ("raw = open('/proc/self/cmdline').read()", "process_arguments: /proc/self/cmdline"),
        ("fds = os.listdir('/proc/self/fd')", "process_arguments: /proc/self"),
        ("import atexit", "exit_hook: atexit"),
        ("signal.signal(signal.SIGTERM, rewrite)", "exit_hook: signal.signal"),
        ("    os._exit(0)", "forced_exit: os._exit"),
        ("os.abort()", "forced_exit: os.abort"),
        ("os.kill(os.getppid(), 9)", "forced_exit: os.kill"),
        ("sys.exit(0)", "forced_exit: sys.exit (module level)"),
        ("raise SystemExit(0)", "forced_exit: sys.exit (module level)"),
        ("sys.addaudithook(hook)", "introspection: sys.addaudithook"),
        ("sys.settrace(tracer)", "introspection: sys.settrace"),
        ("threading.setprofile(p)", "introspection: sys.setprofile"),
        ("frame = sys._getframe(3)", "introspection: sys._getframe"),
        ("frame = inspect.currentframe()", "introspection: inspect.currentframe"),
        ("for obj in gc.get_objects():", "introspection: gc.get_objects"),
        ("owners = gc.get_referrers(x)", "introspection: gc.get_referrers"),
        ("import ctypes", "introspection: ctypes"),
        ("f.__code__ = g.__code__", "introspection: __code__"),
        ("caller = frame.f_back", "introspection: f_back"),
        ("g = frame.f_globals", "introspection: f_globals"),
        ("builtins.open = fake_open", "introspection: builtins."),
        ("__builtins__['print'] = p", "introspection: builtins."),
    ],
)
def test_each_category_is_flagged(line, flag):
    assert flag in screening.screen_patch(_patch([line]))


def test_flags_are_sorted_unique_and_categorised():
    flags = screening.screen_patch(
        _patch(["import atexit", "import atexit as a", "args = sys.argv", "import pluggy"])
    )
    assert flags == ("exit_hook: atexit", "process_arguments: sys.argv", "runner_internals: pluggy")
    assert all(flag.split(": ")[0] in screening.CATEGORIES for flag in flags)


def test_removed_and_context_lines_are_not_flagged():
    patch = _patch(["x = 1"], removed=("import atexit", "args = sys.argv"), context="import ctypes")
    assert screening.screen_patch(patch) == ()


def test_headers_are_not_added_lines_but_added_plus_lines_are():
    # "+++ b/atexit.py" is a header; an added line whose content starts with "++" is content.
    patch = (
        "diff --git a/atexit.py b/atexit.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/atexit.py\n@@ -0,0 +1,2 @@\n+x = 1\n+++ y; import ctypes\n"
    )
    assert screening.screen_patch(patch) == ("introspection: ctypes",)


def test_a_token_inside_a_string_literal_is_still_flagged():
    # Attacks spell these names in strings (getattr, open): flagging strings is deliberate.
    flags = screening.screen_patch(
        _patch(
            [
                'name = getattr(sys, "argv")',
                'data = open("/proc/self/cmdline", "rb").read()',
                "# uses _pytest internals",
            ]
        )
    )
    assert flags == ("process_arguments: /proc/self/cmdline", "runner_internals: _pytest")


def test_sys_exit_inside_a_function_is_not_flagged():
    assert (
        screening.screen_patch(
            _patch(["def main():", "    sys.exit(main_impl())", "    raise SystemExit(1)"])
        )
        == ()
    )


def test_binary_hunks_are_flagged(toy):
    patch = toy.patch_for({"calc/ops.pyc": "\x00\x01binary"})
    assert "GIT binary patch" in patch
    assert screening.screen_patch(patch) == (screening.BINARY_FLAG,)


def test_real_patch_from_the_toy_repository(toy):
    hostile = toy.patch_for(
        {"calc/ops.py": "import atexit\nimport os\n\natexit.register(lambda: os._exit(0))\n"}
    )
    assert screening.screen_patch(hostile) == ("exit_hook: atexit", "forced_exit: os._exit")
