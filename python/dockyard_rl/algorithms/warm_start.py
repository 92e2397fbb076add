"""Supervised warm start: a few epochs of next-token training on gold answers, before GRPO.

    warm_start:                       # section of the recipe; null (the default) = off
      train_path: /data/warm/tasks.jsonl   # tasks NOT in data.train_path / validation
      num_epochs: 3
      batch_size: 4
      synthesis: {packages: [xmltodict==1.0.4]}  # optional: made when train_path is missing

Why: GRPO learns only from groups whose samples differ in reward. A small model that almost
never writes a parseable answer in the run's output format (docs/learning_run.md: ~2% for
SmolLM2-135M) gives every sample of a group the same penalty, and GRPO nothing to learn from.
A few supervised steps on correct answers to *other* tasks teach the format; GRPO then learns
which edits make the tests pass.

The examples (`warm_start_examples`): every task of `train_path` is prompted exactly as the
loop prompts (the run's processor and `data.prompt`), and its gold patch is written in
`data.prompt.patch_format` (a ```diff block, SEARCH/REPLACE blocks, or the rewritten functions),
then the tokenizer's end-of-sequence token. Tasks whose gold patch the format cannot express (a
change outside any function, in the function format) are skipped and counted. A warm-start task
whose repository is also in the training or validation data is an error naming
`warm_start.train_path` at start-up (grpo_setup): it would show GRPO the answers to its own
tasks.

`run_warm_start` trains with `SupervisedLossFn` (the mean negative log-likelihood of the answer
tokens, at `policy.logprob_temperature`: the distribution the engines sample from) through the
policy's own `train`, so its optimizer, scheduler and learning rate apply (the scheduler's
warm-up counts these steps). The GRPO loop runs it once, in a fresh run before step 1, and
checkpoints the result as step 0; a resumed run never repeats it.

Multi-turn agents (`grpo.max_rollout_turns` > 1) warm-start on tool-use demonstrations instead
(`agent_warm_start_examples`): each gold patch played as an episode of view, replace, run_tests
and submit, trained on the assistant's turns only.

Not covered: a separate learning rate or optimizer for the warm start.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dockyard_rl.algorithms.rollouts import pack_sequences, pad_to_dp_multiple
from dockyard_rl.data import datasets
from dockyard_rl.data.patch_formats import git_dir_lister, git_file_reader, gold_answer
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.data.synthesis.task_synthesis import TaskSynthesisConfig
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
from dockyard_rl.environments.tool_demonstrations import build_demonstrations
from dockyard_rl.utils.config import is_int, require

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """YAML section `warm_start` (module docstring)."""

    train_path: str | None = None  # required: tasks whose gold answers are the examples
    dataset: str = "jsonl"  # loader registry name, as data.dataset
    num_epochs: int = 2  # passes over the examples
    batch_size: int = 4  # examples per optimizer step
    seed: int = 0  # the order of the examples in each epoch
    # Tasks to synthesize into train_path's folder when train_path is missing (the same shape
    # as the recipe's `synthesis` section, data/synthesis/task_synthesis.py); null = train_path
    # must exist.
    synthesis: TaskSynthesisConfig | None = None

    def __post_init__(self):
        require(
            isinstance(self.train_path, str) and bool(self.train_path.strip()),
            "train_path",
            "is required: a task file (e.g. a tasks.jsonl of synthesize_swe_tasks) whose "
            "gold patches are the examples; it must not share repositories with data",
        )
        require(
            self.dataset in datasets.dataset_names(),
            "dataset",
            f"unknown dataset loader {self.dataset!r}; valid: "
            f"{', '.join(datasets.dataset_names())}",
        )
        for key, minimum in (("num_epochs", 1), ("batch_size", 1), ("seed", 0)):
            value = getattr(self, key)
            require(
                is_int(value) and value >= minimum,
                key,
                f"must be an integer >= {minimum}, got {value!r}",
            )


@dataclasses.dataclass(frozen=True)
class WarmStartExample:
    instance_id: str
    prompt_token_ids: tuple[int, ...]
    answer_token_ids: tuple[int, ...]  # ends with the end-of-sequence token
    # Multi-turn demonstrations: 1 on the assistant's tokens, 0 on the tool outputs between its
    # turns (context, not trained on). None: every answer token is trained on.
    answer_mask: tuple[int, ...] | None = None


def warm_start_examples(
    instances: Sequence[SweInstance], processor
) -> tuple[list[WarmStartExample], int]:
    """(examples, number of tasks skipped because the format cannot express their gold patch),
    prompted by the loop's `processor` and tokenized with its tokenizer. The caller checks that
    the instances share no repository with the GRPO data (grpo_setup does, at start-up)."""
    tokenizer = processor.tokenizer
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "warm_start: the tokenizer has no end-of-sequence token to end the answers with"
        )
    examples, skipped = [], 0
    for instance in instances:
        read_file = git_file_reader(instance.repo, instance.base_commit)
        prompt = processor(instance, read_file)
        try:
            answer = gold_answer(instance.patch, prompt.patch_format, read_file)
        except ValueError as error:
            logger.info("warm start: %s skipped: %s", instance.instance_id, error)
            skipped += 1
            continue
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        examples.append(
            WarmStartExample(
                instance.instance_id,
                tuple(prompt.token_ids),
                tuple(answer_ids) + (tokenizer.eos_token_id,),
            )
        )
    return examples, skipped


def agent_warm_start_examples(
    instances: Sequence[SweInstance], renderer, user_message, *, max_tokens: int
) -> tuple[list[WarmStartExample], int]:
    """(examples, tasks skipped) for a multi-turn agent: each task's gold patch played as a
    tool-use episode (`environments/tool_demonstrations.py`: view, replace per hunk, run_tests,
    submit), tokenized by the rollouts' `renderer` from the prompt `user_message(instance)`
    gives, so the warm start trains on the token sequences episodes produce. Tool outputs are
    masked."""
    items = [
        (
            instance,
            git_file_reader(instance.repo, instance.base_commit),
            user_message(instance),
            # The demonstration finds the file first (view ".", then each directory down to
            # it): the agent is never told where the bug is.
            git_dir_lister(instance.repo, instance.base_commit),
        )
        for instance in instances
    ]
    demos, skipped = build_demonstrations(items, renderer, max_tokens=max_tokens)
    if skipped:
        logger.info("warm start: demonstrations skipped by reason: %s", dict(skipped))
    messages = {item[0].instance_id: item[2] for item in items}
    examples = []
    for demo in demos:
        prompt_length = len(renderer.initial_prompt_ids(messages[demo.instance_id]))
        examples.append(
            WarmStartExample(
                demo.instance_id,
                demo.token_ids[:prompt_length],
                demo.token_ids[prompt_length:],
                demo.mask[prompt_length:],
            )
        )
    return examples, sum(skipped.values())


def examples_batch(examples: Sequence[WarmStartExample], pad_token_id: int) -> BatchedDataDict:
    """The (B, S) batch the policy trains on: prompt + answer, right-padded; token_mask is 1 on
    the answer tokens (the layout of a GRPO batch, rollouts.pack_sequences), times the answer
    mask of a multi-turn demonstration."""
    batch = pack_sequences(
        [(e.prompt_token_ids, e.answer_token_ids) for e in examples], pad_token_id
    )
    for b, example in enumerate(examples):
        if example.answer_mask is not None:
            start = len(example.prompt_token_ids)
            end = start + len(example.answer_token_ids)
            batch["token_mask"][b, start:end] = torch.tensor(
                example.answer_mask, dtype=batch["token_mask"].dtype
            )
    batch["sample_mask"] = torch.ones(len(examples))
    return batch


class SupervisedLossFn:
    """Mean negative log-likelihood per valid token, over the global batch.

    The same call contract as ClippedPGLossFn (loss_functions.py): the loss of one microbatch
    is its sum over valid tokens divided by the global valid-token count, so microbatches and
    data-parallel shards sum to the whole batch's loss. Metrics: loss, num_valid_tokens,
    num_valid_sequences (all sum-combined)."""

    required_batch_keys = ("token_mask", "sample_mask")

    def __call__(
        self,
        logprobs_BS: torch.Tensor,
        batch: Mapping[str, Any],
        global_num_valid_tokens,
        global_num_valid_sequences,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        valid_BS = (batch["token_mask"] > 0) & (batch["sample_mask"] > 0)[:, None]
        valid_BS = valid_BS.to(logprobs_BS.device)
        logp_BS = logprobs_BS.to(torch.promote_types(logprobs_BS.dtype, torch.float32))
        # where, not multiply: padding positions may hold -inf.
        loss = -torch.where(valid_BS, logp_BS, 0.0).sum() / max(float(global_num_valid_tokens), 1.0)
        return loss, {
            "loss": float(loss.detach()),
            "num_valid_tokens": float(valid_BS.sum()),
            "num_valid_sequences": float(valid_BS.any(dim=1).sum()),
        }


def run_warm_start(
    policy,
    examples: Sequence[WarmStartExample],
    config: WarmStartConfig,
    pad_token_id: int,
    *,
    dp_size: int = 1,
) -> list[dict[str, float]]:
    """Trains `policy` on the examples (module docstring); returns one metrics dict per epoch
    (`nll_per_token` over the epoch, `steps`). A batch is padded to a multiple of `dp_size`
    with masked copies (rollouts.pad_to_dp_multiple)."""
    if not examples:
        raise ValueError(
            "warm_start.train_path: no task's gold patch could be made into an example (in the "
            "run's output format, data.prompt.patch_format, or as a tool-use demonstration that "
            "fits env.agent.max_episode_tokens; the log says why each was skipped); nothing to "
            "train on"
        )
    loss_fn = SupervisedLossFn()
    order = list(examples)
    rng = random.Random(config.seed)
    history = []
    for epoch in range(config.num_epochs):
        rng.shuffle(order)
        nll_sum, num_tokens, steps = 0.0, 0.0, 0
        for start in range(0, len(order), config.batch_size):
            batch = pad_to_dp_multiple(
                examples_batch(order[start : start + config.batch_size], pad_token_id), dp_size
            )
            metrics = policy.train(batch, loss_fn)
            # The loss is the batch's mean NLL per token; the token count makes it a sum again.
            nll_sum += metrics["loss"] * metrics["num_valid_tokens"]
            num_tokens += metrics["num_valid_tokens"]
            steps += 1
        history.append({"nll_per_token": nll_sum / max(num_tokens, 1), "steps": float(steps)})
        logger.info(
            "warm start epoch %d/%d: nll per token %.3f over %d steps",
            epoch + 1,
            config.num_epochs,
            history[-1]["nll_per_token"],
            steps,
        )
    return history


__all__ = [
    "SupervisedLossFn",
    "WarmStartConfig",
    "WarmStartExample",
    "examples_batch",
    "run_warm_start",
    "warm_start_examples",
]
