"""Tests of the master config: recipes, overrides, paths, bad configs naming the key."""

import dataclasses
import pathlib
import re

import pytest
import yaml

from dockyard_rl.algorithms import grpo_config
from dockyard_rl.algorithms.grpo_config import (
    MasterConfig,
    config_to_dict,
    config_to_yaml,
    describe_config,
    load_config,
    master_config_from_dict,
)
from dockyard_rl.data_plane.config import DataPlaneConfig
from dockyard_rl.rewards.shaping import IntegrityStageConfig
from dockyard_rl.utils.config_loading import ConfigError, apply_overrides

# python/dockyard_rl/algorithms/<this file> -> the workspace root (also in Bazel's runfiles tree).
WORKSPACE = pathlib.Path(__file__).absolute().parents[3]
RECIPES = sorted((WORKSPACE / "configs").glob("*.yaml"))

# The smallest valid recipe: a training file and a prompt budget that fits the default context.
MINIMAL = {"data": {"train_path": "/data/tasks.jsonl", "prompt": {"max_context_tokens": 1024}}}


def _with(**sections):
    raw = {section: dict(values) for section, values in MINIMAL.items()}
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section].update(values)
        else:
            raw[section] = values
    return raw


def _write(tmp_path, raw, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def _error(raw_or_text, tmp_path, overrides=()):
    path = _write(tmp_path, raw_or_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, base_dir=tmp_path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message
    return message


# -- the recipes in configs/


def test_the_recipes_exist():
    names = {path.name for path in RECIPES}
    assert {
        "smoke_cpu.yaml",
        "smoke_cpu_async.yaml",
        "qwen2.5-coder-7b_swe_gym.yaml",
        "qwen2.5-coder-32b_swe_smith.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_every_recipe_loads_and_round_trips(recipe, tmp_path):
    config = load_config(recipe, base_dir=WORKSPACE)
    assert config.grpo.run_name == recipe.stem
    # What --dry-run prints loads back to the same config.
    resolved = _write(tmp_path, config_to_yaml(config), "resolved.yaml")
    assert config_to_dict(load_config(resolved, base_dir=tmp_path)) == config_to_dict(config)


def test_smoke_recipes():
    sync = load_config(WORKSPACE / "configs/smoke_cpu.yaml", base_dir=WORKSPACE)
    asyn = load_config(WORKSPACE / "configs/smoke_cpu_async.yaml", base_dir=WORKSPACE)
    assert (sync.grpo.mode, asyn.grpo.mode) == ("sync", "async")
    assert asyn.loss_fn.use_importance_sampling_correction
    for config in (sync, asyn):
        assert config.policy.model == "smollm2-135m-instruct"  # a zoo name stays a name
        assert config.policy.dp_size == 1 and config.generation.num_engines == 1
        assert config.generation.kv_cache_memory_bytes == 256 << 20
        assert config.generation.enforce_eager
        assert config.data_plane is None
        # A fresh clone: the data is a cache the loop fills from the synthesis section.
        assert config.synthesis is not None
        assert pathlib.Path(config.data.train_path) == (
            pathlib.Path.home() / ".cache/dockyard_rl/data/smoke_swe/tasks.jsonl"
        )
        assert config.logger.log_dir == str(WORKSPACE / "results")
        assert config.executor is not None and config.executor.port == 0
    assert sync.executor.work_dir != asyn.executor.work_dir


@pytest.mark.parametrize(
    "name", ["qwen2.5-coder-7b_swe_gym.yaml", "qwen2.5-coder-32b_swe_smith.yaml"]
)
def test_gpu_recipes(name):
    config = load_config(WORKSPACE / "configs" / name, base_dir=WORKSPACE)
    assert config.weight_sync.transport == "collective"
    # Groups reach the trainer through Ray's object store: the loop does not use a data plane
    # yet, and setup warns when the section is set.
    assert config.data_plane is None
    assert config.policy.dp_size > 1 and config.generation.num_engines > 1
    assert config.executor is None
    # The model directory need not exist here: dry runs validate the recipe only.
    assert not pathlib.Path(config.policy.model).exists()


# -- bad configs fail naming the key


def test_unknown_key_names_the_section_and_lists_valid_keys(tmp_path):
    message = _error(_with(grpo={"num_prompt_per_step": 2}), tmp_path)
    assert "grpo: unknown key(s) 'num_prompt_per_step'" in message
    assert "num_prompts_per_step" in message  # the valid keys are listed


def test_unknown_nested_key(tmp_path):
    message = _error(_with(policy={"optimizer": {"lr": 0.1}}), tmp_path)
    assert "policy.optimizer: unknown key(s) 'lr'; valid keys: " in message


def test_unknown_section(tmp_path):
    message = _error(_with(grpoo={"val_period": 1}), tmp_path)
    assert "unknown section(s) 'grpoo'; valid sections: grpo, policy," in message


@pytest.mark.parametrize(
    "section, values, expected",
    [
        (
            "policy",
            {"micro_batch_size": "four"},
            "policy.micro_batch_size: expected an integer, got str 'four'",
        ),
        (
            "policy",
            {"optimizer": {"learning_rate": "1e-6x"}},
            "policy.optimizer.learning_rate: expected a number, got str '1e-6x' (write numbers "
            "unquoted",
        ),
        (
            "policy",
            {"activation_checkpointing": "yes please"},
            "policy.activation_checkpointing: expected true or false",
        ),
        ("grpo", {"val_num_prompts": 2.5}, "grpo.val_num_prompts: expected an integer or null"),
        (
            "generation",
            {"max_tokens": True},
            "generation.max_tokens: expected an integer, got bool",
        ),
        (
            "cluster",
            {"fleets": {"trainer": {"strategy": 3}}},
            "cluster.fleets.trainer.strategy: expected a string, got int 3",
        ),
        (
            "data_plane",
            {"max_in_flight_batches": "many"},
            "data_plane.max_in_flight_batches: expected an integer",
        ),
        ("grpo", [1, 2], "grpo: expected a mapping"),
    ],
)
def test_wrong_type_names_the_key(tmp_path, section, values, expected):
    assert expected in _error(_with(**{section: values}), tmp_path)


def test_async_without_importance_sampling_correction(tmp_path):
    message = _error(_with(grpo={"mode": "async"}), tmp_path)
    assert (
        "loss_fn.use_importance_sampling_correction: must be true when grpo.mode is async"
        in message
    )
    ok = _write(
        tmp_path,
        _with(grpo={"mode": "async"}, loss_fn={"use_importance_sampling_correction": True}),
    )
    assert load_config(ok).grpo.mode == "async"


def test_negative_val_period(tmp_path):
    assert "grpo.val_period: must be an integer >= 0" in _error(
        _with(grpo={"val_period": -1}), tmp_path
    )


def test_keep_top_k_without_metric_name(tmp_path):
    message = _error(_with(checkpointing={"keep_top_k": 2, "metric_name": None}), tmp_path)
    assert "checkpointing.keep_top_k" in message


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"grpo": {"max_rollout_turns": 0}}, "grpo.max_rollout_turns: must be an integer >= 1"),
        (
            {"grpo": {"max_rollout_turns": 4}, "env": {"agent": {"max_episode_tokens": 8192}}},
            "env.agent.max_episode_tokens: (8192) must be <= generation.max_model_len",
        ),
        (
            {
                "grpo": {"max_rollout_turns": 4},
                "env": {"agent": {"max_episode_tokens": 2048, "max_turn_tokens": 1000}},
            },
            "env.agent.max_turn_tokens: (1000) must be <= generation.max_tokens (512)",
        ),
        (
            {"rewards": {"stages": [{"type": "turn_limit"}]}},
            "rewards.stages[0]: is a turn_limit stage but grpo.max_rollout_turns is 1",
        ),
        ({"grpo": {"mode": "pipelined"}}, "grpo.mode: must be one of sync, async"),
        ({"grpo": {"num_generations_per_prompt": 1}}, "grpo.num_generations_per_prompt"),
        (
            {
                "grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 2},
                "policy": {"dp_size": 4},
            },
            "policy.dp_size: (4) must divide the samples per step, grpo.num_prompts_per_step x "
            "grpo.num_generations_per_prompt = 6",
        ),
        (
            {"data": {"train_path": "/t.jsonl", "prompt": {"max_context_tokens": 1800}}},
            "data.prompt.max_context_tokens: (1800) + generation.max_tokens (512) must be below "
            "generation.max_model_len (2048)",
        ),
        (
            {
                "loss_fn": {"reference_kl_coef": 0.01},
                "grpo": {"skip_reference_policy_logprobs": True},
            },
            "grpo.skip_reference_policy_logprobs: cannot be true while loss_fn.reference_kl_coef",
        ),
        ({"grpo": {"val_period": 5}}, "grpo.val_period: validation is on"),
        ({"grpo": {"val_at_end": True}}, "data has no validation split"),
        (
            {"generation": {"model": "tiny-llama"}},
            "generation.model: ('tiny-llama') must be the policy's model",
        ),
        (
            {"generation": {"dtype": "bfloat16"}},
            "generation.dtype: (bfloat16) must equal policy.dtype (float32)",
        ),
        ({"generation": {"temperature": 0}}, "generation.temperature: is 0 (greedy)"),
        (
            {
                "grpo": {"mode": "async", "num_prompts_per_step": 8},
                "loss_fn": {"use_importance_sampling_correction": True},
                "async_grpo": {"max_buffer_groups": 4},
            },
            "async_grpo.max_buffer_groups: (4) must be >=",
        ),
        (
            {"rewards": {"stages": [{"type": "overlong", "threshold": 600}]}},
            "rewards.stages[0].threshold: (600) must be below generation.max_tokens (512)",
        ),
        ({"rewards": {"stages": [{"type": "overlong"}]}}, "rewards.stages[0]"),
        (
            {"executor": {"port": 9191}},
            "env.swe.executor_url: (http://127.0.0.1:9090) must point "
            "at the executor the loop starts",
        ),
        ({"executor": {"auth_token": "x" * 32}}, "executor.auth_token: must be null in a recipe"),
        (
            {
                "synthesis": {"packages": ["xmltodict==1.0.4"]},
                "data": {"train_path": "/d/train.jsonl"},
            },
            "data.train_path: (/d/train.jsonl) must be <folder>/tasks.jsonl",
        ),
        ({"synthesis": {"packages": []}}, "synthesis.packages: must be a non-empty list"),
        (
            {"warm_start": {"train_path": "/w/train.jsonl", "synthesis": {"packages": ["x==1"]}}},
            "warm_start.train_path: (/w/train.jsonl) must be <folder>/tasks.jsonl when the "
            "warm_start.synthesis section",
        ),
        (
            {"warm_start": {"train_path": "/w/tasks.jsonl", "synthesis": {"packages": []}}},
            "warm_start.synthesis.packages: must be a non-empty list",
        ),
        ({"warm_start": {"num_epochs": 2}}, "warm_start.train_path: is required"),
        (
            {"warm_start": {"train_path": "/w/tasks.jsonl", "batch_size": 0}},
            "warm_start.batch_size: must be an integer >= 1",
        ),
        ({"grpo": {"run_name": "a/b"}}, "grpo.run_name: must be 1-100 letters"),
        (
            {"policy": {"logprob_temperature": 0.7}},
            "policy.logprob_temperature: (0.7) must equal generation.temperature (1.0)",
        ),
    ],
)
def test_inconsistent_configs_name_the_key(tmp_path, sections, expected):
    assert expected in _error(_with(**sections), tmp_path)


