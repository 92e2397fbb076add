import pathlib
import subprocess

import hypothesis
import hypothesis.strategies as st
import pytest

from dockyard_rl.data.patch_formats import (
    InvalidReason,
    PatchFormat,
    diff_to_search_replace,
    extract_diff,
    git_file_reader,
    parse_model_output,
    search_replace_to_diff,
    strip_think,
)
from dockyard_rl.sandbox import testing_repos


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return testing_repos.make_toy_repo(tmp_path_factory.mktemp("toy") / "repo")


@pytest.fixture(scope="module")
def read_file(toy):
    return git_file_reader(str(toy.path), toy.base_commit)


def _apply(toy, patch, tmp_path) -> pathlib.Path:
    """`git apply --check` then `git apply` at base_commit in a fresh clone; returns the clone."""
    clone = tmp_path / "clone"
    testing_repos.git(tmp_path, "clone", "--quiet", str(toy.path), str(clone))
    testing_repos.git(clone, "checkout", "--quiet", "--detach", toy.base_commit)
    for args in (["--check"], []):
        result = subprocess.run(
            ["git", "apply", *args, "-"], cwd=clone, input=patch, text=True, capture_output=True
        )
        assert result.returncode == 0, result.stderr
    return clone


def test_git_file_reader_reads_base_commit_files_only(toy, read_file):
    assert read_file("calc/ops.py") == testing_repos.OPS_BASE
    assert read_file("tests/test_mul_table.py") is None  # only exists in the fix commit
    assert read_file("calc") is None  # a directory, not a file
    assert read_file("../etc/passwd") is None


def test_gold_diff_raw_and_fenced_round_trips(toy, tmp_path):
    for index, output in enumerate(
        (
            toy.gold_patch,
            f"<think>mul adds; it should multiply</think>\nHere is the fix:\n\n```diff\n"
            f"{toy.gold_patch}```\nThis makes mul multiply.\n",
            f"The fix:\n{toy.gold_patch}That is all.\n",
        )
    ):
        parsed = parse_model_output(output, "diff")
        assert parsed.valid, parsed.detail
        assert parsed.files == ("calc/ops.py",)
        (tmp_path / str(index)).mkdir()
        clone = _apply(toy, parsed.patch, tmp_path / str(index))
        assert (clone / "calc/ops.py").read_text() == testing_repos.OPS_FIXED
    assert (
        parse_model_output(f"<think>x</think>```diff\n{toy.gold_patch}```", "diff").thinking == "x"
    )


def test_diff_without_a_b_prefixes_gets_them(toy, tmp_path):
    bare = (
        "\n".join(
            line
            for line in toy.gold_patch.splitlines()
            if not line.startswith(("diff --git", "index "))
        )
        + "\n"
    )
    bare = bare.replace("--- a/calc/ops.py", "--- calc/ops.py").replace(
        "+++ b/calc/ops.py", "+++ calc/ops.py"
    )
    parsed = extract_diff(f"```diff\n{bare}```")
    assert parsed.valid and "--- a/calc/ops.py" in parsed.patch
    assert (
        _apply(toy, parsed.patch, tmp_path) / "calc/ops.py"
    ).read_text() == testing_repos.OPS_FIXED


def test_gold_as_search_replace_round_trips(toy, read_file, tmp_path):
    blocks = diff_to_search_replace(toy.gold_patch, read_file)
    assert "<<<<<<< SEARCH" in blocks and ">>>>>>> REPLACE" in blocks
    parsed = parse_model_output(
        f"<think>\nfix mul\n</think>\n```\n{blocks}```\n", PatchFormat.SEARCH_REPLACE, read_file
    )
    assert parsed.valid, parsed.detail
    assert parsed.thinking == "fix mul" and parsed.files == ("calc/ops.py",)
    clone = _apply(toy, parsed.patch, tmp_path)
    assert (clone / "calc/ops.py").read_text() == testing_repos.OPS_FIXED


def test_hand_written_blocks_edit_two_places_and_create_a_file(toy, read_file, tmp_path):
    output = """I will fix mul and sub.

calc/ops.py
<<<<<<< SEARCH
def mul(a, b):
    return a + b
=======
def mul(a, b):
    return a * b
>>>>>>> REPLACE

`calc/ops.py`
<<<<<<< SEARCH
def sub(a, b):
    return a - b
=======
def sub(a, b):
    return a - b  # unchanged behaviour
>>>>>>> REPLACE

calc/extra.py
<<<<<<< SEARCH
=======
VALUE = 1
>>>>>>> REPLACE
"""
    parsed = search_replace_to_diff(output, read_file)
    assert parsed.valid, parsed.detail
    assert parsed.files == ("calc/ops.py", "calc/extra.py")
    clone = _apply(toy, parsed.patch, tmp_path)
    ops = (clone / "calc/ops.py").read_text()
    assert "return a * b" in ops and "return a - b  # unchanged behaviour" in ops
    assert (clone / "calc/extra.py").read_text() == "VALUE = 1\n"


