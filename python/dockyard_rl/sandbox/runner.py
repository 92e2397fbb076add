"""Running pytest on a patched worktree inside the sandbox, and collecting its evidence.

    args = pytest_arguments(spec.test_command)          # ValueError for commands we cannot isolate
    result, evidence = run_pytest(args, worktree, RunnerLimits(...), canaries=True)
    grade = grading.grade_run(f2p, p2p, evidence, reward_mode)

The executor's half of the protocol whose other half is `runner_bootstrap.py` (read its
docstring for what happens inside). Here:
- Which invocations are accepted (`pytest_arguments`): `pytest ARGS`, `py.test ARGS` or
  `python[3[.N]] -m pytest ARGS` (any interpreter path), and only options the runner can isolate:
  no `-p NAME` (only `-p no:NAME`), no JUnit options (the runner owns the report), no xdist
  (`-n`, `--dist`, `--tx`: results would come from other processes), no `-c/--config-file`
  (a config file the patch could write), no debugger, no leading `VAR=value` assignments. Other
  runners (Django's runtests.py, sympy's bin/test, tox) are refused with that reason.
- The sandbox's view: the interpreter's prefixes read-only; the patched worktree read-only at
  `/.dockyard/src` and copied by the runner into a size-capped tmpfs at `/testbed` (the tests
  never write to the host's disk, and a full tmpfs is the patch's "disk limit"); the runner's
  files read-only under an unpredictable name; a small tmpfs for the report. Nothing else of the
  host (isolation.py: deny by default). The runner's settings travel on stdin; its records and
  the report come back on two pipes and are parsed as they arrive (`evidence.py`, bounded).
- Environment: PATH with the interpreter first, HOME=/tmp, PYTHONHASHSEED=0 (reproducible
  runs), PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 (no entry-point plugins, the worktree's included),
  git's safe.directory for /testbed, and nothing else; the interpreter runs with -s (no user
  site), -P (no script dir on sys.path) and -B (no bytecode written).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from dockyard_rl.sandbox import images, isolation
from dockyard_rl.sandbox.evidence import JUnitStream, RecordStream
from dockyard_rl.sandbox.grading import RunEvidence

SANDBOX_WORKTREE = pathlib.Path("/testbed")
_SANDBOX_SOURCE = pathlib.Path("/.dockyard/src")
_SANDBOX_REPORT_DIR = pathlib.Path("/.dockyard/out")
_BOOTSTRAP = pathlib.Path(__file__).with_name("runner_bootstrap.py")

_PYTEST_ENTRIES = ("pytest", "py.test")
_PYTHON_RE = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
_ENV_ASSIGNMENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Options whose value is the next argument (or joined with "=").
_REFUSED_OPTIONS = {
    "--junitxml": "the runner writes the JUnit report itself",
    "--junit-xml": "the runner writes the JUnit report itself",
    "--junit-prefix": "the runner writes the JUnit report itself",
    "-n": "pytest-xdist runs tests in other processes the runner cannot watch",
    "--numprocesses": "pytest-xdist runs tests in other processes the runner cannot watch",
    "--dist": "pytest-xdist runs tests in other processes the runner cannot watch",
    "--tx": "pytest-xdist runs tests in other processes the runner cannot watch",
    "-c": "a configuration file named on the command line could be one the patch wrote",
    "--config-file": "a configuration file named on the command line could be one the patch wrote",
    "--inifile": "a configuration file named on the command line could be one the patch wrote",
    "--pdb": "a debugger needs a terminal",
    "--trace": "a debugger needs a terminal",
    "--pdbcls": "a debugger needs a terminal",
}


@dataclasses.dataclass(frozen=True)
class RunnerLimits:
    """The sandbox's limits plus what the runner itself bounds."""

    sandbox: isolation.SandboxLimits
    worktree_size_bytes: int  # the /testbed tmpfs the worktree is copied into
    max_report_bytes: int  # the report and the record stream, each
    max_report_testcases: int


