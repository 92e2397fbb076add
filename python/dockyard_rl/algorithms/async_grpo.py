"""Asynchronous GRPO: generation and scoring never wait for training, and the reverse.

    collector thread:  prompts -> samples -> rewards -> one group per prompt -> replay buffer
    trainer (this):    buffer.sample(num_prompts_per_step groups, no older than the bound)
                       -> batch -> log-probs -> train -> mark stale -> sync the engines

The collector (`TrajectoryCollector`) runs in a thread of the driver with its own event loop:
the engines (Ray actors) and the executor (HTTP) already run elsewhere, so the collector is only
orchestration (awaiting samples and verdicts), and a thread shares the driver's generation
controller and prompt sampler without copying them into another process. It tags each group with
the OLDEST weight version that produced any of its samples (vLLM reports it per sample), so the
buffer's age bound holds for every sample: a group trained while the trainer holds weight
version v (`synchronizer.trainer_version`: s - 1 at step s, s after a warm start) is at most `async_grpo.max_trajectory_age_steps` versions old, strictly; older
ones are dropped by the buffer and counted (`async/dropped_stale`), and their prompts handed out
again.

Weight updates: with `async_grpo.in_flight_weight_updates` the trainer syncs the engines while
the collector generates (vLLM pauses, swaps weights, resumes; a sample then spans versions and
counts as its oldest). Without it the trainer takes the collector's generation lock, so a sync
waits for the round being generated and never changes weights under a request.

The loss must correct for off-policy samples (`loss_fn.use_importance_sampling_correction`,
enforced by the config): the engine's log-probs (`generation_logprobs`) are the behaviour policy.

Checkpoints hold, besides the policy: the collector's prompt sampler, the prompts of the round in
flight (generated again on resume), and the buffered groups with their versions, so a resumed run
trains on exactly the prompts an uninterrupted one would hand out (samples differ: generation is
stochastic). The snapshot is taken under the collector's state lock, which it never holds while waiting.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from dockyard_rl.algorithms.async_utils.replay_buffer import BufferClosedError, ReplayBuffer
from dockyard_rl.algorithms.grpo import (finish_step, maybe_validate, refresh_engine_weights,
                                         train_on_rollouts)
from dockyard_rl.algorithms.grpo_setup import GRPORun
from dockyard_rl.algorithms.rollouts import Rollout

logger = logging.getLogger(__name__)


def _split_groups(rollout: Rollout) -> list[Rollout]:
    """One Rollout per prompt (the buffer's unit: a whole group, never split)."""
    from dockyard_rl.environments.interfaces import EnvironmentResult

    n, groups = rollout.num_samples, []
    for g, instance in enumerate(rollout.instances):
        part = slice(g * n, (g + 1) * n)
        result = EnvironmentResult(
            rewards_B=rollout.rewards_B[part].clone(),
            sample_mask_B=rollout.sample_mask_B[part].clone(),
            metadata=rollout.result.metadata[part], metrics={})
        groups.append(Rollout([instance], n, rollout.samples[part], result,
                              generate_seconds=rollout.generate_seconds / len(rollout.instances),
                              score_seconds=rollout.score_seconds / len(rollout.instances)))
    return groups


class TrajectoryCollector:
    """Generates and scores rounds of prompts into `buffer` until stopped (module docstring).

    `state_lock` guards the prompt bookkeeping (the sampler, the round in flight, prompts to
    redo) and is never held while waiting: a checkpoint takes it to read a consistent state.
    """

    def __init__(self, run: GRPORun, buffer: ReplayBuffer, pending: list[int] | None = None):
        self.run, self.buffer = run, buffer
        self.generation_lock = threading.Lock()  # held while a round generates
        self.state_lock = threading.Lock()
        self.in_flight: list[int] = []           # prompts generated but not yet in the buffer
        self.pending = list(pending or [])       # prompts to redo first (resume, stale drops)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._round = 0
        self._thread = threading.Thread(target=self._main, name="trajectory-collector",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def check(self) -> None:
        """Raises the collector's error, if it died."""
        if self._error is not None:
            raise RuntimeError(f"the trajectory collector failed: {self._error}") from self._error

    def stop(self) -> None:
        self._stop.set()
        self.buffer.close()
        self._thread.join(300)

    def prompts_to_redo(self) -> list[int]:
        """What a checkpoint records: prompts handed out but not (yet) in the buffer."""
        with self.state_lock:
            return list(self.in_flight) + list(self.pending)

    def _next_round(self) -> list[int]:
        size = self.run.config.grpo.num_prompts_per_step
        with self.state_lock:
            # Stale groups were dropped by the buffer: their prompts go round again.
            self.pending += [dropped.prompt_id for dropped in self.buffer.pop_dropped()]
            batch, self.pending = self.pending[:size], self.pending[size:]
            while len(batch) < size:
                batch += self.run.sampler.next_batch()[:size - len(batch)]
            self.in_flight = list(batch)
            return batch

    def _push(self, index: int, group: Rollout) -> None:
        versions = [s.oldest_weight_version for s in group.samples]
        while not self._stop.is_set():
            with self.state_lock:
                try:
                    self.buffer.push(group, versions, prompt_id=index, timeout=0)
                except TimeoutError:  # full: wait outside the lock for the trainer to sample
                    pass
                else:
                    self.in_flight.remove(index)
                    return
            time.sleep(0.2)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        config = self.run.config
        try:
            while not self._stop.is_set():
                indices = self._next_round()
                instances = [self.run.train[i] for i in indices]
                self._round += 1
                with _no_lock() if config.async_grpo.in_flight_weight_updates \
                        else self.generation_lock:
                    # Task ids must not collide with validation's (which uses the step).
                    rollout = loop.run_until_complete(self.run.runner.run(
                        instances, num_samples=config.grpo.num_generations_per_prompt,
                        global_step=1_000_000 + self._round))
                for index, group in zip(indices, _split_groups(rollout)):
                    self._push(index, group)
        except BufferClosedError:
            pass
        except BaseException as error:  # surfaced to the trainer by check()
            self._error = error
            logger.exception("trajectory collector failed")
        finally:
            loop.close()


def async_grpo_train(run: GRPORun) -> None:
    """The asynchronous loop (module docstring), from `run.step + 1` to `grpo.max_num_steps`."""
    config = run.config
    buffer = ReplayBuffer(config.async_grpo)
    extras = run.resumed.extras if run.resumed else {}
    for record in extras.get("buffer", []):
        buffer.push(record["group"], record["weight_version"], prompt_id=record["prompt_id"])
    collector = TrajectoryCollector(run, buffer, pending=extras.get("in_flight"))
    loop = asyncio.new_event_loop()
    try:
        refresh_engine_weights(run)
        maybe_validate(run, loop, at_start=True)
        collector.start()
        while run.step < config.grpo.max_num_steps:
            step = run.step + 1
            waited = time.monotonic()
            records = _sample(buffer, collector, config.grpo.num_prompts_per_step,
                              run.synchronizer.trainer_version)
            run.logger.add_time("buffer_wait", time.monotonic() - waited)
            metrics = train_on_rollouts(run, [r.payload for r in records], step)
            metrics.update({f"async/{k}": float(v) for k, v in buffer.metrics().items()
                            if isinstance(v, (int, float))})
            with run.logger.timer("weight_sync"):
                lock = None if config.async_grpo.in_flight_weight_updates \
                    else collector.generation_lock
                with lock or _no_lock():
                    refresh_engine_weights(run)
            with collector.state_lock:  # a consistent snapshot for a checkpoint of this step
                extras = {"buffer": [{"group": r.payload, "weight_version": r.weight_version,
                                      "prompt_id": r.prompt_id} for r in buffer.snapshot()],
                          "in_flight": list(collector.in_flight) + list(collector.pending)}
                finish_step(run, loop, step, metrics, extras)
        maybe_validate(run, loop, at_end=True)
    finally:
        collector.stop()
        run.logger.finish()
        loop.close()


def _sample(buffer: ReplayBuffer, collector: TrajectoryCollector, num_groups: int,
            trainer_version: int):
    """Waits for enough fresh groups, checking that the collector is alive."""
    while True:
        collector.check()
        try:
            return buffer.sample(num_groups, trainer_version, timeout=5.0)
        except TimeoutError:
            continue


class _no_lock:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False
