import subprocess
import time

import hypothesis
import hypothesis.strategies as st
import pytest

from dockyard_rl.data.patch_formats import (
    InvalidReason,
    file_diff,
    git_file_reader,
    parse_model_output,
)
from dockyard_rl.data.patch_formats.function_rewrite import (
    diff_to_function_rewrite,
    function_rewrite_to_diff,
)
from dockyard_rl.sandbox import testing_repos

SHAPES = '''\
import math


class Circle:
    def __init__(self, radius):
        self.radius = radius

    # Perimeter, not area.
    @property
    def circumference(self):
        text = """keep
this string"""
        return math.pi * self.radius + len(text) * 0

    def grow(self, by):
        def clamp(value):
            return max(value, 0)

        return Circle(clamp(self.radius + by))


class Square:
    def __init__(self, side):
        self.side = side
'''


def _reader(files: dict[str, str]):
    return files.get


def test_the_toy_gold_fix_as_a_function_applies_and_fixes(tmp_path):
    toy = testing_repos.make_toy_repo(tmp_path / "repo")
    read_file = git_file_reader(str(toy.path), toy.base_commit)
    output = "The bug is in mul.\n\n```python\ndef mul(a, b):\n    return a * b\n```\nThat is all."
    parsed = parse_model_output(output, "function", read_file, ["calc/ops.py"])
    assert parsed.valid, parsed.detail
    assert parsed.files == ("calc/ops.py",)
    clone = tmp_path / "clone"
    testing_repos.git(tmp_path, "clone", "--quiet", str(toy.path), str(clone))
    testing_repos.git(clone, "checkout", "--quiet", "--detach", toy.base_commit)
    subprocess.run(["git", "apply", "-"], cwd=clone, input=parsed.patch, text=True, check=True)
    assert (clone / "calc/ops.py").read_text() == testing_repos.OPS_FIXED


