"""tree_audit on real git worktrees: a clone of the toy repository at its base commit, changed
with `git apply` of real patches or by writing the files a patch would write, then audited."""

import os
import pathlib
import shutil
import sys
from collections.abc import Callable

import pytest

from dockyard_rl.sandbox import tree_audit
from dockyard_rl.sandbox.testing_repos import git, make_toy_repo

PROTECTED = ("tests/test_ops.py", "tests/test_mul_table.py")

PLUGIN_BASE = """\
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.name)


class Reporter:
    def pytest_runtest_logreport(self, report):
        self.last = report.nodeid
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("tree_audit") / "toy")


@pytest.fixture
def worktree(toy, tmp_path) -> pathlib.Path:
    path = tmp_path / "repo"
    git(tmp_path, "clone", "--quiet", str(toy.path), str(path))
    git(path, "checkout", "--quiet", "--detach", toy.base_commit)
    return path


def commit(path: pathlib.Path, files: dict[str, str | bytes]) -> None:
    """Makes `files` part of HEAD (the task's base commit), as a repository would have them."""
    write(path, files)
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "base")


def write(path: pathlib.Path, files: dict[str, str | bytes | None]) -> None:
    for name, content in files.items():
        target = path / name
        if content is None:
            target.unlink()
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)


def patch_from(worktree: pathlib.Path, change: Callable[[pathlib.Path], None]) -> str:
    """A real git patch: `change` applied to a scratch clone of worktree's HEAD, diffed."""
    scratch = worktree.parent / "patch-scratch"
    git(worktree.parent, "clone", "--quiet", str(worktree), str(scratch))
    try:
        change(scratch)
        git(scratch, "add", "-A")
        return git(scratch, "diff", "--cached", "--binary", "HEAD")
    finally:
        shutil.rmtree(scratch)


def git_apply(worktree: pathlib.Path, patch: str) -> None:
    patch_file = worktree.parent / "agent.patch"
    patch_file.write_text(patch)
    git(worktree, "apply", "--whitespace=nowarn", str(patch_file))


def audit(worktree: pathlib.Path, protected=PROTECTED) -> tree_audit.TreeAudit:
    base = tree_audit.base_tree_state(worktree)
    return tree_audit.audit_worktree(worktree, base, protected_test_files=protected)


def paths(result: tree_audit.TreeAudit) -> set[str]:
    return {violation.split(": ", 1)[0] for violation in result.violations}


# --- clean controls and totals ------------------------------------------------------------------


def test_gold_patch_and_an_ordinary_edit_are_clean(toy, worktree):
    git_apply(worktree, toy.gold_patch)
    write(
        worktree,
        {
            "calc/helpers.py": "def twice(x):\n    return 2 * x\n",
            "docs/notes.txt": "a note\n",
            "tests/data/input.json": "{}\n",
        },
    )
    result = audit(worktree)
    assert result.violations == ()
    on_disk = [
        p
        for p in worktree.rglob("*")
        if ".git" not in p.relative_to(worktree).parts and p.is_file()
    ]
    assert result.num_files == len(on_disk)
    assert result.num_bytes == sum(p.stat().st_size for p in on_disk)


def test_base_tree_state_sees_edits_and_deletions(worktree):
    write(worktree, {"calc/ops.py": "x = 1\n", "calc/__init__.py": None})
    base = tree_audit.base_tree_state(worktree)
    assert base.changed == {"calc/ops.py", "calc/__init__.py"}
    assert base.kind("calc") == "dir" and base.kind("calc/ops.py") == "file"
    assert "def mul" in base.read_base("calc/ops.py")
    assert base.read_base("no/such/file.py") is None


def test_ignored_files_are_still_seen(worktree):
    commit(worktree, {".gitignore": "*.pyc\n__pycache__/\nbuild/\n"})
    write(
        worktree,
        {"calc/__pycache__/ops.cpython-311.pyc": b"\x00pyc", "build/conftest.py": "import os\n"},
    )
    assert paths(audit(worktree)) == {
        "calc/__pycache__",
        "calc/__pycache__/ops.cpython-311.pyc",
        "build/conftest.py",
    }