def pytest_arguments(test_command: str | None) -> list[str] | None:
    """The pytest arguments of a task's `test_command` (None for None: the default command).
    Raises ValueError naming the field and the reason for commands the runner cannot isolate."""
    if test_command is None:
        return None
    try:
        words = shlex.split(test_command)
    except ValueError as error:
        raise ValueError(f"test_command: cannot be split into arguments: {error}") from None
    if not words:
        raise ValueError("test_command: must not be empty")
    if _ENV_ASSIGNMENT_RE.match(words[0]):
        raise ValueError(
            f"test_command: environment assignments ({words[0]!r}) are not "
            f"supported: the test environment is fixed by the executor"
        )
    if os.path.basename(words[0]) in _PYTEST_ENTRIES:
        args = words[1:]
    elif _PYTHON_RE.match(words[0]) and words[1:3] == ["-m", "pytest"]:
        args = words[3:]
    else:
        raise ValueError(
            f"test_command: only pytest invocations can be isolated and graded "
            f"(`pytest ARGS` or `python -m pytest ARGS`), got {words[0]!r}; other "
            f"runners (Django's runtests.py, sympy's bin/test, tox) are not "
            f"supported"
        )
    for index, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if name in _REFUSED_OPTIONS or (name.startswith("-n") and name[2:].isdigit()):
            reason = _REFUSED_OPTIONS.get(name, _REFUSED_OPTIONS["-n"])
            raise ValueError(f"test_command: option {name} is not supported: {reason}")
        plugin = None
        if arg == "-p":
            plugin = args[index + 1] if index + 1 < len(args) else ""
        elif arg.startswith("-p") and not arg.startswith("--"):
            plugin = arg[2:]
        if plugin is not None and not plugin.startswith("no:"):
            raise ValueError(
                f"test_command: `-p {plugin}` is not supported: plugins named on "
                f"the command line are imported from the worktree, which the patch "
                f"controls (only `-p no:NAME` is allowed)"
            )
        if (
            arg in ("-o", "--override-ini")
            and index + 1 < len(args)
            and args[index + 1].startswith("junit_")
        ):
            raise ValueError(
                "test_command: junit_* options are not supported: the runner "
                "writes the JUnit report itself"
            )
    return args


def default_pytest_arguments(test_files: Sequence[str]) -> list[str]:
    """Without a task command: pytest on the files the test patch touches."""
    return ["-rN", *test_files]


def interpreter_paths() -> list[pathlib.Path]:
    """What the sandbox must see of this interpreter (bound read-only)."""
    paths = {
        pathlib.Path(sys.prefix).resolve(),
        pathlib.Path(sys.base_prefix).resolve(),
        pathlib.Path(os.path.realpath(sys.executable)).parent.parent,
        # The venv's bin/python symlink can point at an interpreter outside both prefixes
        # (e.g. a pyenv build under /root).
        pathlib.Path(sys.executable).parent.parent,
    }
    return sorted(paths)


def _in_image(image: images.Image, path: str) -> bool:
    return os.path.lexists(image.rootfs / path.lstrip("/"))


def image_interpreter(image: images.Image, test_command: str | None) -> str:
    """The Python that runs the tests in `image`: the interpreter the task's `python -m pytest`
    command names by absolute path, else the first python3 / python on the image's PATH. Raises
    images.ImageError when the image lacks it or the tools the sandbox needs (util-linux)."""
    search = image.env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":")

    def find(name: str) -> str | None:
        return next(
            (
                f"{folder}/{name}"
                for folder in search
                if folder.startswith("/") and _in_image(image, f"{folder}/{name}")
            ),
            None,
        )

    needed = ["prlimit"] + (["setpriv"] if isolation.is_real_root() else [])
    for tool in needed:
        if find(tool) is None:
            raise images.ImageError(
                f"image: {image.digest[:19]} has no `{tool}` on its PATH "
                f"({':'.join(search)}); the sandbox needs util-linux in "
                f"the image"
            )
    words = shlex.split(test_command) if test_command else []
    if words and words[0].startswith("/") and _PYTHON_RE.match(words[0]):
        if not _in_image(image, words[0]):
            raise images.ImageError(f"test_command: {words[0]} does not exist in the image")
        return words[0]
    interpreter = find("python3") or find("python")
    if interpreter is None:
        raise images.ImageError(
            f"image: {image.digest[:19]} has no python3 or python on its PATH ({':'.join(search)})"
        )
    return interpreter


def _check_repo_path(image: images.Image | None, worktree_dir: pathlib.Path) -> None:
    """An image must have the folder the repository goes on (a mount point cannot be made inside
    its read-only tree)."""
    if image is None:
        return
    top = worktree_dir.parts[1] if len(worktree_dir.parts) > 1 else ""
    if _in_image(image, top) and not (image.rootfs / str(worktree_dir).lstrip("/")).is_dir():
        raise images.ImageError(
            f"repo_path: the image has no directory {worktree_dir} to put the repository on"
        )


