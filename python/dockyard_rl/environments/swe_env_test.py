"""Tests of SweEnvironment against the real executor (HTTP on 127.0.0.1, real git, real pytest
under bubblewrap) scoring the toy repository from sandbox.testing_repos, with the real reward
pipeline ({integrity, invalid_action}). Infrastructure failures are real too: a closed port, and
a scoring function that raises (the executor's own INFRA_ERROR path)."""

import asyncio
import collections
import dataclasses
import socket
import threading

import pytest
import torch

from dockyard_rl.environments.config import SweEnvironmentConfig
from dockyard_rl.environments.swe_env import SweEnvironment, SweRollout
from dockyard_rl.rewards.outcome import SCREENING_CATEGORIES
from dockyard_rl.rewards.shaping import RewardPipeline, RewardShapingConfig
from dockyard_rl.sandbox import screening, testing_repos
from dockyard_rl.sandbox.client import ExecutorClient, ExecutorRequestError
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.pipeline import InfrastructureError
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task import ApplyMethod, FailureKind, TestOutcome, Verdict
from dockyard_rl.sandbox.task_executor import pipeline_score_fn
from dockyard_rl.utils.config import from_dict

PENALTY = -1.0


def make_pipeline() -> RewardPipeline:
    return RewardPipeline(
        from_dict(
            RewardShapingConfig,
            {"stages": [{"type": "integrity"}, {"type": "invalid_action", "penalty": PENALTY}]},
            "rewards",
        )
    )


def fast_client_factory(url: str):
    # Small backoffs: the unreachable-executor test must not sleep for the production delays.
    return lambda: ExecutorClient(
        url, request_timeout_s=5.0, max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02, seed=0
    )


def env_config(url: str, **overrides) -> SweEnvironmentConfig:
    values = dict(
        executor_url=url,
        max_concurrency=4,
        poll_interval_s=0.1,
        task_timeout_s=120.0,
        max_infra_retries=1,
    )
    values.update(overrides)
    return SweEnvironmentConfig(**values)


def rollout(repo, patch, invalid_reason=None, instance_id="toy__calc-1"):
    return SweRollout(
        instance=repo.spec("", instance_id=instance_id),
        patch=patch,
        invalid_reason=invalid_reason,
        response_text="...",
        response_length=10,
        max_response_length=100,
    )


def counting(score_fn):
    calls = collections.Counter()
    lock = threading.Lock()

    def wrapper(spec, work_root):
        with lock:
            calls[spec.task_id] += 1
        return score_fn(spec, work_root)

    return wrapper, calls


@pytest.fixture
def repo(tmp_path):
    return testing_repos.make_toy_repo(tmp_path / "toy")


def executor_config(tmp_path, **overrides) -> ExecutorConfig:
    return ExecutorConfig(
        port=0, num_workers=2, work_dir=str(tmp_path / "work"), max_infra_attempts=1, **overrides
    )