# --- rule 0: git attributes ---------------------------------------------------------------------


def test_gitattributes_are_a_violation(worktree):
    write(worktree, {"calc/.gitattributes": "*.py eol=crlf\n"})
    assert audit(worktree).violations == (
        "calc/.gitattributes: git attributes changed (they steer git's view of the tree)",
    )


# --- rule 1: symlinks and special files ---------------------------------------------------------


def test_new_symlink_with_a_space_in_its_name_from_a_real_patch(worktree):
    patch = patch_from(worktree, lambda clone: os.symlink("/etc/passwd", clone / "my link"))
    assert "new file mode 120000" in patch
    git_apply(worktree, patch)
    assert audit(worktree).violations == (
        "my link: symlink not in the base commit (-> /etc/passwd)",
    )


def test_tracked_symlink_is_clean_until_it_is_repointed(worktree):
    os.symlink("ops.py", worktree / "calc" / "alias.py")
    commit(worktree, {})
    assert audit(worktree).violations == ()
    (worktree / "calc" / "alias.py").unlink()
    os.symlink("../tests/test_ops.py", worktree / "calc" / "alias.py")
    assert paths(audit(worktree)) == {"calc/alias.py"}


def test_symlinked_directory_is_not_followed(worktree, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "conftest.py").write_text("import os\n")
    os.symlink(outside, worktree / "tests" / "linked")
    result = audit(worktree)
    assert paths(result) == {"tests/linked"}  # nothing reported from the link's target


def test_fifo_is_a_violation(worktree):
    os.mkfifo(worktree / "calc" / "pipe")
    assert audit(worktree).violations == ("calc/pipe: not a regular file, directory or symlink",)


# --- rule 2: bytecode ---------------------------------------------------------------------------


def test_bytecode_from_a_binary_patch(worktree):
    def change(clone):
        write(
            clone,
            {
                "calc/ops.pyc": b"\xa7\r\r\n\x01\x00\x00\x00" + bytes(range(256)),
                "calc/__pycache__/x.cpython-311.opt-1.pyc": b"\x00\x01",
                "lib/old.pyo": b"\x00",
            },
        )

    patch = patch_from(worktree, change)
    assert "GIT binary patch" in patch
    git_apply(worktree, patch)
    assert paths(audit(worktree)) == {
        "calc/ops.pyc",
        "calc/__pycache__",
        "calc/__pycache__/x.cpython-311.opt-1.pyc",
        "lib/old.pyo",
    }


# --- rule 3: package metadata -------------------------------------------------------------------


def test_package_metadata_is_a_violation(worktree):
    entry_points = "[pytest11]\nevil = calc.evil\n"
    write(
        worktree,
        {
            "calc-1.0.dist-info/entry_points.txt": entry_points,
            "src/calc.egg-info/entry_points.txt": entry_points,
            "tests/boot.pth": "import calc.evil\n",
            "calc.egg-link": ".\n",
        },
    )
    assert paths(audit(worktree)) == {
        "calc-1.0.dist-info",
        "calc-1.0.dist-info/entry_points.txt",
        "src/calc.egg-info",
        "src/calc.egg-info/entry_points.txt",
        "tests/boot.pth",
        "calc.egg-link",
    }


# --- rule 4: modules shadowing the runner or the standard library ------------------------------


@pytest.mark.parametrize(
    "name, flagged",
    [
        ("pytest.py", "pytest.py"),
        ("tests/pytest.py", "tests/pytest.py"),
        ("calc/_pytest/__init__.py", "calc/_pytest"),
        ("pluggy/__init__.py", "pluggy"),
        ("py.py", "py.py"),
        ("iniconfig.py", "iniconfig.py"),
        ("sitecustomize.py", "sitecustomize.py"),
        ("lib/usercustomize.py", "lib/usercustomize.py"),
        ("_dockyard_runner_boot.py", "_dockyard_runner_boot.py"),
        (
            "tests/pytest.cpython-311-x86_64-linux-gnu.so",
            "tests/pytest.cpython-311-x86_64-linux-gnu.so",
        ),
        ("tests/pytest/data.txt", "tests/pytest"),
    ],
)
def test_modules_shadowing_the_runner(worktree, name, flagged):
    write(worktree, {name: "raise SystemExit(0)\n"})
    module = flagged.rpartition("/")[2].split(".")[0]
    assert audit(worktree).violations == (
        f"{flagged}: shadows the test runner's module {module!r}",
    )


