"""The multi-turn agent environment end to end, with a scripted policy in place of the engines:
a real executor (HTTP on 127.0.0.1, sessions, real git, pytest under bubblewrap) on the toy
repository from sandbox.testing_repos, the real SmolLM2 chat template, the real reward pipeline,
and `AgentRolloutRunner` + `build_train_batch` for the batch the trainer would see.

The scripted policy answers each turn from a table keyed by the turn's seed, so the test also
checks that turn t of sample i is generated with the seed the seeding rule gives it."""

import asyncio

import pytest
import torch
import transformers

from dockyard_rl.algorithms.advantages import AdvantageConfig
from dockyard_rl.algorithms.agent_rollouts import AgentRolloutRunner
from dockyard_rl.algorithms.rollouts import build_train_batch
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.environments.agent_env import AgentEnvironment
from dockyard_rl.environments.agent_tools import ChatRenderer, ToolCall, render_tool_call
from dockyard_rl.environments.config import AgentEnvironmentConfig, SweEnvironmentConfig
from dockyard_rl.environments.swe_env import SweEnvironment
from dockyard_rl.models.generation.interfaces import GenerationSample
from dockyard_rl.models.zoo import resolve_model
from dockyard_rl.rewards.shaping import RewardPipeline, RewardShapingConfig
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task_executor import pipeline_score_fn
from dockyard_rl.utils.config import from_dict
from dockyard_rl.utils.seeding import sample_seed

RUN_SEED = 5
TURN_PENALTY = -0.25

FIX = [
    ToolCall("view", {"path": "calc/ops.py"}),
    ToolCall("search", {"pattern": "def mul"}),
    ToolCall(
        "replace",
        {
            "path": "calc/ops.py",
            "old": "def mul(a, b):\n    return a + b",
            "new": "def mul(a, b):\n    return a * b",
        },
    ),
    ToolCall("run_tests", {}),
    ToolCall("submit", {}),
]
# A policy that never gets anywhere: prose, an escape attempt, a replace that matches nothing,
# two tool calls in one turn, a tool that does not exist. It runs out of turns with no change.
FLAIL = [
    "I think the bug is in mul.",
    render_tool_call(ToolCall("view", {"path": "../../../etc/passwd"})),
    render_tool_call(ToolCall("replace", {"path": "calc/ops.py", "old": "nowhere", "new": "x"})),
    render_tool_call(ToolCall("view", {"path": "calc"})) + render_tool_call(FIX[-1]),
    render_tool_call(ToolCall("rm_rf", {"path": "/"})),
]


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    model_dir = resolve_model("smollm2-135m-instruct", cache_dir=tmp_path_factory.mktemp("zoo"))
    return ChatRenderer(transformers.AutoTokenizer.from_pretrained(str(model_dir)))


@pytest.fixture
def repo(tmp_path):
    return testing_repos.make_toy_repo(tmp_path / "toy")


def instance(repo) -> SweInstance:
    return SweInstance.from_row(repo.dataset_row("toy__calc-1"), 0, "test")


class ScriptedGeneration:
    """Answers turn t of sample i with script[i][t], looked up by the request's seed."""

    def __init__(self, renderer, scripts, instance_id, prompt_key):
        self.renderer = renderer
        self.by_seed = {}
        for i, script in enumerate(scripts):
            for turn, text in enumerate(script):
                seed = sample_seed(RUN_SEED, "train", prompt_key, instance_id, i, turn)
                self.by_seed[seed] = (turn, text)
        self.requests = []

    async def generate(self, prompts, num_samples, *, sampling_overrides=None, seeds=None):
        assert len(prompts) == 1 and num_samples == 1, "one request per turn"
        seed = seeds[0][0]
        turn, text = self.by_seed[seed]  # KeyError: a turn asked with a seed of no rule
        self.requests.append((seed, dict(sampling_overrides)))
        ids = self.renderer.response_ids(text)
        yield GenerationSample(
            prompt_index=0,
            sample_index=0,
            prompt_token_ids=tuple(prompts[0]),
            response_token_ids=tuple(ids),
            response_logprobs=tuple([-0.5] * len(ids)),
            response_text=text,
            finish_reason="stop",
            stop_reason=None,
            weight_versions=(10 + turn,),  # as if the weights changed between turns
            oldest_weight_version=10 + turn,
            engine_index=0,
            seed=seed,
        )


