import pytest
import unidiff

from dockyard_rl.sandbox import protected_paths, testing_patches
from dockyard_rl.sandbox.testing_repos import make_toy_repo

PROTECTED = ("tests/test_ops.py", "tests/test_mul_table.py")


def _diff(old: str, new: str, body: str = "@@ -1 +1 @@\n-x\n+y\n", header: str = "") -> str:
    return f"diff --git a/{old} b/{new}\n{header}--- a/{old}\n+++ b/{new}\n{body}"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("integrity") / "toy")


def test_clean_patches_pass(toy):
    assert protected_paths.check_integrity("", PROTECTED) == ()
    assert protected_paths.check_integrity(toy.gold_patch, PROTECTED) == ()
    assert protected_paths.check_integrity(toy.wrong_patch, PROTECTED) == ()


def test_editing_a_held_out_test_file_is_a_violation(toy):
    patch = toy.patch_for({"tests/test_ops.py": "def test_add():\n    pass\n"})
    assert protected_paths.check_integrity(patch, PROTECTED) == ("tests/test_ops.py",)


@pytest.mark.parametrize(
    "name",
    [
        "conftest.py",
        "tests/conftest.py",
        "deep/a/b/conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pytest.toml",
        "sitecustomize.py",
        "lib/usercustomize.py",
        "evil.pth",
        "site/x.pth",
        "tests/CONFTEST.py",
    ],
)
def test_runner_configuration_anywhere_is_a_violation(toy, name):
    patch = toy.patch_for({name: "import os\n"})
    assert protected_paths.check_integrity(patch, PROTECTED) == (name,)


def test_renames_deletes_and_mode_changes_count_both_names(toy):
    renamed = toy.patch_for({"tests/test_ops.py": None, "tests/moved.py": toy_test_ops(toy)})
    assert "rename from tests/test_ops.py" in renamed
    assert protected_paths.check_integrity(renamed, PROTECTED) == ("tests/test_ops.py",)
    deleted = toy.patch_for({"tests/test_ops.py": None})
    assert protected_paths.check_integrity(deleted, PROTECTED) == ("tests/test_ops.py",)
    # Renaming a harmless file onto a protected name is caught through the new name.
    onto = (
        "diff --git a/calc/ops.py b/conftest.py\nsimilarity index 100%\n"
        "rename from calc/ops.py\nrename to conftest.py\n"
    )
    assert protected_paths.check_integrity(onto, PROTECTED) == ("conftest.py",)
    mode_only = (
        "diff --git a/tests/test_ops.py b/tests/test_ops.py\nold mode 100644\nnew mode 100755\n"
    )
    assert protected_paths.check_integrity(mode_only, PROTECTED) == ("tests/test_ops.py",)


def toy_test_ops(toy) -> str:
    from dockyard_rl.sandbox.testing_repos import git

    return git(toy.path, "show", f"{toy.base_commit}:tests/test_ops.py")


def test_binary_patches_are_checked(toy):
    patch = toy.patch_for({"blob.bin": "\x00\x01binary"})
    assert "GIT binary patch" in patch or "Binary files" in patch
    assert protected_paths.check_integrity(patch, PROTECTED) == ()
    binary_conftest = (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n"
        "index 0000000..1111111\nBinary files /dev/null and b/conftest.py differ\n"
    )
    assert protected_paths.check_integrity(binary_conftest, PROTECTED) == ("conftest.py",)


@pytest.mark.parametrize(
    "disguise",
    [
        "./tests/test_ops.py",
        "tests//test_ops.py",
        "tests/./test_ops.py",
        "calc/../tests/test_ops.py",
        '"tests/test_ops.py"',
    ],
)
def test_path_tricks_are_normalised(disguise):
    name = disguise.strip('"')
    quoted = disguise.startswith('"')
    a, b = (f'"a/{name}"', f'"b/{name}"') if quoted else (f"a/{name}", f"b/{name}")
    patch = f"diff --git {a} {b}\n--- {a}\n+++ {b}\n@@ -1 +1 @@\n-x\n+y\n"
    assert protected_paths.check_integrity(patch, PROTECTED) == ("tests/test_ops.py",)


