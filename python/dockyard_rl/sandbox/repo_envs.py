"""Per-repository virtual environments: the middle option between the executor's own interpreter
and a task image, for pure-Python repositories whose tests need a few packages from PyPI.

    envs = RepoEnvCache(cache_dir)
    with envs.lease(("roman==4.2",)) as env:      # ValueError when pip cannot install them
        env.python                                # <env>/bin/python, this executor's CPython

A task names `requirements` (pip requirement lines). The environment is a venv of the executor's
own CPython with those requirements and the executor's pytest version (the runner needs pytest),
installed by pip from the machine's configured index; it is built once per content hash (the
Python version, the pytest pin and the sorted requirement lines) into a staging folder that is
renamed into place, so a crash never leaves a half-built environment where a lookup finds it.
Concurrent tasks with the same requirements wait for one build and share it.

What it supports: wheels and sdists pip can install without network access at test time, on the
executor's Python version; packages needing system libraries or other Pythons need a task image
(images.py). Requirement lines are pip requirement specifiers only (no options, URLs or paths);
pin them (`name==version`) for reproducible environments: the hash covers the lines as written,
not what an unpinned line resolved to. Environments are not evicted (they are small next to
images); remove `<work_dir>/envs` to reclaim the space.

Errors: a requirement pip cannot install (unknown package, no matching version, build failure, or
an index that cannot be reached: pip's message does not tell these apart reliably) is a ValueError
for that task, with pip's own message; the executor keeps serving. An OSError is the executor's
own disk (the pipeline's infrastructure error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from packaging.requirements import InvalidRequirement, Requirement

from dockyard_rl.sandbox import cleanup

logger = logging.getLogger(__name__)

_PIP_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class RepoEnv:
    """One built environment."""

    root: pathlib.Path

    @property
    def python(self) -> pathlib.Path:
        return self.root / "bin" / "python"


def check_requirements(lines: Sequence[str]) -> None:
    """Raises ValueError naming the field unless every line is a plain requirement specifier."""
    for line in lines:
        try:
            requirement = Requirement(line)
        except InvalidRequirement as error:
            raise ValueError(
                f"requirements: {line!r} is not a pip requirement specifier ({error})"
            ) from None
        if requirement.url:
            raise ValueError(
                f"requirements: {line!r} names a URL; only index packages are installed"
            )


def _pytest_pin() -> str:
    import pytest  # the runner inside the environment speaks this pytest's plugin API

    return f"pytest=={pytest.__version__}"


class RepoEnvCache:
    """Built environments under `cache_dir` (module docstring)."""

    def __init__(self, cache_dir: pathlib.Path):
        self.cache_dir = pathlib.Path(cache_dir)
        self._staging = self.cache_dir / "staging"
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        if self._staging.exists():  # a build a crash interrupted
            cleanup.remove_tree(self._staging, trash_dir=self.cache_dir / "trash")
        self._staging.mkdir()

    def key(self, requirements: Sequence[str]) -> str:
        content = json.dumps(
            {"python": sys.version, "pytest": _pytest_pin(), "requirements": sorted(requirements)},
            sort_keys=True,
        )
        return hashlib.sha256(content.encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def lease(self, requirements: Sequence[str]) -> Iterator[RepoEnv]:
        """The environment for `requirements`, built on first use. Raises ValueError when pip
        cannot install them."""
        check_requirements(requirements)
        key = self.key(requirements)
        with self._lock:
            build_lock = self._building.setdefault(key, threading.Lock())
        with build_lock:
            final = self.cache_dir / key
            if not (final / "env.json").exists():
                self._build(requirements, final)
        yield RepoEnv(root=final)

    def _build(self, requirements: Sequence[str], final: pathlib.Path) -> None:
        started = time.monotonic()
        staging = self._staging / secrets.token_hex(8)
        try:
            self._run([sys.executable, "-m", "venv", str(staging)], "creating the venv")
            self._run(
                [
                    str(staging / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "--no-input",
                    "--disable-pip-version-check",
                    "--no-compile",
                    _pytest_pin(),
                    *requirements,
                ],
                "pip install",
            )
            (staging / "env.json").write_text(
                json.dumps({"requirements": list(requirements), "python": sys.version}, indent=1)
            )
            # The sandbox's uid must read (not write) it.
            subprocess.run(
                ["chmod", "-R", "a+rX,go-w", str(staging)],
                check=False,
                timeout=600,
                stdin=subprocess.DEVNULL,
            )
            os.rename(staging, final)
        finally:  # an OSError (the executor's disk) propagates: the pipeline retries it
            if staging.exists():
                cleanup.remove_tree(staging, trash_dir=self.cache_dir / "trash")
        logger.info(
            "repository environment %s (%s): built in %.1f s",
            final.name,
            ", ".join(requirements),
            time.monotonic() - started,
        )

    @staticmethod
    def _run(argv: list[str], what: str) -> None:
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=_PIP_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ValueError(
                f"requirements: {what} took longer than {_PIP_TIMEOUT_S:.0f} s"
            ) from None
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip()[-2000:]
            raise ValueError(f"requirements: {what} failed: {message}")
