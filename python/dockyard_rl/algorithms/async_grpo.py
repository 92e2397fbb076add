"""Asynchronous GRPO: generation and scoring never wait for training, and the reverse.

    collector actor:   prompts -> samples -> rewards -> one group per prompt -> replay buffer
    trainer (this):    collector.sample(num_prompts_per_step groups, no older than the bound)
                       -> batch -> log-probs -> train -> mark stale -> sync the engines

The collector (async_utils/collector.py) is a Ray actor on the driver's node holding the replay
buffer; it samples from the same engines through a picklable client (`generation.client()`) and
scores through its own copy of the environment. A group trained while the trainer holds weight
version v (`synchronizer.trainer_version`: s - 1 at step s, s after a warm start) is at most
`async_grpo.max_trajectory_age_steps` versions old, strictly, counted from the OLDEST version
that produced any of its samples; older ones are dropped by the buffer and counted
(`async/num_groups_dropped_stale`), and their prompts handed out again.

Weight updates: with `async_grpo.in_flight_weight_updates` the trainer syncs the engines while
the collector generates (vLLM pauses, swaps weights, resumes). Without it the trainer pauses the
collector first (`pause_generation` waits for the round being generated), so a sync never changes
weights under a request.

Timeouts: the trainer waits for the collector at most `async_grpo.sample_timeout_s` (for a
step's groups, and for the round in flight before a sync without in-flight updates), and the
collector for room in the buffer at most `async_grpo.push_timeout_s`; a hung collector or trainer
then fails the run with a TimeoutError naming the key (async_utils/collector.py).

The loss must correct for off-policy samples (`loss_fn.use_importance_sampling_correction`,
enforced by the config): the engine's log-probs (`generation_logprobs`) are the behaviour policy.

Experience over the data plane (`data_plane: {transport: ray_direct}`): the collector actor
builds each step's training batch itself (the same rollouts.assemble_train_batch) and sends
shard r to policy rank r (data_plane/experience.py); the trainer gets a `RemoteBatch` handle,
the step's metrics and its sample-log rows, and the policy's ranks compute log-probs and train
from the shards they hold. No experience tensor passes through the driver. The plane connects
the collector (producer) to the ranks (receivers) once, when the collector starts, and closes
when it stops. `data_plane: null` keeps the driver path (`sample_groups`).

Checkpoints hold, besides the policy: the collector's snapshot (its prompt sampler, the prompts of
the round in flight, generated again on resume, and the buffered groups with their versions), so a
resumed run trains on exactly the prompts an uninterrupted one would hand out. Samples are seeded
per prompt draw and sample (utils/seeding.py), so a sample generated under the same weight
versions as in the uninterrupted run is identical; which version generates a round depends on
timing (docs/algorithms.md, "Resume").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import ray
from ray.actor import ActorHandle

from dockyard_rl.algorithms.async_utils.collector import (
    TrajectoryCollector,
    sample_groups,
    send_step_groups,
    start_collector,
)
from dockyard_rl.algorithms.async_utils.event_loops import close_loop
from dockyard_rl.algorithms.grpo_setup import GRPORun
from dockyard_rl.algorithms.grpo_steps import (
    finish_step,
    log_sample_rows,
    maybe_validate,
    refresh_engine_weights,
    train_batch,
    train_on_rollouts,
)
from dockyard_rl.data_plane.config import DataPlaneConfig
from dockyard_rl.data_plane.interfaces import DataPlane

logger = logging.getLogger(__name__)

# How long stopping the collector waits for its loop: a normal stop lets the round in flight end;
# after a failure (perhaps that round hung) the actor is killed soon.
_STOP_WAIT_S = 300.0
_STOP_WAIT_AFTER_FAILURE_S = 5.0


def async_grpo_train(run: GRPORun) -> None:
    """The asynchronous loop (module docstring), from `run.step + 1` to `grpo.max_num_steps`."""
    config = run.config
    extras = run.resumed.extras if run.resumed else {}
    collector = start_collector(
        run.runner.with_generation(run.generation.client()),
        run.train,
        run.sampler.state_dict(),
        cluster_config=config.cluster,
        num_prompts=config.grpo.num_prompts_per_step,
        num_samples=config.grpo.num_generations_per_prompt,
        seed=config.data.seed,
        buffer_config=config.async_grpo,
        redo=extras.get("in_flight", []),
        buffered=extras.get("buffer", []),
        data_plane=config.data_plane is not None,
    )
    loop = asyncio.new_event_loop()
    stop_wait_s = _STOP_WAIT_AFTER_FAILURE_S
    plane: DataPlane | None = None
    try:
        if config.data_plane is not None:
            plane = connect_data_plane(run, collector, config.data_plane)
        refresh_engine_weights(run)
        maybe_validate(run, loop, at_start=True)
        ray.get(collector.start.remote())
        while run.step < config.grpo.max_num_steps:
            step = run.step + 1
            waited = time.monotonic()
            if config.data_plane is None:  # the driver path; else the plane connected above
                records = sample_groups(
                    collector,
                    config.grpo.num_prompts_per_step,
                    run.synchronizer.trainer_version,
                    config.async_grpo.sample_timeout_s,
                )
                run.logger.add_time("buffer_wait", time.monotonic() - waited)
                logger.info(
                    "step %d: prompts %s",
                    step,
                    json.dumps([r.payload.instances[0].instance_id for r in records]),
                )
                metrics = train_on_rollouts(run, [r.payload for r in records], step)
            else:
                # The wait includes building the batch and sending it to the ranks.
                experience = send_step_groups(
                    collector,
                    config.grpo.num_prompts_per_step,
                    run.synchronizer.trainer_version,
                    config.async_grpo.sample_timeout_s,
                    step,
                    transfer_grace_s=config.policy.dp_size * config.data_plane.transfer_timeout_s,
                )
                run.logger.add_time("buffer_wait", time.monotonic() - waited)
                logger.info("step %d: prompts %s", step, json.dumps(experience.prompts))
                log_sample_rows(step, experience.sample_rows)
                metrics = train_batch(run, experience.batch, step, experience.metrics)
            metrics.update(
                {f"async/{k}": v for k, v in ray.get(collector.metrics.remote()).items()}
            )
            with run.logger.timer("weight_sync"):
                if config.async_grpo.in_flight_weight_updates:
                    refresh_engine_weights(run)
                else:
                    ray.get(collector.pause_generation.remote(config.async_grpo.sample_timeout_s))
                    try:
                        refresh_engine_weights(run)
                    finally:
                        ray.get(collector.resume_generation.remote())
            # The collector's prompt sampler is the run's in async mode: the checkpoint takes its
            # state from the snapshot.
            snapshot = ray.get(collector.snapshot.remote())
            run.sampler.load_state_dict(snapshot.pop("sampler"))
            finish_step(run, loop, step, metrics, extras=snapshot)
        maybe_validate(run, loop, at_end=True)
        stop_wait_s = _STOP_WAIT_S
    finally:
        try:
            ray.get(collector.stop.remote(stop_wait_s), timeout=stop_wait_s + 30)
        except Exception as error:  # shutting down: the actor may be gone already
            logger.warning("stopping the trajectory collector failed: %s", error)
        if plane is not None:
            plane.close()
        ray.kill(collector)
        run.logger.finish()
        close_loop(loop)


def connect_data_plane(
    run: GRPORun, collector: ActorHandle[TrajectoryCollector], config: DataPlaneConfig
) -> DataPlane:
    """The data plane (`config`: the recipe's `data_plane`) from the collector actor (producer,
    on the driver's node) to the policy's rank actors (receivers, on the trainer fleet),
    endpoints opened in each; returns the plane (`close()` it when the collector stops). Raises
    ValueError for actors that cannot take part (data_plane/ray_direct.py) or a policy backend
    without receivers."""
    from dockyard_rl.data_plane.factory import create_data_plane

    plane = create_data_plane(config, name=f"grpo-{run.run_dir.name}")
    try:
        endpoints = plane.connect([collector], run.policy.data_plane_receivers())
        run.policy.open_data_plane(endpoints.receivers, config.receive_timeout_s)
        ray.get(
            collector.open_data_plane.remote(
                endpoints.senders[0], run.config.grpo.advantage, run.pad_token_id
            )
        )
    except BaseException:
        plane.close()
        raise
    return plane