@pytest.mark.parametrize(
    "quoted, expected",
    [
        ('"tests/t\\303\\251st.py"', "tests/tést.py"),  # octal escapes: the UTF-8 bytes of "é"
        ('"a\\303\\251.py"', "aé.py"),
        ('"tests/say \\"hi\\".py"', 'tests/say "hi".py'),  # embedded quotes
        ('"back\\\\slash\\ttab\\nnewline"', "back\\slash\ttab\nnewline"),
        ('"\\a\\b\\v\\f\\r"', "\a\b\v\f\r"),
        ('"tést\\t.py"', "tést\t.py"),  # core.quotePath=false: raw UTF-8 between the quotes
        ('"\\377.py"', "\udcff.py"),  # not UTF-8: a surrogate, so no two names collapse
        ('""', ""),
    ],
)
def test_unquote_c_style(quoted, expected):
    assert protected_paths.unquote_c_style(quoted) == expected


@pytest.mark.parametrize(
    "quoted", ['"x\\q"', '"x\\x41"', '"x\\"', '"\\400"', '"\\12"', "no-quotes", '"']
)
def test_unquote_c_style_rejects_what_git_does_not_write(quoted):
    with pytest.raises(ValueError, match="malformed quoted path"):
        protected_paths.unquote_c_style(quoted)
    if quoted.startswith('"') and len(quoted) > 1:
        # The integrity check does not fail on it: the name counts as written between quotes.
        assert protected_paths.normalize_path(quoted) in (quoted[1:-1], None)


@pytest.mark.parametrize("name", ["tests/tést_ops.py", 'tests/say "hi".py', "tests/tab\there.py"])
def test_names_git_quotes_are_matched(toy, name):
    patch = toy.patch_for({name: "def test_x():\n    pass\n"})
    assert '"b/tests/' in patch  # git quoted the name
    assert protected_paths.check_integrity(patch, (name,)) == (name,)
    assert protected_paths.check_integrity(patch, PROTECTED) == ()


def test_headers_unidiff_ignores_are_still_scanned():
    # A context diff: unidiff sees no file, GNU patch (without --unified) would apply it.
    context = (
        "*** a/conftest.py\n--- b/conftest.py\n***************\n*** 1 ****\n! x\n--- 1 ----\n! y\n"
    )
    assert "conftest.py" in protected_paths.check_integrity(context, PROTECTED)
    # The `diff --git` header and the ---/+++ lines disagree: both names count.
    mismatched = (
        "diff --git a/calc/ops.py b/calc/ops.py\n--- a/tests/test_ops.py\n"
        "+++ b/tests/test_ops.py\n@@ -1 +1 @@\n-x\n+y\n"
    )
    assert "tests/test_ops.py" in protected_paths.check_integrity(mismatched, PROTECTED)
    index = "Index: conftest.py\n--- conftest.py\n+++ conftest.py\n@@ -1 +1 @@\n-x\n+y\n"
    assert protected_paths.check_integrity(index, PROTECTED) == ("conftest.py",)


@pytest.mark.parametrize(
    "name",
    ["/etc/passwd", "../outside.py", ".git/config", "sub/.git/hooks/pre-commit", "calc/../../x.py"],
)
def test_escaping_paths_are_violations(name):
    patch = f"--- {name}\n+++ {name}\n@@ -1 +1 @@\n-x\n+y\n"
    assert protected_paths.check_integrity(patch, PROTECTED) != ()


def test_symlink_creation_is_a_violation():
    patch = (
        "diff --git a/calc/link b/calc/link\nnew file mode 120000\nindex 0000000..1111111\n"
        "--- /dev/null\n+++ b/calc/link\n@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n"
    )
    assert protected_paths.check_integrity(patch, PROTECTED) == ("calc/link",)


