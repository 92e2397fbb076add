"""Audit of the worktree after the agent's patch is applied, before any untrusted code runs.

Header parsing of the patch (protected_paths.py) decides what a patch *names*; this module decides
what the tree *is*: it walks the filesystem itself (lstat, never following a link, never asking
`git status`, which a .gitignore can blind) and compares every entry with HEAD. Call order, in
the scoring pipeline:

    checkout base_commit -> apply the agent's patch
      -> base = base_tree_state(worktree)          # git runs here; nothing untrusted has run yet
      -> audit = audit_worktree(worktree, base, protected_test_files=...)
      -> any audit.violations: "integrity violation", not resolved, reward 0, tests not run
      -> restore held-out tests, apply test_patch, run the tests

A path is *changed or new* when it exists on disk but not in HEAD, when git reports it as
differing from HEAD (`git diff --no-renames --name-only -z HEAD`: content, mode, deletion), or
when its type on disk (file / symlink / directory) is not the type HEAD records. Deleted tracked
paths count as changed (their new content is "absent"). Only the top-level `.git` is skipped.
Each violation is a string "path: reason"; the rules (numbers used in the reasons' tests):

0. `.gitattributes` new or changed anywhere: attributes steer how git compares the worktree with
   HEAD (e.g. `eol`, `working-tree-encoding` make git report a changed file as unchanged) and how
   the pipeline's later `git checkout` / `git apply` of the held-out tests behave.
1. A symlink that HEAD does not track as a symlink (mode 120000) with the same target; any entry
   that is not a regular file, directory or symlink (FIFO, socket, device).
2. Compiled bytecode, new or changed: `*.pyc`, `*.pyo`, anything under a `__pycache__`
   directory (a .pyc without its source is importable; an "unchecked-hash" .pyc wins over its
   source).
3. Package metadata the import system and pytest's plugin loader read, new or changed anywhere:
   anything under `*.dist-info/` or `*.egg-info/`, `*.egg-link`, `*.pth` (an entry_points.txt
   can declare `pytest11` plugins; a .pth runs code at start-up).
4. Modules shadowing the runner, new or changed, anywhere: a module or package (any importable
   suffix: .py, .pyc, extension modules, or a directory) named pytest, _pytest, pluggy, py,
   iniconfig, sitecustomize, usercustomize or `_dockyard_runner*`; and a *new* module named after
   a standard-library module (`sys.stdlib_module_names`; a directory only when it holds an
   `__init__`) in a directory that is not a package (no `__init__`): such directories are what
   the worktree or pytest's rootdir insertion put on `sys.path`. The same for a *new* module
   named after a dependency pytest imports from site-packages, some of it lazily or through
   sys.modules (packaging, pygments, exceptiongroup, tomli, colorama, argcomplete, numpy), in
   any directory (code under test can put a folder on sys.path at run time); and a *new* module
   named after any top-level module installed for the executor's interpreter where the stdlib
   rule looks.
5. Runner configuration, decided with real parsers: conftest.py, pytest.ini, .pytest.ini,
   pytest.toml, .pytest.toml new, changed or removed: always. pyproject.toml: parsed (tomllib)
   in its base and new versions; a violation when `tool.pytest` (pytest 9 reads `[tool.pytest]`
   and `[tool.pytest.ini_options]`), `project.entry-points.pytest11` or
   `tool.poetry.plugins.pytest11` differ, or when the new version does not parse. setup.cfg and
   tox.ini: parsed with configparser (no interpolation, not strict, case-sensitive keys) AND with
   iniconfig (pytest's own parser, whenever it is importable); a violation when, for any parser,
   the `tool:pytest` or `pytest` section or the pytest11 keys of `options.entry_points` differ,
   or when the new version does not parse while the base did (or there was no base).
6. Plugin declarations and hooks in every new, changed or removed `*.py` file (the module could
   be a plugin: a base conftest may list it in `pytest_plugins`): parsed with `ast`, the set of
   - functions (any depth, by qualified name, with their decorators) named `pytest_*` or
     decorated with something ending in `hookimpl` / `hookspec`,
   - assignments to `pytest_plugins` (any depth, with the value), to other `pytest_*` names at
     module or class level (with the value), to attributes of `pytest_*` names,
   - module- or class-level imports that bind a `pytest_*` name, and star imports
   must be equal in the base and new versions (names and decorators, not bodies: a repository
   that is itself a pytest plugin can still fix a hook's body). A version that does not parse
   (a syntax error, or syntax newer than this interpreter) is compared by the set of words
   `pytest_*` / `*hookimpl` / `*hookspec` in its NFKC-normalised text instead (Python folds
   identifiers with NFKC: a hook spelled in full-width letters is still a hook). Parsing costs
   about 0.4 s per MB of changed Python source (base and new versions).
7. `protected_test_files` (the task's test files): any change, creation or removal of one, and
   any new non-directory where one of their parent directories must be (it would block the
   held-out tests from being restored).
8. Totals: `num_bytes` / `num_files` count the regular files outside the top-level .git (the
   pipeline compares them with its disk cap).

Reading contents is capped: a config or .py file that rules 5 and 6 would have to read and that
is larger than `MAX_CHECKED_FILE_BYTES` (in its new or its base version) is a violation "too large
to check" (no legitimate fix makes an 8 MiB source file; skipping it would let a padded plugin
through). A file that cannot be read or decoded where a rule needs its text is a violation with
the reason, never an exception.

Robustness: the walk is iterative and holds O(1) file descriptors whatever the depth (it moves
with openat(name) / openat("..") and checks each directory's identity (st_dev, st_ino), so a
3,000-level tree or a path longer than PATH_MAX is fine); names that are not valid UTF-8 are kept
with surrogateescape internally and shown with backslash escapes in violations. At most
`MAX_VIOLATIONS` violations are listed; the rest are counted in a last entry. `audit_worktree`
runs no git command and reads nothing outside the worktree; it raises only for an unusable
`worktree` argument (not a directory). `base_tree_state` raises TreeAuditError when git fails on
the checkout (infrastructure: nothing from the patch can make `ls-tree`, `diff` or `cat-file`
fail).

Not covered (the runtime layers handle these): code that registers hooks or plugins dynamically
(`setattr(module, "pytest_" + name, f)`, `config.pluginmanager.register` inside an existing
hook's body), and anything a repository's own, unchanged code does. A gold patch that adds a
hook (a task in pytest itself, or in a pytest plugin, that adds a hookspec) is a violation too.
Submodule contents (never checked out by the pipeline) would count as new files.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import functools
import importlib.machinery
import importlib.metadata
import os
import pathlib
import posixpath
import re
import stat
import sys
import tomllib
import unicodedata
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping

from dockyard_rl.sandbox import apply as apply_lib

MAX_CHECKED_FILE_BYTES = 8 * 1024 * 1024
MAX_VIOLATIONS = 200
_GIT_TIMEOUT_S = 120

# Git modes as `git ls-tree` prints them.
_MODE_KINDS = {
    "100644": "file",
    "100755": "file",
    "100664": "file",
    "120000": "symlink",
    "040000": "dir",
    "160000": "dir",
}

_CONFIG_ALWAYS = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"}
)
_CONFIG_PARSED = frozenset({"pyproject.toml", "setup.cfg", "tox.ini"})
_RUNNER_MODULES = frozenset(
    {"pytest", "_pytest", "pluggy", "py", "iniconfig", "sitecustomize", "usercustomize"}
)
# What pytest imports from site-packages besides itself, some of it lazily (after the worktree
# is on sys.path): its dependencies and optional helpers. The runner imports them up front; a new
# module of these names where the stdlib rule looks is refused as well.
_RUNNER_DEPENDENCIES = frozenset(
    {"packaging", "pygments", "exceptiongroup", "tomli", "colorama", "argcomplete", "numpy"}
)


@functools.lru_cache(maxsize=1)
def installed_top_level_modules() -> frozenset[str]:
    """Top-level module names of the distributions installed for this interpreter (the one the
    tests run with when the task has no image or venv of its own). Read once per process."""
    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # noqa: BLE001 - a broken dist-info must not stop scoring
        return frozenset()


_RUNNER_PREFIX = "_dockyard_runner"
# Longest first, so "x.cpython-311-x86_64-linux-gnu.so" loses its whole suffix, not just ".so".
_MODULE_SUFFIXES = tuple(sorted(importlib.machinery.all_suffixes(), key=len, reverse=True))
_INIT_NAMES = frozenset("__init__" + suffix for suffix in _MODULE_SUFFIXES)
_HOOK_WORDS_RE = re.compile(r"\b(?:pytest_\w+|\w*hook(?:impl|spec))\b")

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class TreeAuditError(RuntimeError):
    """git failed on the trusted checkout (infrastructure, not the patch's doing)."""


@dataclasses.dataclass(frozen=True)
class TreeAudit:
    violations: tuple[str, ...]  # sorted "path: reason" strings; empty = clean
    num_bytes: int  # total bytes of regular files outside .git
    num_files: int


@dataclasses.dataclass(frozen=True)
class BaseTree:
    """HEAD of the worktree as git records it, captured by `base_tree_state`.

    Paths are repository-relative, "/"-separated str (bytes that are not UTF-8 kept with
    surrogateescape, as os.fsdecode makes them, so they compare equal to the names a directory
    walk returns).
    - `entries`: every path in HEAD, recursively, trees included -> (git mode, object id).
    - `changed`: tracked paths git reports as differing from HEAD in the worktree (content, mode,
      type or deletion), at the time `base_tree_state` ran.
    - `base_contents`: the HEAD bytes of what the rules compare against: the targets of all
      tracked symlinks, and the base version of every changed path named *.py, pyproject.toml,
      setup.cfg or tox.ini. None for a blob larger than MAX_CHECKED_FILE_BYTES (not read).
    """

    worktree: pathlib.Path
    entries: Mapping[str, tuple[str, str]]
    changed: frozenset[str]
    base_contents: Mapping[str, bytes | None]

    def kind(self, path: str) -> str | None:
        """ "file" | "symlink" | "dir" for a path in HEAD, None when HEAD has no such path."""
        entry = self.entries.get(path)
        return None if entry is None else _MODE_KINDS.get(entry[0], "file")

    def read_base(self, path: str) -> str | None:
        """The HEAD text of `path` (UTF-8, undecodable bytes replaced); None when HEAD has no
        such file. From `base_contents` when captured, otherwise `git cat-file` (only before
        untrusted code has run in the worktree: git reads the worktree's .git)."""
        data = self.read_base_bytes(path)
        return None if data is None else data.decode("utf-8", errors="replace")

    def read_base_bytes(self, path: str) -> bytes | None:
        if path in self.base_contents and self.base_contents[path] is not None:
            return self.base_contents[path]
        entry = self.entries.get(path)
        if entry is None or self.kind(path) == "dir":
            return None
        return _cat_blobs(self.worktree, [entry[1]])[entry[1]]


def _git_bytes(worktree: pathlib.Path, *args: str) -> bytes:
    """apply.git_output, raising TreeAuditError (our own checkout: not the patch's doing)."""
    try:
        return apply_lib.git_output(worktree, *args, timeout=_GIT_TIMEOUT_S)
    except apply_lib.GitError as error:
        raise TreeAuditError(str(error)) from error


def _cat_blobs(worktree: pathlib.Path, object_ids: Iterable[str]) -> dict[str, bytes | None]:
    """object id -> content, with one `git cat-file --batch`; None for a missing object."""
    try:
        return apply_lib.cat_file_batch(worktree, list(object_ids), timeout=_GIT_TIMEOUT_S)
    except apply_lib.GitError as error:
        raise TreeAuditError(str(error)) from error


def _is_content_checked(path: str) -> bool:
    name = path.rpartition("/")[2].lower()
    return name.endswith(".py") or name in _CONFIG_PARSED


def base_tree_state(worktree: pathlib.Path) -> BaseTree:
    """HEAD's entries and what git sees as changed (see BaseTree). Call after the agent's patch
    is applied and before any untrusted code has run in `worktree` (git reads its .git).
    Raises TreeAuditError when git fails."""
    worktree = pathlib.Path(worktree)
    entries: dict[str, tuple[str, str]] = {}
    sizes: dict[str, int] = {}
    listing = _git_bytes(worktree, "ls-tree", "-r", "-t", "-l", "-z", "--full-tree", "HEAD")
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, _, raw_path = record.partition(b"\t")
        mode, _kind, oid, size = meta.decode("ascii").split()
        path = os.fsdecode(raw_path)
        entries[path] = (mode, oid)
        if size != "-":
            sizes[path] = int(size)
    diff = _git_bytes(
        worktree,
        "diff",
        "--no-renames",
        "--no-ext-diff",
        "--no-textconv",
        "--ignore-submodules=none",
        "--name-only",
        "-z",
        "HEAD",
    )
    changed = frozenset(os.fsdecode(raw) for raw in diff.split(b"\0") if raw)
    wanted = {path for path, (mode, _) in entries.items() if mode == "120000"}
    wanted |= {
        path
        for path in changed
        if path in entries
        and _is_content_checked(path)
        and _MODE_KINDS.get(entries[path][0]) in ("file", "symlink")
    }
    readable = {path for path in wanted if sizes.get(path, 0) <= MAX_CHECKED_FILE_BYTES}
    blobs = _cat_blobs(worktree, (entries[path][1] for path in sorted(readable)))
    base_contents = {
        path: (blobs.get(entries[path][1]) if path in readable else None) for path in wanted
    }
    return BaseTree(
        worktree=worktree, entries=entries, changed=changed, base_contents=base_contents
    )


# --- rule helpers -------------------------------------------------------------------------------


def _shown(path: str) -> str:
    """A path as printable text: bytes that are not UTF-8 as \\x escapes (the verdict is JSON)."""
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


def _module_name(name: str, kind: str) -> str | None:
    """The module a directory entry provides to the import system, if any."""
    if kind == "dir":
        return name
    for suffix in _MODULE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def _is_runner_module(module: str) -> bool:
    return module in _RUNNER_MODULES or module.startswith(_RUNNER_PREFIX)


def _get(tree: object, *keys: str) -> object:
    for key in keys:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def _pyproject_view(data: bytes) -> dict[str, object]:
    """What pytest reads from a pyproject.toml; raises ValueError when it does not parse."""
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError("not valid UTF-8") from error
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"invalid TOML: {error}") from error
    except RecursionError as error:  # tomllib recurses into nested arrays and inline tables
        raise ValueError("nested too deeply") from error
    return {
        "tool.pytest": _get(document, "tool", "pytest"),
        "project.entry-points.pytest11": _get(document, "project", "entry-points", "pytest11"),
        "tool.poetry.plugins.pytest11": _get(document, "tool", "poetry", "plugins", "pytest11"),
    }


