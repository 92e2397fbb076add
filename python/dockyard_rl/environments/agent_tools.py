"""The multi-turn agent's tool-call layer: tool specs, the call format, its parser, the
observation text and the token-level chat rendering of an episode.

    renderer = ChatRenderer(tokenizer)
    prompt_ids = renderer.initial_prompt_ids(task_text)       # system (tools) + user + header
    response_ids = <the model's generated ids>; text = tokenizer.decode(response_ids, True)
    call = parse_tool_call(text)                              # ToolCall | ToolCallError
    result = await client.call_tool(session_id, call.name, call.args)   # not for submit
    next_ids = renderer.observation_ids(render_observation(result), response_ids)

Call format (Hermes, what Qwen2.5 / Hermes chat templates emit): thinking or prose may come
first, then exactly one call per turn and nothing after it:

    <tool_call>
    {"name": "view", "arguments": {"path": "calc/ops.py", "start_line": 1}}
    </tool_call>

The parser (`parse_tool_call`) ignores whitespace around the JSON and any text before the call
(only the text after the last `</think>` is searched, so calls quoted while thinking do not
count); it is strict about everything else: no call, two calls, text after `</tool_call>`, bad
JSON, keys other than "name" / "arguments", an unknown tool, arguments that are not an object,
unknown, missing or mistyped arguments each give a `ToolCallError` whose message says what is
wrong and shows a correct call of that tool. A missing `</tool_call>` at the very end of the text
is accepted (a stop string may have cut it off). `text` is the response decoded without special
tokens (vLLM's `completion.text` with its default `skip_special_tokens=True`).
Argument values are checked against `tool_specs()` (the JSON schema types and `minimum`); defaults
are not filled in: the executor applies them. Paths are not checked here (the session does).

Chat rendering (`ChatRenderer`) works on token ids so that what a rollout trains on is exactly
what the model generated: the episode loop appends the model's response ids as they are (never
re-decoded and re-tokenized), then `observation_ids(...)`: the end of the assistant turn where
the response lacks it, the tool message and the next assistant header. Every piece comes from
the tokenizer's chat template, so prompt + responses + observations decode to the template
applied to the same messages (`messages_for`), and where the model's response ids are the
canonical tokenization of its text, the ids equal the template's tokenization too (tested with
SmolLM2's tokenizer, whose special tokens start every piece, so BPE never merges across them).
- A template that renders `tools` (Qwen2.5, Hermes) gets `tools=tool_specs()` and puts them in
  the system turn itself; tool results go in as role "tool" messages and the template wraps them.
- A plain ChatML template (SmolLM2: it ignores `tools` and renders any role name verbatim) gets
  the tools text (`tools_text()`) appended to the system prompt, and the tool results as role
  "tool" messages whose content is wrapped in `<tool_response>` tags by this module.
- A response that stopped on the end-of-turn token (`<|im_end|>` for ChatML; vLLM keeps the stop
  token in the ids) gets the rest of the turn's end ("\n"); one without it (cut by the length
  limit, or stopped by a stop string) gets the whole end of turn. The ids of a response are never
  changed, so a response that ended on another special token (e.g. `<|endoftext|>`) keeps it.

Not covered: templates that rewrite earlier assistant turns (Qwen3 drops old `<think>` blocks:
the rendered history then differs from the ids the model generated, and `observation_ids` does not
emulate that), parallel tool calls, and OpenAI-style `tool_calls` message fields (the assistant's
raw text is the message content).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "TOOL_NAMES",
    "ChatRenderer",
    "ToolCall",
    "ToolCallError",
    "parse_tool_call",
    "render_observation",
    "render_tool_call",
    "tool_specs",
    "tools_text",
]

TOOL_NAMES = ("view", "search", "replace", "write_file", "run_tests", "submit")

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
MAX_VIEW_LINES = 200  # the session's view tool shows at most this many lines per call

_PATH = {"type": "string", "description": "Path relative to the repository root."}

# name -> (description, properties, required). The single source of truth for the prompt's tool
# list and for the parser's argument checks.
_TOOLS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "view": (
        "Show lines of a text file, numbered, or the entries of a directory (directories end "
        f"with '/'). At most {MAX_VIEW_LINES} lines per call.",
        {
            "path": _PATH,
            "start_line": {
                "type": "integer",
                "minimum": 1,
                "description": "First line to show (1-based). Default 1.",
            },
            "end_line": {
                "type": ["integer", "null"],
                "minimum": 1,
                "description": "Last line to show, inclusive; null for the end of the file.",
            },
        },
        ("path",),
    ),
    "search": (
        "Find lines containing a text (or matching a regular expression) in a file or under a "
        "directory. Prints path:line:text, at most 50 results.",
        {
            "pattern": {"type": "string", "description": "The text (or regex) to find."},
            "path": {"type": "string", "description": "File or directory to search. Default '.'."},
            "regex": {
                "type": "boolean",
                "description": "Treat pattern as a regular expression. Default false.",
            },
        },
        ("pattern",),
    ),
    "replace": (
        "Replace the one occurrence of `old` in a file with `new`. `old` must occur exactly once: "
        "include enough surrounding lines to make it unique. Whitespace must match exactly.",
        {
            "path": _PATH,
            "old": {"type": "string", "description": "The exact text to replace."},
            "new": {"type": "string", "description": "The text to put in its place."},
        },
        ("path", "old", "new"),
    ),
    "write_file": (
        "Create a text file, or overwrite one, with the given content.",
        {
            "path": _PATH,
            "content": {"type": "string", "description": "The whole new content of the file."},
        },
        ("path", "content"),
    ),
    "run_tests": (
        "Run pytest in the repository and show the end of its output. Without `tests`, runs "
        "the task's test command.",
        {
            "tests": {
                "type": ["array", "null"],
                "items": {"type": "string"},
                "minItems": 1,
                "description": "pytest node ids or paths, e.g. ['tests/test_x.py::test_y'].",
            },
        },
        (),
    ),
    "submit": (
        "Submit the current changes as the fix. Ends the episode; call it when you are done.",
        {},
        (),
    ),
}
assert tuple(_TOOLS) == TOOL_NAMES

# A correct call of each tool, shown in error messages.
_EXAMPLES: dict[str, dict[str, Any]] = {
    "view": {"path": "src/module.py", "start_line": 1, "end_line": 80},
    "search": {"pattern": "def parse", "path": "src"},
    "replace": {"path": "src/module.py", "old": "    return a + b\n", "new": "    return a * b\n"},
    "write_file": {"path": "src/new_module.py", "content": "def f():\n    return 1\n"},
    "run_tests": {"tests": ["tests/test_module.py"]},
    "submit": {},
}

DEFAULT_SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository. You work with tools: "
    "view files, search, edit, run tests. Each turn, write exactly one tool call (you may think "
    "before it; write nothing after it) and wait for its result. When the fix is complete, call "
    "`submit`: it ends the episode and your changes are scored by hidden tests."
)


def tool_specs() -> list[dict[str, Any]]:
    """The tools as OpenAI/Hermes function specs ({"type": "function", "function": {name,
    description, parameters: JSON schema}}), in `TOOL_NAMES` order. A fresh copy per call."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": copy.deepcopy(properties),
                    "required": list(required),
                },
            },
        }
        for name, (description, properties, required) in _TOOLS.items()
    ]


