"""Python source distributions as local git repositories, the raw material of task synthesis.

    archive = fetch_sdist("sqlparse==0.6.1", download_dir)       # pip download, sdist only
    layout = unpack_sdist(archive, extract_dir)                   # name, version, files by role
    repo = SdistRepository.create(repos_dir / "sqlparse.git", layout)
    repo.pristine, repo.screening                                 # two commits, see below

The repository is a bare git repository (the executor clones it as its mirror). Every commit is
written with git plumbing (a private index file, `hash-object`, `commit-tree`) and a fixed author
date, so the same sdist and the same edits give the same commit ids on every machine, and no
checkout is ever needed. Its commits:
- `pristine` (refs/heads/main): the sdist as released.
- `screening` (refs/dockyard/screening): pristine without its non-empty test modules. Scoring a
  mutation against it with `screening_test_patch` (which adds the test modules back) as the
  executor's test_patch runs the full suite on the mutated code: the mutation goes in as the
  "agent's" patch and never touches a held-out file.
- Task commits made by `commit_files` (the synthesizer names them refs/tasks/<instance id>, so a
  `git clone --mirror` carries them).

Src layouts (packages under `src/`) get `import_paths` = src relative to the folder of pytest's
config file (where pytest resolves it); the synthesizer passes it to pytest's `pythonpath` option,
since nothing is installed.

File roles (`PackageLayout`): a `.py` file is a test module when a directory on its path is named
test/tests/testing, or its name is test_*.py, *_test.py or conftest.py; source modules are the
other `.py` files outside top-level docs/examples/benchmarks/scripts folders and setup files.
Empty test modules (package `__init__.py`) stay in every commit: an empty file cannot be added
back by a text patch that every diff parser agrees on.

Trust: the package's tests only ever run inside the executor's sandbox, and archives are
unpacked with tarfile's "data" filter (no absolute paths, no links out of the tree). But
`pip download` of an sdist runs the package's build backend on this machine to read its metadata,
as `pip install` would: only name packages you would install. For anything else, download the
archive elsewhere and pass its path (it is then only unpacked, never built).

Not covered: wheels-only packages (there is nothing to mutate in a wheel), sdists whose tests need
extra dependencies (their baseline simply fails and the synthesizer reports it), non-Python
test suites.
"""

from __future__ import annotations

import dataclasses
import email.parser
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

_GIT_TIMEOUT_S = 300
_PIP_TIMEOUT_S = 900
# A fixed date keeps commit ids a function of content only (reproducible task ids).
_FIXED_DATE = "1700000000 +0000"
_TEST_DIR_NAMES = {"test", "tests", "testing"}
_NON_SOURCE_TOP_DIRS = {
    "doc",
    "docs",
    "example",
    "examples",
    "benchmark",
    "benchmarks",
    "bench",
    "script",
    "scripts",
    "tools",
    "build",
    "dist",
    "ci",
    ".github",
}
_NON_SOURCE_TOP_FILES = {"setup.py", "noxfile.py", "fabfile.py", "tasks.py", "conf.py"}
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")


class SdistError(RuntimeError):
    """Downloading, unpacking or committing an sdist failed; the message says what to check."""


def is_test_module(path: str) -> bool:
    """Whether repository path `path` (a .py file) is part of the test suite."""
    parts = pathlib.PurePosixPath(path).parts
    name = parts[-1]
    return (
        any(part in _TEST_DIR_NAMES for part in parts[:-1])
        or name == "conftest.py"
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
    )


@dataclasses.dataclass(frozen=True)
class PackageLayout:
    """An unpacked sdist: its metadata and which files play which role."""

    name: str  # the distribution's name from PKG-INFO, e.g. "sqlparse"
    version: str
    root: pathlib.Path  # the unpacked tree (what `pristine` commits)
    source_files: tuple[str, ...]  # repository paths of the modules mutations may touch
    test_files: tuple[str, ...]  # non-empty test modules (held out of `screening`)
    test_paths: tuple[str, ...]  # what pytest is pointed at: test folders or loose test files
    import_paths: tuple[str, ...] = ()  # folders to put on sys.path: ("src",) for a src layout

    @property
    def slug(self) -> str:
        """The name as it appears in instance ids and file names."""
        return _file_safe(self.name).lower()

    @property
    def safe_version(self) -> str:
        """The version as it appears in instance ids and git ref names (legacy versions may hold
        spaces or other characters refs cannot)."""
        return _file_safe(self.version)

    @property
    def repo_name(self) -> str:
        """The repository's folder name: one per package and version."""
        return f"{self.slug}-{self.safe_version}"