def _ini_view_configparser(text: str) -> dict[str, object]:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # keys case-sensitive, as pytest reads them
    try:
        parser.read_string(text)
    except configparser.Error as error:
        raise ValueError(f"configparser: {error}".splitlines()[0]) from error
    view: dict[str, object] = {}
    for section in ("tool:pytest", "pytest"):
        view[section] = dict(parser.items(section)) if parser.has_section(section) else None
    if parser.has_section("options.entry_points"):
        view["pytest11"] = {
            key: value
            for key, value in parser.items("options.entry_points")
            if "pytest11" in key.lower()
        }
    return view


def _ini_view_iniconfig(text: str) -> dict[str, object]:
    import iniconfig  # pytest's own ini parser; a dependency of pytest

    try:
        parsed = iniconfig.IniConfig("config.ini", data=text)
    except iniconfig.ParseError as error:
        raise ValueError(f"iniconfig: {error}") from error
    view: dict[str, object] = {}
    for section in ("tool:pytest", "pytest"):
        view[section] = dict(parsed[section].items()) if section in parsed else None
    if "options.entry_points" in parsed:
        view["pytest11"] = {
            key: value
            for key, value in parsed["options.entry_points"].items()
            if "pytest11" in key.lower()
        }
    return view


def _ini_parsers() -> list[tuple[str, Callable[[str], dict[str, object]]]]:
    parsers = [("configparser", _ini_view_configparser)]
    try:
        import iniconfig  # noqa: F401
    except ImportError:
        pass
    else:
        parsers.append(("iniconfig", _ini_view_iniconfig))
    return parsers


