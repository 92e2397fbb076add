"""The whole training recipe as one frozen dataclass: `MasterConfig`, and the `grpo` section.

A recipe (configs/*.yaml) has one top-level key per section; each section is the config dataclass
of the package that owns it, so its defaults and per-key checks live there and nowhere else:

| section         | dataclass (module)                                                        |
|-----------------|---------------------------------------------------------------------------|
| `grpo`          | GRPOConfig (here); `grpo.advantage`: AdvantageConfig (advantages.py)      |
| `policy`        | PolicyConfig (models/policy/config.py)                                    |
| `generation`    | GenerationConfig (models/generation/config.py)                            |
| `loss_fn`       | ClippedPGLossConfig (loss_functions.py)                                   |
| `async_grpo`    | AsyncGRPOConfig (async_utils/replay_buffer.py); read in async mode only   |
| `data`          | DataConfig (data/config.py)                                               |
| `synthesis`     | TaskSynthesisConfig (data/synthesis/task_synthesis.py); null = off        |
| `env`           | EnvConfig (here): `env.swe` SweEnvironmentConfig and `env.agent`          |
|                 | AgentEnvironmentConfig (environments/config.py)                           |
| `rewards`       | RewardShapingConfig (rewards/shaping.py)                                  |
| `executor`      | ExecutorConfig (sandbox/config.py); null = use a running executor         |
| `cluster`       | ClusterConfig (cluster/config.py)                                         |
| `weight_sync`   | WeightSyncConfig (weight_sync/config.py)                                  |
| `data_plane`    | DataPlaneConfig (data_plane/config.py); null = the in-memory path         |
| `checkpointing` | CheckpointingConfig (utils/checkpoint.py)                                 |
| `logger`        | LoggerConfig (utils/logger.py)                                            |
| `warm_start`    | WarmStartConfig (warm_start.py); null = off                               |

`load_config(path, overrides)` reads the YAML, applies command-line overrides `a.b.c=value`,
makes relative paths absolute against the workspace root and builds the dataclasses; every
error is a `ConfigError` (a ValueError) that starts with the file and names the full dotted key.
The generic steps (YAML 1.2 floats, type checks against the annotations before a section
validates, overrides, the workspace root, printing back, --help) are utils/config_loading.py's;
this module holds the schema and what only a GRPO recipe knows.
`MasterConfig.__post_init__` holds the checks that span sections (async mode needs importance
sampling, the batch must split over the data-parallel ranks, prompts must fit the context, ...).
Every key a recipe sets takes effect. Some are read only on one path of the loop; setting one on
the other path is a ConfigError naming the key and the fix (`UNREAD_UNLESS`): `async_grpo` with
`grpo.mode: sync`, `cluster.fleets.sandbox` with `executor: null` (the executors then run
outside the loop, behind `env.swe.executor_url`), and `env.swe.executor_url` with
`executor.port: 0` (the loop points the environment at the executor it starts).
configs/recipe_keys_test.py checks that every key of every recipe is read by product code.
`describe_config()` lists every key with its type and default (the launcher's --help);
`config_to_dict` / `config_to_yaml` give the resolved config back (what --dry-run prints and
what a checkpoint stores).

Relative paths (`PATH_KEYS`, and `policy.model` / `generation.model` unless they are zoo names)
are resolved against the workspace root (config_loading.workspace_root: $BUILD_WORKSPACE_DIRECTORY
under `bazel run`, else the folder above the config file holding WORKSPACE or MODULE.bazel, else
the current directory); `~` is expanded. Nothing checks here that a path exists: the GPU recipes
name cluster paths, and `grpo.run` checks (or creates) what it needs at setup. The run directory
is `<logger.log_dir>/<grpo.run_name>` (`run_name` defaults to the recipe's file name); a relative
`checkpointing.checkpoint_dir` lives inside it (CheckpointingConfig.resolve_dir).

Not covered: several environments at once (`env` has only `swe`), list indices in overrides
(`rewards.stages=[...]` replaces the whole list), and cross-checks that need the model or the
machine (vocabulary, GPU count): those fail at setup, before the first step.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import typing
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from dockyard_rl.algorithms.advantages import AdvantageConfig
from dockyard_rl.algorithms.async_utils.replay_buffer import AsyncGRPOConfig
from dockyard_rl.algorithms.warm_start import WarmStartConfig
from dockyard_rl.cluster.config import ClusterConfig
from dockyard_rl.data.config import DataConfig
from dockyard_rl.data.synthesis.task_synthesis import TaskSynthesisConfig
from dockyard_rl.data_plane.config import DataPlaneConfig
from dockyard_rl.environments.config import AgentEnvironmentConfig, SweEnvironmentConfig
from dockyard_rl.losses.loss_functions import ClippedPGLossConfig
from dockyard_rl.models import zoo
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.policy.config import PolicyConfig
from dockyard_rl.rewards.shaping import (
    OverlongStageConfig,
    RewardShapingConfig,
    TurnLimitStageConfig,
)
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.utils.checkpoint import CheckpointingConfig
from dockyard_rl.utils.config import is_int, is_number, require, require_bool
from dockyard_rl.utils.config_loading import (
    ConfigError,
    apply_overrides,
    blame_override,
    describe_sections,
    one_line,
    read_yaml_mapping,
    resolve_paths,
    sections_from_dict,
    to_plain_data,
    workspace_root,
)
from dockyard_rl.utils.logger import LoggerConfig
from dockyard_rl.weight_sync.config import WeightSyncConfig

__all__ = [
    "EnvConfig",
    "GRPOConfig",
    "MasterConfig",
    "TaskSynthesisConfig",
    "config_to_dict",
    "config_to_yaml",
    "describe_config",
    "load_config",
    "master_config_from_dict",
]

MODES = ("sync", "async")
# Keys holding file-system paths, made absolute at load time (module docstring).
# Not `checkpointing.checkpoint_dir`: a relative one lives inside the run directory
# (<logger.log_dir>/<grpo.run_name>, CheckpointingConfig.resolve_dir).
PATH_KEYS = (
    "data.train_path",
    "data.validation_path",
    "logger.log_dir",
    "executor.work_dir",
    "executor.db_path",
    "executor.pipeline.cache_dir",
    "warm_start.train_path",
)
# A zoo name or a local checkpoint directory: resolved like a path unless it is a zoo name.
MODEL_KEYS = ("policy.model", "generation.model")
# The file the task synthesizer writes into its output folder.
SYNTHESIZED_TASKS_FILE = "tasks.jsonl"
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


# Keys read on one path of the loop only: (dotted key, is it read under this config?, why not and
# the fix). A recipe that sets the key where it is not read fails to load (module docstring).
UNREAD_UNLESS: tuple[tuple[str, typing.Callable[[MasterConfig], bool], str], ...] = (
    (
        "async_grpo",
        lambda config: config.grpo.mode == "async",
        "only the asynchronous loop reads it, and grpo.mode is sync; remove the section or "
        "set grpo.mode: async",
    ),
    (
        "cluster.fleets.sandbox",
        lambda config: config.executor is not None,
        "executor is null: the executors run outside the loop (env.swe.executor_url names "
        "them), so no sandbox fleet is placed; remove it, or set the executor section so the "
        "loop starts the sandbox fleet",
    ),
    (
        "env.agent",
        lambda config: config.grpo.max_rollout_turns > 1,
        "grpo.max_rollout_turns is 1: single-shot rollouts have no agent episodes; remove the "
        "section or set grpo.max_rollout_turns > 1",
    ),
    (
        "env.swe.executor_url",
        lambda config: config.executor is None or config.executor.port != 0,
        "executor.port is 0: the loop points the environment at the executor it starts on a "
        "free port; remove env.swe.executor_url, or give executor a fixed port",
    ),
)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """YAML section `grpo`: the loop's shape (steps, batch, validation, mode)."""

    num_prompts_per_step: int = 32
    # Rollouts per prompt: the group GRPO's baseline is computed over (>= 2).
    num_generations_per_prompt: int = 8
    # 1: single-shot (one response, a patch, per rollout). > 1: a multi-turn agent that works in
    # an executor session with tools for up to this many model turns (environments/agent_env.py,
    # limits in env.agent).
    max_rollout_turns: int = 1
    max_num_steps: int = 100
    # Validate every this many steps on the held-out split; 0 = never (except the
    # val_at_start / val_at_end runs).
    val_period: int = 0
    val_at_start: bool = False
    val_at_end: bool = False
    val_num_prompts: int | None = None  # null = the whole validation split
    val_temperature: float = 0.0  # 0 = greedy
    # Samples per validation task (n): pass_at_1 and pass_at_<n> (validation.py); n > 1 needs
    # val_temperature > 0 (greedy samples are identical).
    val_num_samples: int = 1
    seed: int = 0  # the driver's RNGs (random, numpy, torch) at setup
    # Skip the reference policy's forward pass; only valid with loss_fn.reference_kl_coef = 0.
    skip_reference_policy_logprobs: bool = False
    # sync: generate -> score -> train in lock step. async: a trajectory collector generates and
    # scores into the replay buffer (section async_grpo) while the trainer consumes.
    mode: str = "sync"
    # Names the run directory <logger.log_dir>/<run_name> (metrics, checkpoints); keep it stable
    # across a resume. null = the recipe file's name without .yaml (load_config fills it in).
    run_name: str | None = None
    # PPO-style mini-batches (algorithms/mini_batches.py): samples per optimizer step, null = the
    # whole batch. Must divide num_samples_per_step and be a multiple of policy.dp_size.
    train_mini_batch_size: int | None = None
    # Passes over each rollout batch. A step makes ceil(B / train_mini_batch_size) * num_epochs
    # optimizer steps, all against the log-probs of the weights the step began with: every one
    # after the first is off-policy, which is what makes loss_fn's clip bind.
    num_epochs: int = 1
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)

    def __post_init__(self) -> None:
        for key, minimum, hint in (
            ("num_prompts_per_step", 1, ""),
            (
                "num_generations_per_prompt",
                2,
                " (the group baseline needs at least 2 samples per prompt)",
            ),
            ("max_num_steps", 1, ""),
            ("val_period", 0, " (0 = no periodic validation)"),
        ):
            value = getattr(self, key)
            require(
                is_int(value) and value >= minimum,
                key,
                f"must be an integer >= {minimum}{hint}, got {value!r}",
            )
        require(
            is_int(self.max_rollout_turns) and self.max_rollout_turns >= 1,
            "max_rollout_turns",
            f"must be an integer >= 1 (1 = single-shot, more = a multi-turn agent), got "
            f"{self.max_rollout_turns!r}",
        )
        require_bool(self, "val_at_start", "val_at_end", "skip_reference_policy_logprobs")
        require(
            self.val_num_prompts is None
            or (is_int(self.val_num_prompts) and self.val_num_prompts >= 1),
            "val_num_prompts",
            f"must be an integer >= 1 or null (= the whole validation "
            f"split), got {self.val_num_prompts!r}",
        )
        require(
            is_number(self.val_temperature) and self.val_temperature >= 0,
            "val_temperature",
            f"must be a number >= 0 (0 = greedy), got {self.val_temperature!r}",
        )
        require(
            is_int(self.val_num_samples) and self.val_num_samples >= 1,
            "val_num_samples",
            f"must be an integer >= 1, got {self.val_num_samples!r}",
        )
        require(
            self.val_num_samples == 1 or self.val_temperature > 0,
            "val_num_samples",
            f"is {self.val_num_samples} but grpo.val_temperature is 0 (greedy): every sample "
            "of a task would be the same; set grpo.val_temperature > 0 (e.g. 0.7) for pass@k, "
            "or grpo.val_num_samples: 1 for greedy validation",
        )
        require(
            is_int(self.seed) and self.seed >= 0,
            "seed",
            f"must be an integer >= 0, got {self.seed!r}",
        )
        require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        require(
            self.run_name is None
            or (isinstance(self.run_name, str) and bool(_RUN_NAME.fullmatch(self.run_name))),
            "run_name",
            f"must be 1-100 letters, digits, '.', '_' or '-' (it names a folder), "
            f"or null (= the recipe's file name), got {self.run_name!r}",
        )
        require(
            is_int(self.num_epochs) and self.num_epochs >= 1,
            "num_epochs",
            f"must be an integer >= 1 (passes over each rollout batch), got {self.num_epochs!r}",
        )
        mini = self.train_mini_batch_size
        require(
            mini is None or (is_int(mini) and mini >= 1 and self.num_samples_per_step % mini == 0),
            "train_mini_batch_size",
            f"must be null (the whole batch) or an integer >= 1 that divides the samples per "
            f"step, num_prompts_per_step x num_generations_per_prompt = "
            f"{self.num_samples_per_step}, got {mini!r}",
        )

    @property
    def num_samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer (and LR-scheduler) steps per trainer step on a full batch."""
        mini = self.train_mini_batch_size or self.num_samples_per_step
        return self.num_samples_per_step // mini * self.num_epochs

    @property
    def validation_enabled(self) -> bool:
        return self.val_period > 0 or self.val_at_start or self.val_at_end


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """YAML section `env`: the environment(s) rollouts are scored in (today the SWE one)."""

    swe: SweEnvironmentConfig = dataclasses.field(default_factory=SweEnvironmentConfig)
    # The multi-turn agent's episode limits; read when grpo.max_rollout_turns > 1.
    agent: AgentEnvironmentConfig = dataclasses.field(default_factory=AgentEnvironmentConfig)


@dataclasses.dataclass(frozen=True)
class MasterConfig:
    """The whole recipe (module docstring). Build it with `load_config` or
    `master_config_from_dict`; constructing it directly runs the cross-section checks too."""

    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    loss_fn: ClippedPGLossConfig = dataclasses.field(default_factory=ClippedPGLossConfig)
    async_grpo: AsyncGRPOConfig = dataclasses.field(default_factory=AsyncGRPOConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    synthesis: TaskSynthesisConfig | None = None
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    rewards: RewardShapingConfig = dataclasses.field(default_factory=RewardShapingConfig)
    executor: ExecutorConfig | None = None
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    data_plane: DataPlaneConfig | None = None
    checkpointing: CheckpointingConfig = dataclasses.field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = dataclasses.field(default_factory=LoggerConfig)
    warm_start: WarmStartConfig | None = None

    def __post_init__(self) -> None:
        grpo, policy, generation, loss_fn = self.grpo, self.policy, self.generation, self.loss_fn
        if grpo.mode == "async":
            require(
                loss_fn.use_importance_sampling_correction,
                "loss_fn.use_importance_sampling_correction",
                "must be true when grpo.mode is async: the trainer learns from samples up to "
                "async_grpo.max_trajectory_age_steps old, and only the importance weights "
                "correct for that; set it to true or use grpo.mode: sync",
            )
            require(
                self.async_grpo.max_buffer_groups >= grpo.num_prompts_per_step,
                "async_grpo.max_buffer_groups",
                f"({self.async_grpo.max_buffer_groups}) must be >= "
                f"grpo.num_prompts_per_step ({grpo.num_prompts_per_step}): one step samples "
                "that many groups from the buffer",
            )
        if self.data_plane is not None and grpo.mode == "async":
            self._check_data_plane(self.data_plane)
        require(
            grpo.num_samples_per_step % policy.dp_size == 0,
            "policy.dp_size",
            f"({policy.dp_size}) must divide the samples per step, grpo.num_prompts_per_step"
            f" x grpo.num_generations_per_prompt = {grpo.num_samples_per_step}: every "
            "data-parallel rank trains on the same number of samples",
        )
        require(
            grpo.train_mini_batch_size is None or grpo.train_mini_batch_size % policy.dp_size == 0,
            "grpo.train_mini_batch_size",
            f"({grpo.train_mini_batch_size}) must be a multiple of policy.dp_size "
            f"({policy.dp_size}): every data-parallel rank trains on the same number of samples "
            "in each optimizer step",
        )
        require(
            grpo.num_generations_per_prompt == 1 or generation.temperature > 0,
            "generation.temperature",
            "is 0 (greedy): every rollout of a group would be the "
            "same, so every advantage is 0; use > 0 for training (grpo.val_temperature sets "
            "validation's)",
        )
        context = self.data.prompt.max_context_tokens
        require(
            # A multi-turn agent's prompt shows no code (its tools do): _check_agent instead.
            grpo.max_rollout_turns > 1
            or context + generation.max_tokens < generation.max_model_len,
            "data.prompt.max_context_tokens",
            f"({context}) + generation.max_tokens ({generation.max_tokens}) must be below "
            f"generation.max_model_len ({generation.max_model_len}): the code context alone "
            "could fill the context window (the issue text and instructions come on top); "
            "lower one of the first two or raise max_model_len",
        )
        if loss_fn.reference_kl_coef > 0:
            require(
                not grpo.skip_reference_policy_logprobs,
                "grpo.skip_reference_policy_logprobs",
                f"cannot be true while loss_fn.reference_kl_coef is {loss_fn.reference_kl_coef}"
                ": the KL penalty needs the reference log-probs; set the coefficient to 0 or "
                "this to false",
            )
        if policy.logprob_temperature is None:
            # The trainer's log-probs must be of the distribution the rollouts were sampled from.
            object.__setattr__(
                self,
                "policy",
                dataclasses.replace(policy, logprob_temperature=float(generation.temperature)),
            )
        else:
            require(
                policy.logprob_temperature == generation.temperature,
                "policy.logprob_temperature",
                f"({policy.logprob_temperature}) must equal generation.temperature "
                f"({generation.temperature}): the trainer's log-probs are of the distribution "
                "the rollouts were sampled from; leave it out and the loop sets it",
            )
        require(
            policy.model == generation.model,
            "generation.model",
            f"({generation.model!r}) must be the policy's model (policy.model: "
            f"{policy.model!r}): the engine receives the policy's weights",
        )
        require(
            policy.dtype == generation.dtype,
            "generation.dtype",
            f"({generation.dtype}) must equal policy.dtype ({policy.dtype}): weight sync sends "
            "the policy's tensors as they are",
        )
        if grpo.validation_enabled:
            require(
                self.data.validation_path is not None or self.data.validation_fraction > 0,
                "grpo.val_period",
                "validation is on (val_period > 0, val_at_start or "
                "val_at_end) but the data has no validation split; set "
                "data.validation_fraction or data.validation_path, or turn validation off",
            )
        self._check_rewards()
        self._check_agent()
        self._check_checkpointing()
        self._check_executor()
        self._check_synthesis()

    def _check_data_plane(self, data_plane: DataPlaneConfig) -> None:
        """`data_plane` set in async mode: the collector actor sends each step's batch straight
        to the dtensor ranks (data_plane/experience.py). Sync mode generates in the driver, so
        its experience keeps the driver path whatever this section says (docs/algorithms.md).
        Mini-batches and epochs work on either path (the same plan: algorithms/mini_batches.py)."""
        require(
            data_plane.transport == "ray_direct",
            "data_plane.transport",
            f"must be ray_direct for the GRPO loop, got {data_plane.transport!r}: the "
            "collector actor and the trainer ranks are separate processes (in_memory connects "
            "one process only); data_plane: null keeps experience on the driver path",
        )
        require(
            self.policy.backend == "dtensor",
            "data_plane",
            f"is set but policy.backend is {self.policy.backend}: only the dtensor ranks "
            "receive experience over the data plane; set data_plane: null",
        )

    def _check_rewards(self) -> None:
        for index, stage in enumerate(self.rewards.stages):
            if isinstance(stage, OverlongStageConfig) and stage.threshold is not None:
                require(
                    stage.threshold < self.generation.max_tokens,
                    f"rewards.stages[{index}].threshold",
                    f"({stage.threshold}) must be below generation.max_tokens "
                    f"({self.generation.max_tokens}), or the penalty never applies",
                )

    def _check_agent(self) -> None:
        multi_turn = self.grpo.max_rollout_turns > 1
        for index, stage in enumerate(self.rewards.stages):
            require(
                multi_turn or not isinstance(stage, TurnLimitStageConfig),
                f"rewards.stages[{index}]",
                "is a turn_limit stage but grpo.max_rollout_turns is 1: it acts on multi-turn "
                "episodes only; remove it or set grpo.max_rollout_turns > 1",
            )
        if not multi_turn:
            return
        agent = self.env.agent
        require(
            agent.max_episode_tokens <= self.generation.max_model_len,
            "env.agent.max_episode_tokens",
            f"({agent.max_episode_tokens}) must be <= generation.max_model_len "
            f"({self.generation.max_model_len}): every turn is generated from the whole "
            "episode so far; lower it or raise max_model_len",
        )
        require(
            agent.max_turn_tokens <= self.generation.max_tokens,
            "env.agent.max_turn_tokens",
            f"({agent.max_turn_tokens}) must be <= generation.max_tokens "
            f"({self.generation.max_tokens}), the engines' per-request limit",
        )

    def _check_checkpointing(self) -> None:
        ckpt = self.checkpointing
        if ckpt.keep_top_k is not None:
            require(
                bool(ckpt.metric_name),
                "checkpointing.keep_top_k",
                f"is {ckpt.keep_top_k} but checkpointing.metric_name is not set: name the "
                "validation metric that ranks checkpoints, or set keep_top_k to null",
            )

    def _check_executor(self) -> None:
        executor = self.executor
        if executor is None:
            return
        require(
            executor.auth_token is None,
            "executor.auth_token",
            "must be null in a recipe (recipes are logged and saved with checkpoints); the "
            "executor the loop starts listens on a loopback address, where no token is needed",
        )
        if executor.port != 0:
            url = urllib.parse.urlsplit(self.env.swe.executor_url)
            require(
                url.hostname == executor.host.strip("[]") and url.port == executor.port,
                "env.swe.executor_url",
                f"({self.env.swe.executor_url}) must point at the "
                f"executor the loop starts (executor.host {executor.host}, executor.port "
                f"{executor.port}); or set executor.port: 0 (a free port, used automatically)",
            )

    def _check_synthesis(self) -> None:
        data = self.data
        checks = [
            (self.synthesis, "data", data.dataset, data.train_path, "train_path", "synthesis"),
            (
                data.validation_synthesis,
                "data",
                data.dataset,
                data.validation_path,
                "validation_path",
                "data.validation_synthesis",
            ),
        ]
        if self.warm_start is not None:
            checks.append(
                (
                    self.warm_start.synthesis,
                    "warm_start",
                    self.warm_start.dataset,
                    self.warm_start.train_path,
                    "train_path",
                    "warm_start.synthesis",
                )
            )
        for synthesis, section, dataset, train_path, path_key, name in checks:
            if synthesis is None:
                continue
            require(
                dataset == "jsonl",
                f"{section}.dataset",
                f"must be jsonl when the {name} section is set (it writes "
                f"{SYNTHESIZED_TASKS_FILE}), got {dataset!r}",
            )
            require(
                pathlib.PurePath(train_path or "").name == SYNTHESIZED_TASKS_FILE,
                f"{section}.{path_key}",
                f"({train_path}) must be <folder>/"
                f"{SYNTHESIZED_TASKS_FILE} when the {name} section is set: the synthesizer "
                "writes that file into the folder",
            )


# ---------------------------------------------------------------------------------------------
# Building from YAML (the generic steps: utils/config_loading.py)


def master_config_from_dict(
    raw: Mapping[str, Any] | None, source: str = "<config>"
) -> MasterConfig:
    """Builds and validates a MasterConfig from parsed YAML (no path resolution, no overrides).

    Raises:
        ConfigError: `<source>: <dotted.key>: <message>` for an unknown section or key, a value
            of the wrong type, a bad value or an inconsistency between sections.
    """
    raw = {} if raw is None else raw
    try:
        config = MasterConfig(**sections_from_dict(MasterConfig, raw))
        _check_every_key_is_read(raw, config)
        return config
    except ValueError as error:
        raise ConfigError(f"{source}: {one_line(error)}") from None


def _check_every_key_is_read(raw: Mapping[str, Any], config: MasterConfig) -> None:
    """ValueError naming the first key of `raw` that `config`'s path of the loop never reads."""
    for key, is_read, why in UNREAD_UNLESS:
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None and not is_read(config):
            raise ValueError(f"{key}: is set but nothing reads it: {why}")