def test_consistent_variants_of_the_checks_pass(tmp_path):
    raw = _with(
        grpo={"val_period": 5},
        data={"validation_fraction": 0.2},
        executor={"port": 9090},
        synthesis={"packages": ["x==1"]},
        rewards={"stages": [{"type": "integrity"}, {"type": "overlong", "threshold": 256}]},
        loss_fn={"reference_kl_coef": 0.01},
    )
    config = load_config(_write(tmp_path, raw), base_dir=tmp_path)
    assert config.executor.port == 9090 and config.synthesis.packages == ("x==1",)
    assert isinstance(config.rewards.stages[0], IntegrityStageConfig)


def test_the_trainer_takes_the_sampling_temperature(tmp_path):
    config = load_config(
        _write(tmp_path, _with(generation={"temperature": 0.7})), base_dir=tmp_path
    )
    assert config.policy.logprob_temperature == 0.7
    # The resolved config states it, and it loads back.
    resolved = _write(tmp_path, config_to_yaml(config), "resolved.yaml")
    assert load_config(resolved, base_dir=tmp_path).policy == config.policy


def test_yaml_errors_name_the_file_and_line(tmp_path):
    message = _error("grpo:\n  val_period: [1\n", tmp_path)
    assert "not valid YAML (line 3" in message
    assert "must hold a mapping of sections" in _error("- 1\n", tmp_path)
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the config file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_12_floats(tmp_path):
    path = _write(
        tmp_path,
        "data: {train_path: /t.jsonl, prompt: {max_context_tokens: 1024}}\n"
        "policy: {optimizer: {learning_rate: 3e-6}}\n"
        "grpo: {advantage: {epsilon: 1e-8}}\n",
    )
    config = load_config(path)
    assert config.policy.optimizer.learning_rate == 3e-6
    assert config.grpo.advantage.epsilon == 1e-8