def _config_reasons(name: str, base: bytes | None, new: bytes | None) -> list[str]:
    """Rule 5 for pyproject.toml / setup.cfg / tox.ini: why base -> new changes pytest's
    configuration ([] when it does not). None = the file is absent in that version."""
    if name == "pyproject.toml":
        views = []
        for version, data in (("base", base), ("new", new)):
            if data is None:
                views.append({})
                continue
            try:
                views.append(_pyproject_view(data))
            except ValueError as error:
                if version == "new":
                    return [f"pyproject.toml that pytest cannot read ({error})"]
                views.append({})  # a broken base: pytest read nothing from it
        base_view, new_view = views
        return [
            f"changes pytest configuration ({key})"
            for key in sorted(set(base_view) | set(new_view))
            if base_view.get(key) != new_view.get(key)
        ]
    texts = []
    for version, data in (("base", base), ("new", new)):
        if data is None:
            texts.append(None)
            continue
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            if version == "new":
                return [f"{name} that pytest cannot read (not valid UTF-8)"]
            texts.append(None)
    base_text, new_text = texts
    reasons = []
    for parser_name, parse in _ini_parsers():
        base_view: dict[str, object] | None = {}
        if base_text is not None:
            try:
                base_view = parse(base_text)
            except ValueError:
                base_view = None  # unreadable by this parser: it cannot compare
        new_view: dict[str, object] | None = {}
        if new_text is not None:
            try:
                new_view = parse(new_text)
            except ValueError as error:
                if base_view is not None:
                    reasons.append(f"{name} does not parse ({error})")
                continue
        if base_view is None:
            continue
        reasons += [
            f"changes pytest configuration ([{key}], read with {parser_name})"
            for key in sorted(set(base_view) | set(new_view))
            if base_view.get(key) != new_view.get(key)
        ]
    return reasons


