"""Applying a patch to a worktree with the SWE-bench fallback chain, resetting between tries.

`apply_patch(worktree, patch)` tries, in order: `git apply`, `git apply --3way`, then
`patch --batch --forward --fuzz=5 -p1 --unified`, and returns the first method that worked
(`ApplyMethod`), `ApplyMethod.EMPTY` for an empty patch, or `ApplyMethod.FAILED` with the
appliers' messages. Before every try the worktree is reset to its clean HEAD state
(`git reset --hard` + `git clean -ffdx`), so a half-applied attempt never leaks into the next.

`--unified` is added to GNU patch on purpose: it then accepts only the unified format that the
integrity check (protected_paths.py, which parses with unidiff) also understands, so a context or
"normal" diff cannot smuggle a file past the check through the last applier.

Host resources (the appliers run on the host, outside the sandbox): a git binary patch
declares the size of each hunk's content (`literal <size>` / `delta <size>`): a few bytes of
zlib stream can claim gigabytes (git allocates what a hunk declares before inflating), a few
megabytes inflate to gigabytes, and a delta of kilobytes can rebuild a file of gigabytes by
copying the same source range again and again. So before any applier runs, `binary_hunks` adds
up what the patch declares (every literal and delta hunk, forward and reverse, since git
inflates both; for a forward delta also the result size written in its header) and a total over
`max_binary_bytes` is refused: `ApplyResult(FAILED, message, too_large=True)`, nothing written.
Behind that, every applier runs under RLIMIT_FSIZE = `max_file_bytes` (via util-linux `prlimit`,
which the sandbox needs too), so no file it writes can outgrow the cap even if a declaration
lies; an applier killed by SIGXFSZ also marks the result too_large. The defaults are the module
constants DEFAULT_MAX_BINARY_BYTES and DEFAULT_MAX_FILE_BYTES.

What raises: `apply_patch` raises ApplyInfrastructureError only when git cannot reset the
worktree (git or prlimit missing, disk full or I/O errors, a damaged repository, a git command
past its timeout) — never for anything in the patch. A patch cannot cause a failed reset: the
integrity check (run before this) refuses absolute paths, `..` and `.git` components and
symlinks, so the appliers only write regular files inside the worktree; a file's mode (GNU patch
honours git's `new mode 100000`, i.e. 000) does not stop `git reset --hard`, which replaces
files by unlinking them; nested repositories are removed too (`git clean -ffdx`); the index
lock an applier killed mid-write leaves (SIGXFSZ, timeout) is removed before resetting; and no
untrusted code has run yet that could have planted anything else. Every other failure of an
applier (bad patch, timeout, size limits) is an ApplyResult.

Not covered: `git apply --reject` (partial application) is deliberately not in the chain — a
partly applied patch is not the patch the model wrote. Call this only before any untrusted code
has run in the worktree: git reads the worktree's .git/config, which sandboxed code could edit.
"""

from __future__ import annotations

import base64
import dataclasses
import pathlib
import re
import signal
import subprocess
import zlib

from dockyard_rl.sandbox.task import ApplyMethod

DEFAULT_MAX_BINARY_BYTES = 1 << 20  # declared binary content per patch (sum over its hunks)
DEFAULT_MAX_FILE_BYTES = 256 << 20  # RLIMIT_FSIZE of each applier: the largest file it may write

_APPLY_TIMEOUT_S = 120
_MAX_MESSAGE_CHARS = 4000
_ULONG_MAX = (1 << 64) - 1


class ApplyInfrastructureError(RuntimeError):
    """Resetting the worktree failed: the tree is not in a known state (not the patch's fault)."""


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    method: ApplyMethod
    message: str  # the appliers' combined stderr when every method failed; "" otherwise
    # FAILED because of the size caps: the declared binary content is over max_binary_bytes (no
    # applier ran), or an applier was stopped by RLIMIT_FSIZE (and no other method applied it).
    too_large: bool = False


@dataclasses.dataclass(frozen=True)
class BinaryHunks:
    """What a patch's git binary hunks declare (see `binary_hunks`)."""

    num_hunks: int
    num_bytes: int


