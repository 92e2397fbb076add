"""Config section `env.swe`: how the single-shot SWE environment reaches and uses the executor.

    env:
      swe:
        executor_url: http://127.0.0.1:9090
        max_concurrency: 64       # tasks in flight (submitted, not yet finished) per step
        request_timeout_s: 30     # one HTTP request to the executor
        task_timeout_s: 1800      # waiting for one task's verdict, queueing included
        poll_interval_s: 1.0      # how often a waiting task is polled
        max_infra_retries: 2      # extra tries per sample after an infrastructure error
        reward_mode: binary       # binary | pass_rate (the executor's raw reward)
        task_id_prefix: swe       # set one per run when several runs share an executor
        auth_token_env: DOCKYARD_EXECUTOR_TOKEN  # environment variable holding the bearer token

The executor's bearer token is never written in the config (configs are logged and committed):
`auth_token_env` names the environment variable that holds it; when that variable is unset or
empty, requests carry no token (right for an executor on 127.0.0.1 without one).

Build with `from_dict(SweEnvironmentConfig, yaml["env"]["swe"], "env.swe")`. Covered: the
values and their validation. Not covered: the executor's own settings (`executor` section).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from dockyard_rl.sandbox.task import RewardMode
from dockyard_rl.utils.config import is_int, is_number, require

__all__ = ["AgentEnvironmentConfig", "SweEnvironmentConfig"]

# Task ids the executor accepts are [A-Za-z0-9._-]{1,128}; the environment appends about 40
# characters (step, index, instance hash, retry generation) to the prefix.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _is_finite_number(value: Any) -> bool:
    # Stricter than utils.config.is_number: a timeout of NaN or inf is no timeout.
    return is_number(value) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class SweEnvironmentConfig:
    """See the module docstring for the keys."""

    executor_url: str = "http://127.0.0.1:9090"
    max_concurrency: int = 64
    request_timeout_s: float = 30.0
    task_timeout_s: float = 1800.0
    poll_interval_s: float = 1.0
    max_infra_retries: int = 2
    reward_mode: str = RewardMode.BINARY.value
    task_id_prefix: str = "swe"
    auth_token_env: str = "DOCKYARD_EXECUTOR_TOKEN"

    def __post_init__(self) -> None:
        require(
            isinstance(self.executor_url, str)
            and self.executor_url.startswith(("http://", "https://")),
            "executor_url",
            f"must be an http:// or https:// URL of the executor, e.g. "
            f"http://127.0.0.1:9090, got {self.executor_url!r}",
        )
        require(
            is_int(self.max_concurrency) and self.max_concurrency >= 1,
            "max_concurrency",
            f"must be an integer >= 1, got {self.max_concurrency!r}",
        )
        for name in ("request_timeout_s", "task_timeout_s", "poll_interval_s"):
            value = getattr(self, name)
            require(
                _is_finite_number(value) and value > 0,
                name,
                f"must be a number of seconds > 0, got {value!r}",
            )
        require(
            self.poll_interval_s <= self.task_timeout_s,
            "poll_interval_s",
            f"must be <= task_timeout_s ({self.task_timeout_s}), got {self.poll_interval_s}",
        )
        require(
            is_int(self.max_infra_retries) and self.max_infra_retries >= 0,
            "max_infra_retries",
            f"must be an integer >= 0 (0 = one try only), got {self.max_infra_retries!r}",
        )
        valid_modes = [mode.value for mode in RewardMode]
        require(
            self.reward_mode in valid_modes,
            "reward_mode",
            f"must be one of {valid_modes}, got {self.reward_mode!r}",
        )
        require(
            isinstance(self.task_id_prefix, str) and bool(_PREFIX_RE.match(self.task_id_prefix)),
            "task_id_prefix",
            f"must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit, got "
            f"{self.task_id_prefix!r}",
        )
        require(
            isinstance(self.auth_token_env, str)
            and bool(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.auth_token_env)),
            "auth_token_env",
            f"must be the name of an environment variable (the token "
            f"itself never goes in a config), got {self.auth_token_env!r}",
        )

    @property
    def auth_token(self) -> str | None:
        """The token from the environment variable `auth_token_env`, or None when unset."""
        return os.environ.get(self.auth_token_env) or None

    @property
    def reward_mode_enum(self) -> RewardMode:
        return RewardMode(self.reward_mode)


@dataclasses.dataclass(frozen=True)
class AgentEnvironmentConfig:
    """Config section `env.agent`: the multi-turn agent's episode limits (agent_env.py).

        env:
          agent:
            max_turn_tokens: 256          # tokens the model may generate in one turn
            max_episode_tokens: 4096      # prompt + every turn + every tool output
            max_observation_chars: 4000   # a tool output longer than this is cut (head kept)
            max_concurrent_episodes: 32   # episodes in flight, each holding an executor session
            tool_format: full             # full (JSON specs) | compact (a line per tool)

    The number of turns is `grpo.max_rollout_turns`; the executor's session budgets (tool calls,
    wall clock, CPU, output bytes) are the executor's `sessions` section. An episode whose next
    turn would not fit in `max_episode_tokens` ends there (`context_limit`), and is scored like
    one that ran out of turns. `max_episode_tokens` must fit the engines' `max_model_len`
    (checked with the whole recipe).
    """

    max_turn_tokens: int = 256
    max_episode_tokens: int = 4096
    max_observation_chars: int = 4000
    max_concurrent_episodes: int = 32
    tool_format: str = "full"

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_turn_tokens", 8),
            ("max_episode_tokens", 64),
            ("max_observation_chars", 100),
            ("max_concurrent_episodes", 1),
        ):
            value = getattr(self, name)
            require(
                is_int(value) and value >= minimum,
                name,
                f"must be an integer >= {minimum}, got {value!r}",
            )
        require(
            self.tool_format in ("full", "compact"),
            "tool_format",
            f"must be full (the tools as JSON function specs: a ~970-token SmolLM2 prompt) or "
            f"compact (one line per tool: ~320), got {self.tool_format!r}",
        )
        require(
            self.max_turn_tokens < self.max_episode_tokens,
            "max_turn_tokens",
            f"must be below max_episode_tokens ({self.max_episode_tokens}), got "
            f"{self.max_turn_tokens}",
        )