def test_methods_are_reindented_and_keep_their_comments_strings_and_neighbours():
    output = (
        '```python\n@property\ndef circumference(self):\n    text = """keep\n'
        'this string"""\n    return 2 * math.pi * self.radius + len(text) * 0\n```'
    )
    parsed = function_rewrite_to_diff(output, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    assert parsed.valid, parsed.detail
    removed = [line for line in parsed.patch.splitlines() if line.startswith("-")][1:]
    added = [line for line in parsed.patch.splitlines() if line.startswith("+")][1:]
    assert removed == ["-        return math.pi * self.radius + len(text) * 0"]
    assert added == ["+        return 2 * math.pi * self.radius + len(text) * 0"]


def test_a_nested_function_an_unterminated_block_and_thinking():
    # A last block cut off by the token limit still counts when it parses.
    output = (
        "<think>clamp lets negatives through?</think>\n```python\ndef clamp(value):\n"
        "    return max(value, 1)\n"
    )
    parsed = function_rewrite_to_diff(output, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    assert parsed.valid, parsed.detail
    assert parsed.thinking == "clamp lets negatives through?"
    assert "-            return max(value, 0)\n+            return max(value, 1)\n" in parsed.patch


def test_two_functions_in_two_files():
    files = {"shapes.py": SHAPES, "calc.py": "def double(x):\n    return x + x\n"}
    output = (
        "```python\ndef double(x):\n    return 2 * x\n```\nand\n```py\ndef grow(self, by):"
        "\n    return Circle(self.radius + by)\n```"
    )
    parsed = function_rewrite_to_diff(output, _reader(files), ["shapes.py", "calc.py"])
    assert parsed.valid, parsed.detail
    assert sorted(parsed.files) == ["calc.py", "shapes.py"]
    assert "def clamp" in parsed.patch  # grow's nested helper went with it


@pytest.mark.parametrize(
    "output, reason, detail",
    [
        ("No code here.", InvalidReason.NO_PATCH, "no ```python block"),
        ("```python\nimport os\n```", InvalidReason.NO_PATCH, "no ```python block"),
        (
            "```python\ndef grow(self, by)\n    return 1\n```",
            InvalidReason.SYNTAX_ERROR,
            "code block 1 is not valid Python",
        ),
        (
            "```python\ndef area(self):\n    return 1\n```",
            InvalidReason.UNKNOWN_FUNCTION,
            "no function named 'area' in the files shown (shapes.py)",
        ),
        (
            "```python\ndef __init__(self, size):\n    self.size = size\n```",
            InvalidReason.AMBIGUOUS_FUNCTION,
            "'__init__' is defined 2 times (shapes.py:5, shapes.py:",
        ),
        (
            "```python\ndef clamp(v):\n    return v\n\ndef clamp(v):\n    return 0\n```",
            InvalidReason.MALFORMED_BLOCK,
            "'clamp' is given twice",
        ),
        (
            "```python\ndef grow(self, by):\n    return self\n\ndef clamp(v):\n    return v\n```",
            InvalidReason.MALFORMED_BLOCK,
            "'clamp' is given together with 'grow'",
        ),
        (
            "```python\ndef clamp(value):\n    return max(value, 0)\n```",
            InvalidReason.NO_CHANGE,
            "equal the originals",
        ),
        ("<think>never closed", InvalidReason.UNTERMINATED_THINK, "never closed"),
    ],
)
def test_bad_outputs_name_the_reason(output, reason, detail):
    parsed = function_rewrite_to_diff(output, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    assert parsed.invalid_reason is reason and parsed.patch is None
    assert detail in parsed.detail


def test_only_the_shown_files_are_searched():
    files = {"shapes.py": SHAPES, "hidden.py": "def secret():\n    return 1\n"}
    parsed = function_rewrite_to_diff(
        "```python\ndef secret():\n    return 2\n```", _reader(files), ["shapes.py"]
    )
    assert parsed.invalid_reason is InvalidReason.UNKNOWN_FUNCTION


def test_the_dispatcher_needs_read_file():
    with pytest.raises(ValueError, match="the function format needs read_file"):
        parse_model_output("```python\ndef f():\n    pass\n```", "function")


def test_a_diff_as_functions_round_trips():
    # Two hunks: the nested clamp (goes out as all of grow, its outermost function) and a
    # removed line at the end of circumference's body.
    new = SHAPES.replace("return max(value, 0)", "return max(value, 1)").replace(
        "        return math.pi * self.radius + len(text) * 0\n", ""
    )
    patch = file_diff("shapes.py", SHAPES, new)
    answer = diff_to_function_rewrite(patch, _reader({"shapes.py": SHAPES}))
    assert answer.count("```python\n") == 2
    assert answer.startswith("```python\n@property\ndef circumference(self):\n")
    assert "\n```python\ndef grow(self, by):\n    def clamp(value):\n" in answer
    parsed = function_rewrite_to_diff(answer, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    assert parsed.patch == patch


@pytest.mark.parametrize(
    "new, message",
    [
        (SHAPES.replace("import math\n", "import math\nimport os\n"), "outside any function"),
        (SHAPES.replace("self.side = side", "self.side = abs(side)"), "defined 2 times"),
        (SHAPES.replace("return max(value, 0)", "return max(value, 0"), "cannot parse"),
    ],
)
def test_a_diff_the_format_cannot_say_is_a_clear_error(new, message):
    with pytest.raises(ValueError, match=message):
        diff_to_function_rewrite(
            file_diff("shapes.py", SHAPES, new), _reader({"shapes.py": SHAPES})
        )


def _adversarial_outputs(num_bytes: int) -> dict[str, str]:
    """FUNCTION-format outputs of about `num_bytes` aimed at the block search and libcst."""
    n = num_bytes
    return {
        "unclosed_python_fences": "```python\nx\n" * (n // 12),
        "unclosed_bare_fences": "```\n--- a\n" * (n // 10),
        "many_tiny_blocks": "```python\nx = 1\n```\n" * (n // 20),
        "many_small_defs": "```python\ndef grow(self, by):\n    return 1\n```\n" * (n // 46),
        "one_huge_def": "```python\ndef grow(self, by):\n" + "    x = 1\n" * (n // 10) + "```\n",
        # A native stack overflow in libcst (a crash, not an exception) before this change.
        "nested_parens": "```python\ndef grow(self, by):\n    return " + "(" * 5000 + "```\n",
        "closed_nested_parens": "```python\nx = " + "(" * 250 + "1" + ")" * 250 + "\n```\n",
        "nested_lambdas": "```python\ndef grow(self, by):\n    return "
        + "lambda: " * 150
        + "1\n```\n",
        "nested_unary": "```python\ndef grow(self, by):\n    return " + "-" * (n // 2) + "1\n```\n",
        "long_line": "```python\ndef grow(self, by):\n    return " + "1+" * (n // 2) + "1\n```\n",
        "null_byte": "```python\ndef grow(self, by):\n    return '\0'\n```\n",
    }


def test_a_1_mib_adversarial_output_parses_in_linear_time():
    read_file = _reader({"shapes.py": SHAPES})
    for shape, output in _adversarial_outputs(1 << 20).items():
        start, cpu_start = time.perf_counter(), time.process_time()
        parsed = function_rewrite_to_diff(output, read_file, ["shapes.py"])
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        print(f"{shape}: {seconds:.3f} s ({cpu_seconds:.3f} s CPU) {parsed.detail[:80]}")
        assert cpu_seconds < 5.0, shape  # generous; CPU time, which other work does not stretch
        assert not parsed.valid and parsed.detail


@pytest.mark.parametrize(
    "shape, reason, detail",
    [
        ("one_huge_def", InvalidReason.MALFORMED_BLOCK, "more than 65536 characters"),
        ("nested_parens", InvalidReason.SYNTAX_ERROR, "code block 1 is not valid Python"),
        ("nested_lambdas", InvalidReason.SYNTAX_ERROR, "nested more than 100 levels deep"),
        ("closed_nested_parens", InvalidReason.SYNTAX_ERROR, "too many nested parentheses"),
        ("null_byte", InvalidReason.SYNTAX_ERROR, "null bytes"),
    ],
)
def test_outputs_libcst_cannot_take_are_refused_before_it(shape, reason, detail):
    output = _adversarial_outputs(1 << 16)[shape]
    parsed = function_rewrite_to_diff(output, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    assert parsed.invalid_reason is reason and detail in parsed.detail


@hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(
        st.one_of(
            st.sampled_from(
                [
                    "```python",
                    "```",
                    "```py",
                    "def grow(self, by):",
                    "    return Circle(self.radius * by)",
                    "def clamp(value):",
                    "async def grow(self):",
                    "@property",
                    "class Circle:",
                    "    def grow(self, by):",
                    "        return 2",
                    "</think>",
                ]
            ),
            st.text(alphabet="()[]{}:=-+ \t\n'\"\\\0xdef", max_size=20),
        ),
        max_size=25,
    ).map("\n".join)
)
def test_arbitrary_outputs_never_raise(output):
    parsed = function_rewrite_to_diff(output, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    assert parsed.valid == (parsed.patch is not None)
    assert parsed.valid or parsed.detail


def test_the_slowest_output_under_the_size_cap_is_bounded():
    # libcst's worst per byte: deep (but allowed) nesting on every line, filling the size cap.
    line = "    x = " + "-" * 95 + "1\n"
    output = "```python\ndef grow(self, by):\n" + line * (63_000 // len(line)) + "```\n"
    start, cpu_start = time.perf_counter(), time.process_time()
    parsed = function_rewrite_to_diff(output, _reader({"shapes.py": SHAPES}), ["shapes.py"])
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    print(f"deep lines, {len(output)} characters: {seconds:.3f} s ({cpu_seconds:.3f} s CPU)")
    assert parsed.valid
    assert cpu_seconds < 10.0  # about 2.5 s: libcst's constant, bounded by the size cap