def _strtoul(text: str) -> int:
    """The number git reads after `literal ` / `delta ` (C strtoul, base 10): leading blanks, a
    sign, digits, anything after ignored; overflow saturates. A negative number would wrap to a
    huge one in C: counted as the maximum."""
    match = re.match(r"[ \t\n\v\f\r]*([+-]?)([0-9]*)", text)
    sign, digits = match.group(1), match.group(2).lstrip("0")
    if not digits:
        return 0
    if sign == "-" or len(digits) > 20:
        return _ULONG_MAX
    return min(int(digits), _ULONG_MAX)


def _base85_line(line: str) -> bytes:
    """One line of a git binary hunk: a length letter (A-Z = 1..26, a-z = 27..52 bytes), then
    git's base85 (the same alphabet as Python's b85). Raises ValueError when malformed."""
    if not line:
        raise ValueError("empty line")
    letter = line[0]
    if "A" <= letter <= "Z":
        length = ord(letter) - ord("A") + 1
    elif "a" <= letter <= "z":
        length = ord(letter) - ord("a") + 27
    else:
        raise ValueError(f"bad length letter {letter!r}")
    return base64.b85decode(line[1:])[:length]


def _delta_result_size(lines: list[str], start: int) -> int:
    """The result size a git delta declares in its header (after the source size), read by
    inflating only the first bytes of the hunk that starts at `lines[start]`; 0 if unreadable
    (git refuses such a hunk anyway). Reads lines in place: slicing `lines` here would copy the
    rest of the patch for every delta hunk (quadratic in a patch of many tiny sections)."""
    inflater = zlib.decompressobj()
    head = b""
    try:
        for index in range(start, len(lines)):
            line = lines[index]
            if not line:
                break
            head += inflater.decompress(_base85_line(line), 32 - len(head))
            if len(head) >= 20:  # two varints of at most 10 bytes each
                break
    except (ValueError, zlib.error):
        return 0
    sizes = []
    value = shift = 0
    for byte in head:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            sizes.append(min(value, _ULONG_MAX))
            value = shift = 0
            if len(sizes) == 2:
                return sizes[1]
        elif shift > 63:
            return _ULONG_MAX  # a varint git would read as more than 64 bits
    return 0


def binary_hunks(patch: str) -> BinaryHunks:
    """Counts the git binary hunks of `patch` and adds up the bytes they declare.

    A hunk is a `literal <size>` or `delta <size>` line after a `GIT binary patch` line (until the
    next `diff ` header), parsed as git parses it. Every hunk counts, forward and reverse (git
    inflates both into buffers of the declared size); a forward delta also counts the result size
    its header declares (what applying it writes). Where this reading is looser than git's (a
    stray `literal` line git would reject), it counts more, which refuses a patch, never admits
    one; a delta header that cannot be read here counts 0 and is left to the file-size limit.
    """
    lines = patch.split("\n")
    num_hunks = num_bytes = 0
    in_binary = False
    hunk_in_section = 0
    for index, line in enumerate(lines):
        if line.startswith("diff "):
            in_binary = False
        elif line.startswith("GIT binary patch"):
            in_binary, hunk_in_section = True, 0
        elif in_binary and line.startswith(("literal ", "delta ")):
            kind, _, size = line.partition(" ")
            num_hunks += 1
            num_bytes += _strtoul(size)
            if kind == "delta" and hunk_in_section == 0:
                num_bytes += _delta_result_size(lines, index + 1)
            hunk_in_section += 1
    return BinaryHunks(num_hunks=num_hunks, num_bytes=num_bytes)


def binary_patch_bytes(patch: str) -> int:
    """The bytes `patch`'s git binary hunks declare in total (`binary_hunks(patch).num_bytes`)."""
    return binary_hunks(patch).num_bytes