def _file_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip(".-") or "unnamed"


# `bundled:toystats`: a package that ships with dockyard_rl (no network; bundled_sdists.py).
BUNDLED_PREFIX = "bundled:"


def fetch_sdist(requirement: str, download_dir: pathlib.Path) -> pathlib.Path:
    """The sdist archive for `requirement`: a local archive path is returned as is;
    `bundled:<name>` writes a package that ships with dockyard_rl (`bundled_sdists.BUNDLED`)
    into `download_dir`; otherwise `pip download --no-deps --no-binary :all:` fetches it from
    the configured index into `download_dir` (every call downloads again; pass the saved
    archive's path to reuse it). Raises SdistError with pip's output when nothing could be
    downloaded."""
    if requirement.startswith(BUNDLED_PREFIX):
        from dockyard_rl.data.synthesis import bundled_sdists

        name = requirement[len(BUNDLED_PREFIX) :]
        if name not in bundled_sdists.BUNDLED:
            raise SdistError(
                f"{requirement}: no bundled package {name!r}; bundled: "
                f"{', '.join(BUNDLED_PREFIX + n for n in bundled_sdists.BUNDLED)}"
            )
        return bundled_sdists.BUNDLED[name](download_dir)
    candidate = pathlib.Path(requirement).expanduser()
    if requirement.endswith(ARCHIVE_SUFFIXES):
        if not candidate.is_file():
            raise SdistError(
                f"{requirement}: looks like an sdist archive path but no such file exists"
            )
        return candidate.resolve()
    download_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pip-", dir=download_dir) as staging:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "--dest",
            staging,
            requirement,
        ]
        try:
            result = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=_PIP_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SdistError(
                f"{requirement}: pip download did not finish in "
                f"{_PIP_TIMEOUT_S} s (is the package index reachable?)"
            ) from None
        archives = [p for p in pathlib.Path(staging).iterdir() if p.name.endswith(ARCHIVE_SUFFIXES)]
        if result.returncode != 0 or len(archives) != 1:
            raise SdistError(
                f"{requirement}: pip download of the source distribution failed "
                f"(exit {result.returncode}); is the name right and does the "
                f"package publish an sdist? pip said:\n"
                f"{(result.stdout + result.stderr).strip()[-3000:]}"
            )
        target = download_dir / archives[0].name
        shutil.move(str(archives[0]), target)
    return target


def _safe_extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
    try:
        _extract(archive, dest)
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as error:
        # Corrupt archives and members the "data" filter refuses (absolute or escaping links,
        # devices) end here: the package is skipped, the run goes on.
        raise SdistError(f"{archive.name}: cannot be unpacked safely: {error}") from None


def _extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zipped:
            for member in zipped.namelist():
                resolved = (dest / member).resolve()
                if not resolved.is_relative_to(dest.resolve()):
                    raise SdistError(f"{archive}: member {member!r} escapes the archive root")
            zipped.extractall(dest)
        return
    with tarfile.open(archive) as tarred:
        # The "data" filter refuses absolute paths, links out of the tree and device files.
        tarred.extractall(dest, filter="data")


def _read_metadata(root: pathlib.Path) -> tuple[str, str]:
    for candidate in (root / "PKG-INFO", *sorted(root.glob("*.egg-info/PKG-INFO"))):
        if candidate.is_file():
            message = email.parser.Parser().parsestr(candidate.read_text(errors="replace"))
            if message.get("Name") and message.get("Version"):
                return message["Name"], message["Version"]
    raise SdistError(f"{root}: no PKG-INFO with Name and Version (is this an sdist?)")


