"""Everything a GRPO run needs, built from one `MasterConfig`: `setup(config) -> GRPORun`.

Order (each step fails with the config key named before the next, heavier one starts):
data (synthesized first when `synthesis` is set and the task file is missing; the same for the
warm start's tasks, which must share no repository with the data) -> Ray (this
process is the driver: `cluster.bootstrap.init_ray`) -> the checkpoint to resume from, if any
-> the sandbox fleet (when `executor` is set) and the environment -> the policy (restored from
the checkpoint) -> the generation engines (started from the checkpoint's weights, at its weight
version) -> the weight synchronizer -> the logger (resumed at the checkpoint's step).

Resume: the newest complete checkpoint under `checkpointing.checkpoint_dir` decides. Its
`policy/` directory restores the policy (weights, optimizer, scheduler, per-rank RNG) and is
also the engines' model, so trainer and engines agree without a sync; its `trainer_state/`
restores the step, the weight version, the prompt sampler's position and the driver's RNG
streams. A run with no checkpoint starts at step 0 from `policy.model`.

`GRPORun.close()` shuts every fleet down (safe to repeat). Not covered here: the loops
(grpo.py), validation (validation.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import random
import shutil
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dockyard_rl.algorithms.agent_rollouts import AgentRolloutRunner
from dockyard_rl.algorithms.grpo_config import MasterConfig, config_to_dict, config_to_yaml
from dockyard_rl.algorithms.rollouts import RolloutRunner
from dockyard_rl.data import datasets
from dockyard_rl.data.config import load_train_validation
from dockyard_rl.data.prompt_sampler import PromptSampler
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.environments.agent_env import AgentEnvironment
from dockyard_rl.environments.agent_tools import ChatRenderer
from dockyard_rl.environments.config import SweEnvironmentConfig
from dockyard_rl.environments.swe_env import SweEnvironment
from dockyard_rl.losses.loss_functions import ClippedPGLossFn
from dockyard_rl.models import zoo
from dockyard_rl.models.generation.config import GenerationConfig
from dockyard_rl.models.generation.factory import create_generation
from dockyard_rl.models.generation.interfaces import GenerationInterface
from dockyard_rl.models.policy.factory import create_policy
from dockyard_rl.models.policy.interfaces import PolicyInterface
from dockyard_rl.rewards.shaping import RewardPipeline
from dockyard_rl.utils.checkpoint import CheckpointInfo, CheckpointManager
from dockyard_rl.utils.logger import Logger
from dockyard_rl.utils.training_state import RngState, TrainerState, load_trainer_state
from dockyard_rl.weight_sync.factory import create_weight_synchronizer
from dockyard_rl.weight_sync.interfaces import WeightSynchronizer

if TYPE_CHECKING:  # imported where a run starts a sandbox fleet (_sandbox), not for every run
    from dockyard_rl.sandbox.fleet import SandboxFleet

logger = logging.getLogger(__name__)

POLICY_DIR = "policy"
TRAINER_STATE_DIR = "trainer_state"


@dataclasses.dataclass
class GRPORun:
    """The live parts of a run (module docstring); `step` is the last finished step. After
    `close()` the fleets (policy, generation, synchronizer, sandbox fleet) are shut down."""

    config: MasterConfig
    run_dir: pathlib.Path
    train: list[SweInstance]
    validation: list[SweInstance]
    policy: PolicyInterface
    generation: GenerationInterface
    environment: SweEnvironment
    runner: RolloutRunner | AgentRolloutRunner
    synchronizer: WeightSynchronizer
    loss_fn: ClippedPGLossFn
    logger: Logger
    checkpoints: CheckpointManager
    sampler: PromptSampler
    pad_token_id: int
    step: int = 0
    resumed: TrainerState | None = None
    sandbox_fleet: SandboxFleet | None = None  # None: the executors run outside the loop
    # The supervised warm start's tasks (warm_start.py); empty when `warm_start` is off.
    warm_start_instances: list[SweInstance] = dataclasses.field(default_factory=list)
    closed: bool = dataclasses.field(default=False, init=False)

    def close(self) -> None:
        """Shuts the fleets down; safe to repeat (only the first call closes them)."""
        if self.closed:
            return
        self.closed = True
        _close_parts({name: getattr(self, name) for name in _FLEET_PARTS})


# Closed in this order: the synchronizer's session first, the sandbox last.
_FLEET_PARTS = ("synchronizer", "generation", "policy", "sandbox_fleet")


def _close_parts(parts: dict[str, object]) -> None:
    for name in _FLEET_PARTS:
        value = parts.get(name)
        closer = getattr(value, "close", None) or getattr(value, "shutdown", None)
        if closer is not None:
            try:
                closer()
            except Exception as error:  # shutting down: log, go on with the rest
                logger.warning("closing the %s failed: %s", name, error)


def run_directory(config: MasterConfig) -> pathlib.Path:
    # load_config names a run after its recipe; a config built in code may leave it unset.
    return pathlib.Path(config.logger.log_dir) / (config.grpo.run_name or "run")


def ensure_task_data(config: MasterConfig) -> None:
    """Synthesizes a task set whose file is missing: `data.train_path` when `synthesis` is set,
    `data.validation_path` when `data.validation_synthesis` is, `warm_start.train_path` when
    `warm_start.synthesis` is."""
    wanted = [(config.data.train_path, config.synthesis, "synthesis", "data.train_path")]
    if config.data.validation_synthesis is not None:
        wanted.append(
            (
                config.data.validation_path,
                config.data.validation_synthesis,
                "data.validation_synthesis",
                "data.validation_path",
            )
        )
    if config.warm_start is not None:
        wanted.append(
            (
                config.warm_start.train_path,
                config.warm_start.synthesis,
                "warm_start.synthesis",
                "warm_start.train_path",
            )
        )
    for path, synthesis, section, path_key in wanted:
        train_path = pathlib.Path(path)
        if train_path.exists() or synthesis is None:
            continue
        from dockyard_rl.data.synthesis.synthesize_swe_tasks import synthesize

        logger.info(
            "no tasks at %s: synthesizing them from %s once (cached for later runs)",
            train_path,
            ", ".join(synthesis.packages),
        )
        status = synthesize(
            list(synthesis.packages),
            synthesis.search,
            train_path.parent,
            workers=synthesis.num_workers or os.cpu_count() or 1,
        )
        if status != 0 or not train_path.is_file():
            raise ValueError(
                f"{section}: making the task set {train_path} failed (status "
                f"{status}; the report is in {train_path.parent / 'report.json'}); "
                f"fix the packages in {section}.packages or point {path_key} at "
                "an existing task file"
            )


def setup(config: MasterConfig) -> GRPORun:
    """Builds a run (module docstring). Raises ValueError naming the key for a bad setup."""
    run_dir = run_directory(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    _seed_driver(config.grpo.seed)
    ensure_task_data(config)
    train, validation = load_train_validation(config.data)
    warm_start_instances = _warm_start_instances(config, train + validation)

    os.environ.setdefault("DOCKYARD_FLEET_ROLE", "driver")
    from dockyard_rl.cluster.bootstrap import init_ray

    init_ray(config.cluster, log_to_driver=False)
    checkpoints = CheckpointManager(config.checkpointing, config.checkpointing.resolve_dir(run_dir))
    latest = checkpoints.latest()
    resumed = load_trainer_state(latest.path / TRAINER_STATE_DIR) if latest else None
    # Before any fleet starts: a logger backend that is missing fails here.
    run_logger = Logger(config.logger, run_dir.name, total_steps=config.grpo.max_num_steps)

    parts: dict[str, object] = {}
    try:
        sandbox_fleet, env_config = _sandbox(config)
        parts["sandbox_fleet"] = sandbox_fleet
        # Executor task ids are (prefix, step, sample, instance): a prefix of its own per start
        # keeps a resumed step's new samples from colliding with a crashed attempt's tasks.
        env_config = dataclasses.replace(
            env_config, task_id_prefix=f"{env_config.task_id_prefix}-{uuid.uuid4().hex[:8]}"
        )
        environment = SweEnvironment(env_config, RewardPipeline(config.rewards))
        policy = create_policy(
            config.policy,
            resume_from=latest.path / POLICY_DIR if latest else None,
            cluster_config=config.cluster,
        )
        parts["policy"] = policy
        generation = create_generation(
            _engine_config(config, latest, policy, run_dir),
            cluster_config=config.cluster,
            initial_weight_version=resumed.weight_version if resumed else 0,
        )
        parts["generation"] = generation
        synchronizer = create_weight_synchronizer(config.weight_sync, policy, generation)
        parts["synchronizer"] = synchronizer
    except BaseException:
        _close_parts(parts)
        raise

    tokenizer = _tokenizer(config)
    processor = datasets.get_processor(config.data.processor)(tokenizer, config.data.prompt)
    runner: RolloutRunner | AgentRolloutRunner
    if config.grpo.max_rollout_turns > 1:
        # A multi-turn agent: episodes in executor sessions, final diffs scored by `environment`.
        agent = config.env.agent
        runner = AgentRolloutRunner(
            generation,
            AgentEnvironment(
                agent,
                environment,
                ChatRenderer(tokenizer, tool_format=agent.tool_format),
                max_rollout_turns=config.grpo.max_rollout_turns,
            ),
            max_response_tokens=config.grpo.max_rollout_turns * agent.max_turn_tokens,
            thinking_required=config.data.prompt.enable_thinking,
            run_seed=config.grpo.seed,
        )
    else:
        runner = RolloutRunner(
            generation,
            environment,
            processor,
            max_response_tokens=config.generation.max_tokens,
            thinking_required=config.data.prompt.enable_thinking,
            run_seed=config.grpo.seed,  # per-sample generation seeds (utils/seeding.py)
        )
    sampler = PromptSampler(len(train), config.grpo.num_prompts_per_step, config.data.seed)
    step = 0
    if resumed is not None:
        sampler.load_state_dict(resumed.sampler)
        resumed.rng.restore()
        step = resumed.step
    if resumed is not None:
        run_logger.resume_from(step)
    run_logger.log_hyperparams(config_to_dict(config))
    logger.info(
        "run %s: %d training / %d validation tasks, %s at step %d",
        run_dir.name,
        len(train),
        len(validation),
        "resuming" if resumed else "starting",
        step,
    )
    return GRPORun(
        config=config,
        run_dir=run_dir,
        train=train,
        validation=validation,
        policy=policy,
        generation=generation,
        environment=environment,
        runner=runner,
        synchronizer=synchronizer,
        loss_fn=ClippedPGLossFn(config.loss_fn),
        logger=run_logger,
        checkpoints=checkpoints,
        sampler=sampler,
        pad_token_id=int(tokenizer.pad_token_id or 0),
        step=step,
        resumed=resumed,
        sandbox_fleet=sandbox_fleet,
        warm_start_instances=warm_start_instances,
    )


def trainer_state(run: GRPORun, extras: dict[str, Any] | None = None) -> TrainerState:
    """What a checkpoint of `run` after its current step holds besides the policy."""
    return TrainerState(
        step=run.step,
        weight_version=run.synchronizer.trainer_version,
        sampler=run.sampler.state_dict(),
        rng=RngState.capture(),
        config_text=config_to_yaml(run.config),
        extras=extras or {},
    )


def _seed_driver(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _warm_start_instances(config: MasterConfig, data: list[SweInstance]) -> list[SweInstance]:
    """The warm start's tasks; a repository shared with the GRPO data is an error (it would show
    GRPO the answers to its own tasks)."""
    if config.warm_start is None:
        return []
    instances = datasets.get_dataset(config.warm_start.dataset)(config.warm_start.train_path)
    if not instances:
        raise ValueError(
            f"warm_start.train_path: {config.warm_start.train_path!r} holds no instances"
        )
    leaked = sorted({i.repo for i in instances} & {i.repo for i in data})
    if leaked:
        raise ValueError(
            f"warm_start.train_path: repositories {leaked[:5]} are also in the "
            "training or validation data; the warm start would show GRPO the "
            "answers to its own tasks. Use tasks of other repositories"
        )
    return instances


def _sandbox(config: MasterConfig) -> tuple[SandboxFleet | None, SweEnvironmentConfig]:
    """The executor the environment scores with: a sandbox fleet started here when `executor` is
    set (its URL goes into env.swe.executor_url), else the running one env.swe names."""
    if config.executor is None:
        return None, config.env.swe
    from dockyard_rl.sandbox.fleet import SandboxFleet

    fleet = SandboxFleet(config.executor, config.cluster)
    return fleet, dataclasses.replace(config.env.swe, executor_url=fleet.urls[0])


# Where a resumed run's engines start from when its checkpoint holds no HF export.
ENGINE_START_DIR = "engine_start"
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def _engine_config(
    config: MasterConfig,
    latest: CheckpointInfo | None,
    policy: PolicyInterface,
    run_dir: pathlib.Path,
) -> GenerationConfig:
    """The engines start from the resumed policy's weights: the checkpoint's HF export, or, for
    a checkpoint saved with `checkpointing.export_hf: false`, an export the restored policy
    writes now into `<run dir>/engine_start` (replaced at every such resume)."""
    if latest is None:
        return config.generation
    policy_dir = latest.path / POLICY_DIR
    if not any((policy_dir / name).is_file() for name in _HF_WEIGHTS):
        policy_dir = run_dir / ENGINE_START_DIR
        shutil.rmtree(policy_dir, ignore_errors=True)
        policy.export_hf(policy_dir)
    return dataclasses.replace(config.generation, model=str(policy_dir))


def _tokenizer(config: MasterConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(zoo.resolve_model(config.policy.model)))