def test_file_without_trailing_newline_keeps_it_that_way(tmp_path):
    contents = {"a.txt": "one\ntwo"}
    parsed = search_replace_to_diff(
        "a.txt\n<<<<<<< SEARCH\none\n=======\nuno\n>>>>>>> REPLACE\n", contents.get
    )
    assert parsed.valid and "\\ No newline at end of file" in parsed.patch
    subprocess.run(["git", "init", "--quiet", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("one\ntwo")
    subprocess.run(["git", "apply", "-"], cwd=tmp_path, input=parsed.patch, text=True, check=True)
    assert (tmp_path / "a.txt").read_text() == "uno\ntwo"


_SR = "calc/ops.py\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


@pytest.mark.parametrize(
    "output, fmt, reason, detail",
    [
        ("", "diff", InvalidReason.NO_PATCH, "no unified diff"),
        ("I could not find the bug.", "diff", InvalidReason.NO_PATCH, "no unified diff"),
        ("```python\nprint('hi')\n```", "diff", InvalidReason.NO_PATCH, "no unified diff"),
        (
            "--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1,5 +1,5 @@\n-x\n+y\n",
            "diff",
            InvalidReason.UNPARSABLE_DIFF,
            "does not parse",
        ),
        (
            "--- a/calc/ops.py\n+++ b/calc/ops.py\n",
            "diff",
            InvalidReason.UNPARSABLE_DIFF,
            "no hunks",
        ),
        (
            "<think>still thinking about mul",
            "diff",
            InvalidReason.UNTERMINATED_THINK,
            "never closed",
        ),
        ("", "search_replace", InvalidReason.NO_PATCH, "no '<<<<<<< SEARCH'"),
        (
            _SR.format(search="def div(a, b):\n", replace="x\n"),
            "search_replace",
            InvalidReason.SEARCH_NOT_FOUND,
            "block 1 (calc/ops.py): the SEARCH text does not occur",
        ),
        (
            _SR.format(search="def mul(a, b):\n", replace="def mul(x, y):\n")
            + "\n"
            + _SR.format(search="    return a + b\n", replace="    return a * b\n"),
            "search_replace",
            InvalidReason.AMBIGUOUS_SEARCH,
            "block 2 (calc/ops.py): the SEARCH text occurs 2 times",
        ),
        (
            _SR.format(search="    return a + b\n", replace="x\n").replace(
                "calc/ops.py", "calc/nope.py"
            ),
            "search_replace",
            InvalidReason.UNKNOWN_FILE,
            "block 1 (calc/nope.py): no such file",
        ),
        (
            _SR.format(search="x\n", replace="y\n").replace("calc/ops.py", "../calc/ops.py"),
            "search_replace",
            InvalidReason.UNKNOWN_FILE,
            "without '..'",
        ),
        (
            "calc/ops.py\n<<<<<<< SEARCH\ndef mul(a, b):\n=======\ndef mul(x, y):\n",
            "search_replace",
            InvalidReason.MALFORMED_BLOCK,
            "block 1 (calc/ops.py): no '>>>>>>> REPLACE' line",
        ),
        (
            "calc/ops.py\n<<<<<<< SEARCH\ndef mul(a, b):\n>>>>>>> REPLACE\n",
            "search_replace",
            InvalidReason.MALFORMED_BLOCK,
            "'>>>>>>> REPLACE' before '======='",
        ),
        (
            "<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n",
            "search_replace",
            InvalidReason.MALFORMED_BLOCK,
            "block 1: no file path",
        ),
        (
            "=======\n>>>>>>> REPLACE\n",
            "search_replace",
            InvalidReason.MALFORMED_BLOCK,
            "before any",
        ),
        (
            _SR.format(search="", replace="x\n"),
            "search_replace",
            InvalidReason.MALFORMED_BLOCK,
            "empty SEARCH on an existing file",
        ),
        (
            _SR.format(search="def mul(a, b):\n", replace="def mul(a, b):\n"),
            "search_replace",
            InvalidReason.NO_CHANGE,
            "unchanged",
        ),
        (
            "<think>" + _SR.format(search="x\n", replace="y\n"),
            "search_replace",
            InvalidReason.UNTERMINATED_THINK,
            "never closed",
        ),
    ],
)
def test_malformed_outputs_give_the_right_invalid_reason(output, fmt, reason, detail, read_file):
    parsed = parse_model_output(output, fmt, read_file)
    assert not parsed.valid and parsed.patch is None
    assert parsed.invalid_reason is reason
    assert detail in parsed.detail, parsed.detail


def test_strip_think_variants():
    assert strip_think("<think>a</think>b") == ("a", "b", True)
    assert strip_think("a</think>b") == ("a", "b", True)  # template opened the block
    assert strip_think("no thinking") == (None, "no thinking", True)
    assert strip_think("  <think>open") == ("open", "", False)


def test_caller_errors_raise():
    with pytest.raises(
        ValueError,
        match=r"patch format 'xml' is unknown; valid: \['diff', "
        r"'search_replace', 'function'\]",
    ):
        parse_model_output("", "xml")
    with pytest.raises(ValueError, match="needs read_file"):
        parse_model_output("", "search_replace")


@hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(
        st.sampled_from(
            [
                "<think>",
                "</think>",
                "```diff",
                "```",
                "--- a/calc/ops.py",
                "+++ b/calc/ops.py",
                "@@ -1,2 +1,2 @@",
                "@@ -x @@",
                " a",
                "-b",
                "+c",
                "calc/ops.py",
                "<<<<<<< SEARCH",
                "=======",
                ">>>>>>> REPLACE",
                "def mul(a, b):",
                "    return a + b",
                "",
                "diff --git a/x b/x",
            ]
        ),
        max_size=25,
    )
)
def test_arbitrary_outputs_never_raise(lines):
    contents = {"calc/ops.py": testing_repos.OPS_BASE}
    output = "\n".join(lines)
    for fmt in PatchFormat:
        parsed = parse_model_output(output, fmt, contents.get)
        assert parsed.valid == (parsed.patch is not None)
        assert parsed.valid or parsed.detail