def unpack_sdist(archive: pathlib.Path, extract_dir: pathlib.Path) -> PackageLayout:
    """Unpacks `archive` under `extract_dir` (replacing an earlier unpack of the same archive)
    and sorts its files by role. Raises SdistError when it has no tests or no source modules."""
    target = extract_dir / re.sub(
        r"(\.tar\.gz|\.tgz|\.tar\.bz2|\.tar\.xz|\.zip)$", "", archive.name
    )
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    _safe_extract(archive, target)
    entries = list(target.iterdir())
    # An sdist holds one top-level folder, <name>-<version>/.
    root = entries[0] if len(entries) == 1 and entries[0].is_dir() else target
    name, version = _read_metadata(root)
    source_files, test_files, loose_tests, test_dirs = [], [], [], set()
    for path in sorted(root.rglob("*.py")):
        if not path.is_file() or path.is_symlink():
            continue
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if is_test_module(relative):
            if path.stat().st_size > 0:
                test_files.append(relative)
            test_dir = next(
                (i for i, part in enumerate(parts[:-1]) if part in _TEST_DIR_NAMES), None
            )
            if test_dir is not None:
                test_dirs.add("/".join(parts[: test_dir + 1]))
            elif parts[-1] != "conftest.py":
                loose_tests.append(relative)
        elif (
            parts[0] not in _NON_SOURCE_TOP_DIRS
            and not parts[0].endswith(".egg-info")
            and not (len(parts) == 1 and parts[0] in _NON_SOURCE_TOP_FILES)
        ):
            source_files.append(relative)
    # A test folder inside another test folder is covered by the outer one.
    dirs = sorted(d for d in test_dirs if not any(d.startswith(other + "/") for other in test_dirs))
    test_paths = dirs + [f for f in loose_tests if not any(f.startswith(d + "/") for d in dirs)]
    if not test_files or not test_paths:
        raise SdistError(
            f"{name} {version}: the sdist ships no test modules, so no task can be "
            f"checked; pick a package whose sdist includes its tests"
        )
    if not source_files:
        raise SdistError(f"{name} {version}: no source modules found outside the tests")
    # A src layout keeps the import packages under src/: the tests import them only with src on
    # sys.path (an installed package would provide that; nothing is installed here).
    src_layout = any(path.startswith("src/") and path.count("/") >= 2 for path in source_files)
    import_paths = ()
    if src_layout:
        # pytest reads `pythonpath` relative to the folder of the config file it picked.
        config_dir = _pytest_config_dir(root, test_paths)
        import_paths = (os.path.relpath(root / "src", config_dir),)
    return PackageLayout(
        name=name,
        version=version,
        root=root,
        source_files=tuple(source_files),
        test_files=tuple(test_files),
        test_paths=tuple(test_paths),
        import_paths=import_paths,
    )


def _pytest_config_dir(root: pathlib.Path, test_paths: list[str]) -> pathlib.Path:
    """The folder of the config file pytest uses for `test_paths` (its rule: the first file that
    holds a pytest section, from the arguments' common ancestor up), else `root`."""
    ancestor = pathlib.Path(os.path.commonpath([str(root / p) for p in test_paths]))
    if ancestor.is_file():
        ancestor = ancestor.parent
    sections = {
        "pytest.ini": None,
        ".pytest.ini": None,
        "pyproject.toml": "[tool.pytest",
        "tox.ini": "[pytest]",
        "setup.cfg": "[tool:pytest]",
    }
    for folder in (ancestor, *ancestor.parents):
        for file_name, section in sections.items():
            candidate = folder / file_name
            if candidate.is_file() and (
                section is None or section in candidate.read_text(errors="replace")
            ):
                return folder
        if folder == root:
            break
    return root