def test_modules_shadowing_the_standard_library(worktree):
    write(
        worktree,
        {
            "tests/json.py": "",
            "json.py": "",
            "tests/email/__init__.py": "",  # a regular package: shadows
            "tests/html/page.txt": "",  # a data directory: does not
            "calc/json.py": "",  # inside a package: not on sys.path
            "tests/jsonish.py": "",
        },
    )
    result = audit(worktree)
    assert {v.split(": ")[0] for v in result.violations} == {
        "tests/json.py",
        "json.py",
        "tests/email",
    }
    assert "json.py: shadows the standard-library module 'json'" in result.violations


def test_new_modules_shadowing_the_runners_dependencies(worktree):
    # pytest imports these from site-packages, some lazily once the worktree is on sys.path.
    write(
        worktree,
        {
            "pygments/__init__.py": "",
            "tests/packaging.py": "",
            "exceptiongroup.py": "",
            # inside a package, but code under test can put that folder on sys.path
            "calc/_vendor/numpy.py": "",
            "tomli/data.txt": "",  # a data directory: does not shadow
        },
    )
    result = audit(worktree)
    assert {v.split(": ")[0] for v in result.violations} == {
        "pygments",
        "tests/packaging.py",
        "exceptiongroup.py",
        "calc/_vendor/numpy.py",
    }
    assert "pygments: shadows the test runner's dependency 'pygments'" in result.violations


def test_new_modules_shadowing_installed_modules(worktree):
    installed = sorted(tree_audit.installed_top_level_modules() - set(sys.stdlib_module_names))
    assert "unidiff" in installed  # the executor's own dependency
    write(worktree, {"unidiff.py": "", "calc/unidiff.py": "", "tests/yaml/__init__.py": ""})
    assert {v.split(": ")[0] for v in audit(worktree).violations} == {"unidiff.py", "tests/yaml"}


# --- rule 5: runner configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "conftest.py",
        "tests/conftest.py",
        "a/b/c/conftest.py",
        "pytest.ini",
        "tests/.pytest.ini",
        "pytest.toml",
        "sub/.pytest.toml",
    ],
)
def test_runner_config_files_always_violate(worktree, name):
    write(worktree, {name: "\n"})
    assert audit(worktree).violations == (f"{name}: test runner configuration file",)


def test_removing_a_tracked_conftest_is_a_violation(worktree):
    commit(worktree, {"tests/conftest.py": "import os\n"})
    (worktree / "tests" / "conftest.py").unlink()
    assert audit(worktree).violations == (
        "tests/conftest.py: test runner configuration file (removed)",
    )


def test_escaped_toml_key_in_a_subdirectory_pyproject(worktree):
    # A substring check misses it: "\u0070ytest" is "pytest" to TOML.
    pyproject = '[tool."\\u0070ytest".ini_options]\naddopts = "-p calc.evil"\n'
    assert "pytest" not in pyproject
    patch = patch_from(
        worktree, lambda clone: write(clone, {"tests/sub/pyproject.toml": pyproject})
    )
    git_apply(worktree, patch)
    assert audit(worktree).violations == (
        "tests/sub/pyproject.toml: changes pytest configuration (tool.pytest)",
    )


PYPROJECT_BASE = """\
[project]
name = "calc"
version = "1.0"

[tool.pytest.ini_options]
addopts = "-ra"
"""


