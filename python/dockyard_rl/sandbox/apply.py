"""Applying a patch to a worktree with the SWE-bench fallback chain, resetting between tries.

`apply_patch(worktree, patch)` tries, in order: `git apply`, `git apply --3way`, then
`patch --batch --forward --fuzz=5 -p1 --unified`, and returns the first method that worked
(`ApplyMethod`), `ApplyMethod.EMPTY` for an empty patch, or `ApplyMethod.FAILED` with the
appliers' messages. Before every try the worktree is reset to its clean HEAD state
(`git reset --hard` + `git clean -fdx`), so a half-applied attempt never leaks into the next.

`--unified` is added to GNU patch on purpose: it then accepts only the unified format that the
integrity check (integrity.py, which parses with unidiff) also understands, so a context or
"normal" diff cannot smuggle a file past the check through the last applier.

Not covered: `git apply --reject` (partial application) is deliberately not in the chain — a
partly applied patch is not the patch the model wrote. Call this only before any untrusted code
has run in the worktree: git reads the worktree's .git/config, which sandboxed code could edit.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess

from dockyard_rl.sandbox.task import ApplyMethod

_APPLY_TIMEOUT_S = 120
_MAX_MESSAGE_CHARS = 4000


class ApplyInfrastructureError(RuntimeError):
    """Resetting the worktree failed: the tree is not in a known state (not the patch's fault)."""


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    method: ApplyMethod
    message: str   # the appliers' combined stderr when every method failed; "" otherwise


def _chain(patch_file: pathlib.Path) -> list[tuple[ApplyMethod, list[str]]]:
    return [
        (ApplyMethod.GIT_APPLY, ["git", "apply", "--verbose", "--whitespace=nowarn",
                                 str(patch_file)]),
        (ApplyMethod.GIT_APPLY_3WAY, ["git", "apply", "--verbose", "--3way",
                                      "--whitespace=nowarn", str(patch_file)]),
        (ApplyMethod.PATCH_FUZZ, ["patch", "--batch", "--forward", "--fuzz=5", "-p1",
                                  "--unified", "--no-backup-if-mismatch", "-i", str(patch_file)]),
    ]


def git(worktree: pathlib.Path, *args: str, check: bool = True,
        timeout: float = _APPLY_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Runs git in `worktree` with a fixed identity and no user/system config."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_TERMINAL_PROMPT": "0", "GIT_AUTHOR_NAME": "dockyard", "GIT_AUTHOR_EMAIL":
           "dockyard@localhost", "GIT_COMMITTER_NAME": "dockyard",
           "GIT_COMMITTER_EMAIL": "dockyard@localhost"}
    return subprocess.run(["git", "-C", str(worktree), *args], env=env, capture_output=True,
                          text=True, errors="replace", timeout=timeout, check=check)


def reset_worktree(worktree: pathlib.Path) -> None:
    """Back to the clean checkout of HEAD: tracked edits undone, untracked files removed."""
    try:
        git(worktree, "reset", "--hard", "--quiet", "HEAD")
        git(worktree, "clean", "-fdxq")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        raise ApplyInfrastructureError(f"cannot reset worktree {worktree}: {detail}") from error


def apply_patch(worktree: pathlib.Path, patch: str, scratch_dir: pathlib.Path) -> ApplyResult:
    """Applies `patch` to `worktree` (see the module docstring). `scratch_dir` (outside the
    worktree) receives the patch file. Never raises for a bad patch; raises
    ApplyInfrastructureError when the worktree cannot be reset."""
    if not patch.strip():
        return ApplyResult(ApplyMethod.EMPTY, "")
    patch_file = scratch_dir / "agent.patch"
    # git apply wants a final newline; models often drop it.
    patch_file.write_text(patch if patch.endswith("\n") else patch + "\n", encoding="utf-8")
    messages = []
    for method, command in _chain(patch_file):
        reset_worktree(worktree)
        try:
            result = subprocess.run(command, cwd=worktree, capture_output=True, text=True,
                                    errors="replace", timeout=_APPLY_TIMEOUT_S,
                                    stdin=subprocess.DEVNULL,
                                    env={"PATH": "/usr/local/bin:/usr/bin:/bin",
                                         "HOME": "/nonexistent", "LANG": "C.UTF-8",
                                         "GIT_CONFIG_NOSYSTEM": "1",
                                         "GIT_CONFIG_GLOBAL": "/dev/null"})
        except subprocess.TimeoutExpired:
            messages.append(f"{method.value}: timed out after {_APPLY_TIMEOUT_S}s")
            continue
        if result.returncode == 0:
            return ApplyResult(method, "")
        messages.append(f"{method.value}: {(result.stderr + result.stdout).strip()}")
    reset_worktree(worktree)
    return ApplyResult(ApplyMethod.FAILED, "\n".join(messages)[-_MAX_MESSAGE_CHARS:])
