"""End to end for single-shot SWE tasks: dataset row -> SweInstance ->
prompt (SwePromptProcessor, the tiny-llama tokenizer's chat template) -> "model output" ->
patch_formats.parse_model_output -> SweRollout -> SweEnvironment.step -> the real executor
(HTTP on 127.0.0.1, real git, real pytest under bubblewrap) with the real reward pipeline
({integrity, invalid_action}).

The model outputs are written by hand: the toy repository's gold patch in each output format
(a ```diff block after a <think> block; SEARCH/REPLACE blocks and rewritten functions made from
the gold diff), which must score reward 1 and resolve the task; and empty, malformed and prose
outputs, which must get the invalid-action outcome (parse failure in the metadata, the penalty as
reward) without ever reaching the executor.

The second test does the same for tasks the synthesizer generates on the spot from a toy sdist
(data/synthesis/synthesize_swe_tasks.py; no committed data): every output format of every task's
gold patch scores 1, the empty output is an invalid action. Synthesis and scoring share one
executor.

Not covered: sampling from a model (no policy here), prompts cut to a token budget
(processors_test covers those), infrastructure retries (swe_env_test covers them).
"""

import asyncio
import json

import pytest
import transformers
import unidiff

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.data.patch_formats import (
    InvalidReason,
    PatchFormat,
    diff_to_function_rewrite,
    diff_to_search_replace,
    git_file_reader,
    gold_answer,
    parse_model_output,
)
from dockyard_rl.data.processors import PromptConfig, SwePromptProcessor
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.data.synthesis import bundled_sdists, synthesize_swe_tasks
from dockyard_rl.environments.config import SweEnvironmentConfig
from dockyard_rl.environments.swe_env import SweEnvironment, SweRollout
from dockyard_rl.models.zoo import resolve_model
from dockyard_rl.rewards.shaping import RewardPipeline, RewardShapingConfig
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.utils.config import from_dict

PENALTY = -1.0
MAX_RESPONSE_TOKENS = 512
PROBLEM = "calc.ops.mul(3, 4) returns 7 instead of 12: it adds its arguments."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("zoo"))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return testing_repos.make_toy_repo(tmp_path_factory.mktemp("toy") / "repo")


@pytest.fixture(scope="module")
def instance(toy):
    # The published datasets store the test lists as JSON-encoded strings: load one that way.
    row = {
        "instance_id": "toy__calc-1",
        "repo": str(toy.path),
        "base_commit": toy.base_commit,
        "patch": toy.gold_patch,
        "test_patch": toy.test_patch,
        "FAIL_TO_PASS": json.dumps(list(toy.fail_to_pass)),
        "PASS_TO_PASS": json.dumps(list(toy.pass_to_pass)),
        "problem_statement": PROBLEM,
        "version": "1.0",
    }
    return SweInstance.from_row(row, 0, "toy.jsonl")


def removed_lines(patch: str) -> list[str]:
    """The base_commit lines the patch removes: code the prompt must show."""
    return [
        line.value
        for patched in unidiff.PatchSet(patch)
        for hunk in patched
        for line in hunk
        if line.is_removed
    ]


def make_rollout(instance, tokenizer, output, patch_format, read_file, files_shown=()):
    parsed = parse_model_output(output, patch_format, read_file, files_shown)
    return parsed, SweRollout(
        instance=instance.to_task_spec(""),
        patch=parsed.patch,
        invalid_reason=None if parsed.valid else parsed.invalid_reason.value,
        response_text=output,
        response_length=len(tokenizer(output, add_special_tokens=False)["input_ids"]),
        max_response_length=MAX_RESPONSE_TOKENS,
    )