def _terminal_name(node: ast.expr) -> str:
    while isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _names_in(target: ast.expr) -> list[str]:
    return [node.id for node in ast.walk(target) if isinstance(node, ast.Name)]


def _words_in(target: ast.expr) -> list[str]:
    """Names, attribute names and string constants in an assignment target."""
    words = []
    for node in ast.walk(target):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.append(node.value)
    return words


def _hook_signature(tree: ast.Module) -> frozenset[tuple[str, ...]]:
    """Rule 6's set for one module (see the module docstring). Iterative: no recursion."""
    signature: set[tuple[str, ...]] = set()
    # (node, qualified-name prefix, is this a module/class scope whose names pytest can see)
    stack: list[tuple[ast.AST, str, bool]] = [(tree, "", True)]
    while stack:
        node, qual, binding = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("pytest_") or any(
                _terminal_name(d).endswith(("hookimpl", "hookspec")) for d in node.decorator_list
            ):
                signature.add(
                    ("def", qual + node.name, *(ast.dump(d) for d in node.decorator_list))
                )
            stack.extend((child, f"{qual}{node.name}.", False) for child in node.body)
            continue
        if isinstance(node, ast.ClassDef):
            if binding and node.name.startswith("pytest_"):
                signature.add(("class", qual + node.name))
            stack.extend((child, f"{qual}{node.name}.", True) for child in node.body)
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]

            def value(node=node) -> str:  # dumped only when it matters (dumps are slow)
                return ast.dump(node.value) if node.value is not None else ""

            for target in targets:
                names = _names_in(target)
                if isinstance(target, (ast.Attribute, ast.Subscript)):
                    # `pytest_x.hookwrapper = True`, `Plugin.pytest_x = f`,
                    # `globals()["pytest_plugins"] = [...]`
                    if any(word.startswith("pytest_") for word in _words_in(target)):
                        signature.add(("attr", qual, ast.dump(target), value()))
                    continue
                for name in names:
                    if name == "pytest_plugins":
                        signature.add(("plugins", qual, value()))
                    elif binding and name.startswith("pytest_"):
                        signature.add(("bind", qual + name, value()))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if binding and any(
                alias.name == "*"
                or (alias.asname or alias.name.split(".")[0]).startswith("pytest_")
                for alias in node.names
            ):
                signature.add(("import", qual, ast.dump(node)))
            continue
        # Compound statements (if / try / with / for / while / match) keep their scope.
        stack.extend(
            (child, qual, binding)
            for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case))
        )
    return frozenset(signature)


