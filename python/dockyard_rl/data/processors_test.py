import pytest
import transformers

from dockyard_rl.data import datasets
from dockyard_rl.data.patch_formats import PatchFormat, git_file_reader, search_replace_to_diff
from dockyard_rl.data.processors import (
    PromptConfig,
    SwePromptProcessor,
    python_spans,
    touched_files,
)
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.models.zoo import resolve_model
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.utils.config import from_dict


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("zoo"))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return testing_repos.make_toy_repo(tmp_path_factory.mktemp("toy") / "repo")


def _instance(repo, base_commit, patch, test_patch="diff --git a/t b/t\n"):
    return SweInstance(
        instance_id="toy__calc-1",
        repo=repo,
        base_commit=base_commit,
        patch=patch,
        test_patch=test_patch,
        FAIL_TO_PASS=("tests/test_ops.py::test_mul",),
        PASS_TO_PASS=(),
        problem_statement="mul(3, 4) returns 7 instead of 12.",
        hints_text="Look at calc/ops.py.",
    )


def _decode(tokenizer, prompt):
    return tokenizer.decode(list(prompt.token_ids))


def test_whole_file_diff_prompt(tokenizer, toy):
    instance = _instance(str(toy.path), toy.base_commit, toy.gold_patch, toy.test_patch)
    processor = SwePromptProcessor(tokenizer)
    prompt = processor(instance, git_file_reader(str(toy.path), toy.base_commit))
    assert prompt.patch_format is PatchFormat.DIFF
    assert prompt.files_shown == ("calc/ops.py",) and not prompt.truncated
    user = prompt.messages[1]["content"]
    assert "mul(3, 4) returns 7 instead of 12." in user
    assert testing_repos.OPS_BASE in user  # the exact file text, so SEARCH blocks match
    assert "```diff" in user and "<think>" not in user
    assert "Look at calc/ops.py." not in user  # hints are off by default
    # Token ids are exactly the chat template's rendering, ending with the assistant turn.
    text = tokenizer.apply_chat_template(
        list(prompt.messages), tokenize=False, add_generation_prompt=True
    )
    assert list(prompt.token_ids) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert prompt.num_tokens == len(prompt.token_ids)
    assert _decode(tokenizer, prompt).rstrip().endswith("assistant")


def test_search_replace_prompt_with_thinking_and_hints(tokenizer, toy):
    instance = _instance(str(toy.path), toy.base_commit, toy.gold_patch)
    config = PromptConfig(patch_format="search_replace", enable_thinking=True, include_hints=True)
    prompt = SwePromptProcessor(tokenizer, config)(
        instance, git_file_reader(str(toy.path), toy.base_commit)
    )
    user = prompt.messages[1]["content"]
    assert prompt.patch_format is PatchFormat.SEARCH_REPLACE
    assert "<<<<<<< SEARCH" in user and ">>>>>>> REPLACE" in user and "```diff" not in user
    assert "<think>" in user and "Look at calc/ops.py." in user


def test_function_prompt_asks_for_whole_functions(tokenizer, toy):
    instance = _instance(str(toy.path), toy.base_commit, toy.gold_patch)
    prompt = SwePromptProcessor(tokenizer, PromptConfig(patch_format="function"))(
        instance, git_file_reader(str(toy.path), toy.base_commit)
    )
    user = prompt.messages[1]["content"]
    assert prompt.patch_format is PatchFormat.FUNCTION
    assert "rewriting the function that holds the bug" in user and "```python" in user
    assert "<<<<<<< SEARCH" not in user and "```diff" not in user


def _big_module(num_functions):
    parts = ['"""A module with many functions."""\n\nimport os\n']
    for i in range(num_functions):
        parts.append(f"\n\ndef helper_{i}(value):\n    total = value + {i}\n    return total\n")
    parts.append(
        "\n\nclass Shape:\n    sides = 4\n\n    def __init__(self, unit):\n"
        "        self.unit = unit\n\n    def area(self, w, h):\n"
        "        return w + h\n\n    @staticmethod\n    def name():\n"
        "        return 'shape'\n"
    )
    return "".join(parts)


def test_over_budget_python_file_is_cut_to_the_touched_method(tokenizer):
    files = {"pkg/big.py": _big_module(60), "README.md": "docs\n" * 200}
    gold = search_replace_to_diff(
        "pkg/big.py\n<<<<<<< SEARCH\n        return w + h\n=======\n        return w * h\n"
        ">>>>>>> REPLACE\n",
        files.get,
    ).patch
    instance = _instance("octo/shapes", "abc", gold)
    whole = SwePromptProcessor(tokenizer, PromptConfig(max_context_tokens=100_000))(
        instance, files.get
    )
    assert not whole.truncated and "def helper_30" in whole.messages[1]["content"]
    prompt = SwePromptProcessor(tokenizer, PromptConfig(max_context_tokens=200))(
        instance, files.get
    )
    user = prompt.messages[1]["content"]
    assert prompt.truncated and prompt.files_cut == ("pkg/big.py",)
    assert prompt.num_context_tokens <= 200 < whole.num_context_tokens
    # The method comes with its class's state: the class-level assignment and __init__.
    assert (
        "class Shape:\n    sides = 4\n...\n    def __init__(self, unit):\n"
        "        self.unit = unit\n...\n    def area(self, w, h):\n        return w + h\n...\n"
    ) in user
    assert "def helper_" not in user and "def name" not in user
    # Where the state does not fit the budget, the method and its class's header line do.
    tight_budget = prompt.num_context_tokens - 1
    tight = SwePromptProcessor(tokenizer, PromptConfig(max_context_tokens=tight_budget))(
        instance, files.get
    )
    user = tight.messages[1]["content"]
    assert tight.num_context_tokens <= tight_budget
    assert "class Shape:\n...\n    def area(self, w, h):\n        return w + h\n...\n" in user
    assert "sides" not in user and "__init__" not in user