def test_unparseable_patch_is_a_violation():
    patch = (
        "diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
        "@@ -1,5 +1,5 @@\n-x\n"
    )  # the hunk claims 5 lines and has 1
    assert protected_paths.UNPARSEABLE in protected_paths.check_integrity(patch, PROTECTED)


PYPROJECT = """[project]
name = "calc"
version = "1.0"

[tool.pytest.ini_options]
addopts = "-q"
testpaths = ["tests"]

[tool.black]
line-length = 100
"""


def _pyproject_patch(hunk: str, new_file: bool = False) -> str:
    old = "/dev/null" if new_file else "a/pyproject.toml"
    return f"diff --git a/pyproject.toml b/pyproject.toml\n--- {old}\n+++ b/pyproject.toml\n{hunk}"


def test_pyproject_only_pytest_changes_are_violations():
    def read(path):
        return PYPROJECT if path == "pyproject.toml" else None

    version_bump = (
        '@@ -1,3 +1,3 @@\n [project]\n name = "calc"\n-version = "1.0"\n+version = "1.1"\n'
    )
    assert protected_paths.check_integrity(_pyproject_patch(version_bump), PROTECTED, read) == ()
    black = "@@ -10,2 +10,2 @@\n [tool.black]\n-line-length = 100\n+line-length = 120\n"
    assert protected_paths.check_integrity(_pyproject_patch(black), PROTECTED, read) == ()
    # Inside the [tool.pytest.ini_options] table without mentioning pytest on the changed line.
    addopts = '@@ -6,2 +6,2 @@\n-addopts = "-q"\n+addopts = "-q --co"\n testpaths = ["tests"]\n'
    assert protected_paths.check_integrity(_pyproject_patch(addopts), PROTECTED, read) == (
        "pyproject.toml",
    )
    new_table = (
        '@@ -3,1 +3,3 @@\n version = "1.0"\n+[tool.pytest.ini_options]\n+addopts = "-p evil"\n'
    )
    assert protected_paths.check_integrity(_pyproject_patch(new_table), PROTECTED, read) == (
        "pyproject.toml",
    )
    # Without the base file, any change to an existing pyproject.toml counts.
    assert protected_paths.check_integrity(_pyproject_patch(version_bump), PROTECTED) == (
        "pyproject.toml",
    )
    created = '@@ -0,0 +1,2 @@\n+[project]\n+name = "x"\n'
    assert (
        protected_paths.check_integrity(
            _pyproject_patch(created, new_file=True), PROTECTED, lambda _: None
        )
        == ()
    )


def test_protected_paths_are_normalised_too():
    patch = _diff("tests/test_ops.py", "tests/test_ops.py")
    assert protected_paths.check_integrity(patch, ["./tests//test_ops.py"]) == (
        "tests/test_ops.py",
    )


def test_touched_paths_reports_old_and_new_names():
    patch = (
        "diff --git a/old.py b/new.py\nsimilarity index 90%\nrename from old.py\n"
        "rename to new.py\n--- a/old.py\n+++ b/new.py\n@@ -1 +1 @@\n-x\n+y\n"
    )
    names, symlinks, parsed = protected_paths.touched_paths(patch)
    assert {"old.py", "new.py"} <= names and symlinks == set() and parsed


@pytest.mark.parametrize("name", ["my link", "a b/c d", "plain"])
def test_symlinks_with_spaces_in_their_names_are_found(name):
    # git does not quote spaces: "diff --git a/my link b/my link" (a symlink named so slipped past).
    patch = (
        f"diff --git a/{name} b/{name}\nnew file mode 120000\nindex 0000000..1111111\n"
        f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+/etc/passwd\n"
        "\\ No newline at end of file\n"
    )
    # (unidiff cannot parse some of these headers: "<unparseable patch>" may come with it)
    assert name in protected_paths.check_integrity(patch, PROTECTED)


