"""Async GRPO's trajectory collector: a Ray actor that generates and scores groups nonstop.

    collector = start_collector(runner, instances, ...)      # the actor, on the driver's node
    ray.get(collector.start.remote())
    records = sample_groups(collector, num_groups, trainer_version, sample_timeout_s)
    ray.get(collector.pause_generation.remote(timeout_s)) ... resume_generation  # around a sync
    state = ray.get(collector.snapshot.remote())                         # for a checkpoint

One thread of the actor loops: the next `num_prompts` prompts (redone ones first) -> samples from
the engines (through an `EngineClient`) -> verdicts from the sandbox -> one group per prompt,
pushed into the actor's age-bounded replay buffer (replay_buffer.py). The trainer's calls run
on the actor's other threads (a threaded actor), so `sample` waits for groups while the loop
keeps generating.

Timeouts (section `async_grpo`), so a hung collector fails the run instead of hanging it:
- `sample_timeout_s` bounds every wait of the trainer for the collector: `sample_groups` raises
  TimeoutError naming the key when fewer than the asked groups arrived in that many seconds (the
  engines or the executors hung, or are too slow), and so does `pause_generation` when the round
  being generated does not finish in time. null waits indefinitely.
- `push_timeout_s` bounds how long the loop waits for room in the full buffer (the trainer is
  not sampling); then the loop fails with TimeoutError naming the key, and the trainer's next
  `sample` raises it. null waits as long as it takes (the normal back-pressure).

Why an actor and not a thread of the driver: generation and scoring are the slow, always-busy
half of async GRPO; in their own process their Python work (tokenizing, parsing patches,
assembling rewards) never competes with the trainer driver's GIL, and the driver only blocks on
`sample`. The actor is pinned to the driver's node (the task repositories the prompts are read
from are local files there) and takes no CPU from the fleets' placement (num_cpus 0: it mostly
waits on the engines and the executor).

A group is tagged with the OLDEST weight version that produced any of its samples (vLLM reports
it per sample), so the buffer's bound holds for every sample. Groups the buffer drops as stale go
round again: their prompts are redone first.

Weight updates: with in-flight updates the trainer syncs the engines while the loop generates
(a sample then spans versions and counts as its oldest). Without, the trainer brackets the sync
with `pause_generation` (waits for the round being generated, starts no new one) and
`resume_generation`, so weights never change under a request.

Experience over the data plane (`data_plane` set): instead of `sample`, the trainer calls
`send_step_groups` -> the actor's `send_step`: it takes the step's groups from the buffer,
builds the step's training batch itself (rollouts.assemble_train_batch, the driver's own code),
sends shard r to trainer rank r over the data plane (data_plane/experience.py) and returns only
a `StepExperience`: the batch's handle, the step's metrics and sample-log rows. The tensors
never pass through the driver. The groups leave the buffer exactly as with `sample`, so the
checkpoint guarantees below are the same: a step's groups are in the last checkpoint's snapshot
until the step that trained them is checkpointed.

`snapshot` returns, atomically, what a checkpoint needs to resume exactly: the prompt sampler's
state, the prompts handed out but not yet buffered (generated again on resume), and the buffered
groups with their versions.

Seeds: a prompt is handed out as a ticket (instance index, draw index: its position in the
sampler's stream), and its samples are seeded from the draw (utils/seeding.py). The ticket stays
with the prompt when it is generated again (in flight at a checkpoint, or dropped as stale), so a
resumed run samples it with the seeds the killed run used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from dockyard_rl.algorithms.async_utils.event_loops import close_loop
from dockyard_rl.algorithms.async_utils.replay_buffer import (
    AsyncGRPOConfig,
    BufferClosedError,
    GroupRecord,
    ReplayBuffer,
)
from dockyard_rl.algorithms.rollouts import (
    Rollout,
    Rollouts,
    assemble_train_batch,
    rollout_metrics,
    sample_log_rows,
)
from dockyard_rl.data.prompt_sampler import PromptSampler
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.data_plane.experience import RemoteBatch

logger = logging.getLogger(__name__)

# Task ids must not collide with validation's, which uses the step as its global step.
_ROUND_OFFSET = 1_000_000
# How long one `sample` call waits in the actor before the trainer checks the deadline again.
_SAMPLE_POLL_S = 5.0
# How much longer than its own bounded wait the actor may take to answer a `sample` call before
# the trainer takes it as hung (it is a threaded actor: a hung round does not block `sample`).
_REPLY_GRACE_S = 60.0


@dataclasses.dataclass(frozen=True)
class StepExperience:
    """What the driver gets for a step whose batch went to the ranks over the data plane.

    Attributes:
        batch: the handle the policy trains on, or None when every group was dropped.
        prompts: the groups' instance ids (the step's prompt log line).
        metrics: rollouts.rollout_metrics of the groups plus `dropped_groups`.
        sample_rows: rollouts.sample_log_rows of the groups (the per-step sample log).
    """

    batch: RemoteBatch | None
    prompts: list[str]
    metrics: dict[str, float]
    sample_rows: list[dict[str, Any]]


def split_groups(rollout: Rollout) -> list[Rollout]:
    """One Rollout per prompt (the buffer's unit: a whole group, never split)."""
    from dockyard_rl.environments.interfaces import EnvironmentResult

    n, groups = rollout.num_samples, []
    for g, instance in enumerate(rollout.instances):
        part = slice(g * n, (g + 1) * n)
        result = EnvironmentResult(
            rewards_B=rollout.rewards_B[part].clone(),
            sample_mask_B=rollout.sample_mask_B[part].clone(),
            metadata=rollout.result.metadata[part],
            metrics={},
        )
        groups.append(
            Rollout(
                [instance],
                n,
                rollout.samples[part],
                result,
                generate_seconds=rollout.generate_seconds / len(rollout.instances),
                score_seconds=rollout.score_seconds / len(rollout.instances),
                prompt_keys=None if rollout.prompt_keys is None else rollout.prompt_keys[g : g + 1],
            )
        )
    return groups


class TrajectoryCollector:
    """The actor's class (module docstring); `start_collector` starts it.

    Args:
        runner: prompts -> scored rollouts, with an `EngineClient` as its generation.
        instances: the training tasks; the sampler hands out indices into them.
        sampler_state: the `PromptSampler` state to continue from (a checkpoint's).
        num_prompts, num_samples: prompts per round, samples per prompt.
        buffer_config: the replay buffer's (`async_grpo`).
        redo: prompts to generate first (a checkpoint's in-flight tickets; a bare index, from a
            checkpoint written before tickets, is generated unseeded).
        buffered: a checkpoint's buffered groups, as `snapshot` returned them.
    """

    def __init__(
        self,
        runner: Rollouts,
        instances: Sequence[SweInstance],
        sampler_state: dict[str, Any],
        *,
        num_prompts: int,
        num_samples: int,
        seed: int,
        buffer_config: AsyncGRPOConfig,
        redo: Sequence[int] = (),
        buffered: Sequence[dict[str, Any]] = (),
    ):
        self._runner = runner
        self._instances = list(instances)
        self._num_prompts, self._num_samples = num_prompts, num_samples
        self._sampler = PromptSampler(len(self._instances), num_prompts, seed)
        self._sampler.load_state_dict(sampler_state)
        self._buffer = ReplayBuffer(buffer_config)
        self._push_timeout_s = buffer_config.push_timeout_s
        for record in buffered:
            self._buffer.push(
                record["group"], record["weight_version"], prompt_id=_ticket(record["prompt_id"])
            )
        # Guards the prompt bookkeeping; never held while waiting, so snapshot() is quick.
        self._state_lock = threading.Lock()
        # Tickets (instance index, draw index or None): see the module docstring.
        self._in_flight: list[tuple[int, int | None]] = []  # generated, not yet in the buffer
        self._redo = [_ticket(t) for t in redo]  # to hand out first
        self._generation_lock = threading.Lock()  # held while a round generates
        self._stop = threading.Event()
        self._error: str | None = None
        self._round = 0
        self._thread = threading.Thread(target=self._main, name="trajectory-collector", daemon=True)

    # ------------------------------------------------------------------- the trainer's calls

    def start(self) -> None:
        self._thread.start()

    def sample(
        self, num_groups: int, trainer_version: int, timeout_s: float
    ) -> list[GroupRecord] | None:
        """`num_groups` groups no older than the age bound for `trainer_version`, or None after
        `timeout_s` without enough. Raises RuntimeError when the loop has died."""
        self._check_alive()
        try:
            return self._buffer.sample(num_groups, trainer_version, timeout=timeout_s)
        except TimeoutError:
            self._check_alive()
            return None

    def open_data_plane(
        self, sender_specs: Sequence[Any], advantage_cfg: Any, pad_token_id: int
    ) -> None:
        """Opens this actor's senders to the trainer ranks (`endpoints.senders[0]`, rank order);
        `send_step` builds batches with `advantage_cfg` (`grpo.advantage`) and `pad_token_id`."""
        self._senders = [spec.open() for spec in sender_specs]
        self._advantage_cfg, self._pad_token_id = advantage_cfg, pad_token_id

    def send_step(
        self, num_groups: int, trainer_version: int, timeout_s: float, step: int
    ) -> StepExperience | None:
        """`sample`, then the step's batch built here and sent to the ranks (module docstring);
        None after `timeout_s` without enough groups (nothing sent).

        Raises:
            RuntimeError: the loop has died.
            DataPlaneError: a send failed (fatal for the run: resume from the last checkpoint).
        """
        from dockyard_rl.data_plane.experience import send_step_shards
        from dockyard_rl.losses.loss_functions import count_valid

        records = self.sample(num_groups, trainer_version, timeout_s)
        if records is None:
            return None
        rollouts = [record.payload for record in records]
        batch, stats = assemble_train_batch(
            rollouts, self._advantage_cfg, self._pad_token_id, len(self._senders)
        )
        metrics = rollout_metrics(rollouts)
        metrics["dropped_groups"] = float(sum(s.num_dropped_groups for s in stats))
        remote = None
        if batch is not None:
            remote = send_step_shards(self._senders, batch, step=step, num_valid=count_valid(batch))
        return StepExperience(
            batch=remote,
            prompts=[r.instances[0].instance_id for r in rollouts],
            metrics=metrics,
            sample_rows=sample_log_rows(rollouts),
        )

    def pause_generation(self, timeout_s: float | None = None) -> None:
        """Waits for the round being generated to finish; no new round starts until
        `resume_generation` (for weight syncs without in-flight updates).

        Raises:
            TimeoutError: the round did not finish within `timeout_s` (the trainer passes
                `async_grpo.sample_timeout_s`; None waits indefinitely). Nothing is paused then.
        """
        if not self._generation_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError(
                f"async_grpo.sample_timeout_s={timeout_s:g}: the round being generated did not "
                f"finish within {timeout_s:g} s, so the weight sync cannot start: generation or "
                "scoring is hung or too slow (check the engines and the sandbox executors), or "
                "raise async_grpo.sample_timeout_s (null waits indefinitely)"
            )

    def resume_generation(self) -> None:
        self._generation_lock.release()

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds (module docstring), taken atomically."""
        with self._state_lock:
            return {
                "sampler": self._sampler.state_dict(),
                "in_flight": list(self._in_flight) + list(self._redo),
                "buffer": [
                    {
                        "group": r.payload,
                        "weight_version": r.weight_version,
                        "prompt_id": r.prompt_id,
                    }
                    for r in self._buffer.snapshot()
                ],
            }

    def metrics(self) -> dict[str, float]:
        return {
            k: float(v) for k, v in self._buffer.metrics().items() if isinstance(v, (int, float))
        }

    def stop(self, timeout_s: float = 300.0) -> None:
        self._stop.set()
        self._buffer.close()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------------- the loop

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the trajectory collector failed: {self._error}")

    def _next_round(self) -> list[tuple[int, int | None]]:
        with self._state_lock:
            # Stale groups were dropped by the buffer: their prompts go round again.
            self._redo += [dropped.prompt_id for dropped in self._buffer.pop_dropped()]
            batch = self._redo[: self._num_prompts]
            self._redo = self._redo[self._num_prompts :]
            while len(batch) < self._num_prompts:
                first_draw = self._sampler.num_consumed
                drawn = self._sampler.next_batch()[: self._num_prompts - len(batch)]
                batch += [(index, first_draw + k) for k, index in enumerate(drawn)]
            self._in_flight = list(batch)
            return batch

    def _push(self, ticket: tuple[int, int | None], group: Rollout) -> None:
        versions = [s.oldest_weight_version for s in group.samples]
        # The loop fails after async_grpo.push_timeout_s without room (None: waits until stopped).
        waited = time.monotonic()
        while not self._stop.is_set():
            if (
                self._push_timeout_s is not None
                and time.monotonic() - waited > self._push_timeout_s
            ):
                raise TimeoutError(
                    f"async_grpo.push_timeout_s={self._push_timeout_s:g}: the replay buffer "
                    f"stayed full for {self._push_timeout_s:g} s: the trainer is not sampling "
                    "(hung or far slower than generation); check the trainer, or raise "
                    "async_grpo.push_timeout_s (null waits as long as it takes)"
                )
            with self._state_lock:
                try:
                    self._buffer.push(group, versions, prompt_id=ticket, timeout=0)
                except TimeoutError:  # full: wait outside the lock for the trainer to sample
                    pass
                else:
                    self._in_flight.remove(ticket)
                    return
            time.sleep(0.2)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while not self._stop.is_set():
                tickets = self._next_round()
                self._round += 1
                draws = [draw for _, draw in tickets]
                with self._generation_lock:
                    rollout = loop.run_until_complete(
                        self._runner.run(
                            [self._instances[i] for i, _ in tickets],
                            num_samples=self._num_samples,
                            global_step=_ROUND_OFFSET + self._round,
                            prompt_keys=None if None in draws else draws,
                        )
                    )
                for ticket, group in zip(tickets, split_groups(rollout)):
                    self._push(ticket, group)
        except BufferClosedError:
            pass
        except BaseException as error:  # surfaced to the trainer by sample()
            self._error = f"{type(error).__name__}: {error}"
            logger.exception("trajectory collector failed")
        finally:
            close_loop(loop)


def _ticket(value: Any) -> tuple[int, int | None]:
    """A prompt ticket from a checkpoint: (index, draw) as saved, or a bare index (older)."""
    if isinstance(value, (tuple, list)):
        index, draw = value
        return int(index), None if draw is None else int(draw)
    return int(value), None


def sample_groups(
    collector, num_groups: int, trainer_version: int, timeout_s: float | None
) -> list[GroupRecord]:
    """The trainer's side of `sample`: `num_groups` groups for `trainer_version` from the
    collector actor, waiting at most `timeout_s` (`async_grpo.sample_timeout_s`; None: no limit).

    Raises:
        TimeoutError: too few fresh groups arrived within `timeout_s`, or the actor did not
            answer a bounded `sample` call at all (the message names the key).
        RuntimeError: the collector's loop has died (its error, e.g. a push timeout).
    """
    records = _poll_collector(
        lambda wait_s: collector.sample.remote(num_groups, trainer_version, wait_s),
        num_groups,
        trainer_version,
        timeout_s,
        _REPLY_GRACE_S,
    )
    return list(records)


def send_step_groups(
    collector,
    num_groups: int,
    trainer_version: int,
    timeout_s: float | None,
    step: int,
    transfer_grace_s: float,
) -> StepExperience:
    """The trainer's side of `send_step` (module docstring): as `sample_groups`, but the batch
    goes to the trainer ranks over the data plane and only a `StepExperience` comes back.
    `transfer_grace_s`: how much longer than a plain `sample` the actor may take to answer
    (the sends: e.g. the number of ranks x `data_plane.transfer_timeout_s`). Raises as
    `sample_groups`, and the actor's DataPlaneError (wrapped by Ray) when a send failed."""
    return _poll_collector(
        lambda wait_s: collector.send_step.remote(num_groups, trainer_version, wait_s, step),
        num_groups,
        trainer_version,
        timeout_s,
        _REPLY_GRACE_S + transfer_grace_s,
    )


def _poll_collector(
    call, num_groups: int, trainer_version: int, timeout_s: float | None, grace_s: float
) -> Any:
    """Repeats `call(wait_s)` (an ObjectRef of a bounded collector call answering None while
    too few groups are there) until it answers or `timeout_s` passes (TimeoutError)."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait_s = _SAMPLE_POLL_S
        if deadline is not None:
            wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
        try:
            records = ray.get(call(wait_s), timeout=wait_s + grace_s)
        except ray.exceptions.GetTimeoutError:
            # Not retried: a late answer would take groups out of the buffer that nobody gets.
            raise TimeoutError(
                f"async_grpo.sample_timeout_s: the trajectory collector did not answer a "
                f"{wait_s:g} s sample call within {wait_s + grace_s:g} s: the actor is "
                "hung; check its log"
            ) from None
        if records is not None:
            return records
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"async_grpo.sample_timeout_s={timeout_s:g}: the trajectory collector delivered "
                f"fewer than {num_groups} fresh groups for weight version {trainer_version} "
                f"within {timeout_s:g} s: generation or scoring is hung or too slow (check the "
                "engines and the sandbox executors), or raise async_grpo.sample_timeout_s "
                "(null waits indefinitely)"
            )


def start_collector(
    runner: Rollouts,
    instances: Sequence[SweInstance],
    sampler_state: dict[str, Any],
    *,
    cluster_config,
    data_plane: bool = False,
    **kwargs: Any,
):
    """Starts a `TrajectoryCollector` actor on this (the driver's) node and returns its handle;
    `kwargs` go to the constructor. `data_plane`: declare it a data-plane producer (tensor
    transport and the `data_plane` concurrency group, data_plane/ray_direct.py). Ray must be
    running."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dockyard_rl.cluster.bootstrap import fleet_runtime_env

    actor_cls = ray.remote(TrajectoryCollector)
    if data_plane:
        from dockyard_rl.data_plane.ray_direct import data_plane_actor_options

        actor_cls = ray.remote(**data_plane_actor_options())(TrajectoryCollector)
    return actor_cls.options(
        num_cpus=0,
        # The trainer's sample / pause / snapshot / stop calls wait concurrently with each
        # other.
        max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
        runtime_env=fleet_runtime_env("driver", cluster_config),
    ).remote(runner, instances, sampler_state, **kwargs)