def test_rewards_metadata_and_idempotent_resubmission(tmp_path, repo):
    config = executor_config(tmp_path)
    score_fn, calls = counting(pipeline_score_fn(config.pipeline))
    held_out_edit = repo.patch_for(
        {
            "tests/test_ops.py": testing_repos.TEST_OPS_BASE
            + "\n\ndef test_extra():\n    assert True\n"
        }
    )
    rollouts = [
        rollout(repo, repo.gold_patch),
        rollout(repo, repo.wrong_patch),
        rollout(repo, repo.conflicting_patch),
        rollout(repo, None, invalid_reason="no diff block in the response"),
        rollout(repo, held_out_edit),
    ]

    async def scenario():
        async with running_server(config, score_fn) as server:
            env = SweEnvironment(env_config(server.url), make_pipeline())
            first = await env.step(rollouts, global_step=3)
            num_records = len(server.executor.all_records())
            again = await env.step(rollouts, global_step=3)  # a retried step
            return first, again, num_records, len(server.executor.all_records())

    first, again, num_records, num_records_after = asyncio.run(scenario())

    assert first.rewards_B.dtype == torch.float32 and first.sample_mask_B.dtype == torch.float32
    assert first.rewards_B.tolist() == [1.0, 0.0, PENALTY, PENALTY, 0.0]
    assert first.sample_mask_B.tolist() == [1.0] * 5
    gold, wrong, conflict, unparsed, hostile = first.metadata

    assert gold["resolved"] and gold["apply_method"] == "git_apply" and not gold["apply_failure"]
    assert set(gold["test_outcomes"]["FAIL_TO_PASS"].values()) == {"passed"}
    assert gold["raw_reward"] == 1.0 and gold["infra_error"] is None and gold["num_tries"] == 1

    assert not wrong["resolved"] and wrong["raw_reward"] == 0.0
    assert set(wrong["test_outcomes"]["FAIL_TO_PASS"].values()) == {"passed"}
    p2p = wrong["test_outcomes"]["PASS_TO_PASS"]
    assert p2p["tests/test_ops.py::test_sub[five minus three]"] == "failed"
    assert p2p["tests/test_ops.py::test_add"] == "passed"
    assert not wrong["invalid_action/triggered"] and not wrong["integrity/triggered"]

    assert conflict["apply_failure"] and conflict["apply_method"] == "failed"
    assert conflict["invalid_action/reason"] == "patch_not_applied"

    assert (
        unparsed["task_id"] is None and unparsed["parse_failure"] == "no diff block in the response"
    )
    assert unparsed["invalid_action/reason"] == "no_patch"

    assert hostile["integrity_violation"] == ["tests/test_ops.py"]
    assert hostile["integrity/violated_files"] == ("tests/test_ops.py",)
    assert hostile["integrity/triggered"] and not hostile["invalid_action/triggered"]
    assert hostile["apply_method"] == "not_attempted"

    assert first.metrics["env/num_infra_errors"] == 0.0
    assert first.metrics["env/num_parse_failures"] == 1.0
    assert first.metrics["env/num_resolved"] == 1.0

    # The parse failure was never submitted; the retried step scored nothing again.
    assert num_records == 4 and num_records_after == 4
    assert len(calls) == 4 and set(calls.values()) == {1}
    assert again.rewards_B.tolist() == first.rewards_B.tolist()
    assert [m["task_id"] for m in again.metadata] == [m["task_id"] for m in first.metadata]


def test_reference_similarity_pays_the_unresolved_patch_by_its_nearness_to_the_gold(tmp_path, repo):
    config = executor_config(tmp_path)
    stages = [
        {"type": "integrity"},
        {"type": "invalid_action", "penalty": PENALTY},
        {"type": "reference_similarity", "weight": 0.5},
    ]
    pipeline = RewardPipeline(from_dict(RewardShapingConfig, {"stages": stages}, "rewards"))
    rollouts = [
        dataclasses.replace(rollout(repo, patch), reference_patch=repo.gold_patch)
        for patch in (repo.gold_patch, repo.wrong_patch, repo.conflicting_patch)
    ]
    rollouts.append(rollout(repo, repo.wrong_patch))  # no reference patch: nothing paid

    async def scenario():
        async with running_server(config, pipeline_score_fn(config.pipeline)) as server:
            env = SweEnvironment(env_config(server.url), pipeline)
            return await env.step(rollouts, global_step=1)

    result = asyncio.run(scenario())
    gold, wrong, conflict, no_reference = result.metadata
    similarity = wrong["reference_similarity/similarity"]
    assert 0.0 < similarity < 1.0 and not wrong["resolved"]
    assert result.rewards_B.tolist() == pytest.approx([1.0, 0.5 * similarity, PENALTY, 0.0])
    assert gold["reference_similarity/similarity"] is None  # resolved: the verdict stands
    assert conflict["reference_similarity/similarity"] is None  # did not apply
    assert no_reference["reference_similarity/similarity"] is None
    assert result.metrics["env/reference_similarity/num_triggered"] == 1.0


def test_reward_mode_is_sent_to_the_executor(tmp_path, repo):
    config = executor_config(tmp_path)

    async def scenario():
        async with running_server(config) as server:
            env = SweEnvironment(env_config(server.url, reward_mode="pass_rate"), make_pipeline())
            return await env.step([rollout(repo, repo.wrong_patch)], global_step=0)

    result = asyncio.run(scenario())
    # 3 FAIL_TO_PASS pass; 4 of 5 PASS_TO_PASS pass (sub(5, 3) fails, sub(1, 1) is 0 either way).
    assert result.rewards_B.tolist() == [pytest.approx(7 / 8)]