def test_gold_patches_in_every_format_score_1_and_bad_outputs_are_invalid_actions(
    tmp_path, tokenizer, toy, instance
):
    assert instance.FAIL_TO_PASS == toy.fail_to_pass and instance.PASS_TO_PASS == toy.pass_to_pass
    read_file = git_file_reader(str(toy.path), instance.base_commit)
    gold_removed = removed_lines(instance.patch)
    assert gold_removed, "the toy gold patch must remove at least one line"

    # --- Prompts: every format shows the problem and the code the gold patch touches, and asks
    # for its own output format.
    prompts = {}
    for patch_format in PatchFormat:
        processor = SwePromptProcessor(
            tokenizer, PromptConfig(patch_format=patch_format.value, enable_thinking=True)
        )
        prompt = processor(instance, read_file)
        prompts[patch_format] = prompt
        assert prompt.patch_format is patch_format
        assert prompt.files_shown == ("calc/ops.py",) and not prompt.truncated
        assert prompt.num_tokens == len(prompt.token_ids) > prompt.num_context_tokens > 0
        user = prompt.messages[-1]["content"]
        assert PROBLEM in user
        for line in gold_removed:
            assert line in user, f"{patch_format.value} prompt lacks the touched line {line!r}"
        assert read_file("calc/ops.py") in user  # exact file text, so SEARCH blocks can match
        # The token ids are the chat template's rendering of those messages.
        decoded = tokenizer.decode(list(prompt.token_ids))
        assert "def mul(a, b):" in decoded and PROBLEM in decoded
    assert "```diff" in prompts[PatchFormat.DIFF].messages[-1]["content"]
    sr_user = prompts[PatchFormat.SEARCH_REPLACE].messages[-1]["content"]
    assert "<<<<<<< SEARCH" in sr_user and "```diff" not in sr_user

    # --- Model outputs: the gold patch in each format, then outputs with no usable patch.
    diff_output = (
        "<think>\nmul returns a + b; it should return a * b.\n</think>\n"
        f"The fix:\n\n```diff\n{instance.patch}```\n"
    )
    blocks = diff_to_search_replace(instance.patch, read_file)
    for block_search in blocks.split("<<<<<<< SEARCH\n")[1:]:
        # What the model copies into SEARCH is text the prompt showed it.
        assert block_search.split("=======\n")[0] in sr_user
    sr_output = f"<think>\nmul adds; make it multiply.\n</think>\n{blocks}"
    function_output = "<think>\nmul adds.\n</think>\n" + diff_to_function_rewrite(
        instance.patch, read_file
    )
    assert function_output.endswith("```python\ndef mul(a, b):\n    return a * b\n```\n")
    missing_search = (
        "calc/ops.py\n<<<<<<< SEARCH\ndef mul(a, b):\n    return a - b\n=======\n"
        "def mul(a, b):\n    return a * b\n>>>>>>> REPLACE\n"
    )
    prose = "<think>\nThe bug is in mul.\n</think>\nChange mul so it multiplies instead of adding."
    cases = [  # (output, format, the expected parse failure or None)
        (diff_output, PatchFormat.DIFF, None),
        (sr_output, PatchFormat.SEARCH_REPLACE, None),
        (function_output, PatchFormat.FUNCTION, None),
        ("", PatchFormat.DIFF, InvalidReason.NO_PATCH),
        ("", PatchFormat.SEARCH_REPLACE, InvalidReason.NO_PATCH),
        (missing_search, PatchFormat.SEARCH_REPLACE, InvalidReason.SEARCH_NOT_FOUND),
        (prose, PatchFormat.DIFF, InvalidReason.NO_PATCH),
    ]
    rollouts = []
    for output, patch_format, expected in cases:
        parsed, rollout = make_rollout(
            instance, tokenizer, output, patch_format, read_file, prompts[patch_format].files_shown
        )
        assert parsed.invalid_reason is expected, (patch_format, output, parsed.detail)
        if expected is None:
            assert parsed.files == ("calc/ops.py",) and parsed.thinking
        rollouts.append(rollout)

    # --- Scoring through the real executor.
    executor_config = ExecutorConfig(
        port=0, num_workers=2, work_dir=str(tmp_path / "work"), max_infra_attempts=1
    )
    pipeline = RewardPipeline(
        from_dict(
            RewardShapingConfig,
            {"stages": [{"type": "integrity"}, {"type": "invalid_action", "penalty": PENALTY}]},
            "rewards",
        )
    )

    async def scenario():
        async with running_server(executor_config) as server:
            env = SweEnvironment(
                SweEnvironmentConfig(
                    executor_url=server.url,
                    max_concurrency=4,
                    poll_interval_s=0.1,
                    task_timeout_s=120.0,
                    max_infra_retries=1,
                    task_id_prefix="e2e",
                ),
                pipeline,
            )
            result = await env.step(rollouts, global_step=0)
            return result, server.executor.all_records()

    result, records = asyncio.run(scenario())

    assert result.rewards_B.tolist() == [1.0, 1.0, 1.0] + [PENALTY] * 4
    assert result.sample_mask_B.tolist() == [1.0] * 7  # every sample has an outcome, none masked
    for meta, label in zip(result.metadata[:3], ("diff", "search_replace", "function")):
        assert meta["resolved"], (label, meta)
        assert meta["raw_reward"] == 1.0 and meta["reward"] == 1.0, (label, meta)
        assert meta["parse_failure"] is None and not meta["apply_failure"]
        assert meta["integrity_violation"] == [] and not meta["timed_out"]
        assert meta["infra_error"] is None and meta["num_tries"] == 1
        outcomes = meta["test_outcomes"]
        assert set(outcomes["FAIL_TO_PASS"]) == set(toy.fail_to_pass)
        assert set(outcomes["PASS_TO_PASS"]) == set(toy.pass_to_pass)
        assert set(outcomes["FAIL_TO_PASS"].values()) == {"passed"}, (label, outcomes)
        assert set(outcomes["PASS_TO_PASS"].values()) == {"passed"}, (label, outcomes)
        assert not meta["invalid_action/triggered"]
    for meta, (_, _, expected) in zip(result.metadata[3:], cases[3:]):
        assert meta["parse_failure"] == expected.value
        assert meta["task_id"] is None and meta["num_tries"] == 0  # never submitted
        assert meta["invalid_action/triggered"] and meta["invalid_action/reason"] == "no_patch"
        assert meta["reward"] == PENALTY and not meta["resolved"]
        assert meta["test_outcomes"] == {"FAIL_TO_PASS": {}, "PASS_TO_PASS": {}}

    # Only the three gold patches reached the executor.
    submitted = {m["task_id"] for m in result.metadata[:3]}
    assert len(submitted) == 3 and {record.spec.task_id for record in records} == submitted
    assert result.metrics["env/num_resolved"] == 3.0
    assert result.metrics["env/num_parse_failures"] == 4.0
    assert result.metrics["env/num_infra_errors"] == 0.0