def test_symlink_named_only_by_its_plus_header_is_found():
    patch = (
        "diff --git a/x y b/z w\nnew file mode 120000\nindex 0000000..1111111\n"
        "--- /dev/null\n+++ b/z w\n@@ -0,0 +1 @@\n+/etc\n"
    )
    assert "z w" in protected_paths.check_integrity(patch, PROTECTED)


# -- cost and totality on hostile patches (the patch is the agent's) ----------------------------


def test_adversarial_patches_parse_in_linear_time():
    import time

    from dockyard_rl.sandbox import apply, screening
    from dockyard_rl.sandbox.testing_patches import adversarial_patches

    worst = ("", 0.0)
    for name, patch in adversarial_patches(1 << 20).items():
        for parse in (
            lambda p: protected_paths.check_integrity(p, PROTECTED, lambda path: None),
            screening.screen_patch,
            apply.binary_hunks,
        ):
            start = time.perf_counter()
            parse(patch)
            elapsed = time.perf_counter() - start
            worst = max(worst, (name, elapsed), key=lambda item: item[1])
    print(f"slowest 1 MiB adversarial patch: {worst[0]} {worst[1]:.3f} s")
    assert worst[1] < 5.0, worst


def test_fuzz_patch_parsers_never_raise():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from dockyard_rl.sandbox import apply, screening

    pieces = st.sampled_from(
        [
            "diff --git a/x b/x\n",
            "--- a/x\n",
            "+++ b/x\n",
            "--- /dev/null\n",
            "@@ -1 +1 @@\n",
            "@@ -1,2 +1,3 @@\n",
            "@@ -0,0 +1," + "9" * 30 + " @@\n",
            "+a\n",
            "-b\n",
            " c\n",
            "\n",
            "\\ No newline at end of file\n",
            "new file mode 120000\n",
            'rename to "q\\303"\n',
            "Binary files a and b differ\n",
            "GIT binary patch\n",
            "literal 99999999999999999999999\n",
            "delta 5\n",
            "zcmV?d00001\n",
            'diff --git "a/\\q" "b/\\400"\n',
            "Index: pyproject.toml\n",
            "--- a/pyproject.toml\n",
            "+++ b/pyproject.toml\n",
            "+[tool.pytest]\n",
            "\ud800\n",
            "\r\n",
            "*** a/x\n",
            "copy from ../x\n",
        ]
    )
    patches = st.one_of(st.lists(pieces, max_size=12).map("".join), st.text(max_size=300))

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(patch=patches)
    def check(patch):
        parsed = protected_paths.parse_patch(patch)
        assert isinstance(parsed.problem, str)
        violations = protected_paths.check_integrity(
            patch, PROTECTED, lambda path: "[tool.pytest]\n"
        )
        assert all(isinstance(v, str) for v in violations)
        screening.screen_patch(patch)
        apply.binary_hunks(patch)

    check()


def test_malformed_patches_are_violations_not_errors():
    for patch in (
        "@@ -1 +1 @@\n-x\n+y\n",  # a hunk outside any file
        "--- a/x\n+++ b/x\n@@ -1," + "9" * 5000 + " +1 @@\n+x\n",  # int() would refuse it
        "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-x\n+\ud800\n",  # not valid Unicode
        "+++ b/x\n@@ -1 +1 @@\n-x\n+y\n",  # "+++" without "---"
    ):
        assert protected_paths.UNPARSEABLE in protected_paths.check_integrity(patch, PROTECTED), (
            patch
        )


def test_the_benchmarks_ordinary_patch_is_well_formed():
    # The baseline every adversarial shape is compared with must be a well-formed patch.
    patch = testing_patches.ordinary_patch(64 * 1024)
    assert protected_paths.parse_patch(patch).problem == ""
    assert len(unidiff.PatchSet(patch)) > 10
