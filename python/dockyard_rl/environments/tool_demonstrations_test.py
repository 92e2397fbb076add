"""Tests for tool-use demonstrations: real git repositories (the toy task and a multi-file one
made here), real gold patches from `git diff`, and the real SmolLM2 tokenizer. The demo's edits,
applied the way the session's tools apply them, must give exactly the gold patch's files."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from dockyard_rl.data.patch_formats import git_dir_lister, git_file_reader
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.environments.agent_tools import (
    ChatRenderer,
    ToolCall,
    parse_tool_call,
    render_observation,
    render_tool_call,
)
from dockyard_rl.environments.tool_demonstrations import (
    MAX_VIEW_BYTES,
    MAX_WIDEN,
    RUN_TESTS_OUTPUT,
    Demonstration,
    Skipped,
    SkipReason,
    build_demonstration,
    build_demonstrations,
    replace_output,
    view_output,
)
from dockyard_rl.models import zoo
from dockyard_rl.sandbox import pipeline, sessions
from dockyard_rl.sandbox.testing_repos import OPS_BASE, OPS_FIXED, git, make_toy_repo

USER = "Fix the issue: calc.ops.mul adds instead of multiplying."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(zoo.resolve_model(zoo.SMOLLM2_NAME))


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


def _instance(repo: str, base_commit: str, patch: str, instance_id: str = "t__x-1") -> SweInstance:
    return SweInstance(
        instance_id=instance_id,
        repo=repo,
        base_commit=base_commit,
        patch=patch,
        test_patch="",
        FAIL_TO_PASS=("tests/test_x.py::test_x",),
        PASS_TO_PASS=(),
        problem_statement="fix it",
    )


def _play(calls, read_file) -> dict[str, str]:
    """Applies the demo's edits the way the session's tools do; returns the edited files."""
    files: dict[str, str] = {}
    for call in calls:
        path = call.args.get("path")
        if call.name == "replace":
            content = files[path] if path in files else read_file(path)
            old = call.args["old"]
            first = content.find(old)
            assert old and first >= 0 and content.find(old, first + 1) < 0, (path, old)
            files[path] = content.replace(old, call.args["new"], 1)
        elif call.name == "write_file":
            assert read_file(path) is None and path not in files
            files[path] = call.args["content"]
    return files


def _check_tokens(demo: Demonstration, renderer: ChatRenderer, tokenizer) -> None:
    """The ids decode to the template over the episode's messages; the mask marks exactly the
    calls (each ending with the end-of-turn token), and each masked span parses to its call."""
    assert len(demo.token_ids) == len(demo.mask)
    assert demo.calls[-1] == ToolCall("submit", {})
    assert len(demo.observations) == len(demo.calls) - 1
    turns = [
        (render_tool_call(call), observation)
        for call, observation in zip(demo.calls, [*demo.observations, None])
    ]
    text = tokenizer.apply_chat_template(renderer.messages_for(USER, turns), tokenize=False)
    assert tokenizer.decode(demo.token_ids) == text.removesuffix("\n")
    assert list(demo.token_ids) == tokenizer.encode(text, add_special_tokens=False)[:-1]
    spans, start = [], None
    for i, bit in enumerate([*demo.mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append(demo.token_ids[start:i])
            start = None
    assert len(spans) == len(demo.calls)
    assert demo.mask[: len(renderer.initial_prompt_ids(USER))] == (0,) * len(
        renderer.initial_prompt_ids(USER)
    )
    for span, call in zip(spans, demo.calls):
        assert span[-1] == tokenizer.eos_token_id
        assert parse_tool_call(tokenizer.decode(span, skip_special_tokens=True)) == call


def test_toy_task_demonstration_views_replaces_tests_and_submits(tmp_path, renderer, tokenizer):
    toy = make_toy_repo(tmp_path / "toy")
    read_file = git_file_reader(str(toy.path), toy.base_commit)
    instance = SweInstance.from_row(toy.dataset_row("toy__calc-1"), 0, "toy")
    demo = build_demonstration(instance, read_file, renderer, USER)
    assert isinstance(demo, Demonstration), demo
    assert [call.name for call in demo.calls] == ["view", "replace", "run_tests", "submit"]
    view = demo.calls[0].args
    assert view == {"path": "calc/ops.py"}  # a short file is viewed whole
    assert demo.observations[0] == view_output("calc/ops.py", OPS_BASE)
    # The replace names the changed line and only the context that makes it unique (`a + b`
    # is also add's body): no run of blank lines for a small model to repeat.
    assert demo.calls[1].args["old"] == "def mul(a, b):\n    return a + b\n\n"
    assert "return a + b" in demo.observations[0]
    assert demo.observations[1].startswith("replaced 1 occurrence in calc/ops.py; lines ")
    assert "    return a * b" in demo.observations[1]
    assert demo.observations[2] == RUN_TESTS_OUTPUT
    assert demo.calls[2].args == {}
    assert _play(demo.calls, read_file) == {"calc/ops.py": OPS_FIXED}
    _check_tokens(demo, renderer, tokenizer)


def test_view_output_follows_the_view_tool_contract():
    content = "a\n\tb\r\n\nlast"
    assert view_output("f", content) == "    1\ta\n    2\t\tb\n    3\t\n    4\tlast"
    assert view_output("f", content, 2, 3) == "    2\t\tb\n    3\t"
    assert view_output("f", content, 3, 99) == "    3\t\n    4\tlast"
    assert view_output("f", "") == "(f is empty)"
    with pytest.raises(ValueError):
        view_output("f", content, 5)
    many = "".join(f"line {i}\n" for i in range(1, 501))
    shown = view_output("f", many, 10).splitlines()
    assert len(shown) == 201 and shown[0] == "   10\tline 10" and shown[199] == "  209\tline 209"
    assert shown[200] == (
        "[showing lines 10-209 of 500; at most 200 at a time: view again with start_line=210]"
    )
    assert replace_output("f", "a\nb\nc\nd\ne\nf\n", "c\n", "C\nC2\n") == (
        "replaced 1 occurrence in f; lines 1-7 now read:\n"
        "    1\ta\n    2\tb\n    3\tC\n    4\tC2\n    5\td\n    6\te\n    7\tf"
    )


# A base tree and its fix that exercise every shape of hunk: several hunks in one file (line
# offsets shift after each replace), a hunk whose context repeats elsewhere (widening), a pure
# insertion, a change to a last line without a newline, and a new file.
TWINS_BASE = "".join(
    f"def {name}():\n    x = 1\n    return x\n\n\n" for name in ("first", "second", "third")
)
TWINS_FIXED = TWINS_BASE.replace(
    "def second():\n    x = 1\n    return x\n", "def second():\n    x = 1\n    return x + 1\n"
)
LONG_BASE = "".join(f"value_{i} = {i}\n" for i in range(1, 61))
LONG_FIXED = (
    LONG_BASE.replace("value_5 = 5\n", "value_5 = 50\n")
    .replace("value_30 = 30\n", "value_30 = 30\nvalue_30b = 31\nvalue_30c = 32\n")
    .replace("value_55 = 55\n", "")
)
# Lines of about 100 bytes, every tenth changed: git joins the hunks into one, whose view would be
# over MAX_VIEW_BYTES.
WIDE_BASE = "".join(f"w_{i:03} = '{'x' * 90}'\n" for i in range(150))
WIDE_FIXED = "".join(f"w_{i:03} = '{'y' if i % 10 == 5 else 'x' * 90}'\n" for i in range(150))
BASE_FILES = {
    "pkg/wide.py": WIDE_BASE,
    "pkg/twins.py": TWINS_BASE,
    "pkg/long.py": LONG_BASE,
    "pkg/tail.txt": "one\ntwo",
    "pkg/gone.py": "x = 1\n",
}
FIXED_FILES = {
    "pkg/wide.py": WIDE_FIXED,
    "pkg/twins.py": TWINS_FIXED,
    "pkg/long.py": LONG_FIXED,
    "pkg/tail.txt": "one\nTWO",
    "pkg/new.py": "def new():\n    return 'new'\n",
}


@pytest.fixture(scope="module")
def multi_repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi")
    git(path, "init", "--quiet", "--initial-branch=main")
    for name, content in BASE_FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "base")
    base = git(path, "rev-parse", "HEAD").strip()
    for name, content in FIXED_FILES.items():
        (path / name).write_text(content)
    (path / "pkg/gone.py").unlink()
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "fix")
    fix = git(path, "rev-parse", "HEAD").strip()
    return path, base, fix


@pytest.mark.parametrize("context", [0, 1, 3])
def test_every_hunk_shape_replays_to_the_gold_files(multi_repo, context, renderer, tokenizer):
    path, base, fix = multi_repo
    files = ["pkg/twins.py", "pkg/long.py", "pkg/tail.txt", "pkg/new.py"]
    patch = git(path, "diff", f"-U{context}", base, fix, "--", *files)
    read_file = git_file_reader(str(path), base)
    demo = build_demonstration(_instance(str(path), base, patch), read_file, renderer, USER)
    assert isinstance(demo, Demonstration), demo
    expected = {name: git(path, "show", f"{fix}:{name}") for name in files}
    assert _play(demo.calls, read_file) == expected
    names = [call.name for call in demo.calls]
    assert names[-2:] == ["run_tests", "submit"] and names.count("write_file") == 1
    assert names.count("replace") == 5  # twins 1, long 3, tail 1
    twins_replace = next(
        c for c in demo.calls if c.name == "replace" and c.args["path"] == "pkg/twins.py"
    )
    # With little context the hunk's text occurs three times: it was widened to "def second".
    assert "def second():" in twins_replace.args["old"]
    for call in demo.calls:
        if call.name == "view":
            if "end_line" in call.args:
                assert call.args["end_line"] - call.args["start_line"] < 200
    _check_tokens(demo, renderer, tokenizer)


def test_unsupported_patches_are_skipped_with_counted_reasons(multi_repo, renderer, tmp_path):
    path, base, fix = multi_repo
    read_file = git_file_reader(str(path), base)

    def diff(*names):
        return git(path, "diff", base, fix, "--", *names)

    ambiguous_base = "same\n" * (2 * MAX_WIDEN + 10)
    ambiguous_patch = (
        "diff --git a/pkg/flat.py b/pkg/flat.py\n--- a/pkg/flat.py\n+++ b/pkg/flat.py\n"
        f"@@ -{MAX_WIDEN + 5},1 +{MAX_WIDEN + 5},1 @@\n-same\n+other\n"
    )
    mismatch = diff("pkg/twins.py").replace(" def second():", " def zecond():")
    cases = {
        "deletes": (diff("pkg/gone.py"), read_file),
        "garbage": ("not a diff at all\n", read_file),
        "missing": (diff("pkg/long.py").replace("pkg/long.py", "pkg/absent.py"), read_file),
        "mismatch": (mismatch, read_file),
        "ambiguous": (ambiguous_patch, {"pkg/flat.py": ambiguous_base}.get),
    }
    results = {
        name: build_demonstration(_instance(str(path), base, patch), reader, renderer, USER)
        for name, (patch, reader) in cases.items()
    }
    assert {name: r.reason for name, r in results.items() if isinstance(r, Skipped)} == {
        "deletes": SkipReason.UNSUPPORTED_CHANGE,
        "garbage": SkipReason.UNPARSABLE_PATCH,
        "missing": SkipReason.MISSING_FILE,
        "mismatch": SkipReason.HUNK_MISMATCH,
        "ambiguous": SkipReason.AMBIGUOUS_HUNK,
    }
    assert "pkg/gone.py" in results["deletes"].detail
    assert "not unique" in results["ambiguous"].detail

    toy = make_toy_repo(tmp_path / "toy")
    toy_item = (
        SweInstance.from_row(toy.dataset_row("toy__calc-1"), 0, "toy"),
        git_file_reader(str(toy.path), toy.base_commit),
        USER,
    )
    items = [
        toy_item,
        (_instance(str(path), base, diff("pkg/gone.py")), read_file, USER),
        (_instance(str(path), base, "junk\n"), read_file, USER),
    ]
    demos, skipped = build_demonstrations(items, renderer)
    assert [d.instance_id for d in demos] == ["toy__calc-1"]
    assert skipped == {"unsupported_change": 1, "unparsable_patch": 1}
    demos, skipped = build_demonstrations(items[:1], renderer, max_tokens=100)
    assert demos == [] and skipped == {"too_long": 1}


def test_views_are_split_to_stay_under_the_session_output_cut(multi_repo, renderer, tokenizer):
    path, base, fix = multi_repo
    patch = git(path, "diff", base, fix, "--", "pkg/wide.py")
    read_file = git_file_reader(str(path), base)
    demo = build_demonstration(_instance(str(path), base, patch), read_file, renderer, USER)
    assert isinstance(demo, Demonstration), demo
    views = [
        (call.args, observation)
        for call, observation in zip(demo.calls, demo.observations)
        if call.name == "view"
    ]
    assert len(views) >= 2
    for (args, _), (next_args, _) in zip(views, views[1:]):
        assert next_args["start_line"] == args["end_line"] + 1
    assert all(len(observation.encode()) <= MAX_VIEW_BYTES for _, observation in views)
    assert _play(demo.calls, read_file) == {"pkg/wide.py": WIDE_FIXED}
    _check_tokens(demo, renderer, tokenizer)


@pytest.mark.parametrize("context", [0, 3])
def test_observations_are_what_the_session_tools_answer(multi_repo, context, renderer, tmp_path):
    """Plays the demonstration with the executor session's own tool functions on a checkout of
    the base commit: each answer equals the demonstration's observation, and the tree ends up
    as the fix commit's."""

    path, base, fix = multi_repo
    files = ["pkg/wide.py", "pkg/twins.py", "pkg/long.py", "pkg/tail.txt", "pkg/new.py"]
    patch = git(path, "diff", f"-U{context}", base, fix, "--", *files)
    read_file = git_file_reader(str(path), base)
    demo = build_demonstration(_instance(str(path), base, patch), read_file, renderer, USER)
    assert isinstance(demo, Demonstration), demo
    git(tmp_path, "clone", "--quiet", str(path), "tree")
    tree = tmp_path / "tree"
    git(tree, "checkout", "--quiet", base)
    tree_fd = os.open(tree, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for call, observation in zip(demo.calls, demo.observations):
            args = call.args
            if call.name == "view":
                answer = sessions._view(
                    tree_fd, args["path"], args.get("start_line", 1), args.get("end_line")
                )
            elif call.name == "replace":
                answer = sessions._replace(tree_fd, args["path"], args["old"], args["new"])
            elif call.name == "write_file":
                answer = sessions._write_file(tree_fd, args["path"], args["content"])
            else:
                assert call.name == "run_tests"
                continue
            assert render_observation(_SessionAnswer(answer)) == observation, call
    finally:
        os.close(tree_fd)
    for name in files:
        assert (tree / name).read_text() == git(path, "show", f"{fix}:{name}"), name


class _SessionAnswer:
    ok, error, truncated, exhausted = True, None, False, False

    def __init__(self, output: str):
        self.output = output


def test_with_a_directory_lister_the_demonstration_finds_the_file_first(
    tmp_path, renderer, tokenizer
):
    # The agent is never told where the bug is: the episode lists the root, then the package,
    # then reads the file, each answered as the session's view answers a directory.
    toy = make_toy_repo(tmp_path / "toy")
    read_file = git_file_reader(str(toy.path), toy.base_commit)
    list_dir = git_dir_lister(str(toy.path), toy.base_commit)
    assert list_dir(".") == ["calc/", "tests/"] and list_dir("calc") == ["__init__.py", "ops.py"]
    assert list_dir("calc/ops.py") is None and list_dir("nowhere") is None
    instance = SweInstance.from_row(toy.dataset_row("toy__calc-1"), 0, "toy")
    demo = build_demonstration(instance, read_file, renderer, USER, list_dir=list_dir)
    assert isinstance(demo, Demonstration), demo
    assert [(c.name, c.args.get("path")) for c in demo.calls] == [
        ("view", "."),
        ("view", "calc"),
        ("view", "calc/ops.py"),
        ("replace", "calc/ops.py"),
        ("run_tests", None),
        ("submit", None),
    ]
    assert demo.observations[:2] == ("calc/\ntests/", "__init__.py\nops.py")
    # The listings are what a real session answers on the same checkout.
    spec = toy.spec("")
    manager = sessions.SessionManager(
        sessions.SessionConfig(), pipeline.PipelineConfig(), tmp_path / "work", 1 << 20
    )
    manager.start()
    try:
        manager.open(spec, "listing")
        for call, observation in zip(demo.calls[:2], demo.observations[:2]):
            assert manager.call("listing", "view", call.args).output == observation
    finally:
        manager.stop()
    assert _play(demo.calls, read_file) == {"calc/ops.py": OPS_FIXED}
    _check_tokens(demo, renderer, tokenizer)