def _environment(
    image: images.Image | None, worktree_dir: pathlib.Path, repo_env: pathlib.Path | None = None
) -> tuple[dict[str, str], list[pathlib.Path]]:
    """The tests' environment variables and the host paths to bind read-only for them."""
    env = {
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "PYTHONHASHSEED": "0",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        # The worktree is a root-owned tmpfs; git would refuse its copied .git as "dubious".
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": str(worktree_dir),
    }
    if image is None:
        interpreter = [pathlib.Path(p) for p in interpreter_paths()]
        if repo_env is not None:  # a venv of this same CPython (repo_envs.py)
            env["PATH"] = f"{repo_env}/bin:/usr/local/bin:/usr/bin:/bin"
            env["VIRTUAL_ENV"] = str(repo_env)
            return env, [*interpreter, repo_env]
        env["PATH"] = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
        return env, interpreter
    # The image's own environment (its PATH, a conda prefix, ...) under the fixed variables.
    env = {**image.env, **env}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env, []


def _readable(worktree: pathlib.Path) -> None:
    """The sandbox's uid must be able to read the checkout whatever the executor's umask was."""
    subprocess.run(
        ["chmod", "-R", "a+rX", str(worktree)],
        check=False,
        timeout=600,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# Runner configuration files bound read-only like the tests (besides every conftest.py).
_RUNNER_CONFIG_FILES = (
    "pytest.ini",
    ".pytest.ini",
    "pytest.toml",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
)


def protected_test_files(
    worktree: pathlib.Path, test_files: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """(files to bind read-only over the tests' copy of `worktree`, {Python file among them:
    sha256 of its content}) for a worktree whose tests are installed (no untrusted code has run
    in it yet). They are the task's test files (`test_files`, repository paths; those that exist
    as regular files), every conftest.py, and the runner configuration files at the top."""
    chosen: set[str] = set()
    for path in test_files:
        if (worktree / path).is_file() and not (worktree / path).is_symlink():
            chosen.add(os.path.normpath(path))
    for name in _RUNNER_CONFIG_FILES:
        if (worktree / name).is_file() and not (worktree / name).is_symlink():
            chosen.add(name)
    for folder, dirs, files in os.walk(worktree):
        dirs[:] = [d for d in dirs if d != ".git"]  # os.walk does not follow links by default
        if "conftest.py" in files and not os.path.islink(os.path.join(folder, "conftest.py")):
            chosen.add(os.path.relpath(os.path.join(folder, "conftest.py"), worktree))
    digests = {}
    for path in sorted(chosen):
        if path.endswith(".py"):
            digests[path] = hashlib.sha256((worktree / path).read_bytes()).hexdigest()
    return sorted(chosen), digests


def _read_only_test_mounts(
    worktree: pathlib.Path, worktree_dir: pathlib.Path, files: Sequence[str]
) -> list[isolation.Mount]:
    """Binds each of `files` read-only at its place in the tests' tmpfs copy of the worktree:
    code under test cannot write, truncate, delete or rename them (a mount point is busy). Their
    folders are made first, 1777 like the tmpfs itself so the runner can copy the rest of the
    folder in (made by bwrap as root they are also sticky: the sandbox's uid cannot rename them)."""
    mounts: list[isolation.Mount] = []
    folders: set[pathlib.Path] = set()
    for path in files:
        relative = pathlib.PurePosixPath(path)
        for depth in range(1, len(relative.parts)):
            folder = worktree_dir.joinpath(*relative.parts[:depth])
            if folder not in folders:
                folders.add(folder)
                mounts.append(isolation.Mount("dir", folder, perms="1777"))
        mounts.append(isolation.Mount("ro", worktree_dir / relative, worktree / relative))
    return mounts


def run_pytest(
    pytest_args: Sequence[str],
    worktree: pathlib.Path,
    scratch_dir: pathlib.Path,
    limits: RunnerLimits,
    *,
    canaries: bool = True,
    hidden_paths: Sequence[pathlib.Path] = (),
    patched_files: Sequence[str] = (),
    image: images.Image | None = None,
    interpreter: str | None = None,
    worktree_dir: pathlib.Path = SANDBOX_WORKTREE,
    repo_env: pathlib.Path | None = None,
    read_only_files: Sequence[str] = (),
    verified_files: Mapping[str, str] | None = None,
    protect_test_code: bool = True,
) -> tuple[isolation.SandboxResult, RunEvidence]:
    """Runs pytest with `pytest_args` on a copy of `worktree` inside the sandbox (module
    docstring). `scratch_dir` (executor-owned, outside the worktree) receives the runner's files.
    `patched_files`: repository paths the agent's patch changed; a test whose code comes from one
    of them (other than its own module) is tampering. With `image` (an unpacked task image) the
    image's root filesystem is the sandbox's system view and `interpreter` (a path inside it, see
    image_interpreter) runs the tests, with the image's Env under ours; without, this executor's
    interpreter does. The tests' copy of the worktree lives at `worktree_dir` (the repository's
    path in the image). `repo_env` (a per-repository venv, repo_envs.py; not with an image) runs
    the tests with that venv's interpreter instead of this one. `read_only_files` and
    `verified_files` (from protected_test_files): repository files bound read-only in the tests'
    copy, and the Python ones among them with their sha256, whose code the runner verifies when
    pytest imports them, before each test and after the run (runner_bootstrap.py).
    `protect_test_code=False` also skips the runner's up-front imports and bytecode-cache pinning:
    for runs whose outcome is no reward (listing test ids) and for measuring the overhead. Raises
    isolation.SandboxUnavailableError when the sandbox cannot start; whatever the tests do ends
    in the returned evidence."""
    if image is not None and interpreter is None:
        raise ValueError("run_pytest: an image needs its interpreter (image_interpreter)")
    _check_repo_path(image, worktree_dir)
    runner_dir = scratch_dir / f"runner-{secrets.token_hex(8)}"
    runner_dir.mkdir(mode=0o755)
    os.chmod(runner_dir, 0o755)
    bootstrap = runner_dir / "runner_bootstrap.py"
    shutil.copyfile(_BOOTSTRAP, bootstrap)
    canary_file = runner_dir / f"test_{secrets.token_hex(6)}.txt"
    canary_file.write_text("# collected by the executor's runner\n")
    for path in (bootstrap, canary_file):
        os.chmod(path, 0o644)
    _readable(worktree)
    inside_runner = pathlib.Path(f"/.dockyard/{secrets.token_hex(8)}")
    args = list(pytest_args)
    if not any(arg == "--rootdir" or arg.startswith("--rootdir=") for arg in args):
        args.append(f"--rootdir={worktree_dir}")
    suite_name = f"dockyard-{secrets.token_hex(16)}"
    canary_names = (f"test_{secrets.token_hex(5)}", f"test_{secrets.token_hex(5)}")
    records = RecordStream(limits.max_report_bytes)
    report = JUnitStream(limits.max_report_bytes, limits.max_report_testcases)
    events_channel = isolation.OutputChannel(records)
    report_channel = isolation.OutputChannel(report)
    settings = {
        "source_dir": str(_SANDBOX_SOURCE),
        "worktree_dir": str(worktree_dir),
        "tmp_dir": "/tmp",
        "report_parent": str(_SANDBOX_REPORT_DIR),
        "report_name": f"junit-{secrets.token_hex(8)}.xml",
        "suite_name": suite_name,
        "canaries": canaries,
        "canary_path": str(inside_runner / canary_file.name),
        "canary_names": list(canary_names),
        "events_fd": events_channel.child_fd,
        "report_fd": report_channel.child_fd,
        "pytest_args": args,
        "patched_files": list(patched_files),
        "mounted_files": list(read_only_files),
        "verified_files": dict(verified_files or {}),
        "protect_test_code": protect_test_code,
    }
    mounts = [
        isolation.Mount("ro", _SANDBOX_SOURCE, worktree),
        isolation.Mount("ro", inside_runner, runner_dir),
        isolation.Mount("tmpfs", worktree_dir, size_bytes=limits.worktree_size_bytes, perms="1777"),
        isolation.Mount(
            "tmpfs",
            _SANDBOX_REPORT_DIR,
            size_bytes=limits.max_report_bytes + 1024 * 1024,
            perms="1777",
        ),
        *_read_only_test_mounts(worktree, worktree_dir, read_only_files),
    ]
    env, readonly = _environment(image, worktree_dir, repo_env)
    if image is None:
        python = str(repo_env / "bin" / "python") if repo_env is not None else sys.executable
        command = [python, "-s", "-P", "-B"]
    else:
        command = [interpreter, "-s", "-B"]
    result = isolation.run_sandboxed(
        [*command, str(inside_runner / bootstrap.name)],
        writable_dirs=[],
        limits=limits.sandbox,
        cwd=worktree_dir,
        hidden_paths=hidden_paths,
        readonly_paths=readonly,
        mounts=mounts,
        env=env,
        stdin_data=json.dumps(settings).encode(),
        channels=[events_channel, report_channel],
        root=image.rootfs if image is not None else None,
    )
    records.finish()
    report.finish()
    evidence = RunEvidence(
        records=records,
        report=report,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        suite_name=suite_name,
        canary_names=canary_names if canaries else None,
    )
    return result, evidence


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    """What `run_script` saw: the sandbox's result, the command's log (stdout and stderr, head
    and tail kept up to the report limit), and its exit status, None when the command did not
    finish (killed, crashed shell, or the completion line missing)."""

    result: isolation.SandboxResult
    log: str
    exit_status: int | None


def run_script(
    commands: Sequence[str],
    worktree: pathlib.Path,
    limits: RunnerLimits,
    *,
    hidden_paths: Sequence[pathlib.Path] = (),
    image: images.Image | None = None,
    worktree_dir: pathlib.Path = SANDBOX_WORKTREE,
    read_only_files: Sequence[str] = (),
) -> ScriptRun:
    """Runs shell `commands` (bash, one per line) in the repository's copy at
    `worktree_dir` inside the sandbox, for test runners other than pytest (swebench_harness.py).

    Same view and isolation as run_pytest: the patched worktree read-only at /.dockyard/src,
    copied into a size-capped tmpfs at `worktree_dir`, in `image` or on the host's system. The
    script comes on stdin (no argv or file the tests could read); the log goes to a pipe of its
    own, and after the commands a completion line with a per-run nonce and the exit status of the
    last command, so a run that was killed, or whose output stopped early, is recognised. The log
    itself is what the tests printed: anything in it can be forged by the code under test.
    `read_only_files` (repository paths: the test files and the runner script) are bound
    read-only in the copy, as in run_pytest."""
    _check_repo_path(image, worktree_dir)
    _readable(worktree)
    log = isolation.BoundedOutput(limits.max_report_bytes)
    log_channel = isolation.OutputChannel(log.write)
    nonce = secrets.token_hex(16)
    fd = log_channel.child_fd
    # One compound command: bash parses all of it before running any of it, so the commands
    # cannot read the rest of the script (or the nonce) from stdin.
    script = (
        "\n".join(
            [
                "{",
                # -n: the read-only test files are already in place (bound by the sandbox).
                f"cp -Rn {shlex.quote(str(_SANDBOX_SOURCE))}/. "
                f"{shlex.quote(str(worktree_dir))}/ || {{ echo 'copying the worktree failed' "
                f">&{fd}; exit 97; }}",
                f"cd {shlex.quote(str(worktree_dir))}",
                f"exec 1>&{fd} 2>&1",
                *commands,
                "status=$?",
                f'echo; echo "dockyard-{nonce} exit $status"',
                "} </dev/null",
            ]
        )
        + "\n"
    )
    env, readonly = _environment(image, worktree_dir)
    mounts = [
        isolation.Mount("ro", _SANDBOX_SOURCE, worktree),
        isolation.Mount("tmpfs", worktree_dir, size_bytes=limits.worktree_size_bytes, perms="1777"),
        *_read_only_test_mounts(worktree, worktree_dir, read_only_files),
    ]
    result = isolation.run_sandboxed(
        ["bash", "--noprofile", "--norc", "-s"],
        writable_dirs=[],
        limits=limits.sandbox,
        cwd=pathlib.Path("/"),
        hidden_paths=hidden_paths,
        readonly_paths=readonly,
        mounts=mounts,
        env=env,
        stdin_data=script.encode(),
        channels=[log_channel],
        root=image.rootfs if image is not None else None,
    )
    text = log.text()
    marker = f"dockyard-{nonce} exit "
    at = text.rfind(marker)
    if at < 0 or result.timed_out:
        return ScriptRun(result=result, log=text, exit_status=None)
    status = text[at + len(marker) :].split("\n", 1)[0].strip()
    return ScriptRun(
        result=result, log=text[:at], exit_status=int(status) if status.isdigit() else None
    )
