"""Integrity check of an agent's patch: does it touch held-out tests or the test runner's config?

`check_integrity(patch, protected_paths, read_base_file)` returns the sorted violating paths
(empty tuple = clean). A violation scores zero and the tests are not run. Rules:
- Any file the gold test_patch touches (held-out tests): the pipeline also restores them from
  the base commit before applying test_patch, so this is the "agent tried" signal.
- Test-runner configuration, anywhere in the tree: conftest.py, pytest.ini, .pytest.ini,
  pytest.toml, .pytest.toml, tox.ini, setup.cfg (its [tool:pytest] section: the whole file is
  protected, conservatively), sitecustomize.py, usercustomize.py, *.pth.
- pyproject.toml: only a change to pytest configuration is a violation — a hunk whose added or
  removed lines mention "pytest" (a new `[tool.pytest...]` table, a pytest11 entry point, ...),
  or a hunk that lies inside a `[tool.pytest...]` table of the base file. Without the base file
  (`read_base_file` returns None for an existing file) any change to it counts, conservatively.
- Paths that git or patch could be tricked with: absolute paths, `..` components, any `.git`
  component (hooks, config), and symlinks created by the patch (mode 120000: a link could point
  a later write outside the tree). These are reported as violations too. Header parsing is
  the early, cheap layer: tree_audit.py inspects the tree after the patch is applied and is the
  authoritative check for symlinks, bytecode, package metadata and runner configuration.

How names are collected, so that the check cannot be dodged: the patch is parsed with `unidiff`
(renames, copies, deletes, binary and mode-only changes: both the old and the new name count),
AND every raw header line any applier would read (`diff --git`, `---`, `+++`, `***`, `Index:`,
`rename/copy from/to`, `Binary files ... differ`) is scanned as well — GNU patch (the last
method of the apply chain) honours headers unidiff would not parse. Names are normalised: quotes
and C escapes undone, `a/` `b/` prefixes stripped, `./` and duplicate slashes collapsed, compared
case-insensitively for the config names. A patch unidiff cannot parse at all is a violation
("<unparseable patch>"): we cannot tell what it touches.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable

import unidiff

UNPARSEABLE = "<unparseable patch>"

_CONFIG_BASENAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
_SYMLINK_MODE = "120000"

# Header lines that name a file, in any of the formats git apply or GNU patch read.
_HEADER_RES = [
    re.compile(r"^diff --git (?P<a>\"(?:[^\"\\]|\\.)*\"|\S+) (?P<b>\"(?:[^\"\\]|\\.)*\"|\S+)\s*$"),
    re.compile(r"^(?:---|\+\+\+|\*\*\*) (?P<a>\"(?:[^\"\\]|\\.)*\"|[^\t\n]+?)(?:\t.*)?\s*$"),
    re.compile(r"^Index: (?P<a>.+?)\s*$"),
    re.compile(r"^(?:rename|copy) (?:from|to) (?P<a>.+?)\s*$"),
    re.compile(r"^Binary files (?P<a>.+?) and (?P<b>.+?) differ\s*$"),
]


# git's C-style escapes (quote.c: sq_lookup / unquote_c_style) -> the byte each stands for.
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_OCTAL_BYTE = re.compile(r"[0-3][0-7]{2}")


def unquote_c_style(quoted: str) -> str:
    """Decodes a path as git quotes it: '"tests/t\\303\\251st.py"' -> "tests/tést.py".

    git wraps a path that holds control characters, '"', '\\' or (with core.quotePath, the
    default) bytes >= 0x80 in double quotes and writes those as C escapes: \\a \\b \\t \\n \\v \\f
    \\r \\" \\\\ and three octal digits per byte ("é" is \\303\\251 in UTF-8). Other characters
    stand for their own UTF-8 bytes. The bytes are decoded as UTF-8; bytes that are not UTF-8
    become surrogates ("surrogateescape"), so the name still differs from every other one and
    `os.fsencode` gives back git's bytes.

    Raises:
        ValueError: `quoted` is not wrapped in double quotes, or holds an escape git does not
            write (a lone trailing backslash, "\\q", "\\x41", an octal value above \\377).
    """
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        raise ValueError(f"malformed quoted path {quoted!r}: not wrapped in double quotes")
    body = quoted[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out += char.encode("utf-8", errors="surrogateescape")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError(f"malformed quoted path {quoted!r}: ends with a lone backslash")
        escape = body[i + 1]
        if escape in _C_ESCAPES:
            out.append(_C_ESCAPES[escape])
            i += 2
        elif _OCTAL_BYTE.fullmatch(body[i + 1 : i + 4]):
            out.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            raise ValueError(f"malformed quoted path {quoted!r}: unknown escape \\{escape}")
    return out.decode("utf-8", errors="surrogateescape")


def normalize_path(name: str) -> str | None:
    """A diff path as a clean repository-relative path; None for /dev/null.

    A quoted name is unquoted (`unquote_c_style`); a malformed one, which git would not write,
    keeps its text between the quotes, so that it is still compared with the protected names.
    """
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] == '"':
        try:
            name = unquote_c_style(name)
        except ValueError:
            name = name[1:-1]
    if name == "/dev/null" or not name:
        return None
    if name.startswith(("a/", "b/")):
        name = name[2:]
    return name


def _clean(name: str) -> str:
    # normpath collapses "x//y", "./x" and "x/./y"; ".." is kept (and flagged by the caller).
    return posixpath.normpath(name) if name else name


def touched_paths(patch: str) -> tuple[set[str], set[str], bool]:
    """(every path the patch names, paths it makes symlinks, parsed?) — see the module docstring."""
    names: set[str] = set()
    symlinks: set[str] = set()
    parsed = True
    try:
        patch_set = unidiff.PatchSet(patch)
    except (unidiff.UnidiffParseError, UnicodeError, ValueError, IndexError):
        parsed = False
        patch_set = []
    for patched_file in patch_set:
        for raw in (patched_file.source_file, patched_file.target_file, patched_file.path):
            if raw:
                name = normalize_path(raw)
                if name:
                    names.add(_clean(name))
    for line in patch.splitlines():
        for header in _HEADER_RES:
            match = header.match(line)
            if match:
                for group in match.groupdict().values():
                    name = normalize_path(group) if group else None
                    if name:
                        names.add(_clean(name))
                break
    # git's extended headers: "new file mode 120000" / "new mode 120000" make a symlink. The
    # file is named by its "diff --git" line or, when that line is ambiguous (unquoted names
    # with spaces: "diff --git a/my link b/my link"), by the equal-halves reading git itself
    # uses, and by the "+++" / "rename to" line that follows.
    current: str | None = None
    pending = False  # a symlink mode seen, its name not known yet
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            match = _HEADER_RES[0].match(line)
            current = (
                normalize_path(match.group("b"))
                if match
                else _equal_halves_name(line[len("diff --git ") :])
            )
            pending = False
        elif re.match(rf"^(?:new file mode|new mode) {_SYMLINK_MODE}\s*$", line):
            if current:
                symlinks.add(_clean(current))
            pending = True
        elif pending and (line.startswith("+++ ") or line.startswith("rename to ")):
            match = (_HEADER_RES[1] if line.startswith("+++ ") else _HEADER_RES[3]).match(line)
            name = normalize_path(match.group("a")) if match else None
            if name:
                symlinks.add(_clean(name))
            pending = False
    return names, symlinks, parsed


def _equal_halves_name(rest: str) -> str | None:
    """ "a/x y b/x y" -> "x y": git's reading of an unquoted header whose names contain spaces
    (both sides name the same file); None when no split makes the halves equal."""
    for index, char in enumerate(rest):
        if char == " ":
            old, new = rest[:index], rest[index + 1 :].rstrip()
            old_name, new_name = normalize_path(old), normalize_path(new)
            if old_name and old_name == new_name:
                return old_name
    return None


def _pyproject_touches_pytest(
    patch: str, path: str, read_base_file: Callable[[str], str | None] | None
) -> bool:
    try:
        patch_set = unidiff.PatchSet(patch)
    except (unidiff.UnidiffParseError, UnicodeError, ValueError, IndexError):
        return True
    files = [f for f in patch_set if _clean(normalize_path(f.path) or "") == path]
    if not files:
        return True  # named only in a raw header unidiff did not parse: conservative
    base = read_base_file(path) if read_base_file is not None else None
    pytest_lines: set[int] = set()
    if base is not None:
        in_pytest_table = False
        for number, line in enumerate(base.splitlines(), start=1):
            stripped = line.strip()
            if stripped.startswith("["):
                in_pytest_table = stripped.lstrip("[").startswith("tool.pytest")
            if in_pytest_table:
                pytest_lines.add(number)
    for patched_file in files:
        if base is None and not patched_file.is_added_file:
            return True
        if patched_file.is_binary_file or not patched_file:
            return True
        for hunk in patched_file:
            for line in hunk:
                if (line.is_added or line.is_removed) and "pytest" in line.value.lower():
                    return True
            first, last = hunk.source_start, hunk.source_start + max(hunk.source_length, 1)
            if any(number in pytest_lines for number in range(first, last)):
                return True
    return False


def check_integrity(
    patch: str,
    protected_paths: Iterable[str],
    read_base_file: Callable[[str], str | None] | None = None,
) -> tuple[str, ...]:
    """The sorted paths of `patch` that violate integrity (module docstring); () when clean.

    `protected_paths`: the files of the gold test_patch. `read_base_file(path)`: the file's text
    at the base commit, or None when it does not exist (used for pyproject.toml only).
    """
    if not patch.strip():
        return ()
    names, symlinks, parsed = touched_paths(patch)
    protected = {_clean(p) for p in protected_paths}
    violations: set[str] = set()
    if not parsed:
        violations.add(UNPARSEABLE)
    for name in names:
        parts = name.split("/")
        basename = parts[-1].lower()
        if (
            name in protected
            or basename in _CONFIG_BASENAMES
            or basename.endswith(".pth")
            or name.startswith("/")
            or ".." in parts
            or any(part.lower() == ".git" for part in parts)
        ):
            violations.add(name)
        elif basename == "pyproject.toml" and _pyproject_touches_pytest(
            patch, name, read_base_file
        ):
            violations.add(name)
    violations |= symlinks
    return tuple(sorted(violations))
