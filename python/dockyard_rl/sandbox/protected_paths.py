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

How names are collected, so that the check cannot be dodged: `parse_patch` reads the patch once,
as git apply and GNU patch (the last method of the apply chain) do: lines split on "\n", hunks
followed by their line counts, and every header line any applier reads outside a hunk
(`diff --git`, `---`, `+++`, `***`, `Index:`, `rename/copy from/to`, `Binary files ... differ`),
both the old and the new name. Names are normalised: quotes and C escapes undone, `a/` `b/`
prefixes stripped, `./` and duplicate slashes collapsed, compared case-insensitively for the
config names. A malformed patch (`ParsedPatch.problem`: a hunk outside a file or shorter than it
says, a "+++" without "---", absurd line numbers, text that is not valid Unicode) is a violation
("<unparseable patch>"): we cannot tell what it touches.

Cost: the patch is the agent's, up to the executor's size cap, and parsing
runs on the host holding the GIL. `parse_patch` is one linear pass with no backtracking regular
expression (unidiff's header regexes are quadratic or worse on crafted lines, so unidiff is not
used here), each pyproject.toml is judged from that one parse, and at most 16 pyproject.toml
files are read from the base commit (more are violations). A 1 MiB adversarial patch parses in
tens of milliseconds: `bazel run //tests/benchmarks:patch_parse_benchmark`.
"""

from __future__ import annotations

import codecs
import dataclasses
import posixpath
import re
from collections.abc import Callable, Iterable

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

# git's C-style escapes (quote.c: sq_lookup / unquote_c_style) -> the byte each stands for.
_GIT_QUOTED_BODY = re.compile(rb'(?:[^\\]|\\[abtnvfr"\\]|\\[0-3][0-7]{2})*')


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
        raise ValueError(f"malformed quoted path {quoted[:200]!r}: not wrapped in double quotes")
    try:
        body = quoted[1:-1].encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        raise ValueError(f"malformed quoted path {quoted[:200]!r}: not valid Unicode") from None
    # Validated by one linear regex, decoded in C by escape_decode (which alone would also take
    # escapes git never writes, "\\x41" or "\\q"): linear in the name however many escapes.
    if _GIT_QUOTED_BODY.fullmatch(body) is None:
        if body.endswith(b"\\") and _GIT_QUOTED_BODY.fullmatch(body[:-1]) is not None:
            raise ValueError(f"malformed quoted path {quoted[:200]!r}: ends with a lone backslash")
        raise ValueError(f"malformed quoted path {quoted[:200]!r}: unknown escape")
    return codecs.escape_decode(body)[0].decode("utf-8", errors="surrogateescape")


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


def _name(raw: str | None) -> str | None:
    name = normalize_path(raw) if raw else None
    return _clean(name) if name else None


@dataclasses.dataclass
class Hunk:
    """One unified hunk: where it starts in the old file, how many old lines it covers, and
    whether a line it adds or removes mentions "pytest" (any case)."""

    source_start: int
    source_length: int
    mentions_pytest: bool = False


@dataclasses.dataclass
class FileSection:
    """One file of a patch: every name its headers give (normalised), and what it does."""

    names: set[str] = dataclasses.field(default_factory=set)
    is_added: bool = False
    is_binary: bool = False
    hunks: list[Hunk] = dataclasses.field(default_factory=list)
    has_git_header: bool = False  # started by "diff --git" (the ---/+++ lines belong to it)


@dataclasses.dataclass
class ParsedPatch:
    """What `parse_patch` read: the file sections, every name any header gives, the names made
    symlinks, and `problem` ("" when the patch is a well-formed diff)."""

    files: list[FileSection]
    names: set[str]
    symlinks: set[str]
    problem: str


def _quoted_prefix(text: str) -> int:
    """The length of the C-quoted token `text` starts with ('"a\\"b" rest' -> 6); 0 if none."""
    if not text.startswith('"'):
        return 0
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return 0


def _file_header_name(rest: str) -> str:
    """The name of a "---", "+++" or "***" line (after the marker): a C-quoted token followed
    by nothing but a tab-separated timestamp or blanks, else the text before the first tab."""
    end = _quoted_prefix(rest)
    if end and (not rest[end:].strip() or rest[end:].startswith("\t")):
        return rest[:end]
    return rest.partition("\t")[0].rstrip()


def _git_header_names(rest: str) -> tuple[str | None, str | None]:
    """(old, new) of a "diff --git" line (after the marker). Two C-quoted or blank-free tokens;
    otherwise git's reading of unquoted names with spaces, where both sides name the same file
    ("a/my link b/my link"): the split that leaves equal names, which (their prefixes being
    "a/" and "b/" or absent) lies in the middle, give or take one prefix. Linear in the line."""
    rest = rest.rstrip()
    first = _quoted_prefix(rest) or (rest.find(" ") if " " in rest else len(rest))
    if rest[first : first + 1] == " ":
        second = rest[first + 1 :]
        if _quoted_prefix(second) == len(second) or (second and " " not in second):
            return rest[:first], second
    middle = (len(rest) - 1) // 2
    for index in (middle, middle - 1, middle + 1):
        if 0 < index < len(rest) and rest[index] == " ":
            old, new = normalize_path(rest[:index]), normalize_path(rest[index + 1 :])
            if old and old == new:
                return rest[:index], rest[index + 1 :]
    return None, None


def _binary_files_names(rest: str) -> tuple[str | None, str | None]:
    """(old, new) of "Binary files OLD and NEW differ" (after "Binary files ")."""
    body = rest.rstrip()
    if not body.endswith(" differ"):
        return None, None
    body = body[: -len(" differ")]
    at = body.find(" and ", 1)
    if at < 0 or at + len(" and ") >= len(body):
        return None, None
    return body[:at], body[at + len(" and ") :]


# The first characters of the lines `parse_patch` reads outside hunks.
_HEADER_STARTS = frozenset("@\\dn-+*IrcBG")
_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
# Line numbers and counts of more digits than this are no real file's (and int() of thousands
# of digits is itself slow, or refused).
_MAX_NUMBER_DIGITS = 15


def parse_patch(patch: str) -> ParsedPatch:
    """Reads `patch` in one pass, in time linear in its length, without raising.

    Lines are split on "\\n" (as git and GNU patch read them). A unified hunk is followed by its
    line counts ("+++ x" inside a hunk is content, not a header). Outside hunks, every header
    line any applier reads names files: `diff --git`, `---`, `+++`, `***`, `Index:`,
    `rename/copy from/to`, `Binary files ... differ`. `new file mode 120000` / `new mode 120000`
    marks the section's new name (and the next "+++"/"rename to" name) as a symlink.

    `problem` names what makes the patch malformed: text that is not valid Unicode (lone
    surrogates), a hunk outside any file, a hunk shorter than its header declares (a line that is
    not " ", "+", "-", "\\" or empty before its counts are met), a "+++" without "---", or a line
    number of more than 15 digits. No regular expression here can backtrack: header names are
    found with `partition`/`find`, and the hunk header's regex is anchored and unambiguous.
    """
    files: list[FileSection] = []
    names: set[str] = set()
    symlinks: set[str] = set()
    problems: list[str] = []
    try:
        patch.encode("utf-8")
    except UnicodeEncodeError as error:
        problems.append(f"the patch is not valid Unicode text ({error.reason})")
    current: FileSection | None = None
    source: str | None = None  # a "---" line's name waiting for its "+++"
    git_name: str | None = None  # the new name of the current "diff --git" section
    pending_symlink = False  # a symlink mode seen, its "+++"/"rename to" name not yet
    num_old = num_new = 0  # lines the open hunk still expects
    hunk: Hunk | None = None

    def add(section: FileSection | None, *raw_names: str | None) -> None:
        for raw in raw_names:
            name = _name(raw)
            if name:
                names.add(name)
                if section is not None:
                    section.names.add(name)

    for number, line in enumerate(patch.split("\n"), start=1):
        if (
            num_old <= 0
            and num_new <= 0
            and (
                line[:1] not in _HEADER_STARTS
                or (line[:1] in "+-" and not line.startswith(("+++ ", "--- ")))
            )
        ):
            continue  # not a header line: text between files, which appliers skip too
        if num_old > 0 or num_new > 0:
            kind = line[:1]
            if kind in ("+", "-", " ", ""):
                if kind == "+":
                    num_new -= 1
                elif kind == "-":
                    num_old -= 1
                else:
                    num_old, num_new = num_old - 1, num_new - 1
                if kind in ("+", "-") and hunk is not None and not hunk.mentions_pytest:
                    hunk.mentions_pytest = "pytest" in line.lower()
                if num_old < 0 or num_new < 0:
                    problems.append(f"line {number}: the hunk is longer than its header says")
                    num_old = num_new = 0
                continue
            if kind == "\\":
                continue
            problems.append(f"line {number}: the hunk is shorter than its header says")
            num_old = num_new = 0
        line = line.removesuffix("\r")
        if line.startswith("@@ "):
            match = _HUNK_HEADER.match(line)
            if match is None:
                problems.append(f"line {number}: malformed hunk header")
                continue
            if any(g is not None and len(g) > _MAX_NUMBER_DIGITS for g in match.groups()):
                problems.append(f"line {number}: a line number of more than 15 digits")
                continue
            if current is None:
                problems.append(f"line {number}: a hunk outside any file")
                continue
            old_start, old_count, _, new_count = match.groups()
            num_old = int(old_count) if old_count is not None else 1
            num_new = int(new_count) if new_count is not None else 1
            hunk = Hunk(int(old_start), num_old)
            current.hunks.append(hunk)
            continue
        if line.startswith("\\"):  # "\ No newline at end of file" after a hunk
            continue
        if line.startswith("diff --git "):
            old, new = _git_header_names(line[len("diff --git ") :])
            current = FileSection(has_git_header=True)
            files.append(current)
            add(current, old, new)
            git_name, source, pending_symlink = _name(new), None, False
        elif line.startswith(("new file mode ", "new mode ")):
            if current is not None and line.startswith("new file mode "):
                current.is_added = True
            if line.rpartition(" ")[2].strip() == _SYMLINK_MODE:
                if git_name:
                    symlinks.add(git_name)
                pending_symlink = True
        elif line.startswith("deleted file mode "):
            pass
        elif line.startswith("--- "):
            source = _file_header_name(line[4:])
            add(None, source)
        elif line.startswith("+++ "):
            target = _file_header_name(line[4:])
            if current is None or not current.has_git_header or current.hunks:
                if source is None:
                    problems.append(f"line {number}: a '+++' line without its '---' line")
                current = FileSection()
                files.append(current)
            add(current, source, target)
            if source is not None and normalize_path(source) is None:
                current.is_added = True
            if pending_symlink and _name(target):
                symlinks.add(_name(target))
            source, pending_symlink = None, False
        elif line.startswith("*** "):
            add(None, _file_header_name(line[4:]))
        elif line.startswith("Index: "):
            add(None, line[len("Index: ") :].strip())
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            name = line.split(" ", 2)[2].rstrip()
            add(current, name)
            if pending_symlink and line.startswith("rename to ") and _name(name):
                symlinks.add(_name(name))
                pending_symlink = False
        elif line.startswith("Binary files "):
            old, new = _binary_files_names(line[len("Binary files ") :])
            if current is None or not current.has_git_header:
                current = FileSection()
                files.append(current)
            current.is_binary = True
            add(current, old, new)
        elif line.startswith("GIT binary patch"):
            if current is not None:
                current.is_binary = True
    if num_old > 0 or num_new > 0:
        problems.append("the last hunk is shorter than its header says")
    return ParsedPatch(files, names, symlinks, "; ".join(problems[:3]))


def touched_paths(patch: str) -> tuple[set[str], set[str], bool]:
    """(every path the patch names, paths it makes symlinks, well-formed?): `parse_patch`."""
    parsed = parse_patch(patch)
    return parsed.names, parsed.symlinks, not parsed.problem


# More pyproject.toml files than this in one patch are all violations: each costs a read of
# the base file, and no bug fix needs them.
_MAX_PYPROJECT_FILES = 16


def _pytest_tables(base: str) -> list[tuple[int, int]]:
    """[first, last] line numbers of the base file's [tool.pytest...] tables."""
    tables: list[tuple[int, int]] = []
    start = None
    number = 0
    for number, line in enumerate(base.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            if start is not None:
                tables.append((start, number - 1))
                start = None
            if stripped.lstrip("[").startswith("tool.pytest"):
                start = number
    if start is not None:
        tables.append((start, number))
    return tables


def _pyproject_touches_pytest(
    sections: list[FileSection], path: str, read_base_file: Callable[[str], str | None] | None
) -> bool:
    if not sections:
        return True  # named only in a header that starts no file section: conservative
    base = read_base_file(path) if read_base_file is not None else None
    tables = _pytest_tables(base) if base is not None else []
    for section in sections:
        if base is None and not section.is_added:
            return True
        if section.is_binary or not section.hunks:
            return True
        for hunk in section.hunks:
            if hunk.mentions_pytest:
                return True
            first, last = hunk.source_start, hunk.source_start + max(hunk.source_length, 1) - 1
            if any(first <= end and start <= last for start, end in tables):
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
    parsed = parse_patch(patch)
    protected = {_clean(p) for p in protected_paths}
    violations: set[str] = set()
    if parsed.problem:
        violations.add(UNPARSEABLE)
    sections_by_name: dict[str, list[FileSection]] = {}
    for section in parsed.files:
        for name in section.names:
            sections_by_name.setdefault(name, []).append(section)
    num_pyproject = 0
    for name in sorted(parsed.names):
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
        elif basename == "pyproject.toml":
            num_pyproject += 1
            if num_pyproject > _MAX_PYPROJECT_FILES or _pyproject_touches_pytest(
                sections_by_name.get(name, []), name, read_base_file
            ):
                violations.add(name)
    violations |= parsed.symlinks
    return tuple(sorted(violations))