def tools_text() -> str:
    """The tool list and call format for a system prompt whose template does not render tools
    (Hermes wording, but one call per turn)."""
    specs = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in tool_specs())
    return (
        "# Tools\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        "To call a function, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}\n'
        "Exactly one tool call per turn. Its result comes back within <tool_response>"
        "</tool_response> XML tags. Calling submit ends the episode."
    )


def compact_tools_text() -> str:
    """`tools_text` in a few lines: one signature with defaults and a one-sentence description
    per tool, and the call format, for small models and short contexts: SmolLM2's whole agent
    prompt is ~320 tokens with it instead of ~970 (the byte-level test tokenizer's ~730 instead
    of ~2140)."""
    lines = []
    for spec in tool_specs():
        function = spec["function"]
        properties = function["parameters"]["properties"]
        required = function["parameters"]["required"]
        params = ", ".join(
            name if name in required else f"{name}={_COMPACT_DEFAULTS.get(name, 'null')}"
            for name in properties
        )
        summary = function["description"].split(". ")[0].rstrip(".")
        lines.append(f"- {function['name']}({params}): {summary}.")
    return (
        "# Tools\n"
        + "\n".join(lines)
        + f'\nCall one per turn, arguments as JSON:\n{CALL_OPEN}\n{{"name": "view", '
        f'"arguments": {{"path": "a.py"}}}}\n{CALL_CLOSE}\nResults come back within '
        "<tool_response></tool_response> tags. Calling submit ends the episode."
    )


