"""Tests for the agent's tool-call layer: specs, parser, observations, and the token-level chat
rendering with the real SmolLM2 tokenizer (plain ChatML) and a Hermes-style template that
renders tools (Qwen2.5's layout)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dockyard_rl.environments import agent_tools
from dockyard_rl.environments.agent_tools import (
    TOOL_NAMES,
    ChatRenderer,
    ToolCall,
    ToolCallError,
    parse_tool_call,
    render_observation,
    render_tool_call,
    tool_specs,
)
from dockyard_rl.models import zoo

# Qwen2.5's tool layout (system turn lists the tools, tool results go in a user turn wrapped in
# <tool_response>), trimmed to what these tests render.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' + messages[0]['content'] }}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[1:] %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm2_dir():
    return zoo.resolve_model(zoo.SMOLLM2_NAME)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hermes_tokenizer(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Specs, parser, observations


def test_tool_specs_name_every_tool_with_a_json_schema():
    specs = tool_specs()
    assert [spec["function"]["name"] for spec in specs] == list(TOOL_NAMES)
    for spec in specs:
        assert spec["type"] == "function"
        parameters = spec["function"]["parameters"]
        assert parameters["type"] == "object"
        assert set(parameters["required"]) <= set(parameters["properties"])
        json.dumps(spec)  # serialisable for the chat template
    by_name = {spec["function"]["name"]: spec["function"]["parameters"] for spec in specs}
    assert by_name["replace"]["required"] == ["path", "old", "new"]
    assert by_name["submit"]["properties"] == {}
    # Callers may edit what they get without changing the next call's specs.
    specs[0]["function"]["parameters"]["properties"].clear()
    assert tool_specs()[0]["function"]["parameters"]["properties"]


CALLS = [
    ToolCall("view", {"path": "a.py"}),
    ToolCall("view", {"path": "pkg/b.py", "start_line": 3, "end_line": None}),
    ToolCall("search", {"pattern": "def f(", "path": ".", "regex": False}),
    ToolCall("replace", {"path": "a.py", "old": "x = 1\n", "new": 'x = "é"\n\t</tool_call>'}),
    ToolCall("write_file", {"path": "new.py", "content": ""}),
    ToolCall("run_tests", {}),
    ToolCall("run_tests", {"tests": ["tests/test_a.py::test_x", "tests"]}),
    ToolCall("run_tests", {"tests": None}),
    ToolCall("submit", {}),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_rendered_calls_parse_back(call):
    text = render_tool_call(call)
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    assert parse_tool_call(text) == call


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "view", "arguments": {"path": "a.py"}}</tool_call>',
        '  \n<tool_call>\n\n  {"name":"view","arguments":{"path":"a.py"}}  \n</tool_call>\n\n',
        'I should look at a.py first.\n<tool_call>\n{"name": "view", "arguments": '
        '{"path": "a.py"}}\n</tool_call>',
        '<think>maybe <tool_call>{"name": "submit"}</tool_call>? no.</think>\n'
        '<tool_call>\n{"name": "view", "arguments": {"path": "a.py"}}\n</tool_call>',
        # a stop string on </tool_call> cut the closing tag off
        '<tool_call>\n{"name": "view", "arguments": {"path": "a.py"}}\n',
    ],
    ids=["compact", "whitespace", "prose_before", "call_in_thinking", "unclosed_at_end"],
)
def test_parser_tolerates_whitespace_and_text_before(text):
    assert parse_tool_call(text) == ToolCall("view", {"path": "a.py"})


def test_submit_without_arguments_key_is_accepted():
    assert parse_tool_call('<tool_call>{"name": "submit"}</tool_call>') == ToolCall("submit", {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I will call view on a.py", ["no <tool_call> found", "Tools: view, search"]),
        (
            '<tool_call>{"name": "view", "arguments": {"path": "a"}}</tool_call>\n'
            '<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
            ["exactly one tool call per turn", "found 2"],
        ),
        ("<tool_call>{'name': 'view'}</tool_call>", ["not valid JSON"]),
        ('<tool_call>{"name": "view", "arguments": {"path": "a"}', ["not valid JSON", "missing"]),
        ('<tool_call>["view"]</tool_call>', ["must be a JSON object, got list"]),
        ("<tool_call>" + "[" * 100_000, ["nested too deeply"]),
        (
            '<tool_call>{"name": "submit", "arguments": {}} and then </tool_call>',
            ["expected </tool_call> right after the JSON object"],
        ),
        ('<tool_call>{"name": "cat", "arguments": {}}</tool_call>', ["unknown tool 'cat'"]),
        ('<tool_call>{"arguments": {}}</tool_call>', ["'name' must be a string"]),
        (
            '<tool_call>{"name": "view", "arguments": "{\\"path\\": \\"a\\"}"}</tool_call>',
            ["'arguments' must be a JSON object, got str", '"name": "view"'],
        ),
        (
            '<tool_call>{"name": "view", "args": {"path": "a"}}</tool_call>',
            ["unexpected keys ['args']"],
        ),
        (
            '<tool_call>{"name": "replace", "arguments": {"path": "a", "old": "x"}}</tool_call>',
            ["replace needs the argument 'new'", '"name": "replace"'],
        ),
        (
            '<tool_call>{"name": "view", "arguments": {"path": "a", "line": 3}}</tool_call>',
            ["view has no argument 'line'", "start_line (optional)"],
        ),
        (
            '<tool_call>{"name": "view", "arguments": {"path": "a", "start_line": "3"}}'
            "</tool_call>",
            ["'start_line' of view must be an integer >= 1", 'got "3"'],
        ),
        (
            '<tool_call>{"name": "view", "arguments": {"path": "a", "start_line": 0}}</tool_call>',
            ["'start_line' of view must be an integer >= 1, got 0"],
        ),
        (
            '<tool_call>{"name": "view", "arguments": {"path": "a", "end_line": true}}</tool_call>',
            ["'end_line' of view must be an integer >= 1 or null"],
        ),
        (
            '<tool_call>{"name": "search", "arguments": {"pattern": "x", "regex": "yes"}}'
            "</tool_call>",
            ["'regex' of search must be true or false"],
        ),
        (
            '<tool_call>{"name": "run_tests", "arguments": {"tests": "tests/"}}</tool_call>',
            ["'tests' of run_tests must be a non-empty list of strings or null"],
        ),
        (
            '<tool_call>{"name": "run_tests", "arguments": {"tests": []}}</tool_call>',
            ["'tests' of run_tests must be a non-empty list of strings or null"],
        ),
        (
            '<tool_call>{"name": "run_tests", "arguments": {"tests": [1]}}</tool_call>',
            ["'tests' of run_tests must be a non-empty list of strings or null"],
        ),
        (
            '<tool_call>{"name": "submit", "arguments": {}}</tool_call> Done! The fix is in.',
            ["text after </tool_call>", "end your turn right after it"],
        ),
    ],
    ids=[
        "no_call",
        "two_calls",
        "bad_json",
        "truncated_json",
        "not_an_object",
        "deep_nesting",
        "text_before_close",
        "unknown_tool",
        "no_name",
        "arguments_string",
        "extra_key",
        "missing_arg",
        "unknown_arg",
        "string_for_int",
        "below_minimum",
        "bool_for_int",
        "string_for_bool",
        "string_for_list",
        "empty_list",
        "int_in_list",
        "text_after",
    ],
)
def test_malformed_calls_say_what_is_wrong_and_what_to_write(text, expected):
    error = parse_tool_call(text)
    assert isinstance(error, ToolCallError)
    assert error.message.startswith("Invalid tool call: ")
    for fragment in expected:
        assert fragment in error.message, error.message
    # Every message shows a correct call to copy.
    example = error.message[error.message.index("<tool_call>") :]
    assert example.endswith("</tool_call>") or example.endswith(".")


def test_error_examples_are_valid_calls():
    for name in TOOL_NAMES:
        message = agent_tools._format_hint(name)
        example = message[message.index("<tool_call>") :]
        assert parse_tool_call(example).name == name


class _Result:
    def __init__(self, ok=True, output="", error=None, truncated=False, exhausted=False):
        self.ok, self.output, self.error = ok, output, error
        self.truncated, self.exhausted = truncated, exhausted


def test_render_observation():
    assert render_observation(_Result(output="    1\tx = 1")) == "    1\tx = 1"
    assert render_observation(_Result(output="")) == "(no output)"
    assert render_observation(_Result(ok=False, error="a.py: no such file")) == (
        "Error: a.py: no such file"
    )
    failed = render_observation(
        _Result(ok=False, error="exit 1", output="FAILED t", truncated=True)
    )
    assert failed == "Error: exit 1\nFAILED t\n[output truncated]"
    spent = render_observation(_Result(ok=False, error="budget spent", exhausted=True))
    assert spent.startswith("Error: budget spent\n") and "call submit" in spent
    bad = parse_tool_call("nothing")
    assert render_observation(bad) == f"Error: {bad.message}"


# ---------------------------------------------------------------------------------------------
# Token-level rendering


def _episode(renderer, tokenizer, responses):
    """Plays responses (ids) with fixed observations; returns (ids, turns for messages_for)."""
    ids = renderer.initial_prompt_ids("Fix calc.ops.mul.")
    turns = []
    for i, response in enumerate(responses):
        ids += response
        text = tokenizer.decode(response, skip_special_tokens=True)
        if i + 1 < len(responses):
            observation = f"    {i + 1}\tdef mul(a, b):\n{i}: ok"
            ids += renderer.observation_ids(observation, response)
            turns.append((text, observation))
        else:
            turns.append((text, None))
    return ids, turns


def test_smollm2_template_is_plain_chatml_and_gets_the_tools_in_the_system_prompt(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert not renderer.renders_tools  # SmolLM2's template ignores `tools`
    assert renderer.end_of_turn == "<|im_end|>\n"
    assert renderer.end_of_turn_ids[0] == tokenizer.eos_token_id
    prompt = tokenizer.decode(renderer.initial_prompt_ids("Fix it."))
    assert prompt.startswith("<|im_start|>system\nYou are a software engineer")
    assert "<tools>\n" in prompt and '"name": "run_tests"' in prompt
    assert "Exactly one tool call per turn" in prompt and "submit ends the episode" in prompt
    assert prompt.endswith(
        "<|im_end|>\n<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n"
    )
    custom = ChatRenderer(tokenizer, system_prompt="Be brief.")
    assert custom.system_content.startswith("Be brief.\n\n# Tools")


def test_smollm2_episode_tokens_equal_the_template_over_the_same_messages(tokenizer):
    renderer = ChatRenderer(tokenizer)
    view = render_tool_call(ToolCall("view", {"path": "calc/ops.py"}))
    replace = render_tool_call(
        ToolCall("replace", {"path": "calc/ops.py", "old": "a + b", "new": "a * b"})
    )
    eos = tokenizer.eos_token_id
    responses = [
        tokenizer.encode("Let me look.\n" + view, add_special_tokens=False) + [eos],  # EOS
        tokenizer.encode(replace, add_special_tokens=False),  # stop string: no EOS
        tokenizer.encode('<tool_call>\n{"name": "run_te', add_special_tokens=False),  # length cut
        renderer.response_ids(render_tool_call(ToolCall("submit", {}))),
    ]
    ids, turns = _episode(renderer, tokenizer, responses)
    messages = renderer.messages_for("Fix calc.ops.mul.", turns)
    # The last assistant turn is not closed in the ids: the template closes every turn.
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("<|im_end|>\n")
    assert tokenizer.decode(ids) == text[: -len("\n")]
    # The pieces tokenize exactly as the whole text does (special tokens split every piece).
    assert ids == tokenizer.encode(text, add_special_tokens=False)[:-1]
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3 + [
        "assistant"
    ]
    assert messages[3]["content"].startswith("<tool_response>\n    1\tdef mul")


def test_observation_ids_complete_the_turn_only_where_the_response_did_not(tokenizer):
    renderer = ChatRenderer(tokenizer)
    eos, newline = renderer.end_of_turn_ids
    text_ids = tokenizer.encode(render_tool_call(ToolCall("submit", {})), add_special_tokens=False)
    stopped = renderer.observation_ids("ok", text_ids + [eos])
    cut = renderer.observation_ids("ok", text_ids)
    assert stopped[0] == newline and stopped[1] != eos
    assert cut[:2] == [eos, newline] and cut[2:] == stopped[1:]
    assert renderer.observation_ids("ok", text_ids + [eos, newline]) == stopped[1:]
    assert tokenizer.decode(stopped) == (
        "\n<|im_start|>tool\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert renderer.response_ids("x")[-1] == eos


def test_hermes_template_renders_the_tools_and_wraps_the_results(hermes_tokenizer):
    renderer = ChatRenderer(hermes_tokenizer, system_prompt="Fix bugs.")
    assert renderer.renders_tools
    assert renderer.system_content == "Fix bugs."  # the template adds the tools itself
    prompt = hermes_tokenizer.decode(renderer.initial_prompt_ids("Fix it."))
    assert prompt.startswith("<|im_start|>system\nFix bugs.\n\n# Tools\n\n<tools>\n")
    assert prompt.count('"type": "function"') == len(TOOL_NAMES)
    responses = [
        renderer.response_ids(render_tool_call(ToolCall("view", {"path": "a.py"}))),
        renderer.response_ids(render_tool_call(ToolCall("submit", {}))),
    ]
    ids = renderer.initial_prompt_ids("Fix it.")
    ids += responses[0] + renderer.observation_ids("    1\tx", responses[0]) + responses[1]
    text = hermes_tokenizer.apply_chat_template(
        renderer.messages_for(
            "Fix it.",
            [
                (hermes_tokenizer.decode(responses[0], skip_special_tokens=True), "    1\tx"),
                (hermes_tokenizer.decode(responses[1], skip_special_tokens=True), None),
            ],
        ),
        tools=tool_specs(),
        tokenize=False,
    )
    assert hermes_tokenizer.decode(ids) == text[: -len("\n")]
    assert "<|im_start|>user\n<tool_response>\n    1\tx\n</tool_response><|im_end|>" in text


def test_a_tokenizer_without_chat_template_is_refused(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(tokenizer)


def test_compact_tool_format_lists_every_tool_in_a_line_and_parses_the_same(
    tokenizer, hermes_tokenizer
):
    full = ChatRenderer(tokenizer)
    compact = ChatRenderer(tokenizer, tool_format="compact")
    prompt = tokenizer.decode(compact.initial_prompt_ids("Fix it."))
    assert "<tools>" not in prompt and '"type": "function"' not in prompt
    for name in TOOL_NAMES:
        assert f"\n- {name}(" in prompt, name
    assert "- view(path, start_line=1, end_line=null):" in prompt
    assert "- replace(path, old, new):" in prompt and "- submit():" in prompt
    # The example call in the prompt is a call the parser accepts.
    example = prompt[prompt.index("<tool_call>") : prompt.index("</tool_call>") + 12]
    assert parse_tool_call(example) == ToolCall("view", {"path": "a.py"})
    assert len(compact.initial_prompt_ids("x")) < len(full.initial_prompt_ids("x")) / 2
    # Compact wins over a template that would render the JSON specs itself.
    hermes = ChatRenderer(hermes_tokenizer, tool_format="compact")
    assert not hermes.renders_tools and "\n- run_tests(tests=null):" in hermes.system_content
    with pytest.raises(ValueError, match="tool_format: must be one of"):
        ChatRenderer(tokenizer, tool_format="short")