def test_pyproject_edit_outside_the_pytest_table_is_clean(worktree):
    commit(worktree, {"pyproject.toml": PYPROJECT_BASE})
    write(
        worktree,
        {
            "pyproject.toml": PYPROJECT_BASE.replace('"1.0"', '"1.1"')
            + "\n[tool.black]\nline-length = 100\n"
        },
    )
    assert audit(worktree).violations == ()


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda text: text.replace('"-ra"', '"-ra -p no:junitxml"'), "tool.pytest"),
        (
            lambda text: text.replace('[tool.pytest.ini_options]\naddopts = "-ra"\n', ""),
            "tool.pytest",
        ),
        (lambda text: text + '\n[tool.pytest]\nminversion = "9.0"\n', "tool.pytest"),
        (
            lambda text: text + '\n[project.entry-points."pytest11"]\nevil = "calc.evil"\n',
            "project.entry-points.pytest11",
        ),
        (
            lambda text: text + '\n[tool.poetry.plugins.pytest11]\nevil = "calc.evil"\n',
            "tool.poetry.plugins.pytest11",
        ),
    ],
)
def test_pyproject_edit_inside_pytest_configuration_is_a_violation(worktree, edit, key):
    commit(worktree, {"pyproject.toml": PYPROJECT_BASE})
    write(worktree, {"pyproject.toml": edit(PYPROJECT_BASE)})
    assert audit(worktree).violations == (f"pyproject.toml: changes pytest configuration ({key})",)


def test_pyproject_that_does_not_parse_is_a_violation(worktree):
    commit(worktree, {"pyproject.toml": PYPROJECT_BASE})
    write(worktree, {"pyproject.toml": PYPROJECT_BASE + "\n[broken\n"})
    (violation,) = audit(worktree).violations
    assert violation.startswith("pyproject.toml: pyproject.toml that pytest cannot read")
    write(worktree, {"pyproject.toml": b'[project]\nname = "\xff"\n'})
    assert audit(worktree).violations == (
        "pyproject.toml: pyproject.toml that pytest cannot read (not valid UTF-8)",
    )


def test_pyproject_nested_too_deeply_is_a_violation_not_an_error(worktree):
    write(worktree, {"sub/pyproject.toml": "a = " + "[" * 100_000 + "]" * 100_000 + "\n"})
    assert audit(worktree).violations == (
        "sub/pyproject.toml: pyproject.toml that pytest cannot read (nested too deeply)",
    )


SETUP_CFG_BASE = """\
[metadata]
name = calc

[options]
packages = find:

[tool:pytest]
addopts = -ra
"""


def test_setup_cfg_and_tox_ini(worktree):
    commit(worktree, {"setup.cfg": SETUP_CFG_BASE, "tox.ini": "[tox]\nenvlist = py311\n"})
    write(worktree, {"setup.cfg": SETUP_CFG_BASE.replace("name = calc", "name = calc2")})
    assert audit(worktree).violations == ()  # metadata only
    write(
        worktree,
        {
            "setup.cfg": SETUP_CFG_BASE.replace("-ra", "-ra -p calc.evil"),
            "tox.ini": "[tox]\nenvlist = py311\n\n[pytest]\naddopts = -x\n",
            "sub/setup.cfg": "[options.entry_points]\npytest11 =\n  evil = calc.evil\n",
        },
    )
    result = audit(worktree)
    assert paths(result) == {"setup.cfg", "tox.ini", "sub/setup.cfg"}
    assert (
        "setup.cfg: changes pytest configuration ([tool:pytest], read with configparser)"
        in result.violations
    )
    assert (
        "setup.cfg: changes pytest configuration ([tool:pytest], read with iniconfig)"
        in result.violations
    )
    assert any("[pytest11]" in v for v in result.violations if v.startswith("sub/setup.cfg"))


def test_setup_cfg_that_does_not_parse_is_a_violation(worktree):
    write(worktree, {"setup.cfg": "no section header\n[tool:pytest]\naddopts = -x\n"})
    result = audit(worktree)
    assert paths(result) == {"setup.cfg"}
    assert any("does not parse" in v for v in result.violations)