def test_unreachable_executor_masks_submitted_samples(repo):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = SweEnvironment(env_config(url), make_pipeline(), client_factory=fast_client_factory(url))
    rollouts = [
        rollout(repo, repo.gold_patch),
        rollout(repo, repo.wrong_patch),
        rollout(repo, None, invalid_reason="empty response"),
    ]
    result = asyncio.run(env.step(rollouts, global_step=0))
    assert result.sample_mask_B.tolist() == [0.0, 0.0, 1.0]
    assert result.rewards_B.tolist() == [0.0, 0.0, PENALTY]  # the parse failure needs no executor
    for meta in result.metadata[:2]:
        assert meta["infra_error"].startswith("executor unavailable")
        assert meta["num_tries"] == 2  # 1 + max_infra_retries
        assert "reward" not in meta  # never shaped
    assert result.metrics["env/num_infra_errors"] == 2.0
    assert result.metrics["env/num_samples"] == 3.0


def test_executor_infra_error_is_retried_under_a_new_task_id(tmp_path, repo):
    config = executor_config(tmp_path)
    real_score = pipeline_score_fn(config.pipeline)

    def flaky(spec, work_root):  # the first submission of every sample fails on the executor
        if not spec.task_id.endswith("-r1"):
            raise InfrastructureError("disk full (simulated)")
        return real_score(spec, work_root)

    def broken(spec, work_root):
        raise InfrastructureError("disk full (simulated)")

    async def scenario(score_fn):
        async with running_server(config, score_fn) as server:
            env = SweEnvironment(env_config(server.url), make_pipeline())
            return await env.step([rollout(repo, repo.gold_patch)], global_step=1)

    recovered = asyncio.run(scenario(flaky))
    assert recovered.sample_mask_B.tolist() == [1.0] and recovered.rewards_B.tolist() == [1.0]
    assert recovered.metadata[0]["task_id"].endswith("-r1")
    assert recovered.metadata[0]["num_tries"] == 2

    config = dataclasses.replace(config, work_dir=str(tmp_path / "work2"))
    failed = asyncio.run(scenario(broken))
    assert failed.sample_mask_B.tolist() == [0.0] and failed.rewards_B.tolist() == [0.0]
    assert "disk full" in failed.metadata[0]["infra_error"]
    assert failed.metadata[0]["num_tries"] == 2 and failed.metadata[0]["task_id"].endswith("-r1")


def test_patch_refused_by_executor_is_an_invalid_action(tmp_path, repo):
    config = executor_config(tmp_path, max_patch_bytes=len(repo.test_patch.encode()) + 16)
    huge = repo.gold_patch + "\n" * (len(repo.test_patch) + 100)

    async def scenario():
        async with running_server(config) as server:
            env = SweEnvironment(env_config(server.url), make_pipeline())
            result = await env.step([rollout(repo, huge)], global_step=0)
            return result, len(server.executor.all_records())

    result, num_records = asyncio.run(scenario())
    assert result.rewards_B.tolist() == [PENALTY] and result.sample_mask_B.tolist() == [1.0]
    assert "max_patch_bytes" in result.metadata[0]["patch_rejected"]
    assert num_records == 0


