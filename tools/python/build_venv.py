"""Builds (or reuses) the project's virtual environment for one lock file.

Called by the `python_venv` repository rule (tools/python/venv.bzl) with the host CPython, and
usable by hand:

    python3 tools/python/build_venv.py requirements/cpu.lock.txt ~/.cache/dockyard_rl/venvs

The venv lives in CACHE_ROOT/<lock name>-<sha256 of the lock>, so an unchanged lock reuses the
finished venv in seconds, across clones and `bazel clean`. A venv is only used once a marker file
says it finished; a half-built one (interrupted install) is deleted and rebuilt. A file lock
serialises concurrent builds of the same venv (two clones building at once).

Installation is `pip install --no-deps --require-hashes`: the lock is the full closure, and every
file is checked against its pinned sha256.
"""

import argparse
import fcntl
import hashlib
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import time

DONE_MARKER = ".dockyard_venv_complete"
# Imported once after installing, so that a broken environment fails here, with pip's log above
# it, instead of in the first test that happens to import it.
SMOKE_IMPORTS = "import torch, vllm, ray, jax, flax, transformers, nanobind, safetensors, pytest"


def target_python(lock: pathlib.Path) -> str:
    """The 'X.Y' CPython version written in the lock's header by tools/python/lock.py."""
    match = re.search(r"^# Target: CPython (\d+\.\d+)", lock.read_text(), re.MULTILINE)
    if not match:
        raise SystemExit(
            f"error: {lock} has no '# Target: CPython X.Y' header; regenerate it "
            "with tools/python/lock.py"
        )
    return match.group(1)


def check_interpreter(lock: pathlib.Path) -> None:
    wanted = target_python(lock)
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != wanted:
        raise SystemExit(
            f"error: {lock} pins wheels for CPython {wanted}, but the interpreter building the "
            f"venv is CPython {have} ({sys.executable}). Install Python {wanted} and point "
            f"DOCKYARD_PYTHON at it (e.g. --repo_env=DOCKYARD_PYTHON=/usr/bin/python{wanted})."
        )


def venv_path(lock: pathlib.Path, cache_root: pathlib.Path) -> pathlib.Path:
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    return cache_root / f"{lock.name.split('.')[0]}-{digest}"


def build(lock: pathlib.Path, venv: pathlib.Path) -> None:
    if venv.exists():
        print(f"dockyard_rl: removing unfinished venv {venv}", flush=True)
        shutil.rmtree(venv)
    started = time.monotonic()
    print(
        f"dockyard_rl: creating venv {venv} with {sys.executable} ({platform.python_version()})",
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    print(
        f"dockyard_rl: installing {lock} (hash-checked; first time takes a few minutes)", flush=True
    )
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--require-hashes",
            "--no-input",
            "--progress-bar",
            "off",
            "-r",
            str(lock),
        ],
        check=True,
    )
    print("dockyard_rl: checking the environment imports", flush=True)
    subprocess.run([str(python), "-c", SMOKE_IMPORTS], check=True)
    (venv / DONE_MARKER).write_text(lock.read_text())
    print(f"dockyard_rl: venv ready in {time.monotonic() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lock", type=pathlib.Path)
    parser.add_argument("cache_root", type=pathlib.Path)
    parser.add_argument(
        "--print-path", action="store_true", help="only print where the venv for this lock lives"
    )
    args = parser.parse_args()

    venv = venv_path(args.lock.resolve(), args.cache_root.resolve())
    if args.print_path:
        print(venv)
        return
    check_interpreter(args.lock)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        marker = venv / DONE_MARKER
        if marker.exists() and marker.read_text() == args.lock.read_text():
            print(f"dockyard_rl: reusing venv {venv}", flush=True)
            return
        try:
            build(args.lock, venv)
        except subprocess.CalledProcessError as error:
            raise SystemExit(
                f"error: building the venv failed ({' '.join(error.cmd)} exited "
                f"{error.returncode}); the output above says why. Network access to "
                "PyPI is needed the first time."
            ) from None


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)  # the venv must not see the caller's packages
    main()