def _chain(patch_file: pathlib.Path) -> list[tuple[ApplyMethod, list[str]]]:
    return [
        (
            ApplyMethod.GIT_APPLY,
            ["git", "apply", "--verbose", "--whitespace=nowarn", str(patch_file)],
        ),
        (
            ApplyMethod.GIT_APPLY_3WAY,
            ["git", "apply", "--verbose", "--3way", "--whitespace=nowarn", str(patch_file)],
        ),
        (
            ApplyMethod.PATCH_FUZZ,
            [
                "patch",
                "--batch",
                "--forward",
                "--fuzz=5",
                "-p1",
                "--unified",
                "--no-backup-if-mismatch",
                "-i",
                str(patch_file),
            ],
        ),
    ]


# git and the appliers run with no user or system configuration and a fixed identity.
GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "dockyard",
    "GIT_AUTHOR_EMAIL": "dockyard@localhost",
    "GIT_COMMITTER_NAME": "dockyard",
    "GIT_COMMITTER_EMAIL": "dockyard@localhost",
}


def git(
    worktree: pathlib.Path,
    *args: str,
    check: bool = True,
    timeout: float = _APPLY_TIMEOUT_S,
    text: bool = True,
    input: bytes | None = None,
) -> subprocess.CompletedProcess:
    """Runs git in `worktree` with GIT_ENV. `text=False`: bytes in (`input`) and out, for -z
    output whose file names need not be UTF-8 (text mode decodes with replacement)."""
    if text:
        return subprocess.run(
            ["git", "-C", str(worktree), *args],
            env=GIT_ENV,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=check,
        )
    return subprocess.run(
        ["git", "-C", str(worktree), *args],
        env=GIT_ENV,
        input=input,
        capture_output=True,
        timeout=timeout,
        check=check,
    )


class GitError(OSError):
    """git failed (or timed out) on one of the executor's own checkouts."""


def git_output(
    worktree: pathlib.Path,
    *args: str,
    stdin: bytes | None = None,
    timeout: float = _APPLY_TIMEOUT_S,
) -> bytes:
    """git's stdout in bytes (-z output carries file names that need not be UTF-8). Raises
    GitError, naming the command and git's complaint, when git fails or times out."""
    try:
        result = git(worktree, *args, check=False, timeout=timeout, text=False, input=stdin)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise GitError(f"git {args[0]} in {worktree}: {error}") from error
    if result.returncode != 0:
        detail = result.stderr.decode("utf-8", errors="replace").strip()[-1000:]
        raise GitError(f"git {args[0]} in {worktree} failed: {detail}")
    return result.stdout