def test_empty_file_means_defaults(tmp_path):
    # The defaults alone lack the one required key.
    assert "data.train_path: is required" in _error("", tmp_path)


# -- overrides


def test_overrides_set_nested_keys_as_yaml_values(tmp_path):
    path = _write(tmp_path, MINIMAL)
    config = load_config(
        path,
        [
            "grpo.max_num_steps=7",
            "policy.optimizer.learning_rate=2e-6",
            "grpo.val_at_end=true",
            "data.validation_fraction=0.25",
            "generation.stop=['</s>', END]",
            "generation.seed=null",
            "cluster.node.resources.sandbox_slot=8",
            "rewards.stages=[{type: integrity}]",
            "grpo.run_name=my-run",
        ],
        base_dir=tmp_path,
    )
    assert config.grpo.max_num_steps == 7 and config.grpo.val_at_end is True
    assert config.policy.optimizer.learning_rate == 2e-6
    assert config.generation.stop == ("</s>", "END") and config.generation.seed is None
    assert config.cluster.node.resources == {"sandbox_slot": 8}
    assert config.rewards.stages == (IntegrityStageConfig(),)
    assert config.grpo.run_name == "my-run"


def test_later_overrides_win(tmp_path):
    config = load_config(_write(tmp_path, MINIMAL), ["grpo.seed=1", "grpo.seed=2"])
    assert config.grpo.seed == 2