def load_config(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    base_dir: str | os.PathLike[str] | None = None,
) -> MasterConfig:
    """Reads the recipe at `path`, applies `overrides` (`a.b.c=value`), resolves relative paths
    against `base_dir` (default: `workspace_root(path)`) and validates everything.

    Raises:
        ConfigError: one line, starting with `path` and naming the full dotted key (and the
            override, when the bad value came from one).
    """
    source = str(path)
    raw = apply_overrides(MasterConfig, read_yaml_mapping(path), overrides, source)
    grpo = raw.setdefault("grpo", {}) if isinstance(raw.get("grpo", {}), dict) else None
    if grpo is not None and grpo.get("run_name") is None:
        grpo["run_name"] = pathlib.Path(path).stem
    resolve_paths(
        raw,
        PATH_KEYS + MODEL_KEYS,
        pathlib.Path(base_dir) if base_dir is not None else workspace_root(path),
        is_name=lambda key, value: key in MODEL_KEYS and value in zoo.ZOO_NAMES,
    )
    try:
        return master_config_from_dict(raw, source)
    except ConfigError as error:
        raise blame_override(error, source, overrides) from None


# ---------------------------------------------------------------------------------------------
# Printing


def config_to_dict(config: MasterConfig) -> dict[str, Any]:
    """Plain YAML-ready data (dicts, lists, scalars) for `config`; loading it back gives an equal
    config (config_loading.to_plain_data). `executor.auth_token`-style secrets are not
    special-cased because recipes may not hold them (MasterConfig checks). The keys its path of
    the loop does not read (`UNREAD_UNLESS`), which a recipe may not set, are left out."""
    result: dict[str, Any] = to_plain_data(config)
    for key, is_read, _ in UNREAD_UNLESS:
        if not is_read(config):
            *parents, leaf = key.split(".")
            node = result
            for part in parents:
                node = node[part]
            del node[leaf]
    return result


def config_to_yaml(config: MasterConfig) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)


def describe_config() -> str:
    """Every section and key of a recipe with its type and default (the launcher's --help)."""
    lines = [
        "Recipe sections and keys (type = default). Override any key as a.b.c=value (a YAML",
        "value). Relative paths are relative to the workspace root; ~ is expanded.",
    ]
    return "\n".join(lines + describe_sections(MasterConfig)) + "\n"