# The defaults the session applies, shown in the compact signatures.
_COMPACT_DEFAULTS = {"start_line": "1", "path": '"."', "regex": "false"}

TOOL_FORMATS = ("full", "compact")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A malformed call; `message` is shown to the model as the tool's observation."""

    message: str


def render_tool_call(call: ToolCall) -> str:
    """The exact text `parse_tool_call` accepts for `call` (what a demonstration's assistant
    says, and what Hermes templates emit)."""
    payload = json.dumps({"name": call.name, "arguments": call.args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{payload}\n{CALL_CLOSE}"


def _format_hint(name: str | None = None) -> str:
    if name in _TOOLS:
        example = render_tool_call(ToolCall(name, _EXAMPLES[name]))
        required = _TOOLS[name][2]
        arguments = ", ".join(
            f"{arg}{'' if arg in required else ' (optional)'}" for arg in _TOOLS[name][1]
        )
        return f"Arguments of {name}: {arguments or 'none'}. Example:\n{example}"
    return (
        f"Write exactly one tool call in this form:\n{CALL_OPEN}\n"
        f'{{"name": "<tool name>", "arguments": {{...}}}}\n{CALL_CLOSE}\n'
        f"Tools: {', '.join(TOOL_NAMES)}."
    )


def _error(problem: str, name: str | None = None) -> ToolCallError:
    return ToolCallError(f"Invalid tool call: {problem}\n{_format_hint(name)}")


def _type_ok(value: Any, schema: Mapping[str, Any]) -> bool:
    types = schema["type"]
    for kind in [types] if isinstance(types, str) else types:
        if kind == "null" and value is None:
            return True
        if kind == "string" and isinstance(value, str):
            return True
        if kind == "boolean" and isinstance(value, bool):
            return True
        if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return "minimum" not in schema or value >= schema["minimum"]
        if kind == "array" and isinstance(value, list):
            if len(value) < schema.get("minItems", 0):
                return False
            return all(_type_ok(item, schema["items"]) for item in value)
    return False


def _type_words(schema: Mapping[str, Any]) -> str:
    types = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
    words = {
        "null": "null",
        "string": "a string",
        "boolean": "true or false",
        "integer": "an integer" + (f" >= {schema['minimum']}" if "minimum" in schema else ""),
        "array": "a non-empty list of strings",
    }
    return " or ".join(words[t] for t in types)


def _check_args(name: str, args: Mapping[str, Any]) -> ToolCallError | None:
    _, properties, required = _TOOLS[name]
    for arg in args:
        if arg not in properties:
            known = ", ".join(properties) or "none"
            return _error(f"{name} has no argument {arg!r} (its arguments: {known}).", name)
    for arg in required:
        if arg not in args:
            return _error(f"{name} needs the argument {arg!r}.", name)
    for arg, value in args.items():
        if not _type_ok(value, properties[arg]):
            return _error(
                f"argument {arg!r} of {name} must be {_type_words(properties[arg])}, "
                f"got {json.dumps(value)[:80]}.",
                name,
            )
    return None


_DECODER = json.JSONDecoder()


def parse_tool_call(text: str) -> ToolCall | ToolCallError:
    """The one tool call in a model's turn, or what is wrong with it (module docstring)."""
    think_end = text.rfind("</think>")
    if think_end >= 0:
        text = text[think_end + len("</think>") :]
    start = text.find(CALL_OPEN)
    if start < 0:
        return _error("no <tool_call> found.")
    # The JSON value is decoded where it starts, so tags inside its strings (code that mentions
    # <tool_call>) are data, not markup.
    body_start = start + len(CALL_OPEN)
    body_start += len(text[body_start:]) - len(text[body_start:].lstrip())
    try:
        payload, body_end = _DECODER.raw_decode(text, body_start)
    except RecursionError:  # json's decoder recurses per nesting level
        return _error("the call's JSON is nested too deeply.")
    except json.JSONDecodeError as error:
        unclosed = "" if CALL_CLOSE in text[body_start:] else f" (and {CALL_CLOSE} is missing)"
        return _error(f"the call is not valid JSON: {error}{unclosed}.")
    rest = text[body_end:].lstrip()
    if rest.startswith(CALL_CLOSE):
        rest = rest[len(CALL_CLOSE) :]
    elif rest and CALL_OPEN not in rest:
        return _error(f"expected {CALL_CLOSE} right after the JSON object, got {rest[:40]!r}.")
    if CALL_OPEN in rest:
        num_calls = 1 + rest.count(CALL_OPEN)
        return _error(f"exactly one tool call per turn is allowed; found {num_calls}.")
    if rest.strip():
        return _error(
            f"text after {CALL_CLOSE} ({rest.strip()[:40]!r}); end your turn right after it."
        )
    if not isinstance(payload, dict):
        return _error(f"the call must be a JSON object, got {type(payload).__name__}.")
    extra = sorted(set(payload) - {"name", "arguments"})
    if extra:
        return _error(f"unexpected keys {extra}: only 'name' and 'arguments' are allowed.")
    name = payload.get("name")
    if not isinstance(name, str):
        return _error("'name' must be a string naming the tool.")
    if name not in _TOOLS:
        return _error(f"unknown tool {name[:60]!r}.")
    args = payload.get("arguments", {})
    if not isinstance(args, dict):
        return _error(
            f"'arguments' must be a JSON object, got {type(args).__name__}.",
            name,
        )
    error = _check_args(name, args)
    return error if error is not None else ToolCall(name, args)


class ToolResultLike(Protocol):
    """The fields of `sandbox.client.ToolResult` that an observation shows."""

    ok: bool
    output: str
    error: str | None
    truncated: bool
    exhausted: bool


def render_observation(result_or_error: ToolResultLike | ToolCallError) -> str:
    """The tool message's text: the output of a successful call; "Error: ..." (then any output)
    for a failed call or a malformed one; a note when the output was truncated; and, once the
    session's budget is spent, that only submit is left."""
    if isinstance(result_or_error, ToolCallError):
        return f"Error: {result_or_error.message}"
    result = result_or_error
    parts = []
    if not result.ok:
        parts.append(f"Error: {result.error or 'the tool call failed.'}")
    if result.output or result.ok:
        parts.append(result.output if result.output else "(no output)")
    if result.truncated:
        parts.append("[output truncated]")
    if result.exhausted:
        parts.append("[budget exhausted: no more tool calls will run; call submit]")
    return "\n".join(parts)


class ChatRenderer:
    """Token-level rendering of an episode on the tokenizer's chat template (module docstring).

    `tokenizer` is a Hugging Face tokenizer with a chat template whose assistant turns end with
    a fixed end-of-turn text (ChatML's "<|im_end|>\\n"); construction checks that and raises
    ValueError otherwise. `system_prompt` None uses `DEFAULT_SYSTEM_PROMPT`. `tool_format`
    "full" lists the tools as JSON specs (or lets a tool-aware template render them);
    "compact" puts `compact_tools_text()` in the system prompt whatever the template.
    """

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, tool_format: str = "full"):
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format: must be one of {TOOL_FORMATS}, got {tool_format!r}")
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template; use an instruct model's tokenizer or set "
                "tokenizer.chat_template"
            )
        prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        self.renders_tools = tool_format == "full" and (
            self._text(probe, tools=True) != self._text(probe, tools=False)
        )
        # With a template that knows no tools (or the compact format), the tools text joins the
        # system prompt.
        text = compact_tools_text() if tool_format == "compact" else tools_text()
        self.system_content = prompt if self.renders_tools else f"{prompt}\n\n{text}"

        # The end of an assistant turn: what the template puts after an assistant's content.
        head = self._text(probe, generation_prompt=True)
        sentinel = "\u2063RESPONSE\u2063"
        closed = self._text([*probe, {"role": "assistant", "content": sentinel}])
        if not closed.startswith(head + sentinel):
            raise ValueError(
                "the chat template does not render an assistant turn as the generation prompt "
                "followed by the content; ChatRenderer cannot split it into token pieces"
            )
        self.end_of_turn = closed[len(head) + len(sentinel) :]
        self.end_of_turn_ids = self._encode(self.end_of_turn)
        if not self.end_of_turn_ids:
            raise ValueError(
                "the chat template ends assistant turns with no text; the model could not end "
                "its turn (expected an end-of-turn token such as <|im_end|>)"
            )

    def _text(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        generation_prompt: bool = False,
        tools: bool | None = None,
    ) -> str:
        use_tools = self.renders_tools if tools is None else tools
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tool_specs() if use_tools else None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tool_message(self, observation: str) -> dict[str, str]:
        """The chat message that carries a tool's observation (wrapped in <tool_response> tags
        here when the template does not render tools itself)."""
        if self.renders_tools:
            return {"role": "tool", "content": observation}
        return {"role": "tool", "content": f"{RESPONSE_OPEN}\n{observation}\n{RESPONSE_CLOSE}"}

    def messages_for(
        self, user_message: str, turns: Sequence[tuple[str, str | None]]
    ) -> list[dict[str, str]]:
        """The chat messages of an episode: system, user, then per turn the assistant's text and
        its observation (None for the last turn, e.g. submit). Apply the template to them with
        `tools=tool_specs()` where `renders_tools` to get the text the token ids decode to."""
        messages = [
            {"role": "system", "content": self.system_content},
            {"role": "user", "content": user_message},
        ]
        for response, observation in turns:
            messages.append({"role": "assistant", "content": response})
            if observation is not None:
                messages.append(self.tool_message(observation))
        return messages

    def initial_prompt_ids(self, user_message: str) -> list[int]:
        """System (with the tools) + the user's message + the assistant header."""
        return self._encode(self._text(self.messages_for(user_message, []), generation_prompt=True))

    def response_ids(self, text: str) -> list[int]:
        """The ids of an assistant turn that says `text` and stops on the end-of-turn token, as
        a model would generate them (demonstrations use it)."""
        return self._encode(text) + self.end_of_turn_ids[:1]

    def observation_ids(self, observation: str, last_response_ids: Sequence[int]) -> list[int]:
        """What follows the model's response: the rest of the end of turn (all of it when the
        response did not stop on the end-of-turn token), the tool message carrying
        `observation`, and the next assistant header."""
        ending = self.end_of_turn_ids
        response = list(last_response_ids)
        # The longest start of the end-of-turn ids that the response already ends with.
        done = next(
            (k for k in range(len(ending), 0, -1) if response[-k:] == ending[:k]),
            0,
        )
        # The tool message and the next header, as the template renders them after a turn.
        probe = [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
        ]
        closed = self._text(probe)
        following = self._text([*probe, self.tool_message(observation)], generation_prompt=True)
        assert following.startswith(closed), "the template rewrote earlier turns"
        return ending[done:] + self._encode(following[len(closed) :])
