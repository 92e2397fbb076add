"""Tests of prompt_sampler.py: every epoch hands out each prompt once, the order is pinned, and
a sampler resumed from its state (with any batch size) continues the uninterrupted stream."""

import json

import pytest

from dockyard_rl.data.prompt_sampler import PromptSampler


def stream(sampler: PromptSampler, num_batches: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(num_batches)]


def test_each_epoch_hands_out_every_prompt_once_in_a_fresh_order():
    sampler = PromptSampler(num_prompts=7, batch_size=3, seed=0)
    flat = [i for batch in stream(sampler, 7) for i in batch]  # 21 prompts = 3 epochs
    epochs = [flat[0:7], flat[7:14], flat[14:21]]
    assert all(sorted(epoch) == list(range(7)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3
    state = sampler.state_dict()
    assert (state["epoch"], state["position"], sampler.num_consumed) == (3, 0, 21)
    assert epochs == [sampler.permutation(e) for e in range(3)]


def test_the_order_is_pinned():
    # A changed order would make runs started with an older version resume differently.
    pinned = [3, 6, 7, 0, 1, 5, 9, 8, 4, 2]
    assert PromptSampler(10, 4, seed=0).permutation(0) == pinned
    assert PromptSampler(10, 1, seed=0).permutation(0) == pinned  # independent of batch size
    assert PromptSampler(10, 4, seed=1).permutation(0) != pinned


@pytest.mark.parametrize("num_prompts, batch_size", [(7, 3), (6, 3), (2, 5), (1, 1)])
def test_resume_at_any_point_gives_the_uninterrupted_sequence(num_prompts, batch_size):
    uninterrupted = stream(PromptSampler(num_prompts, batch_size, seed=11), 12)
    for stop in range(12):
        first = PromptSampler(num_prompts, batch_size, seed=11)
        before = stream(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        resumed = PromptSampler(num_prompts, batch_size, seed=11)
        resumed.load_state_dict(state)
        assert before + stream(resumed, 12 - stop) == uninterrupted


def test_resume_with_another_batch_size_continues_the_same_prompt_stream():
    flat = [i for batch in stream(PromptSampler(7, 3, seed=5), 6) for i in batch]
    first = PromptSampler(7, 3, seed=5)
    before = [i for batch in stream(first, 2) for i in batch]
    resumed = PromptSampler(7, 4, seed=5)
    resumed.load_state_dict(first.state_dict())
    after = [i for batch in stream(resumed, 3) for i in batch]
    assert before + after == flat[:18]


def test_sampler_state_from_other_data_is_rejected():
    state = PromptSampler(7, 3, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed 5 over 7 prompts, this run has seed 6 over 7"):
        PromptSampler(7, 3, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="over 8"):
        PromptSampler(8, 3, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="0 <= position < 7"):
        PromptSampler(7, 3, seed=5).load_state_dict({**state, "position": 7})
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        PromptSampler(7, 0, seed=5)