def make_environment(url, renderer, max_turns, **agent_overrides):
    pipeline = RewardPipeline(
        from_dict(
            RewardShapingConfig,
            {
                "stages": [
                    {"type": "integrity"},
                    {"type": "invalid_action", "penalty": -1.0},
                    {"type": "turn_limit", "penalty": TURN_PENALTY},
                ]
            },
            "rewards",
        )
    )
    swe_config = SweEnvironmentConfig(
        executor_url=url, poll_interval_s=0.1, task_timeout_s=120.0, max_infra_retries=0
    )
    scorer = SweEnvironment(
        swe_config,
        pipeline,
        client_factory=lambda: ExecutorClient(
            url, request_timeout_s=60.0, max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02
        ),
    )
    agent = AgentEnvironmentConfig(**{"max_episode_tokens": 8192, **agent_overrides})
    return AgentEnvironment(agent, scorer, renderer, max_rollout_turns=max_turns)


def executor_config(tmp_path):
    return ExecutorConfig(port=0, num_workers=2, work_dir=str(tmp_path / "work"))


def test_scripted_agent_fixes_the_bug_in_several_turns(tmp_path, repo, renderer):
    task = instance(repo)
    scripts = [[render_tool_call(call) for call in FIX], FLAIL]
    generation = ScriptedGeneration(renderer, scripts, task.instance_id, prompt_key=7)
    config = executor_config(tmp_path)

    async def scenario():
        async with running_server(config, pipeline_score_fn(config.pipeline)) as server:
            env = make_environment(server.url, renderer, max_turns=len(FIX))
            runner = AgentRolloutRunner(
                generation, env, max_response_tokens=len(FIX) * 256, run_seed=RUN_SEED
            )
            rollout = await runner.run([task], num_samples=2, global_step=1, prompt_keys=[7])
            return rollout, server.executor.sessions.num_open

    rollout, sessions_left = asyncio.run(scenario())
    assert sessions_left == 0, "every episode closes its session"
    fixed, flailed = rollout.result.metadata

    # The fix: five turns, four tool calls, the tests run once, submitted, resolved by the
    # normal scoring path (hidden tests applied there, never in the session).
    assert fixed["episode_end"] == "submit" and fixed["turns"] == 5
    assert fixed["tool_calls"] == 4 and fixed["tool_errors"] == 0 and fixed["tests_run"] == 1
    assert fixed["resolved"] is True and fixed["raw_reward"] == 1.0
    assert fixed["turn_weight_versions"] == [[10], [11], [12], [13], [14]]
    assert rollout.rewards_B[0] == 1.0

    # The flailing policy: every bad call was an observation, nothing crashed; out of turns with
    # no change: "no patch" (-1) plus the turn-limit penalty, and NOT masked out of the loss.
    assert flailed["episode_end"] == "turn_limit" and flailed["turns"] == 5
    assert flailed["tool_errors"] == 5 and flailed["tests_run"] == 0
    assert flailed["parse_failure"] == "empty_diff"
    assert rollout.rewards_B[1] == pytest.approx(-1.0 + TURN_PENALTY)
    assert rollout.sample_mask_B.tolist() == [1.0, 1.0]
    assert rollout.metrics()["env/agent/end_submit"] == 0.5

    # Each turn asked for at most max_turn_tokens, with the rule's seed (looked up above).
    assert len(generation.requests) == 10
    assert all(overrides["max_tokens"] <= 256 for _, overrides in generation.requests)

    # The training batch: the policy's tokens only; the tool outputs are context.
    batch, stats = build_train_batch(rollout, AdvantageConfig())
    assert stats.num_samples == 2
    sample = rollout.samples[0]
    mask = torch.tensor(sample.response_mask, dtype=torch.float32)
    start = len(sample.prompt_token_ids)
    end = start + len(sample.response_token_ids)
    assert torch.equal(batch["token_mask"][0, start:end], mask)
    assert batch["token_mask"][0, :start].sum() == 0
    policy_ids = [t for t, m in zip(sample.response_token_ids, sample.response_mask) if m]
    expected = [id_ for call in FIX for id_ in renderer.response_ids(render_tool_call(call))]
    assert policy_ids == expected
    # Log-probs are the engine's on policy tokens and 0 on the observations.
    logprobs = batch["generation_logprobs"][0, start:end]
    assert torch.all(logprobs[mask == 1] == -0.5) and torch.all(logprobs[mask == 0] == 0)
    # The whole episode decodes to the chat the template makes of the same messages.
    tokenizer = renderer.tokenizer
    text = tokenizer.decode(list(sample.prompt_token_ids) + list(sample.response_token_ids))
    assert "<tool_response>" in text or "<|im_start|>tool" in text
    assert "def mul(a, b):" in text  # the view observation is in the context
    assert sample.weight_versions == (10, 11, 12, 13, 14) and sample.oldest_weight_version == 10


