"""The single-shot SWE environment: one patch per rollout, scored by the sandbox executor.

Shape legend: B = samples in the batch.

    env = SweEnvironment(config, RewardPipeline(rewards_cfg))
    result = await env.step([SweRollout(instance=spec, patch=diff, ...), ...], global_step=7)
    loss_mask_BS = token_mask_BS * result.sample_mask_B[:, None]

Per sample: a rollout whose patch could not be extracted (`invalid_reason` set) is not submitted;
the others are submitted to the executor concurrently (at most `max_concurrency` in flight) and
awaited. Each verdict becomes a `SampleOutcome` (raw reward, whether the patch applied, the files
it touches, the held-out test files and the executor's screening flags) and the `RewardPipeline`
shapes all outcomes into rewards.

Idempotency: a sample's task id is derived from (task_id_prefix, global_step, sample index,
instance id), so calling `step` again with the same step and rollouts finds the tasks the
executor already scored instead of scoring them again.

Infrastructure errors — the client giving up (`ExecutorUnavailableError`), no verdict within
`task_timeout_s`, or a task that ended INFRA_ERROR on the executor — are retried
`max_infra_retries` times. Unavailable and timeout retries reuse the task id (the task may exist
and still finish); an INFRA_ERROR task is final on the executor, so the retry submits it under a
new id (suffix `-r<n>`). A sample still without a verdict gets sample_mask 0, reward 0 and
`infra_error` in its metadata: it is excluded from the loss, never scored 0. So is a verdict
marked `limit_outcome`: the executor proved the limit was not the patch's doing (its test run
ended at the wall-clock or CPU-time limit and so does the task's baseline, the base commit with
the held-out tests and no patch, on that executor). A run killed at a limit that the baseline
does not hit is the patch's failure and is scored like one (reward 0 raw, `failure_kind`
timeout or cpu_limit); docs/sandbox.md, "Runs killed at a limit".

Per-sample metadata keys: `instance_id`, `task_id` (None when not submitted), `parse_failure`
(the extraction's reason or None), `patch_rejected` (the executor refused the patch itself, e.g.
too large; or None), `apply_failure` (bool), `apply_method`, `integrity_violation` (files),
`timed_out`, `limit_outcome`, `test_outcomes` ({"FAIL_TO_PASS": {test id: outcome},
"PASS_TO_PASS": {...}}), `resolved`, `failure_kind` (why the verdict is not resolved: a
`FailureKind` value, "none" when resolved, None without a verdict), `failure_detail` (the
verdict's reason in words; None without a verdict), `screening_flags` (the executor's static
screening of the patch, "category: token"), `infra_error` (None or the last error), `num_tries`,
plus the reward pipeline's keys (`raw_reward`, `reward`, `<stage>/...`) for samples with a
verdict.

Metrics: `env/num_samples`, `env/num_infra_errors`, `env/num_limit_outcomes` (masked: the
baseline hits the limit too), `env/num_patch_limit_failures` (timeout or cpu_limit verdicts
charged to the patch, not masked), `env/num_parse_failures`,
`env/num_apply_failures`, `env/num_integrity_violations`, `env/num_timed_out`, `env/num_resolved`,
`env/num_tampering` (verdicts whose failure kind is tampering: the test process altered its own
results), `env/num_unsafe_capability` and `env/unsafe_capability_rate` (verdicts refused by the
executor's capability screen, and their fraction of all verdicts: a rising rate on patches that
otherwise look honest is the screen's false positives), `env/num_screening_flagged` (verdicts
with any screening flag, penalised or not; the capability screen's findings are flags too,
"capability: ..."), plus the reward pipeline's metrics as `env/<key>`.

Not covered: extracting the patch from the model's text (the data layer does), multi-turn
episodes, choosing among several executors (one URL; put a load balancer in front for a fleet).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dockyard_rl.environments.config import SweEnvironmentConfig
from dockyard_rl.environments.interfaces import Environment, EnvironmentResult
from dockyard_rl.rewards.outcome import SampleOutcome
from dockyard_rl.rewards.shaping import RewardPipeline
from dockyard_rl.sandbox.client import (
    ExecutorClient,
    ExecutorRequestError,
    ExecutorUnavailableError,
)
from dockyard_rl.sandbox.protected_paths import touched_paths
from dockyard_rl.sandbox.task import ApplyMethod, FailureKind, TaskSpec, TaskStatus, Verdict

__all__ = ["ClientFactory", "SweEnvironment", "SweRollout"]

logger = logging.getLogger(__name__)

ClientFactory = Callable[[], ExecutorClient]

_APPLIED = {
    ApplyMethod.GIT_APPLY: True,
    ApplyMethod.GIT_APPLY_3WAY: True,
    ApplyMethod.PATCH_FUZZ: True,
    ApplyMethod.FAILED: False,
    # Nothing was tried: an empty patch, or one refused for integrity before applying.
    ApplyMethod.EMPTY: None,
    ApplyMethod.NOT_ATTEMPTED: None,
}
# Failure kinds of a run killed at a limit (maskable only with the executor's proof).
_LIMIT_KINDS = (FailureKind.TIMEOUT.value, FailureKind.CPU_LIMIT.value)


@dataclasses.dataclass(frozen=True)
class SweRollout:
    """One sample: the task and what the policy produced for it.

    Attributes:
        instance: the SWE task (TaskSpec fields); its `patch`, `task_id` and `reward_mode` are
            ignored — the environment sets them.
        patch: the unified diff extracted from the response; None when extraction failed.
        invalid_reason: why no patch could be extracted; set exactly when `patch` is None.
        response_text, response_length, max_response_length, thinking_required: passed to the
            reward pipeline (format and length stages).
        episode_end: how a multi-turn episode ended (`agent_env.EPISODE_ENDS`), passed to the
            reward pipeline (turn_limit stage); None for a single-shot sample.
        reference_patch: the task's gold patch (`SweInstance.patch`), passed to the reward
            pipeline (reference_similarity stage); "" when there is none.
    """

    instance: TaskSpec
    patch: str | None
    invalid_reason: str | None = None
    response_text: str = ""
    response_length: int = 0
    max_response_length: int = 1
    thinking_required: bool = False
    # Multi-turn episodes only (agent_env.py): how the episode ended, for the turn_limit stage.
    episode_end: str | None = None
    reference_patch: str = ""

    def __post_init__(self):
        if not isinstance(self.instance, TaskSpec):
            raise ValueError(f"instance: must be a TaskSpec, got {type(self.instance).__name__}")
        if self.patch is None:
            if not isinstance(self.invalid_reason, str) or not self.invalid_reason:
                raise ValueError(
                    "invalid_reason: must be a non-empty string when patch is None "
                    "(say why no patch could be extracted)"
                )
        else:
            if not isinstance(self.patch, str):
                raise ValueError(f"patch: must be a str or None, got {type(self.patch).__name__}")
            if self.invalid_reason is not None:
                raise ValueError(
                    "invalid_reason: must be None when a patch was extracted; set "
                    "patch=None for a parse failure"
                )


@dataclasses.dataclass(frozen=True)
class _Scored:
    """What submitting one sample produced (exactly one of verdict / rejected / infra_error)."""

    task_id: str
    num_tries: int
    verdict: Verdict | None = None
    rejected: str | None = None
    infra_error: str | None = None


class SweEnvironment(Environment):
    """See the module docstring. Stateless between steps; one executor client per `step`."""

    max_rollout_turns = 1

    def __init__(
        self,
        config: SweEnvironmentConfig,
        reward_pipeline: RewardPipeline,
        *,
        client_factory: ClientFactory | None = None,
    ):
        if not isinstance(config, SweEnvironmentConfig):
            raise ValueError(f"config: must be a SweEnvironmentConfig, got {type(config).__name__}")
        if not isinstance(reward_pipeline, RewardPipeline):
            raise ValueError(
                f"reward_pipeline: must be a RewardPipeline, got {type(reward_pipeline).__name__}"
            )
        self.config = config
        self.reward_pipeline = reward_pipeline
        # The client is made per step, inside the running loop: its aiohttp session is bound to
        # the loop that creates it, and the caller may run each step in a fresh loop.
        auth_token = config.auth_token  # read once, at set-up
        self._client_factory = client_factory or (
            lambda: ExecutorClient(
                config.executor_url,
                auth_token=auth_token,
                request_timeout_s=config.request_timeout_s,
                max_connections=config.max_concurrency,
            )
        )

    @property
    def client_factory(self) -> ClientFactory:
        """What makes this environment's executor clients (the multi-turn environment opens its
        sessions with the same URL, token and timeouts)."""
        return self._client_factory

    def task_id(
        self, global_step: int, index: int, instance_id: str, generation: int = 0, patch: str = ""
    ) -> str:
        """The deterministic task id of sample `index` of step `global_step` with `patch`.

        The instance id and the patch are hashed: the id may hold characters task ids may not
        ('/'), and the hash makes a retried step whose batch order or patches changed (a
        multi-turn episode replayed against tools whose output varies) resolve to different
        tasks instead of a conflict, while the same sample resolves to the same task.
        `generation` > 0 names a resubmission after an INFRA_ERROR.
        """
        digest = hashlib.sha256(f"{instance_id}\0{patch}".encode()).hexdigest()[:16]
        task_id = f"{self.config.task_id_prefix}-s{global_step}-i{index}-{digest}"
        return task_id if generation == 0 else f"{task_id}-r{generation}"

    async def step(self, rollouts: Sequence[SweRollout], *, global_step: int) -> EnvironmentResult:
        """Scores the rollouts; see `Environment.step` and the module docstring.

        Raises:
            ValueError: a rollout is not a SweRollout, or `global_step` is not an int >= 0.
            ExecutorRequestError: the executor refused a task for a reason other than its patch
                (a malformed instance, a wrong auth token, a task id reused with a different
                spec by another run — set `task_id_prefix` per run); retrying cannot fix these.
        """
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ValueError(f"global_step: must be an int >= 0, got {global_step!r}")
        if isinstance(rollouts, (str, bytes)) or not isinstance(rollouts, Sequence):
            raise ValueError(
                f"rollouts: must be a sequence of SweRollout, got {type(rollouts).__name__}"
            )
        for index, rollout in enumerate(rollouts):
            if not isinstance(rollout, SweRollout):
                raise ValueError(
                    f"rollouts[{index}]: must be a SweRollout, got {type(rollout).__name__}"
                )

        to_submit = [index for index, rollout in enumerate(rollouts) if rollout.patch is not None]
        scored: dict[int, _Scored] = {}
        if to_submit:
            semaphore = asyncio.Semaphore(self.config.max_concurrency)
            async with self._client_factory() as client:
                results = await asyncio.gather(
                    *(
                        self._score_sample(client, semaphore, rollouts[index], index, global_step)
                        for index in to_submit
                    ),
                    return_exceptions=True,
                )
            # Every task has run to its end before anything is raised: no orphaned coroutines.
            for index, result in zip(to_submit, results):
                if isinstance(result, BaseException):
                    raise result
                scored[index] = result
        return self._assemble(rollouts, scored)

    async def _score_sample(
        self,
        client: ExecutorClient,
        semaphore: asyncio.Semaphore,
        rollout: SweRollout,
        index: int,
        global_step: int,
    ) -> _Scored:
        instance_id = rollout.instance.instance_id
        generation = 0
        last_error = "no try made"
        num_tries = 0
        patch = rollout.patch or ""
        task_id = self.task_id(global_step, index, instance_id, patch=patch)
        async with semaphore:
            for num_tries in range(1, self.config.max_infra_retries + 2):
                task_id = self.task_id(global_step, index, instance_id, generation, patch)
                spec = dataclasses.replace(
                    rollout.instance,
                    patch=rollout.patch,
                    task_id=task_id,
                    reward_mode=self.config.reward_mode_enum,
                )
                try:
                    await client.submit(spec)
                    result = await client.wait(
                        task_id,
                        poll_interval_s=self.config.poll_interval_s,
                        timeout_s=self.config.task_timeout_s,
                    )
                except ExecutorUnavailableError as error:
                    last_error = f"executor unavailable: {error}"
                except TimeoutError as error:
                    last_error = f"no verdict in time: {error}"
                except ExecutorRequestError as error:
                    if error.field == "patch":
                        # The model's patch itself was refused (e.g. larger than the executor's
                        # max_patch_bytes): the action's fault, penalised like a non-applying one.
                        return _Scored(task_id, num_tries, rejected=error.message)
                    raise
                else:
                    if result.status is TaskStatus.FINISHED:
                        assert result.verdict is not None, result
                        return _Scored(task_id, num_tries, verdict=result.verdict)
                    last_error = f"executor infra_error: {result.error}"
                    generation += 1  # that task id is final on the executor
                logger.warning(
                    "sample %d (%s, task %s): %s (try %d of %d)",
                    index,
                    instance_id,
                    task_id,
                    last_error,
                    num_tries,
                    self.config.max_infra_retries + 1,
                )
        return _Scored(task_id, num_tries, infra_error=last_error)

    def _assemble(
        self, rollouts: Sequence[SweRollout], scored: dict[int, _Scored]
    ) -> EnvironmentResult:
        num_samples = len(rollouts)
        rewards_B = torch.zeros(num_samples, dtype=torch.float32)
        sample_mask_B = torch.zeros(num_samples, dtype=torch.float32)
        metadata: list[dict[str, Any]] = []
        shaped_indices: list[int] = []
        outcomes: list[SampleOutcome] = []
        held_out_cache: dict[str, tuple[str, ...]] = {}
        for index, rollout in enumerate(rollouts):
            result = scored.get(index)
            verdict = result.verdict if result is not None else None
            meta: dict[str, Any] = {
                "instance_id": rollout.instance.instance_id,
                "task_id": result.task_id if result is not None else None,
                "parse_failure": rollout.invalid_reason,
                "patch_rejected": result.rejected if result is not None else None,
                "apply_failure": bool(
                    verdict is not None and verdict.apply_method is ApplyMethod.FAILED
                ),
                "apply_method": verdict.apply_method.value if verdict is not None else None,
                "integrity_violation": list(verdict.integrity_violation) if verdict else [],
                "timed_out": bool(verdict is not None and verdict.timed_out),
                "limit_outcome": bool(verdict is not None and verdict.limit_outcome),
                "test_outcomes": {
                    "FAIL_TO_PASS": {k: v.value for k, v in verdict.fail_to_pass.items()},
                    "PASS_TO_PASS": {k: v.value for k, v in verdict.pass_to_pass.items()},
                }
                if verdict is not None
                else {"FAIL_TO_PASS": {}, "PASS_TO_PASS": {}},
                "resolved": bool(verdict is not None and verdict.resolved),
                "failure_kind": verdict.failure_kind.value if verdict is not None else None,
                "failure_detail": verdict.failure_detail if verdict is not None else None,
                "screening_flags": list(verdict.screening_flags) if verdict is not None else [],
                "infra_error": result.infra_error if result is not None else None,
                "num_tries": result.num_tries if result is not None else 0,
            }
            metadata.append(meta)
            if result is not None and result.infra_error is not None:
                continue  # masked out: reward stays 0 and is never shaped or counted
            if meta["limit_outcome"]:
                # Killed at a limit that the task's baseline hits too on that executor: proven
                # not to be the patch's doing, so no evidence either way; masked like an
                # infrastructure error. (A limit the baseline does not hit is a plain failure.)
                continue
            held_out = held_out_cache.get(rollout.instance.test_patch)
            if held_out is None:
                held_out = tuple(sorted(touched_paths(rollout.instance.test_patch)[0]))
                held_out_cache[rollout.instance.test_patch] = held_out
            outcomes.append(self._outcome(rollout, result, held_out))
            shaped_indices.append(index)

        shaping = self.reward_pipeline(outcomes)
        for index, reward, shaped_meta in zip(shaped_indices, shaping.rewards, shaping.metadata):
            rewards_B[index] = reward
            sample_mask_B[index] = 1.0
            metadata[index].update(shaped_meta)

        metrics = {f"env/{key}": value for key, value in shaping.metrics.items()}
        metrics["env/num_samples"] = float(num_samples)
        num_limit = sum(m["limit_outcome"] for m in metadata)
        metrics["env/num_infra_errors"] = float(num_samples - len(shaped_indices) - num_limit)
        metrics["env/num_limit_outcomes"] = float(num_limit)
        metrics["env/num_parse_failures"] = float(
            sum(m["parse_failure"] is not None for m in metadata)
        )
        metrics["env/num_apply_failures"] = float(sum(m["apply_failure"] for m in metadata))
        metrics["env/num_integrity_violations"] = float(
            sum(bool(m["integrity_violation"]) for m in metadata)
        )
        metrics["env/num_timed_out"] = float(sum(m["timed_out"] for m in metadata))
        metrics["env/num_resolved"] = float(sum(m["resolved"] for m in metadata))
        metrics["env/num_tampering"] = float(
            sum(m["failure_kind"] == FailureKind.TAMPERING.value for m in metadata)
        )
        num_verdicts = sum(m["failure_kind"] is not None for m in metadata)
        num_unsafe = sum(m["failure_kind"] == FailureKind.UNSAFE_CAPABILITY.value for m in metadata)
        metrics["env/num_unsafe_capability"] = float(num_unsafe)
        metrics["env/unsafe_capability_rate"] = num_unsafe / num_verdicts if num_verdicts else 0.0
        metrics["env/num_patch_limit_failures"] = float(
            sum(m["failure_kind"] in _LIMIT_KINDS and not m["limit_outcome"] for m in metadata)
        )
        metrics["env/num_screening_flagged"] = float(
            sum(bool(m["screening_flags"]) for m in metadata)
        )
        return EnvironmentResult(
            rewards_B=rewards_B,
            sample_mask_B=sample_mask_B,
            metadata=tuple(metadata),
            metrics=metrics,
        )

    @staticmethod
    def _outcome(
        rollout: SweRollout, result: _Scored | None, held_out: tuple[str, ...]
    ) -> SampleOutcome:
        common = dict(
            response_length=rollout.response_length,
            max_response_length=rollout.max_response_length,
            response_text=rollout.response_text,
            thinking_required=rollout.thinking_required,
            episode_end=rollout.episode_end,
            reference_patch=rollout.reference_patch,
        )
        if result is None:  # parse failure: never submitted
            return SampleOutcome(
                reward=0.0,
                patch_parsed=False,
                patch_applied=None,
                held_out_files=held_out,
                **common,
            )
        touched = tuple(sorted(touched_paths(rollout.patch)[0]))
        if result.rejected is not None:
            return SampleOutcome(
                reward=0.0,
                patch_parsed=True,
                patch_applied=False,
                touched_files=touched,
                held_out_files=held_out,
                **common,
            )
        verdict = result.verdict
        assert verdict is not None, result
        # The executor's integrity check also protects files outside test_patch (conftest.py,
        # pytest.ini, ...): what it flagged counts as touched and held out, so the integrity
        # stage zeroes the sample and reports those files.
        flagged = tuple(verdict.integrity_violation)
        return SampleOutcome(
            reward=verdict.reward,
            patch_parsed=True,
            patch_applied=_APPLIED[verdict.apply_method],
            touched_files=tuple(sorted(set(touched) | set(flagged))),
            held_out_files=tuple(sorted(set(held_out) | set(flagged))),
            screening_flags=verdict.screening_flags,
            patch_text=rollout.patch,
            **common,
        )