def test_budget_cuts_at_line_boundaries_and_omits_what_does_not_fit(tokenizer):
    files = {"a.py": "".join(f"x{i} = {i}\n" for i in range(400)), "b.py": "y = 1\n"}
    gold = search_replace_to_diff(
        "a.py\n<<<<<<< SEARCH\n"
        + "".join(f"x{i} = {i}\n" for i in range(0, 300))
        + "=======\nx = 0\n>>>>>>> REPLACE\n\nb.py\n<<<<<<< SEARCH\ny = 1\n=======\ny = 2\n"
        ">>>>>>> REPLACE\n",
        files.get,
    ).patch
    assert [path for path, _ in touched_files(gold)] == ["a.py", "b.py"]
    prompt = SwePromptProcessor(tokenizer, PromptConfig(max_context_tokens=150))(
        _instance("octo/a", "abc", gold), files.get
    )
    assert prompt.files_shown == ("a.py",) and prompt.files_omitted == ("b.py",)
    assert 0 < prompt.num_context_tokens <= 150
    user = prompt.messages[1]["content"]
    assert "x0 = 0\nx1 = 1\n" in user and "x299 = 299" not in user


def test_missing_files_and_non_python_windows(tokenizer):
    text = "".join(f"line {i}\n" for i in range(1, 201))
    files = {"notes.txt": text}
    gold = search_replace_to_diff(
        "notes.txt\n<<<<<<< SEARCH\nline 100\n=======\nLINE 100\n>>>>>>> REPLACE\n", files.get
    ).patch
    gold += gold.replace("notes.txt", "gone.txt")
    prompt = SwePromptProcessor(tokenizer, PromptConfig(max_context_tokens=300))(
        _instance("octo/n", "abc", gold), files.get
    )
    assert prompt.files_omitted == ("gone.txt",) and prompt.files_shown == ("notes.txt",)
    user = prompt.messages[1]["content"]
    assert "line 90\n" in user and "line 110\n" in user
    assert "line 89\n" not in user and "line 111\n" not in user


def test_python_spans_include_decorators_and_module_level_lines():
    source = "import os\n\n\n@decorate\n@again\ndef f():\n    return 1\n\n\nX = 2\n"
    assert python_spans(source, [(7, 7)]) == [(4, 7)]
    assert python_spans(source, [(1, 1), (10, 10)]) == [(1, 1), (10, 10)]
    assert python_spans("def broken(:\n", [(1, 1)]) is None


def test_python_spans_class_state_of_a_touched_method():
    source = (
        "class Box:\n"  # 1
        "    size: int = 3\n"  # 2
        "\n"  # 3
        "    def __init__(self, items):\n"  # 4
        "        self.items = items\n"  # 5
        "\n"  # 6
        "    def helper(self):\n"  # 7
        "        return 0\n"  # 8
        "\n"  # 9
        "    def full(self):\n"  # 10
        "        return len(self.items) > self.size\n"  # 11
        "\n"  # 12
        "\n"  # 13
        "def free(box):\n"  # 14
        "    return box.size\n"  # 15
    )
    assert python_spans(source, [(11, 11)]) == [(1, 1), (10, 11)]
    assert python_spans(source, [(11, 11)], class_state=True) == [(1, 2), (4, 5), (10, 11)]
    # __init__ itself brings the class-level assignments; a module-level function, nothing.
    assert python_spans(source, [(5, 5)], class_state=True) == [(1, 2), (4, 5)]
    assert python_spans(source, [(15, 15)], class_state=True) == [(14, 15)]


def test_config_and_tokenizer_errors(tokenizer):
    with pytest.raises(
        ValueError,
        match=r"data\.prompt\.patch_format: must be one of "
        r"\['diff', 'search_replace', 'function'\], got 'xml'",
    ):
        from_dict(PromptConfig, {"patch_format": "xml"}, "data.prompt")
    with pytest.raises(ValueError, match=r"data\.prompt\.max_context_tokens: must be a positive"):
        from_dict(PromptConfig, {"max_context_tokens": 0}, "data.prompt")

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        SwePromptProcessor(NoTemplate())


def test_processor_is_registered():
    assert datasets.get_processor("swe_single_shot") is SwePromptProcessor
    assert "swe_single_shot" in datasets.processor_names()


def test_touched_files_ranges_cover_removed_lines_and_insertion_points():
    patch = (
        "--- a/m.py\n+++ b/m.py\n@@ -1,4 +1,5 @@\n a\n+inserted\n b\n-c\n+C\n d\n"
        "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+x\n"
    )
    assert touched_files(patch) == [("m.py", [(1, 3)])]  # insertion after 1 (1-2), removed 3