# --- rule 6: plugin declarations and hooks ------------------------------------------------------


def test_new_hook_in_a_non_test_module_is_a_violation(worktree):
    patch = patch_from(
        worktree,
        lambda clone: write(
            clone,
            {
                "calc/report.py": (
                    "def pytest_runtest_makereport(item, call):\n    call.excinfo = None\n"
                )
            },
        ),
    )
    git_apply(worktree, patch)
    assert audit(worktree).violations == (
        "calc/report.py: pytest plugin declarations or hooks changed",
    )


def test_pytest_plugins_in_a_visible_test_module_is_a_violation(worktree):
    write(
        worktree,
        {"tests/test_extra.py": 'pytest_plugins = ["calc.evil"]\n\ndef test_x():\n    pass\n'},
    )
    assert audit(worktree).violations == (
        "tests/test_extra.py: pytest plugin declarations or hooks changed",
    )


def test_plugin_repo_may_edit_a_hook_body_but_not_add_a_hook(worktree):
    commit(worktree, {"calc/plugin.py": PLUGIN_BASE})
    write(
        worktree,
        {
            "calc/plugin.py": PLUGIN_BASE.replace("item.name", "item.nodeid")
            + "\n\ndef helper():\n    return 1\n"
        },
    )
    assert audit(worktree).violations == ()
    for changed in [
        PLUGIN_BASE + "\n\ndef pytest_sessionfinish(session, exitstatus):\n    pass\n",
        PLUGIN_BASE.replace("tryfirst=True", "hookwrapper=True"),
        PLUGIN_BASE.replace("    def pytest_runtest_logreport", "    def other"),
        PLUGIN_BASE + "\nfrom calc.evil import pytest_configure\n",
        PLUGIN_BASE + "\nfrom calc.evil import *\n",
        PLUGIN_BASE + '\nglobals()["pytest_configure"] = print\n',
        PLUGIN_BASE + "\n\ndef setup():\n    @pytest.hookimpl\n    def inner():\n        pass\n",
    ]:
        write(worktree, {"calc/plugin.py": changed})
        assert audit(worktree).violations == (
            "calc/plugin.py: pytest plugin declarations or hooks changed",
        ), changed
    (worktree / "calc" / "plugin.py").unlink()
    assert audit(worktree).violations == (
        "calc/plugin.py: pytest plugin declarations or hooks changed",
    )


def test_hook_spelled_with_full_width_letters(worktree):
    # Python folds identifiers with NFKC: this defines pytest_configure.
    write(
        worktree,
        {
            "calc/wide.py": "def \uff50\uff59test_configure(config):\n    pass\n",
            "calc/wide_broken.py": "def \uff50\uff59test_configure(:\n",
        },
    )
    assert paths(audit(worktree)) == {"calc/wide.py", "calc/wide_broken.py"}


def test_files_that_do_not_parse_are_compared_by_hook_names(worktree):
    write(
        worktree, {"calc/broken.py": "def broken(:\n    pass\n", "calc/latin.py": b"x = '\xe9'\n"}
    )
    assert audit(worktree).violations == ()
    write(worktree, {"calc/broken.py": "def pytest_configure(:\n    pass\n"})
    assert audit(worktree).violations == (
        "calc/broken.py: pytest plugin declarations or hooks changed (compared by name: does "
        "not parse)",
    )


def test_oversized_python_file_is_a_violation(worktree):
    write(worktree, {"calc/big.py": b"#" * (tree_audit.MAX_CHECKED_FILE_BYTES + 1)})
    assert audit(worktree).violations == ("calc/big.py: too large to check",)


# --- rule 7: protected test files ---------------------------------------------------------------