def test_synthesized_tasks_score_1_with_gold_patches_in_every_format(
    tmp_path, tokenizer, monkeypatch
):
    archive = bundled_sdists.make_toy_sdist(tmp_path / "downloads")
    # A token-protected executor: the synthesizer and the environment (env.swe.auth_token_env's
    # default) read the token from the environment.
    token = "synthesis-test-token-0123456789"
    monkeypatch.setenv("DOCKYARD_EXECUTOR_TOKEN", token)
    executor_config = ExecutorConfig(
        port=0,
        num_workers=2,
        work_dir=str(tmp_path / "work"),
        max_infra_attempts=1,
        max_patch_bytes=4 * 1024 * 1024,
        auth_token=token,
    )
    pipeline = RewardPipeline(
        from_dict(
            RewardShapingConfig,
            {"stages": [{"type": "integrity"}, {"type": "invalid_action", "penalty": PENALTY}]},
            "rewards",
        )
    )

    async def scenario():
        async with running_server(executor_config) as server:
            out = tmp_path / "tasks"
            code = await asyncio.to_thread(
                synthesize_swe_tasks.main,
                [
                    "--packages",
                    str(archive),
                    "--out",
                    str(out),
                    "--max-tasks-per-package",
                    "3",
                    "--executor-url",
                    server.url,
                    "--log-level",
                    "WARNING",
                ],
            )
            assert code == 0
            instances = load_jsonl(out / "tasks.jsonl")
            assert len(instances) == 3
            rollouts = []
            for instance in instances:
                read_file = git_file_reader(instance.repo, instance.base_commit)
                for patch_format in PatchFormat:
                    prompt = SwePromptProcessor(
                        tokenizer, PromptConfig(patch_format=patch_format.value)
                    )(instance, read_file)
                    user = prompt.messages[-1]["content"]
                    assert instance.problem_statement.strip() in user
                    for line in removed_lines(instance.patch):
                        assert line in user  # the prompt shows the code the fix changes
                    output = gold_answer(instance.patch, patch_format, read_file)
                    parsed, rollout = make_rollout(
                        instance, tokenizer, output, patch_format, read_file, prompt.files_shown
                    )
                    assert parsed.valid, (instance.instance_id, patch_format, parsed.detail)
                    rollouts.append(rollout)
                _, empty = make_rollout(instance, tokenizer, "", PatchFormat.DIFF, read_file)
                rollouts.append(empty)
            env = SweEnvironment(
                SweEnvironmentConfig(
                    executor_url=server.url,
                    max_concurrency=4,
                    poll_interval_s=0.1,
                    task_timeout_s=300.0,
                    max_infra_retries=1,
                    task_id_prefix="synth",
                ),
                pipeline,
            )
            return await env.step(rollouts, global_step=0)

    result = asyncio.run(scenario())
    assert result.rewards_B.tolist() == [1.0, 1.0, 1.0, PENALTY] * 3, [
        m.get("test_outcomes") for m in result.metadata
    ]
    assert result.sample_mask_B.tolist() == [1.0] * 12
    assert result.metrics["env/num_resolved"] == 9.0
    for meta in result.metadata[3::4]:
        assert meta["parse_failure"] == InvalidReason.NO_PATCH.value and meta["num_tries"] == 0
