"""Helpers shared by the project's repository rules (tools/python, tools/oci, tools/lint)."""

# What pip_install_lock reads from the environment: a rule using it refetches when they change
# (torch's CPU build comes from PIP_FIND_LINKS or the PyTorch index, as for the venv).
PIP_ENV_VARS = ["DOCKYARD_PYTHON", "HOME", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_INDEX_URL"]

def host_python(rctx):
    """The CPython that runs fetch-time scripts: $DOCKYARD_PYTHON, else python3 on PATH.

    Args:
      rctx: the repository_ctx.

    Returns:
      The interpreter's path.
    """
    python = rctx.os.environ.get("DOCKYARD_PYTHON", "python3")
    if "/" in python:
        return python
    found = rctx.which(python)
    if not found:
        fail(("No `{}` on PATH; install CPython 3.11 or set DOCKYARD_PYTHON " +
              "(--repo_env=DOCKYARD_PYTHON=/path/to/python3.11).").format(python))
    return str(found)

def run_or_fail(rctx, command, timeout = 3600):
    """Runs `command` with its output shown; fails the fetch with its stderr when it fails.

    PYTHONPATH is cleared so the host's own setting cannot leak into pip or our scripts.

    Args:
      rctx: the repository_ctx.
      command: the argument list.
      timeout: seconds before the fetch fails.

    Returns:
      The command's stdout.
    """
    result = rctx.execute(
        command,
        timeout = timeout,
        quiet = False,
        environment = {"PYTHONPATH": ""},
    )
    if result.return_code != 0:
        fail("{}: `{}` failed (exit {}): {}".format(
            rctx.name,
            " ".join([str(part) for part in command[:3]]),
            result.return_code,
            result.stderr,
        ))
    return result.stdout

def pip_install_lock(rctx, lock, target):
    """Installs a hash-pinned tools/python/lock.py lock (its full closure) into a folder.

    Args:
      rctx: the repository_ctx.
      lock: the lock file's path.
      target: the folder, relative to the repository.
    """
    run_or_fail(rctx, [
        host_python(rctx),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--no-compile",
        "--disable-pip-version-check",
        "--target",
        target,
        "-r",
        lock,
    ])