def _hook_words(data: bytes | None) -> frozenset[str]:
    """The hook-like words of a text, after the NFKC normalisation Python applies to
    identifiers (so "\uff50ytest_configure" is "pytest_configure", as the interpreter sees it)."""
    if not data:
        return frozenset()
    text = unicodedata.normalize("NFKC", data.decode("utf-8", errors="replace"))
    return frozenset(_HOOK_WORDS_RE.findall(text))


def _hooks_reason(base: bytes | None, new: bytes | None) -> str | None:
    """Rule 6 for one .py file: a reason when plugin declarations or hooks differ."""
    signatures = []
    for data in (base, new):
        if data is None:
            signatures.append(frozenset())
            continue
        try:
            with warnings.catch_warnings():  # invalid escapes etc. are not our business
                warnings.simplefilter("ignore")
                tree = ast.parse(data)
            signatures.append(_hook_signature(tree))
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            signatures = None
            break
    if signatures is not None:
        if signatures[0] != signatures[1]:
            return "pytest plugin declarations or hooks changed"
        return None
    words = [_hook_words(data) for data in (base, new)]
    if words[0] != words[1]:
        return "pytest plugin declarations or hooks changed (compared by name: does not parse)"
    return None


# --- the walk -----------------------------------------------------------------------------------