def test_failure_kind_and_screening_flags_reach_metadata_metrics_and_rewards(tmp_path, repo):
    # The executor's documented seam (an injected score function) returns verdicts as the
    # pipeline writes them for these cases; the HTTP service, client, environment and reward
    # pipeline are real.
    tampered = "diff --git a/tampered b/tampered\n"
    resolved_flagged = "diff --git a/argv b/argv\n"
    failed = "diff --git a/failed b/failed\n"
    verdicts = {
        tampered: (
            False,
            FailureKind.TAMPERING,
            "the must-fail canary passed",
            ("forced_exit: os._exit", "exit_hook: atexit"),
        ),
        resolved_flagged: (True, FailureKind.NONE, "", ("process_arguments: sys.argv",)),
        failed: (False, FailureKind.TESTS_FAILED, "tests/test_ops.py::test_mul failed", ()),
    }

    def score(spec, work_root):
        resolved, kind, detail, flags = verdicts[spec.patch]
        outcome = TestOutcome.PASSED if resolved else TestOutcome.FAILED
        return Verdict(
            resolved=resolved,
            reward=float(resolved),
            fail_to_pass={t: outcome for t in spec.fail_to_pass},
            pass_to_pass={t: TestOutcome.PASSED for t in spec.pass_to_pass},
            apply_method=ApplyMethod.GIT_APPLY,
            integrity_violation=(),
            test_exit_code=0 if resolved else 1,
            timed_out=False,
            timings_s={"total": 0.0},
            log_tail="",
            failure_kind=kind,
            failure_detail=detail,
            screening_flags=flags,
        )

    shaping = RewardPipeline(
        from_dict(
            RewardShapingConfig,
            {
                "stages": [
                    {"type": "integrity"},
                    {"type": "invalid_action", "penalty": PENALTY},
                    {"type": "screening", "penalty": -0.5, "categories": ["forced_exit"]},
                ]
            },
            "rewards",
        )
    )
    rollouts = [
        rollout(repo, tampered),
        rollout(repo, resolved_flagged),
        rollout(repo, failed),
        rollout(repo, None, invalid_reason="no diff block"),
    ]

    async def scenario():
        async with running_server(executor_config(tmp_path), score) as server:
            env = SweEnvironment(env_config(server.url), shaping)
            return await env.step(rollouts, global_step=0)

    result = asyncio.run(scenario())
    # Tampering scores 0 raw and the forced exit is penalised; sys.argv is not in the categories.
    assert result.rewards_B.tolist() == [-0.5, 1.0, 0.0, PENALTY]
    assert result.sample_mask_B.tolist() == [1.0] * 4
    tamper_meta, flagged_meta, failed_meta, unparsed_meta = result.metadata
    assert tamper_meta["failure_kind"] == "tampering"
    assert tamper_meta["failure_detail"] == "the must-fail canary passed"
    assert tamper_meta["screening_flags"] == ["forced_exit: os._exit", "exit_hook: atexit"]
    assert tamper_meta["screening/flags"] == ("forced_exit: os._exit",)
    assert flagged_meta["failure_kind"] == "none" and flagged_meta["failure_detail"] == ""
    assert flagged_meta["screening_flags"] == ["process_arguments: sys.argv"]
    assert not flagged_meta["screening/triggered"]
    assert failed_meta["failure_kind"] == "tests_failed" and failed_meta["screening_flags"] == []
    assert unparsed_meta["failure_kind"] is None and unparsed_meta["failure_detail"] is None
    assert unparsed_meta["screening_flags"] == []
    assert result.metrics["env/num_tampering"] == 1.0
    assert result.metrics["env/num_screening_flagged"] == 2.0
    assert result.metrics["env/screening/num_triggered"] == 1.0


def test_reward_config_knows_the_executors_screening_categories():
    # The reward config checks `categories` against its own list (no sandbox import there); the
    # executor's screening is what writes the flags. They must name the same categories.
    assert SCREENING_CATEGORIES == screening.CATEGORIES
    assert screening.BINARY_FLAG.partition(":")[0] in SCREENING_CATEGORIES


def test_malformed_instance_raises_request_error(tmp_path, repo):
    config = executor_config(tmp_path)
    bad = SweRollout(
        instance=dataclasses.replace(repo.spec(""), repo=str(tmp_path / "nowhere")),
        patch=repo.gold_patch,
    )

    async def scenario():
        async with running_server(config) as server:
            env = SweEnvironment(env_config(server.url), make_pipeline())
            await env.step([bad], global_step=0)

    with pytest.raises(ExecutorRequestError):
        asyncio.run(scenario())


def test_task_ids_are_deterministic_and_valid(repo):
    env = SweEnvironment(env_config("http://127.0.0.1:1", task_id_prefix="run-a"), make_pipeline())
    task_id = env.task_id(12, 3, "django/django__django-11099")
    assert task_id == env.task_id(12, 3, "django/django__django-11099")
    assert task_id.startswith("run-a-s12-i3-") and "/" not in task_id
    assert (
        len(
            {
                task_id,
                env.task_id(13, 3, "django/django__django-11099"),
                env.task_id(12, 4, "django/django__django-11099"),
                env.task_id(12, 3, "other"),
                env.task_id(12, 3, "django/django__django-11099", generation=1),
            }
        )
        == 5
    )