def test_unreachable_executor_masks_the_episode(renderer, repo):
    # Nothing listens on port 9 of 127.0.0.1 here: the episode cannot open its session.
    task = instance(repo)
    generation = ScriptedGeneration(renderer, [FLAIL, FLAIL], task.instance_id, prompt_key=0)
    env = make_environment("http://127.0.0.1:9", renderer, max_turns=5)
    runner = AgentRolloutRunner(generation, env, max_response_tokens=768, run_seed=RUN_SEED)
    rollout = asyncio.run(runner.run([task], num_samples=2, global_step=0, prompt_keys=[0]))
    assert rollout.sample_mask_B.tolist() == [0.0, 0.0]
    assert all(m["infra_error"] for m in rollout.result.metadata)
    assert rollout.metrics()["env/agent/num_infra_errors"] == 2.0


def test_context_limit_ends_the_episode(tmp_path, repo, renderer):
    task = instance(repo)
    prompt_length = len(renderer.initial_prompt_ids("x"))
    generation = ScriptedGeneration(
        renderer, [[render_tool_call(FIX[0])] * 4] * 2, task.instance_id, prompt_key=3
    )
    config = executor_config(tmp_path)

    async def scenario():
        async with running_server(config, pipeline_score_fn(config.pipeline)) as server:
            # Room for the prompt, one turn and little more: the file view does not fit.
            env = make_environment(
                server.url, renderer, max_turns=4, max_episode_tokens=prompt_length + 400
            )
            runner = AgentRolloutRunner(
                generation, env, max_response_tokens=1024, run_seed=RUN_SEED
            )
            return await runner.run([task], num_samples=2, global_step=2, prompt_keys=[3])

    rollout = asyncio.run(scenario())
    for meta, sample in zip(rollout.result.metadata, rollout.samples):
        assert meta["episode_end"] == "context_limit"
        assert len(sample.prompt_token_ids) + len(sample.response_token_ids) <= prompt_length + 400
    assert rollout.rewards_B.tolist() == [-1.0 + TURN_PENALTY] * 2


def test_episode_sample_is_one_generation_sample(renderer):
    # The composite sample keeps GenerationSample's invariants (a mask per response token).
    with pytest.raises(AssertionError, match="response_mask"):
        GenerationSample(
            prompt_index=0,
            sample_index=0,
            prompt_token_ids=(1,),
            response_token_ids=(2, 3),
            response_logprobs=(0.0, 0.0),
            response_text="",
            finish_reason="stop",
            stop_reason=None,
            weight_versions=(0,),
            oldest_weight_version=0,
            engine_index=0,
            response_mask=(1,),
        )


class FailingGeneration(ScriptedGeneration):
    """Sample 1's second turn fails as a dead engine would; sample 0's turns are slow."""

    async def generate(self, prompts, num_samples, *, sampling_overrides=None, seeds=None):
        turn, text = self.by_seed[seeds[0][0]]
        if text == "FAIL":
            raise RuntimeError("the engine died")
        await asyncio.sleep(0.5)
        async for sample in super().generate(
            prompts, num_samples, sampling_overrides=sampling_overrides, seeds=seeds
        ):
            yield sample


def test_an_engine_failure_ends_the_round_and_closes_every_session(tmp_path, repo, renderer):
    task = instance(repo)
    view = render_tool_call(FIX[0])
    generation = FailingGeneration(
        renderer, [[view] * 5, [view, "FAIL"]], task.instance_id, prompt_key=1
    )
    config = executor_config(tmp_path)

    async def scenario():
        async with running_server(config, pipeline_score_fn(config.pipeline)) as server:
            env = make_environment(server.url, renderer, max_turns=5)
            runner = AgentRolloutRunner(
                generation, env, max_response_tokens=1280, run_seed=RUN_SEED
            )
            with pytest.raises(RuntimeError, match="the engine died"):
                await runner.run([task], num_samples=2, global_step=0, prompt_keys=[1])
            return server.executor.sessions.num_open

    # The episode still running was cancelled and closed its session, not left to the reaper.
    assert asyncio.run(scenario()) == 0
