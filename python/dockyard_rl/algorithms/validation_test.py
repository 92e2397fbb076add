"""Tests of validation: the pass@k estimator against brute force, the per-task outcome file and
the aggregates of `validate` (with a stand-in for the rollout runner: generation and scoring are
covered by rollouts' and the GRPO end-to-end tests), and the config errors of its keys."""

import asyncio
import itertools
import json
import types

import pytest
import torch

from dockyard_rl.algorithms import validation
from dockyard_rl.algorithms.grpo_config import GRPOConfig, master_config_from_dict
from dockyard_rl.algorithms.rollouts import Rollout
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.environments.interfaces import EnvironmentResult
from dockyard_rl.models.generation.interfaces import GenerationSample
from dockyard_rl.utils.config_loading import ConfigError


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    # Samples 0..c-1 are the correct ones; every k-subset is equally likely.
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_is_the_brute_force_probability():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert validation.pass_at_k(n, c, k) == pytest.approx(
                    _brute_force_pass_at_k(n, c, k), abs=1e-12
                ), (n, c, k)
    assert validation.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert validation.pass_at_k(200, 1, 100) == pytest.approx(0.5)  # large n: exact, no overflow


@pytest.mark.parametrize("n, c, k", [(3, 1, 0), (3, 1, 4), (3, 4, 1), (3, -1, 1), (0, 0, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        validation.pass_at_k(n, c, k)


def _instance(index: int) -> SweInstance:
    return SweInstance(
        instance_id=f"task-{index}",
        repo="/repos/r.git",
        base_commit="0" * 40,
        patch="",
        test_patch="",
        FAIL_TO_PASS=("tests/test_a.py::test_a",),
        PASS_TO_PASS=(),
        problem_statement="fix it",
    )


def _sample(prompt_index: int, sample_index: int) -> GenerationSample:
    return GenerationSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_token_ids=(1, 2),
        response_token_ids=(3, 4, 5),
        response_logprobs=(-0.1, -0.2, -0.3),
        response_text="```python\n```",
        finish_reason="stop",
        stop_reason=None,
        weight_versions=(7,),
        oldest_weight_version=7,
        engine_index=0,
    )


class _Runner:
    """Returns a fixed outcome per sample: `outcomes[task][sample]` is "resolved", "failed"
    (applied, tests fail), "invalid" (no patch) or "infra" (no verdict); records its call."""

    def __init__(self, outcomes):
        self.outcomes = outcomes
        self.calls = []

    async def run(self, instances, **kwargs):
        self.calls.append({"instances": list(instances), **kwargs})
        n = kwargs["num_samples"]
        outcomes = [o for task in self.outcomes[: len(instances)] for o in task]
        assert len(outcomes) == len(instances) * n
        reward = {"resolved": 1.0, "failed": 0.0, "invalid": -1.0, "infra": 0.0}
        metadata = tuple(
            {
                "resolved": o == "resolved",
                "task_id": None if o == "invalid" else "t",
                # As swe_env writes it: no patch, so nothing failed to apply (and no task id).
                "apply_failure": o == "infra",
                "parse_failure": "no_code_block" if o == "invalid" else None,
                "infra_error": "timeout" if o == "infra" else None,
            }
            for o in outcomes
        )
        result = EnvironmentResult(
            rewards_B=torch.tensor([reward[o] for o in outcomes]),
            sample_mask_B=torch.tensor([0.0 if o == "infra" else 1.0 for o in outcomes]),
            metadata=metadata,
            metrics={},
        )
        samples = [_sample(i // n, i % n) for i in range(len(outcomes))]
        return Rollout(list(instances), n, samples, result)


def _run(tmp_path, outcomes, step=10, **grpo):
    grpo = GRPOConfig(val_period=5, **grpo)
    return types.SimpleNamespace(
        config=types.SimpleNamespace(grpo=grpo),
        validation=[_instance(i) for i in range(len(outcomes))],
        runner=_Runner(outcomes),
        step=step,
        run_dir=tmp_path / "run",
    )


def test_validate_writes_per_task_outcomes_and_pass_at_k(tmp_path):
    outcomes = [
        ["resolved", "resolved", "failed"],
        ["invalid", "failed", "infra"],
        ["resolved", "resolved", "invalid"],
        ["infra", "infra", "infra"],
    ]
    run = _run(tmp_path, outcomes, val_num_samples=3, val_temperature=0.7)
    loop = asyncio.new_event_loop()
    try:
        metrics = validation.validate(run, loop)
    finally:
        loop.close()
    (call,) = run.runner.calls
    # n samples per task, sampled at val_temperature, seeded per (task index, sample) as "val".
    assert call["num_samples"] == 3 and call["purpose"] == "val"
    assert call["sampling_overrides"] == {"temperature": 0.7}
    assert list(call["prompt_keys"]) == [0, 1, 2, 3] and call["global_step"] == 10

    path = tmp_path / "run" / "validation" / "step_000010.jsonl"
    assert validation.validation_file(run.run_dir, 10) == path
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["task_index"], r["instance_id"]) for r in rows] == [
        (i, f"task-{i}") for i in range(4)
    ]
    assert all(r["step"] == 10 and r["num_samples"] == 3 for r in rows)
    assert [r["num_resolved"] for r in rows] == [2, 0, 2, 0]
    assert [r["num_scored"] for r in rows] == [3, 2, 3, 0]
    assert [r["num_applied"] for r in rows] == [3, 1, 2, 0]
    means = [r["reward_mean"] for r in rows]
    assert means == [pytest.approx(2 / 3), -0.5, pytest.approx(1 / 3), None]

    # resolve_rate: resolved samples of all samples (infra errors count as unresolved).
    assert metrics["resolve_rate"] == pytest.approx(4 / 12)
    assert metrics["pass_at_1"] == pytest.approx((2 / 3 + 0 + 2 / 3 + 0) / 4)
    assert metrics["pass_at_1"] == pytest.approx(metrics["resolve_rate"])
    assert metrics["pass_at_3"] == pytest.approx(2 / 4)  # tasks with a resolved sample
    # reward_mean: over the 8 scored samples only.
    assert metrics["reward_mean"] == pytest.approx((1 + 1 + 0 - 1 + 0 + 1 + 1 - 1) / 8)
    # apply_rate: patches that reached the sandbox and applied, of all samples; the same count
    # as the rows' num_applied (answers with no patch never applied).
    assert metrics["apply_rate"] == pytest.approx(sum(r["num_applied"] for r in rows) / 12)
    assert set(validation.VALIDATION_KEYS) <= set(metrics)


def test_greedy_validation_of_a_subset_reports_pass_at_1_only(tmp_path):
    outcomes = [["resolved"], ["failed"], ["resolved"]]
    run = _run(tmp_path, outcomes, step=0, val_num_prompts=2)
    loop = asyncio.new_event_loop()
    try:
        metrics = validation.validate(run, loop)
        first = (tmp_path / "run" / "validation" / "step_000000.jsonl").read_text()
        # A repeated validation of the same step (a resumed run) replaces the file.
        run.runner.outcomes = [["failed"], ["failed"]]
        validation.validate(run, loop)
    finally:
        loop.close()
    assert run.runner.calls[0]["sampling_overrides"] == {"temperature": 0.0}
    assert run.runner.calls[0]["num_samples"] == 1
    assert len(first.splitlines()) == 2  # val_num_prompts: the split's first tasks
    assert metrics["pass_at_1"] == metrics["resolve_rate"] == 0.5
    assert not any(key.startswith("pass_at_") and key != "pass_at_1" for key in metrics)
    again = (tmp_path / "run" / "validation" / "step_000000.jsonl").read_text().splitlines()
    assert [json.loads(line)["num_resolved"] for line in again] == [0, 0]
    assert not list((tmp_path / "run" / "validation").glob("*.partial"))


def test_greedy_with_several_samples_is_a_config_error_naming_the_keys():
    with pytest.raises(ValueError, match="val_num_samples.*val_temperature"):
        GRPOConfig(val_num_samples=4)
    with pytest.raises(ValueError, match="val_num_samples: must be an integer >= 1"):
        GRPOConfig(val_num_samples=0, val_temperature=0.7)
    assert GRPOConfig(val_num_samples=4, val_temperature=0.7).val_num_samples == 4
    raw = {
        "grpo": {"val_num_samples": 8},
        "data": {"train_path": "/data/tasks.jsonl", "prompt": {"max_context_tokens": 1024}},
    }
    with pytest.raises(ConfigError, match="grpo.val_num_samples: is 8 but grpo.val_temperature"):
        master_config_from_dict(raw, "recipe.yaml")


def test_a_synthesized_held_out_split_must_be_named_tasks_jsonl(tmp_path):
    # data.validation_synthesis writes <folder>/tasks.jsonl, so validation_path must name it.
    data = {
        "train_path": "/data/tasks.jsonl",
        "validation_path": str(tmp_path / "held_out.jsonl"),
        "validation_synthesis": {"packages": ["bundled:pocketmath"]},
        "prompt": {"max_context_tokens": 1024},
    }
    with pytest.raises(ConfigError, match="data.validation_path: .* must be <folder>/tasks.jsonl"):
        master_config_from_dict({"data": data}, "recipe.yaml")
    data["validation_path"] = str(tmp_path / "pocketmath" / "tasks.jsonl")
    config = master_config_from_dict({"data": data, "grpo": {"val_period": 5}}, "recipe.yaml")
    assert config.data.validation_synthesis.packages == ("bundled:pocketmath",)