def test_rollout_and_step_validation(repo):
    spec = repo.spec("")
    with pytest.raises(ValueError, match="invalid_reason"):
        SweRollout(instance=spec, patch=None)
    with pytest.raises(ValueError, match="invalid_reason"):
        SweRollout(instance=spec, patch="diff", invalid_reason="both")
    with pytest.raises(ValueError, match="instance"):
        SweRollout(instance={"instance_id": "x"}, patch="")
    env = SweEnvironment(env_config("http://127.0.0.1:1"), make_pipeline())
    with pytest.raises(ValueError, match="global_step"):
        asyncio.run(env.step([], global_step=-1))
    with pytest.raises(ValueError, match=r"rollouts\[0\]"):
        asyncio.run(env.step(["a patch"], global_step=0))
    empty = asyncio.run(env.step([], global_step=0))
    assert empty.rewards_B.shape == (0,) and empty.metadata == ()


def test_limits_charged_to_the_patch_and_unsafe_capabilities_are_scored_and_counted(tmp_path, repo):
    # Verdicts as the pipeline writes them: a limit the task's baseline does not hit is the
    # patch's failure (scored 0, counted); one it hits too is masked; a capability-screen
    # refusal is a failure with its flags.
    charged_timeout = "diff --git a/sleeps b/sleeps\n"
    charged_cpu = "diff --git a/spins b/spins\n"
    masked = "diff --git a/slow_task b/slow_task\n"
    unsafe = "diff --git a/hook b/hook\n"
    verdicts = {
        charged_timeout: (FailureKind.TIMEOUT, False, ()),
        charged_cpu: (FailureKind.CPU_LIMIT, False, ()),
        masked: (FailureKind.TIMEOUT, True, ()),
        unsafe: (FailureKind.UNSAFE_CAPABILITY, False, ("capability: sys.meta_path",)),
    }

    def score(spec, work_root):
        kind, limit_outcome, flags = verdicts[spec.patch]
        return Verdict(
            resolved=False,
            reward=0.0,
            fail_to_pass={t: TestOutcome.MISSING for t in spec.fail_to_pass},
            pass_to_pass={t: TestOutcome.MISSING for t in spec.pass_to_pass},
            apply_method=ApplyMethod.GIT_APPLY,
            integrity_violation=(),
            test_exit_code=None,
            timed_out=kind is FailureKind.TIMEOUT,
            timings_s={"total": 0.0},
            log_tail="",
            failure_kind=kind,
            failure_detail=kind.value,
            screening_flags=flags,
            limit_outcome=limit_outcome,
        )

    shaping = RewardPipeline(
        from_dict(
            RewardShapingConfig,
            {"stages": [{"type": "scale", "scale": 2.0, "shift": -1.0}]},
            "rewards",
        )
    )
    rollouts = [rollout(repo, patch) for patch in (charged_timeout, charged_cpu, masked, unsafe)]

    async def scenario():
        async with running_server(executor_config(tmp_path), score) as server:
            env = SweEnvironment(env_config(server.url), shaping)
            return await env.step(rollouts, global_step=0)

    result = asyncio.run(scenario())
    # Charged and refused samples are shaped like any failure (raw 0 -> -1); the masked one is not.
    assert result.rewards_B.tolist() == [-1.0, -1.0, 0.0, -1.0]
    assert result.sample_mask_B.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert [m["limit_outcome"] for m in result.metadata] == [False, False, True, False]
    assert result.metadata[3]["screening_flags"] == ["capability: sys.meta_path"]
    metrics = result.metrics
    assert metrics["env/num_patch_limit_failures"] == 2.0
    assert metrics["env/num_limit_outcomes"] == 1.0 and metrics["env/num_infra_errors"] == 0.0
    assert metrics["env/num_unsafe_capability"] == 1.0
    assert metrics["env/unsafe_capability_rate"] == pytest.approx(1 / 4)