def test_overrides_switch_optional_sections(tmp_path):
    path = _write(tmp_path, MINIMAL)
    on = load_config(path, ["data_plane.tensor_transport=nccl"])
    assert on.data_plane == DataPlaneConfig(tensor_transport="nccl")
    off = load_config(
        _write(tmp_path, _with(data_plane={"transport": "ray_direct"})), ["data_plane=null"]
    )
    assert off.data_plane is None


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "grpo.val_perod=1",
            "grpo.val_perod: no key 'val_perod' in grpo; valid keys: num_prompts_per_step",
        ),
        ("polcy.dp_size=2", "no key 'polcy' in the top level; valid keys: grpo, policy"),
        ("policy.optimizer.lr=1", "no key 'lr' in policy.optimizer; valid keys: learning_rate"),
        ("grpo.seed.x=1", "grpo.seed is a value (<class 'int'>), it has no key 'x'"),
        ("grpo.seed", "expected KEY=VALUE"),
        ("grpo..seed=1", "expected KEY=VALUE"),
        ("grpo.seed=[1", "override 'grpo.seed=[1': not valid YAML"),
    ],
)
def test_bad_overrides_name_the_key(tmp_path, override, expected):
    message = _error(MINIMAL, tmp_path, [override])
    assert expected in message


def test_bad_override_value_names_the_override(tmp_path):
    message = _error(MINIMAL, tmp_path, ["grpo.val_period=-2"])
    assert re.search(
        r"grpo\.val_period: must be an integer >= 0 .* \(set by the override "
        r"'grpo\.val_period=-2'\)$",
        message,
    )


# -- paths