class _Audit:
    def __init__(self, worktree: pathlib.Path, base: BaseTree, protected: frozenset[str]):
        self.worktree = worktree
        self.base = base
        self.protected = protected
        self.violations: set[str] = set()
        self.num_bytes = 0
        self.num_files = 0
        self.seen_changed: set[str] = set()  # paths of base.changed found on disk as files

    def flag(self, path: str, reason: str) -> None:
        self.violations.add(f"{_shown(path)}: {reason}")

    def is_changed(self, path: str, kind: str, dir_fd: int, name: str) -> bool:
        head_kind = self.base.kind(path)
        if head_kind is None or head_kind != kind or path in self.base.changed:
            return True
        if kind == "symlink":
            return not self.same_link(path, dir_fd, name)
        return False

    def same_link(self, path: str, dir_fd: int, name: str) -> bool:
        if self.base.kind(path) != "symlink":
            return False
        try:
            target = os.fsencode(os.readlink(name, dir_fd=dir_fd))
        except OSError:
            return False
        return target == self.base.base_contents.get(path)

    def name_rules(self, path: str, *, removed: bool = False) -> None:
        """Rules 0, 2, 3, 5 (names that are always a violation) and 7: by name only."""
        parts = path.split("/")
        name = parts[-1]
        lower = name.lower()
        suffix = " (removed)" if removed else ""
        if lower == ".gitattributes":
            self.flag(path, "git attributes changed (they steer git's view of the tree)" + suffix)
        if lower.endswith((".pyc", ".pyo")) or "__pycache__" in parts:
            self.flag(path, "compiled bytecode" + suffix)
        if any(
            part.lower().endswith((".dist-info", ".egg-info")) for part in parts
        ) or lower.endswith((".egg-link", ".pth")):
            self.flag(path, "package metadata read by the import system or pytest" + suffix)
        if lower in _CONFIG_ALWAYS:
            self.flag(path, "test runner configuration file" + suffix)
        if path in self.protected:
            self.flag(path, "protected test file" + suffix)

    def module_rules(
        self, path: str, kind: str, dir_fd: int, name: str, is_new: bool, dir_is_package: bool
    ) -> None:
        """Rule 4: modules shadowing the runner or, in non-package directories, the stdlib."""
        module = _module_name(name, kind)
        if module is None:
            return
        if _is_runner_module(module):
            self.flag(path, f"shadows the test runner's module {module!r}")
        elif is_new and not dir_is_package and module in sys.stdlib_module_names:
            if kind == "dir" and not self.has_init(dir_fd, name):
                return  # a namespace directory never wins over a regular stdlib module
            self.flag(path, f"shadows the standard-library module {module!r}")
        elif is_new and module in _RUNNER_DEPENDENCIES:
            # Anywhere: code under test can put any folder on sys.path at run time, and pytest
            # reaches these through sys.modules (pytest.approx uses whatever "numpy" is there).
            if kind == "dir" and not self.has_init(dir_fd, name):
                return  # a namespace directory never wins over an installed package
            self.flag(path, f"shadows the test runner's dependency {module!r}")
        elif is_new and not dir_is_package and module in installed_top_level_modules():
            if kind == "dir" and not self.has_init(dir_fd, name):
                return
            self.flag(path, f"shadows the installed module {module!r}")

    @staticmethod
    def has_init(dir_fd: int, name: str) -> bool:
        try:
            fd = _open_dir(dir_fd, name)
        except OSError:
            return True  # cannot tell: conservative
        try:
            return not _INIT_NAMES.isdisjoint(os.listdir(fd))
        except OSError:
            return True
        finally:
            os.close(fd)

    def content_rules(self, path: str, new: bytes | None, new_error: str | None) -> None:
        """Rules 5 (parsed config) and 6 (hooks) for a changed path; new=None: absent."""
        lower = path.rpartition("/")[2].lower()
        is_python = lower.endswith(".py")
        if not is_python and lower not in _CONFIG_PARSED:
            return
        if new_error is not None:
            self.flag(path, new_error)
            return
        base: bytes | None = None
        if self.base.kind(path) == "file":
            if path in self.base.base_contents:
                base = self.base.base_contents[path]
                if base is None:
                    self.flag(path, "base version too large to check")
                    return
            else:  # base_tree_state captures every path git reports as changed
                self.flag(path, "base version was not captured (git did not report the change)")
                return
        try:
            reasons = [_hooks_reason(base, new)] if is_python else _config_reasons(lower, base, new)
        except Exception as error:  # noqa: BLE001 - a parser's surprise is the patch's problem
            reasons = [f"could not be checked ({type(error).__name__})"]
        for reason in reasons:
            if reason:
                self.flag(path, reason)

    def read_file(self, dir_fd: int, name: str) -> tuple[bytes | None, str | None]:
        """(content, None) or (None, reason) for a file a content rule needs."""
        try:
            fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
        except OSError as error:
            return None, f"cannot be read ({error.strerror})"
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None, "not a regular file"
            if info.st_size > MAX_CHECKED_FILE_BYTES:
                return None, "too large to check"
            chunks, total = [], 0
            while total <= MAX_CHECKED_FILE_BYTES:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            if total > MAX_CHECKED_FILE_BYTES:
                return None, "too large to check"
            return b"".join(chunks), None
        except OSError as error:
            return None, f"cannot be read ({error.strerror})"
        finally:
            os.close(fd)

    def entry(
        self, path: str, name: str, info: os.stat_result, dir_fd: int, dir_is_package: bool
    ) -> None:
        mode = info.st_mode
        kind = (
            "dir"
            if stat.S_ISDIR(mode)
            else "symlink"
            if stat.S_ISLNK(mode)
            else "file"
            if stat.S_ISREG(mode)
            else "other"
        )
        if kind == "file":
            self.num_files += 1
            self.num_bytes += info.st_size
        if path in self.base.changed and kind == "file":
            self.seen_changed.add(path)
        if kind == "other":
            self.flag(path, "not a regular file, directory or symlink")
        if not self.is_changed(path, kind, dir_fd, name):
            return
        is_new = self.base.kind(path) is None
        if kind == "symlink":
            try:
                target = _shown(os.readlink(name, dir_fd=dir_fd))
            except OSError:
                target = "?"
            self.flag(path, f"symlink not in the base commit (-> {target})")
        self.name_rules(path)
        self.module_rules(path, kind, dir_fd, name, is_new, dir_is_package)
        if kind == "file":
            new, error = self.read_file(dir_fd, name) if _is_content_checked(path) else (None, None)
            self.content_rules(path, new, error)
        elif self.base.kind(path) == "file":
            self.content_rules(path, None, None)  # the file is gone (now a dir or a link)

    def removed(self) -> None:
        """Tracked paths git reports changed that the walk did not find as regular files."""
        for path in sorted(self.base.changed - self.seen_changed):
            kind = self.base.kind(path)
            if kind is None or kind == "dir":
                continue
            if not self.exists(path):
                self.name_rules(path, removed=True)
                self.content_rules(path, None, None)

    def exists(self, path: str) -> bool:
        try:
            os.lstat(os.path.join(self.worktree, path))
            return True
        except OSError:
            return False

    def blocked_protected(self) -> None:
        """Rule 7, second half: a non-directory where a protected file's parent must be."""
        for path in sorted(self.protected):
            parts = path.split("/")
            for depth in range(1, len(parts)):
                prefix = "/".join(parts[:depth])
                try:
                    info = os.lstat(os.path.join(self.worktree, prefix))
                except OSError:
                    break
                if stat.S_ISDIR(info.st_mode):
                    continue
                if self.base.kind(prefix) != "file" or prefix in self.base.changed:
                    self.flag(prefix, f"blocks protected test file {_shown(path)}")
                break