def test_protected_test_files(toy, worktree):
    write(worktree, {"tests/test_ops.py": "def test_add():\n    pass\n"})
    assert audit(worktree).violations == ("tests/test_ops.py: protected test file",)
    git(worktree, "checkout", "--", "tests/test_ops.py")
    (worktree / "tests" / "test_ops.py").unlink()
    assert audit(worktree).violations == ("tests/test_ops.py: protected test file (removed)",)
    git(worktree, "checkout", "--", "tests/test_ops.py")
    # A file the test patch will create, created first (the test patch would not apply).
    write(worktree, {"tests/test_mul_table.py": "\n"})
    assert audit(worktree).violations == ("tests/test_mul_table.py: protected test file",)


def test_a_file_blocking_a_protected_directory(worktree):
    write(worktree, {"tests2": "not a directory\n"})
    assert audit(worktree, protected=("tests2/test_new.py",)).violations == (
        "tests2: blocks protected test file tests2/test_new.py",
    )


# --- robustness ---------------------------------------------------------------------------------


def _make_deep(root: pathlib.Path, depth: int) -> None:
    """root/d/d/.../d (`depth` levels) with a .pyc at the bottom; deeper than PATH_MAX allows to
    name, so built with openat."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    pyc = os.open("evil.pyc", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(pyc, b"\x00" * 10)
    os.close(pyc)
    os.close(fd)


def _remove_deep(root: pathlib.Path) -> None:
    """Removes root/d/d/... without recursion or long paths: lift d/d up, drop d, repeat."""
    (root / "d").rename(root / "deep")
    while True:
        for name in os.listdir(root / "deep"):
            if name != "d":
                (root / "deep" / name).unlink()
        if not (root / "deep" / "d").exists():
            (root / "deep").rmdir()
            return
        (root / "deep" / "d").rename(root / "next")
        (root / "deep").rmdir()
        (root / "next").rename(root / "deep")


def test_a_3000_level_deep_directory(worktree):
    _make_deep(worktree / "calc", 3000)
    try:
        result = audit(worktree)
    finally:
        _remove_deep(worktree / "calc")
    (violation,) = result.violations
    assert violation == "calc/" + "d/" * 3000 + "evil.pyc: compiled bytecode"
    assert result.num_files == 3 + 1  # calc/__init__.py, ops.py, tests/test_ops.py, .pyc


def test_names_that_are_not_utf8(worktree):
    root = os.fsencode(worktree)
    with open(os.path.join(root, b"calc", b"data-\xff.txt"), "wb") as handle:
        handle.write(b"data\n")
    commit(worktree, {})  # tracked in HEAD under a non-UTF-8 name: clean
    assert audit(worktree).violations == ()
    with open(os.path.join(root, b"calc", b"cache-\xfe.pyc"), "wb") as handle:
        handle.write(b"\x00")
    result = audit(worktree)
    assert result.violations == ("calc/cache-\\xfe.pyc: compiled bytecode",)
    result.violations[0].encode("utf-8")  # printable in a JSON verdict


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads directories whatever their mode")
def test_unreadable_directory_is_a_violation_not_an_error(worktree):
    locked = worktree / "calc" / "locked"
    locked.mkdir()
    (locked / "x.py").write_text("")
    locked.chmod(0)
    try:
        result = audit(worktree)
    finally:
        locked.chmod(0o755)
    assert any(v.startswith("calc/locked: ") for v in result.violations)


def test_violations_are_capped(worktree):
    write(worktree, {f"calc/m{i:03}.pyc": b"\x00" for i in range(tree_audit.MAX_VIOLATIONS + 5)})
    result = audit(worktree)
    assert len(result.violations) == tree_audit.MAX_VIOLATIONS + 1
    assert result.violations[-1] == "...: 5 more violations not listed"


def test_base_tree_state_outside_a_repository_raises(tmp_path):
    with pytest.raises(tree_audit.TreeAuditError):
        tree_audit.base_tree_state(tmp_path)


def test_rename_onto_a_config_name_through_git_apply(worktree):
    renamed = patch_from(
        worktree, lambda clone: (clone / "calc" / "ops.py").rename(clone / "calc" / "conftest.py")
    )
    assert "rename to calc/conftest.py" in renamed
    git_apply(worktree, renamed)
    assert audit(worktree).violations == ("calc/conftest.py: test runner configuration file",)
