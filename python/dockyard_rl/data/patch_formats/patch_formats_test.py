import pathlib
import re
import subprocess
import time

import hypothesis
import hypothesis.strategies as st
import pytest
import unidiff
from unidiff import constants as unidiff_constants

from dockyard_rl.data.patch_formats import (
    InvalidReason,
    PatchFormat,
    diff,
    diff_to_search_replace,
    extract_diff,
    file_diff,
    git_file_reader,
    parse_model_output,
    search_replace_to_diff,
    strip_think,
    unidiff_linear,
)
from dockyard_rl.sandbox import testing_patches, testing_repos


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


def test_gold_search_replace_quotes_only_what_makes_the_search_unique(toy, read_file):
    # mul's `return a + b` is also add's body: the block needs mul's def line, and no more.
    assert diff_to_search_replace(toy.gold_patch, read_file) == (
        "calc/ops.py\n<<<<<<< SEARCH\ndef mul(a, b):\n    return a + b\n=======\n"
        "def mul(a, b):\n    return a * b\n>>>>>>> REPLACE\n"
    )
    base = "def f(xs):\n    total = 0\n    for x in xs:\n        total -= x\n    return total\n"
    files = {"m.py": base}
    # A changed line that is unique on its own is the whole block: no diff context.
    one_line = file_diff("m.py", base, base.replace("total -= x", "total += x"))
    assert diff_to_search_replace(one_line, files.get) == (
        "m.py\n<<<<<<< SEARCH\n        total -= x\n=======\n        total += x\n>>>>>>> REPLACE\n"
    )
    # A pure insertion keeps one line of context to anchor it.
    inserted = file_diff(
        "m.py", base, base.replace("    return total\n", "    total += 1\n    return total\n")
    )
    answer = diff_to_search_replace(inserted, files.get)
    parsed = search_replace_to_diff(answer, files.get)
    assert parsed.valid, parsed.detail
    assert answer.count("\n") <= 7  # path, 3 markers, anchor, anchor + inserted line


def test_gold_search_replace_checks_uniqueness_after_the_earlier_blocks():
    # The first hunk's new text repeats the second hunk's changed line: the second block must
    # widen, or it would be ambiguous when the blocks apply in order.
    base = "a = 1\n" + "".join(f"pad{i} = {i}\n" for i in range(10)) + "b = 2\n"
    fixed = base.replace("a = 1\n", "b = 2\n").replace("pad9 = 9\nb = 2\n", "pad9 = 9\nb = 3\n")
    files = {"m.py": base}
    answer = diff_to_search_replace(file_diff("m.py", base, fixed), files.get)
    parsed = search_replace_to_diff(answer, files.get)
    assert parsed.valid, parsed.detail
    assert "pad9 = 9\nb = 2\n=======" in answer


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


# --- cost on adversarial outputs (the model's text) and agreement with unidiff ----------------

_LEAD = "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"  # a valid file first, so the rest is parsed


