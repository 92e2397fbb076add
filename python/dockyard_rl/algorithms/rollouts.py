"""One round of single-shot SWE rollouts, and the training batch built from them.

    runner = RolloutRunner(generation, environment, processor, max_response_tokens=T, run_seed=s)
    rollout = await runner.run(instances, num_samples=N, global_step=step, prompt_keys=keys)
    batch, stats = build_train_batch(rollout, advantage_cfg, pad_token_id)

`run`: each instance's prompt (the data layer's processor: problem statement + the code the task
touches, in the model's chat template) -> N samples from the engines -> the patch parsed from
each response (`patch_formats.parse_model_output`) -> every sample scored by the environment
(the sandbox executor runs the repository's tests) -> shaped rewards and sample masks.
Samples are laid out group-contiguous: sample i belongs to prompt i // N.

Seeds: with a `run_seed` and the prompts' `prompt_keys` (training: their draw indices in the prompt
sampler's stream; validation: their positions in the validation list), sample i of a prompt is
generated with seed `utils/seeding.sample_seed(run_seed, purpose, key, instance_id, i, turn=0)`,
so a resumed run samples what the killed run sampled (same weights, same engine layout).
`sample_digest` fingerprints a sample's tokens for the per-step sample log.

`build_train_batch`: the (B, S) tensors the policy trains on (keys: `batch_layouts.RolloutBatch`;
legend: B = samples, S = tokens, right-padded prompt + response). A group whose samples are all
masked (no verdict: sandbox infrastructure errors) is dropped and counted, never trained on as
zeros; masked samples of other groups stay in with sample_mask 0. Advantages are leave-one-out per
group (algorithms/advantages.py) over the valid samples. `generation_logprobs` are the engine's
log-probs of the sampled tokens (what the importance-sampling correction of async GRPO compares
against); the trainer's own `prev_logprobs` are recomputed by the loop.

Multi-turn episodes are agent_rollouts.py's (same `Rollout`, and `build_train_batch` masks their
tool outputs). Not covered: prompts longer than the engine's
context (the processor's token budget keeps them short; the engine refuses longer ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from dockyard_rl.algorithms.advantages import (
    AdvantageConfig,
    broadcast_to_tokens,
    compute_advantages,
)
from dockyard_rl.data.patch_formats import git_file_reader, parse_model_output
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.data_plane.experience import RemoteBatch
from dockyard_rl.distributed.batch_layouts import RolloutBatch
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.environments.agent_env import agent_metrics
from dockyard_rl.environments.interfaces import EnvironmentResult
from dockyard_rl.environments.swe_env import SweRollout
from dockyard_rl.models.generation.interfaces import GenerationSample
from dockyard_rl.utils.seeding import prompt_seeds


@dataclasses.dataclass
class Rollout:
    """One round: `instances` (G prompts) x `num_samples` (N) samples, group-contiguous."""

    instances: list[SweInstance]
    num_samples: int
    samples: list[GenerationSample]  # B = G * N, sample i of prompt i // N
    result: EnvironmentResult  # rewards_B, sample_mask_B, metadata, metrics
    generate_seconds: float = 0.0
    score_seconds: float = 0.0
    # Per instance: the key its samples' seeds were derived from (module docstring), or None.
    prompt_keys: list[int] | None = None

    @property
    def rewards_B(self) -> torch.Tensor:
        return self.result.rewards_B

    @property
    def sample_mask_B(self) -> torch.Tensor:
        return self.result.sample_mask_B

    def metrics(self) -> dict[str, float]:
        """Per-round figures: reward, resolve / apply / parse rates, response length, versions."""
        meta = self.result.metadata
        valid = self.sample_mask_B.bool()
        num_valid = max(int(valid.sum()), 1)
        lengths = torch.tensor([float(len(s.response_token_ids)) for s in self.samples])
        return {
            "reward_mean": float(self.rewards_B[valid].sum()) / num_valid,
            "resolve_rate": sum(bool(m.get("resolved")) for m in meta) / len(meta),
            "apply_rate": sum(map(patch_applied, meta)) / len(meta),
            "parse_failure_rate": sum(m.get("parse_failure") is not None for m in meta) / len(meta),
            "integrity_violations": float(sum(bool(m.get("integrity_violation")) for m in meta)),
            "infra_errors": float(sum(m.get("infra_error") is not None for m in meta)),
            "response_length_mean": float(lengths.mean()) if len(lengths) else 0.0,
            "oldest_weight_version": float(min(s.oldest_weight_version for s in self.samples)),
            **{k: float(v) for k, v in self.result.metrics.items()},
            **agent_metrics(meta),  # multi-turn episodes' turns, tool calls, ends
        }


def patch_applied(meta: Mapping[str, Any]) -> bool:
    """Whether a sample's patch reached the sandbox and applied, from its environment metadata.
    A sample that never produced a patch (a parse failure: no task id) has `apply_failure`
    False too, since nothing failed to apply; it counts as not applied."""
    return meta.get("task_id") is not None and meta.get("apply_failure") is False


class Rollouts(Protocol):
    """What the loops and the trajectory collector need from a rollout runner: the single-shot
    `RolloutRunner` below and the multi-turn `agent_rollouts.AgentRolloutRunner` both are one."""

    async def run(
        self,
        instances: Sequence[SweInstance],
        *,
        num_samples: int,
        global_step: int,
        sampling_overrides: Mapping[str, Any] | None = None,
        prompt_keys: Sequence[int] | None = None,
        purpose: str = "train",
    ) -> Rollout:
        """G instances x `num_samples` samples, generated and scored (module docstring)."""
        ...

    def with_generation(self, generation: Any) -> Rollouts:
        """The same runner over another generation backend (the collector's engine client)."""
        ...


class RolloutRunner:
    """Prompts -> samples -> patches -> rewards, for any list of instances (module docstring).

    Args:
        generation: the engines (`GenerationInterface`).
        environment: the scorer (`SweEnvironment`).
        processor: the data layer's prompt processor (`SwePromptProcessor(tokenizer, cfg)`).
        max_response_tokens: the generation's max_tokens (the length stage's reference).
        run_seed: the run's seed (`grpo.seed`) for per-sample seeds; None: unseeded sampling.
    """

    def __init__(
        self,
        generation,
        environment,
        processor,
        *,
        max_response_tokens: int,
        thinking_required: bool = False,
        run_seed: int | None = None,
    ):
        self.generation = generation
        self.run_seed = run_seed
        self.environment = environment
        self.processor = processor
        self.max_response_tokens = max_response_tokens
        self.thinking_required = thinking_required
        self._prompts: dict[str, Any] = {}  # instance id -> Prompt (built once per instance)

    def with_generation(self, generation) -> RolloutRunner:
        """A runner like this one that samples from `generation` instead (async GRPO's collector
        actor gets one over an engine client: `GenerationInterface.client()`)."""
        return RolloutRunner(
            generation,
            self.environment,
            self.processor,
            max_response_tokens=self.max_response_tokens,
            thinking_required=self.thinking_required,
            run_seed=self.run_seed,
        )

    def prompt(self, instance: SweInstance):
        if instance.instance_id not in self._prompts:
            read_file = git_file_reader(instance.repo, instance.base_commit)
            self._prompts[instance.instance_id] = (self.processor(instance, read_file), read_file)
        return self._prompts[instance.instance_id]

    async def run(
        self,
        instances: Sequence[SweInstance],
        *,
        num_samples: int,
        global_step: int,
        sampling_overrides: Mapping[str, Any] | None = None,
        prompt_keys: Sequence[int] | None = None,
        purpose: str = "train",
    ) -> Rollout:
        """Generates and scores (module docstring). `prompt_keys` (one per instance) and the
        runner's `run_seed` seed every sample; without either, sampling is unseeded."""
        start = time.monotonic()
        prompts = [self.prompt(instance) for instance in instances]
        samples: list[GenerationSample | None] = [None] * (len(instances) * num_samples)
        seeds = None
        if prompt_keys is not None and self.run_seed is not None:
            seeds = prompt_seeds(
                self.run_seed,
                purpose,
                list(prompt_keys),
                [instance.instance_id for instance in instances],
                num_samples,
            )
        async for sample in self.generation.generate(
            [prompt.token_ids for prompt, _ in prompts],
            num_samples,
            sampling_overrides=sampling_overrides,
            seeds=seeds,
        ):
            samples[sample.prompt_index * num_samples + sample.sample_index] = sample
        assert all(s is not None for s in samples), "the engine returned fewer samples"
        generated = time.monotonic()
        rollouts = []
        for index, sample in enumerate(samples):
            instance = instances[index // num_samples]
            prompt, read_file = prompts[index // num_samples]
            parsed = parse_model_output(
                sample.response_text, prompt.patch_format, read_file, prompt.files_shown
            )
            rollouts.append(
                SweRollout(
                    instance=instance.to_task_spec(""),
                    patch=parsed.patch,
                    invalid_reason=None if parsed.valid else parsed.invalid_reason.value,
                    response_text=sample.response_text,
                    response_length=len(sample.response_token_ids),
                    max_response_length=self.max_response_tokens,
                    thinking_required=self.thinking_required,
                    reference_patch=instance.patch,
                )
            )
        result = await self.environment.step(rollouts, global_step=global_step)
        return Rollout(
            list(instances),
            num_samples,
            samples,
            result,
            generate_seconds=generated - start,
            score_seconds=time.monotonic() - generated,
            prompt_keys=None if prompt_keys is None else list(prompt_keys),
        )


def sample_digest(sample: GenerationSample) -> str:
    """A short fingerprint of a sample's response token ids (the per-step sample log)."""
    data = ",".join(map(str, sample.response_token_ids)).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclasses.dataclass(frozen=True)
class BatchStats:
    num_groups: int
    num_dropped_groups: int  # every sample masked: not trained on
    num_samples: int  # in the batch
    num_masked_samples: int  # in the batch with sample_mask 0


def build_train_batch(
    rollout: Rollout, advantage_cfg: AdvantageConfig, pad_token_id: int = 0
) -> tuple[BatchedDataDict[RolloutBatch] | None, BatchStats]:
    """The training batch of `rollout` (module docstring); None when every group was dropped.
    Its keys are `batch_layouts.RolloutBatch` without the optional log-probs the loop adds."""
    n = rollout.num_samples
    num_groups = len(rollout.instances)
    mask_GN = rollout.sample_mask_B.view(num_groups, n)
    kept_groups = [g for g in range(num_groups) if bool(mask_GN[g].any())]
    stats = BatchStats(
        num_groups=num_groups,
        num_dropped_groups=num_groups - len(kept_groups),
        num_samples=len(kept_groups) * n,
        num_masked_samples=int((mask_GN[kept_groups] == 0).sum()),
    )
    if not kept_groups:
        return None, stats
    keep = [g * n + i for g in kept_groups for i in range(n)]
    samples = [rollout.samples[i] for i in keep]
    rewards_B = rollout.rewards_B[keep]
    sample_mask_B = rollout.sample_mask_B[keep]
    advantages_B = compute_advantages(rewards_B, n, advantage_cfg, sample_mask_B.bool())
    batch = pack_sequences(
        [(s.prompt_token_ids, s.response_token_ids) for s in samples], pad_token_id
    )
    token_mask_BS = batch["token_mask"]
    generation_logprobs_BS = torch.zeros_like(token_mask_BS)
    for b, sample in enumerate(samples):
        response = token_mask_BS[b] > 0
        generation_logprobs_BS[b, response] = torch.tensor(sample.response_logprobs)
        if sample.response_mask is not None:
            # A multi-turn episode: tool outputs and chat markup are context, not actions.
            token_mask_BS[b, response] = torch.tensor(sample.response_mask, dtype=torch.float32)
    batch.update(
        sample_mask=sample_mask_B.float(),
        advantages=broadcast_to_tokens(advantages_B, token_mask_BS),
        generation_logprobs=generation_logprobs_BS,
        weight_version=torch.tensor([s.oldest_weight_version for s in samples]),
    )
    return batch.validate(RolloutBatch, allow_extra_keys=False), stats


def pack_sequences(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int
) -> BatchedDataDict[Any]:
    """(prompt ids, response ids) pairs as the policy's (B, S) layout: input_ids (prompt +
    response, right-padded with `pad_token_id`), input_lengths (B,), token_mask (1 on the
    response tokens, 0 on prompt and padding); see batch_layouts.TrainBatch."""
    packed = BatchedDataDict.from_sequences(
        {
            "input_ids": [
                torch.tensor([*prompt, *response], dtype=torch.int64) for prompt, response in pairs
            ],
            "token_mask": [
                torch.cat([torch.zeros(len(prompt)), torch.ones(len(response))])
                for prompt, response in pairs
            ],
        },
        pad_values={"input_ids": pad_token_id},
        lengths_key="input_lengths",
    )
    return packed.select_keys(("input_ids", "input_lengths", "token_mask"))  # the layout's order


def pad_to_dp_multiple(batch: BatchedDataDict, multiple: int) -> BatchedDataDict:
    """Pads with masked copies of the last sample (sample_mask 0: no effect on the loss) so
    every data-parallel rank gets the same number of samples. Copies, not zero rows: a padding
    row keeps a real length, which every policy backend accepts."""
    size = batch.batch_size
    missing = -size % multiple
    if not missing:
        return batch
    padding = batch.select_indices([size - 1] * missing)
    padding["sample_mask"] = torch.zeros_like(padding["sample_mask"])
    return BatchedDataDict.concat([batch, padding])


# Padding of each field when batches of different widths are concatenated.
_CONCAT_PAD_FIELDS = ("token_mask", "advantages", "generation_logprobs")


def assemble_train_batch(
    rollouts: Sequence[Rollout],
    advantage_cfg: AdvantageConfig,
    pad_token_id: int,
    dp_size: int,
) -> tuple[BatchedDataDict[RolloutBatch] | None, list[BatchStats]]:
    """One step's training batch from its rollouts: `build_train_batch` of each, concatenated
    (right-padded to the widest), padded to a multiple of `dp_size` (`pad_to_dp_multiple`).
    None when every group was dropped. The one place a step's batch is built: the driver's
    loops and, with a data plane, async GRPO's collector actor call it."""
    batches, stats = [], []
    for rollout in rollouts:
        batch, batch_stats = build_train_batch(rollout, advantage_cfg, pad_token_id)
        stats.append(batch_stats)
        if batch is not None:
            batches.append(batch)
    if not batches:
        return None, stats
    batch = (
        BatchedDataDict.concat(
            batches,
            pad_values={"input_ids": pad_token_id, **dict.fromkeys(_CONCAT_PAD_FIELDS, 0)},
        )
        if len(batches) > 1
        else batches[0]
    )
    return pad_to_dp_multiple(batch, dp_size), stats


def rollout_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Sample-weighted means of the rollouts' metrics."""
    weights = [len(r.samples) for r in rollouts]
    per_rollout = [r.metrics() for r in rollouts]
    keys = set().union(*per_rollout)
    return {
        key: sum(w * m.get(key, 0.0) for w, m in zip(weights, per_rollout)) / sum(weights)
        for key in sorted(keys)
    }


def sample_log_rows(rollouts: Sequence[Rollout]) -> list[dict[str, Any]]:
    """One row per sample for the per-step sample log: its prompt, prompt key (the sampler
    draw its seed derives from), sample index, seed, weight versions, token count and a digest
    of its token ids (what tells a resumed run's samples from an uninterrupted run's)."""
    rows = []
    for rollout in rollouts:
        for b, sample in enumerate(rollout.samples):
            g = b // rollout.num_samples
            rows.append(
                {
                    "prompt": rollout.instances[g].instance_id,
                    "key": None if rollout.prompt_keys is None else rollout.prompt_keys[g],
                    "sample": sample.sample_index,
                    "seed": sample.seed,
                    "versions": list(sample.weight_versions),
                    "oldest_version": sample.oldest_weight_version,
                    "tokens": len(sample.response_token_ids),
                    "digest": sample_digest(sample),
                }
            )
    return rows


def valid_weight_versions(batch: BatchedDataDict[RolloutBatch] | RemoteBatch) -> torch.Tensor:
    """The weight version of every sample with sample_mask 1 (int64): of a training batch, or
    of a `data_plane.experience.RemoteBatch`, which carries them for the driver."""
    if isinstance(batch, BatchedDataDict):
        return batch["weight_version"][batch["sample_mask"] > 0]
    return torch.tensor(batch.valid_weight_versions, dtype=torch.int64)