def test_relative_paths_resolve_against_the_base_dir(tmp_path):
    raw = _with(
        data={"train_path": "data/tasks.jsonl", "validation_path": "~/val.jsonl"},
        logger={"log_dir": "results"},
        checkpointing={"checkpoint_dir": "ckpt"},
        executor={"port": 0, "work_dir": "exec"},
        policy={"model": "models/m"},
        generation={"model": "models/m"},
    )
    config = load_config(_write(tmp_path, raw), base_dir=tmp_path / "ws")
    assert config.data.train_path == str(tmp_path / "ws/data/tasks.jsonl")
    assert config.data.validation_path == str(pathlib.Path.home() / "val.jsonl")
    assert config.logger.log_dir == str(tmp_path / "ws/results")
    assert config.executor.work_dir == str(tmp_path / "ws/exec")
    assert config.policy.model == config.generation.model == str(tmp_path / "ws/models/m")
    # Relative checkpoint directories live in the run directory (utils/checkpoint.py).
    assert config.checkpointing.checkpoint_dir == "ckpt"


def test_the_workspace_root(tmp_path, monkeypatch):
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    (tmp_path / "repo/configs").mkdir(parents=True)
    (tmp_path / "repo/WORKSPACE").write_text("")
    path = _write(tmp_path / "repo/configs", _with(logger={"log_dir": "results"}))
    assert load_config(path).logger.log_dir == str(tmp_path / "repo/results")
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(tmp_path / "elsewhere"))
    assert load_config(path).logger.log_dir == str(tmp_path / "elsewhere/results")


# -- building without a file, describing


def test_master_config_from_dict():
    config = master_config_from_dict(_with(data_plane={"tensor_transport": "nccl"}))
    assert config.data_plane.tensor_transport == "nccl"
    assert config.grpo.run_name is None  # only load_config knows a file name
    assert master_config_from_dict(_with(data_plane=None)).data_plane is None
    with pytest.raises(ConfigError, match=r"^<config>: grpo\.val_period"):
        master_config_from_dict(_with(grpo={"val_period": -1}))


def test_direct_construction_runs_the_cross_checks():
    base = master_config_from_dict(MINIMAL)
    with pytest.raises(ValueError, match="loss_fn.use_importance_sampling_correction"):
        dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, mode="async"))