def adversarial_outputs(num_bytes: int) -> dict[str, str]:
    """Model outputs of about `num_bytes`: the executor's adversarial patch shapes after a valid
    file (raw and in a ```diff fence), unclosed fences, and many SEARCH/REPLACE blocks."""
    outputs = {}
    for shape, patch in testing_patches.adversarial_patches(num_bytes).items():
        outputs[shape] = _LEAD + patch
        outputs[f"{shape} (fenced)"] = f"```diff\n{_LEAD}{patch}\n```\n"
    outputs.update(
        unclosed_diff_fences="```diff\nx\n" * (num_bytes // 10),
        unclosed_bare_fences="```\n--- a\n" * (num_bytes // 10),
        unclosed_python_fences="```python\nx\n" * (num_bytes // 12),
        long_line_with_header="--- a\n+++ b\n" + "x" * num_bytes,
        many_search_blocks="calc/ops.py\n<<<<<<< SEARCH\n=======\n>>>>>>> REPLACE\n"
        * (num_bytes // 52),
        many_growing_blocks=(
            "calc/ops.py\n<<<<<<< SEARCH\ndef mul(a, b):\n=======\ndef mul(a, b):\n"
            + "#" * 40
            + "\n>>>>>>> REPLACE\n"
        )
        * (num_bytes // 120),
    )
    return outputs


@pytest.mark.parametrize("fmt", [PatchFormat.DIFF, PatchFormat.SEARCH_REPLACE])
def test_a_1_mib_adversarial_output_parses_in_linear_time(fmt):
    contents = {"calc/ops.py": testing_repos.OPS_BASE}
    slowest = 0.0
    for shape, output in adversarial_outputs(1 << 20).items():
        start, cpu_start = time.perf_counter(), time.process_time()
        parsed = parse_model_output(output, fmt, contents.get)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        print(
            f"{fmt.value} {shape}: {seconds:.3f} s ({cpu_seconds:.3f} s CPU) {parsed.detail[:60]}"
        )
        slowest = max(slowest, cpu_seconds)
        # Generous (the slowest takes about 1.5 s), and CPU time: other work on a shared machine
        # stretches the wall time, not this.
        assert cpu_seconds < 5.0, shape
        assert parsed.valid == (parsed.patch is not None)
    print(f"slowest: {slowest:.3f} s CPU")


def test_too_many_edit_blocks_are_malformed():
    parsed = search_replace_to_diff(adversarial_outputs(1 << 16)["many_growing_blocks"], {}.get)
    assert parsed.invalid_reason is InvalidReason.MALFORMED_BLOCK
    assert "more than 256 edit blocks" in parsed.detail


# The regular expression _fenced_blocks replaces (quadratic with many unclosed fences).
_OLD_FENCE = re.compile(r"^```[ \t]*([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@hypothesis.settings(max_examples=500, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(
        st.sampled_from(["```", "```diff", "``` py ", "```\t", "x", "", "```x y", " ```", "```\r"]),
        max_size=12,
    ).map("\n".join)
)
def test_fences_are_found_as_the_regular_expression_finds_them(text):
    assert diff._fenced_blocks(text) == _OLD_FENCE.findall(text)


@hypothesis.settings(max_examples=500, deadline=None, derandomize=True)
@hypothesis.given(st.text(alphabet=":/ \tab\n", max_size=30))
def test_uri_like_git_headers_read_as_unidiff_reads_them(rest):
    match = unidiff_constants.RE_DIFF_GIT_HEADER_URI_LIKE.match("diff --git " + rest)
    expected = None if match is None else (match.group("source"), match.group("target"))
    assert unidiff_linear._uri_git_header(rest) == expected


@hypothesis.settings(max_examples=1000, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(
        st.sampled_from([" and ", " differ", " has changed", "\t", " ", "1", ":", "x", "\n"]),
        max_size=10,
    ).map("".join),
    st.sampled_from(["Binary files ", "Binary file ", "Binary filesx"]),
)
def test_binary_lines_read_as_unidiff_reads_them(rest, prefix):
    match = unidiff_constants.RE_BINARY_DIFF.match(prefix + rest)
    expected = (
        None if match is None else (match.group("source_filename"), match.group("target_filename"))
    )
    assert unidiff_linear._binary_diff_names(prefix + rest) == expected


_DIFF_LINES = [
    "diff --git a/x b/x",
    "diff --git x y",
    "diff --git http://a http://b",
    "new file mode 100644",
    "deleted file mode 100644",
    "old mode 100644",
    "new mode 100755",
    "index 1a..2b 100644",
    "--- a/x",
    "+++ b/x",
    "--- /dev/null",
    "+++ /dev/null",
    "--- x\t2020",
    "+++ x",
    "@@ -1 +1 @@",
    "@@ -1,2 +1,2 @@ def f():",
    "@@ -0,0 +1 @@",
    "-a",
    "+b",
    " c",
    "",
    "\\ No newline at end of file",
    "prose",
    "Binary files a/x and b/x differ",
    "GIT binary patch",
    "\r",
]


def _unidiff_reading(parse, text):
    try:
        files = parse(text)
    except (unidiff.UnidiffParseError, ValueError) as error:
        return type(error).__name__, str(error)
    return "".join(str(f) for f in files), [
        (f.source_file, f.target_file, f.path, len(f), f.is_binary_file, f.target_mode)
        for f in files
    ]


@hypothesis.settings(max_examples=1500, deadline=None, derandomize=True)
@hypothesis.given(st.lists(st.sampled_from(_DIFF_LINES), max_size=14), st.booleans())
def test_diffs_read_as_unidiff_reads_them(lines, trailing_newline):
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    assert _unidiff_reading(unidiff_linear.patched_files, text) == _unidiff_reading(
        lambda t: list(unidiff.PatchSet(t)), text
    )


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(
        st.one_of(
            st.sampled_from([*_DIFF_LINES, "```diff", "```", "```python", "<<<<<<< SEARCH"]),
            st.text(alphabet=' :/\t-+@ab"\\\nand', max_size=20),
        ),
        max_size=30,
    ).map("\n".join)
)
def test_arbitrary_diff_like_outputs_never_raise(output):
    contents = {"calc/ops.py": testing_repos.OPS_BASE, "x": "a\n"}
    for fmt in PatchFormat:
        parsed = parse_model_output(output, fmt, contents.get, ["calc/ops.py"])
        assert parsed.valid == (parsed.patch is not None)
        assert parsed.valid or parsed.detail