def cat_file_batch(
    worktree: pathlib.Path, names: list[str], timeout: float = _APPLY_TIMEOUT_S
) -> dict[str, bytes | None]:
    """name -> content of the objects `names` give (object ids, or "REV:path"; none may hold a
    newline), read with one `git cat-file --batch`; None for a missing object. Linear in the
    output's size. Raises GitError when git fails or its output is cut short."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    if any("\n" in name for name in wanted):
        raise ValueError("cat_file_batch: an object name holds a newline")
    out = git_output(
        worktree,
        "cat-file",
        "--batch",
        stdin="".join(f"{name}\n" for name in wanted).encode("utf-8", "surrogateescape"),
        timeout=timeout,
    )
    contents: dict[str, bytes | None] = {}
    position = 0
    for name in wanted:
        end = out.find(b"\n", position)
        if end < 0:
            raise GitError(f"git cat-file --batch in {worktree}: truncated output")
        header = out[position:end].split(b" ")
        position = end + 1
        # A found object is "<hex id> <type> <size>"; anything else ("<name> missing",
        # "<name> ambiguous") names the request, which may hold spaces.
        if len(header) == 3 and header[2].isdigit() and _is_hex(header[0]):
            size = int(header[2])
            contents[name] = out[position : position + size] if header[1] == b"blob" else None
            position += size + 1
        else:
            contents[name] = None
    return contents


def _is_hex(token: bytes) -> bool:
    return bool(token) and all(c in b"0123456789abcdef" for c in token)


def reset_worktree(worktree: pathlib.Path) -> None:
    """Back to the clean checkout of HEAD: tracked edits undone, untracked files removed."""
    # An applier killed mid-write (SIGXFSZ at the file-size limit, or its timeout) leaves git's
    # index lock behind, and git refuses to run while it exists. It is stale here: git runs in
    # this worktree only from this module and the pipeline, one command at a time, each waited
    # for. Without this, a patch could turn its own verdict into an infrastructure error.
    try:
        (worktree / ".git" / "index.lock").unlink(missing_ok=True)
    except OSError:
        pass  # not a directory .git (a gitfile): git reports any real problem below
    try:
        git(worktree, "reset", "--hard", "--quiet", "HEAD")
        git(worktree, "clean", "-ffdxq")  # -ff: nested repositories as well
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        raise ApplyInfrastructureError(f"cannot reset worktree {worktree}: {detail}") from error


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer (bytes), got {value!r}")


def apply_patch(
    worktree: pathlib.Path,
    patch: str,
    scratch_dir: pathlib.Path,
    *,
    max_binary_bytes: int = DEFAULT_MAX_BINARY_BYTES,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> ApplyResult:
    """Applies `patch` to `worktree` (see the module docstring). `scratch_dir` (outside the
    worktree) receives the patch file. `max_binary_bytes` caps what the patch's binary hunks
    declare (over it: FAILED, too_large, no applier runs); `max_file_bytes` is each applier's
    RLIMIT_FSIZE.

    Never raises for a bad patch; raises ValueError for a non-positive limit and
    ApplyInfrastructureError when the worktree cannot be reset (module docstring: "What raises").
    """
    _positive_int(max_binary_bytes, "max_binary_bytes")
    _positive_int(max_file_bytes, "max_file_bytes")
    if not patch.strip():
        return ApplyResult(ApplyMethod.EMPTY, "")
    declared = binary_hunks(patch)
    if declared.num_bytes > max_binary_bytes:
        return ApplyResult(
            ApplyMethod.FAILED,
            f"binary content too large: {declared.num_hunks} git binary hunk(s) declare "
            f"{declared.num_bytes} bytes, over the limit of {max_binary_bytes}; not applied",
            too_large=True,
        )
    try:
        data = (patch if patch.endswith("\n") else patch + "\n").encode("utf-8")
    except UnicodeEncodeError as error:
        # Lone surrogates (JSON's "\ud800" escapes): no applier could read such a file.
        return ApplyResult(ApplyMethod.FAILED, f"the patch is not valid Unicode text: {error}")
    patch_file = scratch_dir / "agent.patch"
    # git apply wants a final newline; models often drop it.
    patch_file.write_bytes(data)
    # prlimit sets the limits and execs the applier (soft = hard: the applier cannot raise them);
    # no core file either, which would land in the worktree.
    limit = ["prlimit", f"--fsize={max_file_bytes}:{max_file_bytes}", "--core=0:0", "--"]
    messages = []
    too_large = False
    for method, command in _chain(patch_file):
        reset_worktree(worktree)
        try:
            result = subprocess.run(
                [*limit, *command],
                cwd=worktree,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=_APPLY_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                env=GIT_ENV,
            )
        except subprocess.TimeoutExpired:
            messages.append(f"{method.value}: timed out after {_APPLY_TIMEOUT_S}s")
            continue
        except FileNotFoundError as error:
            raise ApplyInfrastructureError(
                f"cannot run an applier ({error}); prlimit comes "
                f"with util-linux, git and patch with their "
                f"packages"
            ) from error
        if result.returncode == 0:
            return ApplyResult(method, "")
        if result.returncode == -signal.SIGXFSZ:
            too_large = True
            messages.append(
                f"{method.value}: stopped writing a file larger than "
                f"{max_file_bytes} bytes (the per-file limit)"
            )
            continue
        messages.append(f"{method.value}: {(result.stderr + result.stdout).strip()}")
    reset_worktree(worktree)
    return ApplyResult(
        ApplyMethod.FAILED, "\n".join(messages)[-_MAX_MESSAGE_CHARS:], too_large=too_large
    )