def test_frozen():
    config = master_config_from_dict(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.grpo = None


def test_describe_config_lists_every_section_and_key():
    text = describe_config()
    for field in dataclasses.fields(MasterConfig):
        assert re.search(rf"^{field.name}:  \(", text, re.M), field.name
    for line in (
        "grpo.val_period: int = 0",
        'grpo.mode: str = "sync"',
        "loss_fn.use_importance_sampling_correction: bool = false",
        "async_grpo.max_trajectory_age_steps: int = 1",
        'data_plane.tensor_transport: str = "gloo"',
        "checkpointing.keep_top_k: int | None = 3",
        'env.swe.executor_url: str = "http://127.0.0.1:9090"',
        'cluster.fleets.inference.strategy: str = "PACK"',
        'logger.wandb.mode: str = "offline"',
    ):
        assert f"  {line}\n" in text, line
    assert "data_plane:  (DataPlaneConfig, dockyard_rl.data_plane.config)  null by default" in text
    assert "executor.num_workers: int = " in text and "(computed on this machine)" in text
    assert "(the defaults alone are not valid: data.train_path: is required" in text


def test_every_key_path_in_describe_is_overridable(tmp_path):
    # Each listed key is a valid override path (values are the listed defaults).
    keys = re.findall(
        r"^  ([a-z_.]+): .* = (.*?)(?:  \(computed on this machine\))?$", describe_config(), re.M
    )
    assert len(keys) > 100
    for key, _ in keys:
        apply_overrides(MasterConfig, {}, [f"{key}=null"])
    assert grpo_config.PATH_KEYS  # every path key is a listed key
    listed = {key for key, _ in keys}
    assert set(grpo_config.PATH_KEYS + grpo_config.MODEL_KEYS) <= listed


# -- a key set where its path of the loop never reads it fails to load (UNREAD_UNLESS)

_LOOPBACK_EXECUTOR = {"port": 0}


@pytest.mark.parametrize(
    "sections, key, fix",
    [
        ({"async_grpo": {"max_buffer_groups": 64}}, "async_grpo", "grpo.mode: async"),
        (
            {"cluster": {"fleets": {"sandbox": {"strategy": "SPREAD"}}}},
            "cluster.fleets.sandbox",
            "set the executor section",
        ),
        (
            {"executor": _LOOPBACK_EXECUTOR, "env": {"swe": {"executor_url": "http://h:1"}}},
            "env.swe.executor_url",
            "fixed port",
        ),
        ({"env": {"agent": {"max_turn_tokens": 64}}}, "env.agent", "grpo.max_rollout_turns > 1"),
    ],
)
def test_a_key_nothing_reads_fails_naming_it_and_the_fix(tmp_path, sections, key, fix):
    message = _error(_with(**sections), tmp_path)
    assert f": {key}: is set but nothing reads it: " in message
    assert fix in message


def test_the_same_keys_load_where_they_are_read(tmp_path):
    config = load_config(
        _write(
            tmp_path,
            _with(
                grpo={"mode": "async"},
                loss_fn={"use_importance_sampling_correction": True},
                async_grpo={"max_buffer_groups": 64},
                executor=_LOOPBACK_EXECUTOR,
                cluster={"fleets": {"sandbox": {"strategy": "STRICT_SPREAD"}, "trainer": {}}},
            ),
        ),
        base_dir=tmp_path,
    )
    assert config.async_grpo.max_buffer_groups == 64
    assert config.cluster.fleets.sandbox.strategy == "STRICT_SPREAD"


def test_the_trainer_fleet_is_read_with_the_jax_policy(tmp_path):
    # The jax policy is a trainer-fleet actor (models/policy/jax_fleet.py): the section applies.
    recipe = _with(
        policy={"backend": "jax"}, cluster={"fleets": {"trainer": {"strategy": "STRICT_PACK"}}}
    )
    config = load_config(_write(tmp_path, recipe), base_dir=tmp_path)
    assert config.cluster.fleets.trainer.strategy == "STRICT_PACK"


def test_the_resolved_config_leaves_out_what_is_not_read(tmp_path):
    # A sync recipe without an executor section: what --dry-run prints loads back.
    recipe = _with(logger={"log_dir": str(tmp_path)})
    config = load_config(_write(tmp_path, recipe), base_dir=tmp_path)
    resolved = config_to_dict(config)
    assert "async_grpo" not in resolved and "sandbox" not in resolved["cluster"]["fleets"]
    assert "trainer" in resolved["cluster"]["fleets"] and "executor_url" in resolved["env"]["swe"]
    again = load_config(
        _write(tmp_path, config_to_yaml(config), "resolved.yaml"), base_dir=tmp_path
    )
    assert config_to_dict(again) == resolved


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"data_plane": {"transport": "in_memory"}}, "data_plane.transport: must be ray_direct"),
        (
            {"data_plane": {}, "policy": {"backend": "jax"}},
            "data_plane: is set but policy.backend is jax",
        ),
    ],
)
def test_async_experience_over_the_data_plane_is_checked_at_load(tmp_path, sections, expected):
    # Async GRPO sends experience collector -> dtensor ranks (async_grpo.py); sync keeps the
    # driver path whatever the section says.
    raw = _with(grpo={"mode": "async"}, loss_fn={"use_importance_sampling_correction": True})
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    assert expected in _error(raw, tmp_path)
    assert load_config(_write(tmp_path, _with(data_plane={})), base_dir=tmp_path).data_plane


def test_async_experience_over_the_data_plane_loads(tmp_path):
    raw = _with(
        grpo={"mode": "async"},
        loss_fn={"use_importance_sampling_correction": True},
        data_plane={"transport": "ray_direct"},
    )
    config = load_config(_write(tmp_path, raw), base_dir=tmp_path)
    assert config.data_plane.transport == "ray_direct"
    # Several optimizer steps per batch: the ranks split their shards by the driver's plan.
    raw["grpo"]["num_epochs"] = 2
    config = load_config(_write(tmp_path, raw), base_dir=tmp_path)
    assert config.data_plane and config.grpo.optimizer_steps_per_step > 1
