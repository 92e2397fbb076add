"""A cache of bare mirrors (one per repository) and fresh, history-free checkouts from them.

`RepoCache(cache_dir).checkout(repo, base_commit, dest)` makes `dest` a git repository whose
only commit is `base_commit`, with its files checked out:
- The mirror (`git clone --mirror`) is fetched once per repository and reused; it is refreshed
  (`git remote update`) only when it lacks the requested commit. Concurrent workers — threads
  or processes — serialise clone/refresh of one repository with an `fcntl` lock file next to the
  mirror, and the clone lands in a temporary directory that is renamed into place, so nobody
  ever sees a half-cloned mirror.
- The checkout is a NEW repository (`git init`) that fetches exactly `base_commit` with
  `--depth=1 --no-tags` from the mirror by file:// URL. It has no remote, no tags, no other refs,
  no FETCH_HEAD, no reflog, and its object store holds only what base_commit's tree needs: code
  that runs in it cannot find the fix in git (`git log --all` — SWE-bench #465). It does not
  share objects with the mirror (no alternates), and the mirror itself is hidden from the
  sandbox (isolation.py `hidden_paths`).

Accepted repository locations: an absolute or relative local path, a file:// URL, or an https://
URL. Anything else (ssh, git://, ext:: — which runs commands —, strings starting with "-") is a
ValueError. Git runs with GIT_ALLOW_PROTOCOL=file:https and no user/system configuration.

Not covered: authentication for private https repositories; garbage collection of mirrors.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

_GIT_TIMEOUT_S = 600
_COMMIT_RE = re.compile(r"^[0-9a-fA-F]{7,64}$")


class RepoCacheError(RuntimeError):
    """Cloning, fetching or checking out failed (network, disk, unknown commit)."""


def _git_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/nonexistent",
        "LANG": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ALLOW_PROTOCOL": "file:https",
        "GIT_AUTHOR_NAME": "dockyard",
        "GIT_AUTHOR_EMAIL": "dockyard@localhost",
        "GIT_COMMITTER_NAME": "dockyard",
        "GIT_COMMITTER_EMAIL": "dockyard@localhost",
    }


def _run_git(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=_git_env(),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=_GIT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (subprocess.TimeoutExpired, OSError) as error:
        raise RepoCacheError(f"git {' '.join(args[:2])} failed: {error}") from error
    if result.returncode != 0:
        raise RepoCacheError(
            f"git {' '.join(args)} failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}"
        )
    return result


def normalize_repo(repo: str) -> str:
    """The repository as a URL git may fetch from: file:// for local paths, https as given.
    Raises ValueError for other schemes or strings that could be taken for git options."""
    repo = repo.strip()
    if not repo or repo.startswith("-"):
        raise ValueError(f"repo: must be a local path, file:// or https:// URL, got {repo!r}")
    if repo.startswith("https://"):
        return repo
    if repo.startswith("file://"):
        path = pathlib.Path(repo[len("file://") :])
    elif "://" in repo or "::" in repo or re.match(r"^[\w.-]+@[\w.-]+:", repo):
        raise ValueError(
            f"repo: only local paths, file:// and https:// URLs are accepted, got {repo!r}"
        )
    else:
        path = pathlib.Path(repo)
    path = path.resolve()
    if not path.exists():
        raise ValueError(f"repo: local repository {str(path)!r} does not exist")
    return path.as_uri()


def validate_commit(base_commit: str) -> str:
    if not _COMMIT_RE.match(base_commit):
        raise ValueError(
            f"base_commit: must be a hexadecimal commit id (7-64 digits), got {base_commit!r}"
        )
    return base_commit.lower()


class RepoCache:
    """Bare mirrors under `cache_dir`, keyed by a hash of the repository URL."""

    def __init__(self, cache_dir: pathlib.Path):
        self.cache_dir = pathlib.Path(cache_dir).resolve()

    def mirror_path(self, repo: str) -> pathlib.Path:
        url = normalize_repo(repo)
        key = hashlib.sha256(url.encode()).hexdigest()[:24]
        return self.cache_dir / f"{key}.git"

    @contextlib.contextmanager
    def _locked(self, mirror: pathlib.Path) -> Iterator[None]:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(mirror.with_suffix(".lock"), "a+") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    @staticmethod
    def _has_commit(mirror: pathlib.Path, commit: str) -> bool:
        result = subprocess.run(
            ["git", "--git-dir", str(mirror), "cat-file", "-e", f"{commit}^{{commit}}"],
            env=_git_env(),
            capture_output=True,
            timeout=_GIT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        return result.returncode == 0

    def ensure_mirror(self, repo: str, base_commit: str) -> pathlib.Path:
        """The mirror of `repo`, cloned on first use and refreshed only if it lacks the commit.
        Raises ValueError for a bad repo/commit string and RepoCacheError when git fails."""
        url = normalize_repo(repo)
        commit = validate_commit(base_commit)
        mirror = self.mirror_path(repo)
        if mirror.is_dir() and self._has_commit(mirror, commit):
            return mirror  # the common case: no lock needed to read a complete mirror
        with self._locked(mirror):
            if not mirror.is_dir():
                staging = pathlib.Path(tempfile.mkdtemp(prefix=".clone-", dir=self.cache_dir))
                try:
                    _run_git("clone", "--mirror", "--quiet", "--", url, str(staging / "m.git"))
                    os.rename(staging / "m.git", mirror)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            elif not self._has_commit(mirror, commit):
                _run_git("--git-dir", str(mirror), "remote", "update", "--prune")
            if not self._has_commit(mirror, commit):
                raise RepoCacheError(f"commit {commit} not found in {repo}")
        return mirror

    def checkout(self, repo: str, base_commit: str, dest: pathlib.Path) -> None:
        """Makes `dest` (must not exist) a single-commit repository at `base_commit`."""
        mirror = self.ensure_mirror(repo, base_commit)
        # Fetching by id needs the full id; an abbreviated one is resolved in the mirror.
        commit = _run_git(
            "--git-dir",
            str(mirror),
            "rev-parse",
            "--verify",
            "--quiet",
            f"{validate_commit(base_commit)}^{{commit}}",
        ).stdout.strip()
        if dest.exists():
            raise ValueError(f"checkout destination {str(dest)!r} already exists")
        _run_git("init", "--quiet", str(dest))
        _run_git(
            "fetch",
            "--quiet",
            "--depth=1",
            "--no-tags",
            "--no-write-fetch-head",
            mirror.as_uri(),
            commit,
            cwd=dest,
        )
        _run_git(
            "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit, cwd=dest
        )
        # `git init` created an unborn default branch; nothing else points anywhere.
        _run_git("reflog", "expire", "--expire=now", "--all", cwd=dest)