def _open_dir(dir_fd: int, name: str) -> int:
    """openat(dir_fd, name) as a directory, never following a symlink."""
    return os.open(name, _OPEN_DIR, dir_fd=dir_fd)


def _normalize(path: str) -> str | None:
    path = posixpath.normpath(path.strip())
    if path in (".", "") or path.startswith("/") or path.split("/")[0] == "..":
        return None
    return path


def audit_worktree(
    worktree: pathlib.Path, base: BaseTree, *, protected_test_files: Collection[str] = ()
) -> TreeAudit:
    """Walks `worktree` and applies the module docstring's rules against `base` (from
    `base_tree_state` on the same worktree). Never raises for what a patch can do to the tree;
    raises OSError only when `worktree` itself cannot be opened as a directory."""
    protected = frozenset(p for p in map(_normalize, protected_test_files) if p)
    audit = _Audit(pathlib.Path(worktree), base, protected)
    root_fd = os.open(str(worktree), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    _walk(audit, root_fd)
    audit.removed()
    audit.blocked_protected()
    violations = sorted(audit.violations)
    if len(violations) > MAX_VIOLATIONS:
        extra = len(violations) - MAX_VIOLATIONS
        violations = violations[:MAX_VIOLATIONS] + [f"...: {extra} more violations not listed"]
    return TreeAudit(
        violations=tuple(violations), num_bytes=audit.num_bytes, num_files=audit.num_files
    )


@dataclasses.dataclass
class _Frame:
    path: str  # "" for the root
    ident: tuple[int, int]  # (st_dev, st_ino), checked when the walk climbs back with ".."
    pending: list[tuple[str, tuple[int, int]]]  # subdirectories still to visit


def _walk(audit: _Audit, root_fd: int) -> None:
    """Depth-first, iterative, one directory fd open at a time (consumes `root_fd`)."""
    fd = root_fd
    root_info = os.fstat(fd)
    stack: list[_Frame] = []
    entering: tuple[str, tuple[int, int]] | None = ("", (root_info.st_dev, root_info.st_ino))
    try:
        while True:
            if entering is not None:
                path, ident = entering
                entering = None
                stack.append(_Frame(path, ident, _list_dir(audit, fd, path)))
            frame = stack[-1]
            if frame.pending:
                name, ident = frame.pending.pop()
                child_path = f"{frame.path}/{name}" if frame.path else name
                try:
                    child_fd = _open_dir(fd, name)
                except OSError as error:
                    audit.flag(child_path, f"directory cannot be opened ({error.strerror})")
                    continue
                info = os.fstat(child_fd)
                if (info.st_dev, info.st_ino) != ident:
                    os.close(child_fd)
                    audit.flag(child_path, "changed while being audited")
                    continue
                os.close(fd)
                fd = child_fd
                entering = (child_path, ident)
                continue
            stack.pop()
            if not stack:
                return
            try:
                parent_fd = os.open("..", _OPEN_DIR, dir_fd=fd)
            except OSError as error:
                audit.flag(frame.path, f"cannot climb back out ({error.strerror})")
                return
            info = os.fstat(parent_fd)
            os.close(fd)
            fd = parent_fd
            if (info.st_dev, info.st_ino) != stack[-1].ident:
                audit.flag(stack[-1].path or ".", "changed while being audited")
                return
    finally:
        os.close(fd)


def _list_dir(audit: _Audit, fd: int, path: str) -> list[tuple[str, tuple[int, int]]]:
    """Audits every entry of the directory open as `fd`; returns its subdirectories."""
    try:
        with os.scandir(fd) as listing:
            names = sorted(entry.name for entry in listing)
    except OSError as error:
        audit.flag(path or ".", f"directory cannot be listed ({error.strerror})")
        return []
    dir_is_package = not _INIT_NAMES.isdisjoint(names)
    subdirs = []
    for name in names:
        if not path and name == ".git":
            continue
        child_path = f"{path}/{name}" if path else name
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError as error:
            audit.flag(child_path, f"cannot be inspected ({error.strerror})")
            continue
        audit.entry(child_path, name, info, fd, dir_is_package)
        if stat.S_ISDIR(info.st_mode):
            subdirs.append((name, (info.st_dev, info.st_ino)))
    subdirs.reverse()  # popped from the end: visit in name order
    return subdirs
