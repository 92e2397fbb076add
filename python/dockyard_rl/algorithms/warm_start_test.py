import dataclasses

import pytest
import torch
import transformers

from dockyard_rl.algorithms.warm_start import (
    SupervisedLossFn,
    WarmStartConfig,
    examples_batch,
    run_warm_start,
    warm_start_examples,
)
from dockyard_rl.data.patch_formats import PatchFormat, git_file_reader, parse_model_output
from dockyard_rl.data.processors import PromptConfig, SwePromptProcessor
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.losses.loss_functions import count_valid
from dockyard_rl.models.zoo import resolve_model
from dockyard_rl.sandbox import testing_repos
from dockyard_rl.utils.config import from_dict


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("zoo"))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    toy = testing_repos.make_toy_repo(tmp_path_factory.mktemp("toy") / "repo")
    row = {
        "instance_id": "toy__calc-1",
        "repo": str(toy.path),
        "base_commit": toy.base_commit,
        "patch": toy.gold_patch,
        "test_patch": toy.test_patch,
        "FAIL_TO_PASS": list(toy.fail_to_pass),
        "PASS_TO_PASS": list(toy.pass_to_pass),
        "problem_statement": "mul adds",
        "version": "1.0",
    }
    # The same task with a gold patch that also changes a module-level line: the function
    # format cannot express it.
    outside = toy.patch_for(
        {"calc/ops.py": testing_repos.OPS_FIXED.replace("def add", "LIMIT = 10\n\n\ndef add", 1)}
    )
    return [
        SweInstance.from_row(row, 0, "toy.jsonl"),
        SweInstance.from_row(
            {**row, "instance_id": "toy__calc-2", "patch": outside}, 1, "toy.jsonl"
        ),
    ]


@pytest.mark.parametrize("patch_format", list(PatchFormat))
def test_examples_are_the_loop_prompt_then_the_gold_answer_in_the_format(
    tokenizer, instances, patch_format
):
    processor = SwePromptProcessor(tokenizer, PromptConfig(patch_format=patch_format.value))
    examples, skipped = warm_start_examples(instances, processor)
    assert skipped == (1 if patch_format is PatchFormat.FUNCTION else 0)
    example = examples[0]
    read_file = git_file_reader(instances[0].repo, instances[0].base_commit)
    prompt = processor(instances[0], read_file)
    assert example.prompt_token_ids == prompt.token_ids
    assert example.answer_token_ids[-1] == tokenizer.eos_token_id
    answer = tokenizer.decode(list(example.answer_token_ids[:-1]))
    # What the loop would parse from that answer is the gold patch's change.
    parsed = parse_model_output(answer, patch_format, read_file, prompt.files_shown)
    assert parsed.valid, parsed.detail
    assert "+    return a * b" in parsed.patch and "-    return a + b" in parsed.patch


def test_the_batch_masks_everything_but_the_answers(tokenizer, instances):
    processor = SwePromptProcessor(tokenizer, PromptConfig(patch_format="diff"))
    examples, _ = warm_start_examples(instances, processor)
    batch = examples_batch(examples, pad_token_id=0)
    for b, example in enumerate(examples):
        prompt_len, answer_len = len(example.prompt_token_ids), len(example.answer_token_ids)
        assert int(batch["input_lengths"][b]) == prompt_len + answer_len
        assert batch["token_mask"][b].tolist() == (
            [0.0] * prompt_len
            + [1.0] * answer_len
            + [0.0] * (batch["input_ids"].shape[1] - prompt_len - answer_len)
        )
        assert batch["input_ids"][b, prompt_len : prompt_len + answer_len].tolist() == list(
            example.answer_token_ids
        )
    assert batch["sample_mask"].tolist() == [1.0, 1.0]


def test_the_loss_is_the_mean_nll_and_microbatches_sum_to_the_batch():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.4, 1.0]], dtype=torch.float64))
    batch = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        "sample_mask": torch.tensor([1.0, 1.0]),
    }
    loss_fn = SupervisedLossFn()
    loss, metrics = loss_fn(logprobs, batch, 4, 2)
    expected = -(torch.log(torch.tensor([0.25, 0.1, 0.2, 0.4], dtype=torch.float64))).mean()
    assert float(loss) == pytest.approx(float(expected))
    assert metrics["num_valid_tokens"] == 4.0 and metrics["num_valid_sequences"] == 2.0
    halves = [
        loss_fn(logprobs[i : i + 1], {k: v[i : i + 1] for k, v in batch.items()}, 4, 2)[0]
        for i in range(2)
    ]
    assert float(sum(halves)) == pytest.approx(float(loss))
    # A masked sample does not count, even where its log-probs are -inf (padding).
    masked = {**batch, "sample_mask": torch.tensor([1.0, 0.0])}
    padded = logprobs.clone()
    padded[1] = float("-inf")
    loss, metrics = loss_fn(padded, masked, 2, 1)
    assert torch.isfinite(loss) and metrics["num_valid_tokens"] == 2.0


class _RecordingPolicy:
    def __init__(self):
        self.batches = []

    def train(self, batch, loss_fn):
        self.batches.append(batch)
        logprobs = torch.full(batch["input_ids"].shape, -2.0, requires_grad=True)
        loss, metrics = loss_fn(logprobs, batch, *count_valid(batch))
        return {**metrics, "grad_norm": 1.0, "learning_rate": 1e-3}


def test_run_warm_start_goes_over_every_example_each_epoch_in_dp_sized_batches(
    tokenizer, instances
):
    processor = SwePromptProcessor(tokenizer, PromptConfig(patch_format="diff"))
    examples, _ = warm_start_examples(instances, processor)
    examples = examples + [dataclasses.replace(examples[0], instance_id="third")]
    config = from_dict(
        WarmStartConfig,
        {"train_path": "unused.jsonl", "num_epochs": 2, "batch_size": 2},
        "warm_start",
    )
    policy = _RecordingPolicy()
    history = run_warm_start(policy, examples, config, pad_token_id=0, dp_size=2)
    assert [epoch["steps"] for epoch in history] == [2.0, 2.0]
    # 3 examples in batches of 2: the last batch gets a masked copy so 2 ranks split it evenly.
    assert [b.batch_size for b in policy.batches] == [2, 2, 2, 2]
    assert [b["sample_mask"].tolist() for b in policy.batches] == [[1.0, 1.0], [1.0, 0.0]] * 2
    assert history[0]["nll_per_token"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({}, "warm_start.train_path"),
        ({"train_path": "t.jsonl", "num_epochs": 0}, "warm_start.num_epochs"),
        ({"train_path": "t.jsonl", "batch_size": 0}, "warm_start.batch_size"),
        ({"train_path": "t.jsonl", "dataset": "nope"}, "warm_start.dataset"),
    ],
)
def test_bad_configs_name_the_key(raw, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        from_dict(WarmStartConfig, raw, "warm_start")


def test_no_example_is_a_clear_error():
    config = from_dict(WarmStartConfig, {"train_path": "t.jsonl"}, "warm_start")
    with pytest.raises(ValueError, match="data.prompt.patch_format"):
        run_warm_start(_RecordingPolicy(), [], config, pad_token_id=0)