class SdistRepository:
    """A bare git repository holding one sdist and the commits derived from it (module doc)."""

    def __init__(self, path: pathlib.Path, layout: PackageLayout, pristine: str, screening: str):
        self.path = path
        self.layout = layout
        self.pristine = pristine
        self.screening = screening

    @classmethod
    def create(cls, path: pathlib.Path, layout: PackageLayout) -> SdistRepository:
        """Creates (or re-creates) the repository at `path` from `layout.root`."""
        path = path.resolve()
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _git(None, "init", "--quiet", "--bare", str(path))
        with tempfile.TemporaryDirectory(prefix="index-") as scratch:
            index = os.path.join(scratch, "index")
            # -f: commit exactly what the sdist ships, whatever its .gitignore says.
            _git(path, "--work-tree", str(layout.root), "add", "-A", "-f", ".", index=index)
            tree = _git(path, "write-tree", index=index).strip()
        pristine = _git(
            path, "commit-tree", tree, "-m", f"{layout.name} {layout.version} (sdist as released)"
        ).strip()
        _git(path, "update-ref", "refs/heads/main", pristine)
        _git(path, "symbolic-ref", "HEAD", "refs/heads/main")
        repo = cls(path, layout, pristine, screening="")
        repo.screening = repo.commit_files(
            pristine,
            {name: None for name in layout.test_files},
            f"{layout.name} {layout.version} without its test modules (screening base)",
            ref="refs/dockyard/screening",
        )
        return repo

    def read(self, commit: str, path: str) -> str:
        return _git(self.path, "cat-file", "blob", f"{commit}:{path}")

    def commit_files(
        self, parent: str, changes: dict[str, str | None], message: str, ref: str | None = None
    ) -> str:
        """A new commit on top of `parent` with `changes` (path -> new text, None = delete);
        points `ref` at it when given. Returns the commit id."""
        with tempfile.TemporaryDirectory(prefix="index-") as scratch:
            index = os.path.join(scratch, "index")
            _git(self.path, "read-tree", parent, index=index)
            entries = []
            for file_path, text in sorted(changes.items()):
                if text is None:
                    # Mode 0 removes the path from the index.
                    entries.append(f"0 {'0' * 40}\t{file_path}")
                    continue
                staged = _git(self.path, "ls-files", "--stage", "--", file_path, index=index)
                mode = staged.split()[0] if staged else "100644"
                blob = _git(self.path, "hash-object", "-w", "--stdin", stdin=text).strip()
                entries.append(f"{mode} {blob}\t{file_path}")
            _git(
                self.path,
                "update-index",
                "--index-info",
                index=index,
                stdin="".join(entry + "\n" for entry in entries),
            )
            tree = _git(self.path, "write-tree", index=index).strip()
        commit = _git(self.path, "commit-tree", tree, "-p", parent, "-m", message).strip()
        if ref is not None:
            _git(self.path, "update-ref", ref, commit)
        return commit

    def diff(self, old: str, new: str, paths: list[str] | tuple[str, ...] | None = None) -> str:
        """`git diff old new [-- paths]`: a unified diff that turns `old` into `new`."""
        return _git(
            self.path,
            "diff",
            "--no-color",
            "--no-ext-diff",
            "--no-renames",
            old,
            new,
            "--",
            *(paths or ()),
        )

    @property
    def screening_test_patch(self) -> str:
        """Adds every held-out test module back on top of `screening`."""
        return self.diff(self.screening, self.pristine, self.layout.test_files)


def _git(
    repo: pathlib.Path | None, *args: str, index: str | None = None, stdin: str | None = None
) -> str:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/nonexistent",
        "LANG": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "dockyard",
        "GIT_AUTHOR_EMAIL": "dockyard@localhost",
        "GIT_COMMITTER_NAME": "dockyard",
        "GIT_COMMITTER_EMAIL": "dockyard@localhost",
        "GIT_AUTHOR_DATE": _FIXED_DATE,
        "GIT_COMMITTER_DATE": _FIXED_DATE,
        # File names are names, never patterns ("[x].py" must not match "x.py").
        "GIT_LITERAL_PATHSPECS": "1",
    }
    if index is not None:
        env["GIT_INDEX_FILE"] = index
    command = ["git", *(["--git-dir", str(repo)] if repo is not None else []), *args]
    try:
        result = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            errors="surrogateescape",
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            timeout=_GIT_TIMEOUT_S,
        )
    except (subprocess.TimeoutExpired, OSError) as error:
        raise SdistError(f"git {' '.join(args[:2])} failed: {error}") from error
    if result.returncode != 0:
        raise SdistError(
            f"git {' '.join(args)} failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}"
        )
    return result.stdout
