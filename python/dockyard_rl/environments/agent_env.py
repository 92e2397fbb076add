"""The multi-turn SWE agent environment: the policy works in an executor session (view, search,
replace, write_file, run_tests) over several turns, then submits; the session's final diff is
scored exactly like a single-shot patch.

Shape legend: B = samples (episodes) in the batch, T = tokens of one episode after its prompt.

    env = AgentEnvironment(agent_config, SweEnvironment(swe_config, pipeline), renderer,
                           max_rollout_turns=8)
    episode = await env.run_episode(spec, prompt_ids, generate_turn)   # one trajectory
    result = await env.step([episode.rollout(...) for ...], global_step=k)  # verdicts, rewards

An episode (`run_episode`): open a session for the task on the executor (its tree is the base
commit without the hidden tests), then per turn t = 0 .. max_rollout_turns - 1:

1. `generate_turn(context_ids, t, max_tokens)` samples the model's turn from the whole context
   so far (the prompt, every earlier turn's tokens as the engine produced them, every tool
   output), never re-tokenized: the trainer sees exactly the tokens the engine saw.
2. The turn's text is parsed for one tool call (`agent_tools.parse_tool_call`). `submit` ends the
   episode. A malformed call is answered with the parser's error message; a well-formed one runs
   in the session and its result (or the session's error message: bad path, no match, ...) is the
   observation. Neither is an exception: a bad call is the agent's mistake to learn from.
3. The observation, rendered as the chat template's tool message followed by the next assistant
   header (`ChatRenderer.observation_ids`), is appended with response mask 0 (not trained on) and
   log-prob 0.

The episode ends at `submit`, after the last allowed turn (`turn_limit`), when the next turn or
observation would not fit `max_episode_tokens` (`context_limit`), or when the session's budget is
spent (`budget`). Whatever way it ends, the session's diff against the base commit is taken and the
session closed. An empty diff is "no patch" (the invalid_action stage); any other diff is
submitted as a normal task, so the verdict comes from the hardened scoring path in a fresh
checkout with the hidden tests, every integrity check and the tamper detection - never from
anything the agent ran in its session.

Infrastructure errors (the executor unreachable, the session gone while the episode ran) are not
the agent's doing: the episode is marked `infra_error` and `step` masks it out of the loss
(sample_mask 0), as `SweEnvironment` does for a scoring failure. Every error the agent's own
actions cause is an observation or a verdict, never a mask.

`step(rollouts)` scores the episodes' diffs with the wrapped `SweEnvironment` (same task-id
idempotency, retries and reward pipeline; the `turn_limit` stage reads `episode_end`) and adds the
per-trajectory metadata: `turns` (model turns), `tool_calls`, `tool_errors` (malformed calls
and calls the session refused), `tests_run`, `episode_end`, `turn_weight_versions` (the weight
versions that generated each turn: with in-flight updates a later turn may come from newer
weights; the per-token engine log-probs carry the importance-sampling correction). Metrics
(`agent_metrics`, from the metadata: `Rollout.metrics()` computes them per round or group):
`env/agent/turns_mean`, `env/agent/tool_calls_mean`, `env/agent/tool_errors_mean`,
`env/agent/tests_run_mean`, `env/agent/policy_tokens_mean`, `env/agent/end_<reason>` (fraction
of episodes), `env/agent/num_infra_errors`, plus the wrapped environment's metrics.

Not covered: several tool calls in one turn (the first is refused with a message saying one per
turn), tool calls inside a thinking block, choosing among several executors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.environments.agent_tools import (
    ChatRenderer,
    ToolCall,
    ToolCallError,
    parse_tool_call,
    render_observation,
)
from dockyard_rl.environments.config import AgentEnvironmentConfig
from dockyard_rl.environments.interfaces import Environment, EnvironmentResult
from dockyard_rl.environments.swe_env import SweEnvironment, SweRollout
from dockyard_rl.models.generation.interfaces import GenerationSample
from dockyard_rl.rewards.outcome import EPISODE_ENDS
from dockyard_rl.sandbox.client import (
    ExecutorClient,
    ExecutorProtocolError,
    ExecutorRequestError,
    ExecutorUnavailableError,
)
from dockyard_rl.sandbox.task import TaskSpec

__all__ = ["AgentEnvironment", "AgentRollout", "Episode", "GenerateTurn", "agent_metrics"]

logger = logging.getLogger(__name__)

# (context token ids, turn index, max new tokens) -> the engine's sample of that turn.
GenerateTurn = Callable[[list[int], int, int], Awaitable[GenerationSample]]

# Fewer free tokens than this for the next turn: the episode ends (context_limit) rather than
# ask the model for a turn too short to hold a tool call.
_MIN_TURN_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Episode:
    """One finished trajectory.

    Attributes:
        sample: the whole episode as one sample: `prompt_token_ids` the initial prompt,
            `response_token_ids` (T,) every later token (turns and observations, in order),
            `response_logprobs` the engine's on policy tokens and 0.0 elsewhere, `response_mask`
            1 on policy tokens, `weight_versions` the union over turns, `oldest_weight_version`
            their minimum, `seed` the first turn's, `response_text` the turns' texts joined.
        patch: the session's final diff ("" when the agent changed nothing); None with
            `infra_error`.
        episode_end: one of `EPISODE_ENDS`, or "infra_error" (the episode could not be run to
            its end; never scored).
        turns, tool_calls, tool_errors, tests_run: counts (module docstring).
        turn_weight_versions: per turn, the versions that generated it.
        infra_error: why the episode could not be run to its end, or None.
    """

    sample: GenerationSample
    patch: str | None
    episode_end: str
    turns: int
    tool_calls: int
    tool_errors: int
    tests_run: int
    turn_weight_versions: tuple[tuple[int, ...], ...]
    infra_error: str | None = None

    def __post_init__(self) -> None:
        assert self.episode_end in (*EPISODE_ENDS, "infra_error"), self.episode_end
        assert (self.patch is None) == (self.infra_error is not None), (
            self.patch,
            self.infra_error,
        )

    @property
    def policy_tokens(self) -> int:
        mask = self.sample.response_mask
        return len(self.sample.response_token_ids) if mask is None else sum(mask)


@dataclasses.dataclass(frozen=True)
class AgentRollout:
    """One episode to score: the task (TaskSpec fields; patch and task_id are set by the
    environment) and the finished `Episode`."""

    instance: TaskSpec
    episode: Episode
    max_response_length: int = 1  # the policy-token budget (the overlong stage's reference)
    thinking_required: bool = False
    reference_patch: str = ""  # the gold patch, for the reference_similarity stage


class AgentEnvironment(Environment):
    """Runs episodes in executor sessions and scores them (module docstring).

    Args:
        config: the `env.agent` section.
        scorer: the single-shot environment that scores final diffs (its config names the
            executor, its reward pipeline shapes the verdicts).
        renderer: the chat rendering of the prompt, tool calls and observations.
        max_rollout_turns: `grpo.max_rollout_turns` (>= 1).
        client_factory: makes the executor client for sessions (default: the scorer's).
    """

    def __init__(
        self,
        config: AgentEnvironmentConfig,
        scorer: SweEnvironment,
        renderer: ChatRenderer,
        *,
        max_rollout_turns: int,
        client_factory: Callable[[], ExecutorClient] | None = None,
    ):
        if not isinstance(config, AgentEnvironmentConfig):
            raise ValueError(
                f"config: must be an AgentEnvironmentConfig, got {type(config).__name__}"
            )
        if isinstance(max_rollout_turns, bool) or not isinstance(max_rollout_turns, int):
            raise ValueError(f"max_rollout_turns: must be an int, got {max_rollout_turns!r}")
        if max_rollout_turns < 1:
            raise ValueError(f"max_rollout_turns: must be >= 1, got {max_rollout_turns}")
        self.config = config
        self.scorer = scorer
        self.renderer = renderer
        self.max_rollout_turns = max_rollout_turns
        self._client_factory = client_factory or scorer.client_factory
        # Each episode holds an executor session from its first turn to its last.
        self._episode_slots = asyncio.Semaphore(config.max_concurrent_episodes)

    async def run_episode(
        self,
        instance: TaskSpec,
        prompt_ids: Sequence[int],
        generate_turn: GenerateTurn,
        *,
        session_prefix: str = "episode",
    ) -> Episode:
        """Runs one episode of `instance` from `prompt_ids` (module docstring).

        Raises only what `generate_turn` raises (the engines' errors are the loop's to handle)
        and `ExecutorRequestError` for a session the executor refuses as malformed (a bad task,
        a wrong token: retrying cannot fix it). Executor outages become `infra_error`.
        """
        async with self._episode_slots:
            return await self._run_episode(instance, prompt_ids, generate_turn, session_prefix)

    async def _run_episode(
        self,
        instance: TaskSpec,
        prompt_ids: Sequence[int],
        generate_turn: GenerateTurn,
        session_prefix: str,
    ) -> Episode:
        session_id = f"{session_prefix}-{uuid.uuid4().hex[:16]}"
        state = _EpisodeState(list(prompt_ids))
        async with self._client_factory() as client:
            try:
                await client.open_session(instance, session_id)
            except (ExecutorUnavailableError, ExecutorProtocolError) as error:
                return state.failed(f"cannot open a session: {error}")
            try:
                end = await self._turns(client, session_id, state, generate_turn)
                patch = await client.session_diff(session_id)
            except (ExecutorUnavailableError, ExecutorProtocolError) as error:
                return state.failed(f"session {session_id} failed: {error}")
            except _GenerationAborted as error:  # shutdown or an abandoned round
                return state.failed(str(error))
            except ExecutorRequestError as error:
                if error.status != 404:
                    raise
                # Expired (idle past the executor's timeout while the engines were busy) or
                # lost with an executor restart: not the agent's doing.
                return state.failed(f"session {session_id} is gone: {error}")
            finally:
                try:
                    await client.close_session(session_id)
                except Exception as error:  # the executor's reaper removes it anyway
                    logger.warning("closing session %s failed: %s", session_id, error)
        return state.finish(end, patch, None)

    async def _turns(
        self,
        client: ExecutorClient,
        session_id: str,
        state: _EpisodeState,
        generate_turn: GenerateTurn,
    ) -> str:
        """Plays the turns; returns how the episode ended."""
        config = self.config
        for turn in range(self.max_rollout_turns):
            room = config.max_episode_tokens - len(state.context)
            if room < min(_MIN_TURN_TOKENS, config.max_turn_tokens):
                return "context_limit"
            sample = await generate_turn(
                list(state.context), turn, min(config.max_turn_tokens, room)
            )
            state.add_turn(sample)
            if sample.finish_reason == "abort":
                raise _GenerationAborted(f"turn {turn} was aborted by the engine")
            call = parse_tool_call(sample.response_text)
            if isinstance(call, ToolCall) and call.name == "submit":
                return "submit"
            if isinstance(call, ToolCallError):
                state.tool_errors += 1
                observation = render_observation(call)
            else:
                state.tool_calls += 1
                result = await client.call_tool(session_id, call.name, call.args)
                if call.name == "run_tests" and result.ok:
                    state.tests_run += 1
                if not result.ok:
                    state.tool_errors += 1
                if result.exhausted:
                    return "budget"
                observation = render_observation(result)
            if turn == self.max_rollout_turns - 1:
                return "turn_limit"  # no observation after the last turn: nothing would read it
            observation_ids = self.renderer.observation_ids(
                _cut(observation, config.max_observation_chars), sample.response_token_ids
            )
            if len(state.context) + len(observation_ids) + _MIN_TURN_TOKENS > (
                config.max_episode_tokens
            ):
                return "context_limit"
            state.add_observation(observation_ids)
        return "turn_limit"

    async def step(
        self, rollouts: Sequence[AgentRollout], *, global_step: int
    ) -> EnvironmentResult:
        """Scores the episodes' final diffs (module docstring); `Environment.step`'s contract."""
        for index, rollout in enumerate(rollouts):
            if not isinstance(rollout, AgentRollout):
                raise ValueError(
                    f"rollouts[{index}]: must be an AgentRollout, got {type(rollout).__name__}"
                )
        runnable = [i for i, r in enumerate(rollouts) if r.episode.infra_error is None]
        swe_rollouts = [_swe_rollout(rollouts[i]) for i in runnable]
        scored = await self.scorer.step(swe_rollouts, global_step=global_step)
        num = len(rollouts)
        rewards_B = torch.zeros(num, dtype=torch.float32)
        sample_mask_B = torch.zeros(num, dtype=torch.float32)
        metadata: list[dict[str, Any]] = [{} for _ in range(num)]
        for position, index in enumerate(runnable):
            rewards_B[index] = scored.rewards_B[position]
            sample_mask_B[index] = scored.sample_mask_B[position]
            metadata[index] = dict(scored.metadata[position])
        for index, rollout in enumerate(rollouts):
            episode = rollout.episode
            if episode.infra_error is not None:
                metadata[index] = {
                    "instance_id": rollout.instance.instance_id,
                    "task_id": None,
                    "resolved": None,
                    "infra_error": episode.infra_error,
                }
            metadata[index].update(
                turns=episode.turns,
                tool_calls=episode.tool_calls,
                tool_errors=episode.tool_errors,
                tests_run=episode.tests_run,
                episode_end=episode.episode_end,
                policy_tokens=episode.policy_tokens,
                turn_weight_versions=[list(v) for v in episode.turn_weight_versions],
            )
        # The per-trajectory aggregates (`agent_metrics`) are computed from the metadata by
        # `Rollout.metrics()`, so they survive async GRPO's split of a round into groups.
        return EnvironmentResult(rewards_B, sample_mask_B, tuple(metadata), dict(scored.metrics))


class _GenerationAborted(Exception):
    """A turn came back with finish_reason "abort": the episode cannot go on."""


class _EpisodeState:
    """The growing token context of one episode and its counters."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_length = len(prompt_ids)
        self.context = prompt_ids
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.texts: list[str] = []
        self.samples: list[GenerationSample] = []
        self.tool_calls = self.tool_errors = self.tests_run = 0

    def add_turn(self, sample: GenerationSample) -> None:
        self.samples.append(sample)
        self.context.extend(sample.response_token_ids)
        self.logprobs.extend(sample.response_logprobs)
        self.mask.extend([1] * len(sample.response_token_ids))
        self.texts.append(sample.response_text)

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self.context.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.mask.extend([0] * len(token_ids))

    def failed(self, infra_error: str) -> Episode:
        return self.finish("infra_error", None, infra_error)

    def finish(self, end: str, patch: str | None, infra_error: str | None) -> Episode:
        turns = self.samples
        versions = sorted({v for s in turns for v in s.weight_versions})
        first = turns[0] if turns else None
        sample = GenerationSample(
            prompt_index=first.prompt_index if first else 0,
            sample_index=first.sample_index if first else 0,
            prompt_token_ids=tuple(self.context[: self.prompt_length]),
            response_token_ids=tuple(self.context[self.prompt_length :]),
            response_logprobs=tuple(self.logprobs),
            response_text="\n".join(self.texts),
            finish_reason=turns[-1].finish_reason if turns else "abort",
            stop_reason=turns[-1].stop_reason if turns else None,
            weight_versions=tuple(versions),
            oldest_weight_version=min((s.oldest_weight_version for s in turns), default=0),
            engine_index=first.engine_index if first else 0,
            seed=first.seed if first else None,
            response_mask=tuple(self.mask),
        )
        return Episode(
            sample=sample,
            patch=patch,
            episode_end=end,
            turns=len(turns),
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tests_run=self.tests_run,
            turn_weight_versions=tuple(tuple(s.weight_versions) for s in turns),
            infra_error=infra_error,
        )


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    omitted = len(text) - max_chars
    return f"{text[:max_chars]}\n[... {omitted} more characters not shown]"


def _swe_rollout(rollout: AgentRollout) -> SweRollout:
    episode = rollout.episode
    has_change = bool(episode.patch and episode.patch.strip())
    return SweRollout(
        instance=rollout.instance,
        patch=episode.patch if has_change else None,
        invalid_reason=None if has_change else "empty_diff",
        response_text=episode.sample.response_text,
        response_length=episode.policy_tokens,
        max_response_length=rollout.max_response_length,
        thinking_required=rollout.thinking_required,
        episode_end=episode.episode_end,
        reference_patch=rollout.reference_patch,
    )


def agent_metrics(metadata: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The `env/agent/...` aggregates (module docstring) of episodes' metadata dicts; {} when
    none is a multi-turn episode's (no `episode_end` key)."""
    episodes = [m for m in metadata if "episode_end" in m]
    if not episodes:
        return {}
    count = len(episodes)
    metrics = {
        f"env/agent/{name}_mean": sum(m[name] for m in episodes) / count
        for name in ("turns", "tool_calls", "tool_errors", "tests_run", "policy_tokens")
    }
    for end in EPISODE_ENDS:
        metrics[f"env/agent/end_{end}"] = sum(m["episode_end"] == end for m in episodes) / count
    metrics["env/agent/num_infra_errors"] = float(
        sum(m["episode_end"] == "infra_error" for m in episodes)
    )
    return metrics
