"""Tests of training_state.py: the trainer-state round trip (RNG streams continue, extras and
config come back), its errors, and a miniature training loop that crashes and resumes exactly
from a checkpoint directory."""

import pathlib
import random

import numpy as np
import pytest
import torch

from dockyard_rl.data.prompt_sampler import PromptSampler
from dockyard_rl.utils.checkpoint import CheckpointingConfig, CheckpointManager
from dockyard_rl.utils.config import from_dict
from dockyard_rl.utils.training_state import (
    RngState,
    TrainerState,
    load_trainer_state,
    save_trainer_state,
)


def config(**overrides) -> CheckpointingConfig:
    return from_dict(CheckpointingConfig, overrides, "checkpointing")


def draw() -> tuple:
    return (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (2,)).tolist(),
    )


def test_trainer_state_round_trip_continues_the_rng_streams(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draw()
    sampler = PromptSampler(num_prompts=5, batch_size=2, seed=7)
    sampler.next_batch()
    buffer = {"trajectories": [torch.arange(4), {"reward": 1.0}], "versions": [3, 4]}
    state = TrainerState(
        step=12,
        weight_version=12,
        sampler=sampler.state_dict(),
        rng=RngState.capture(),
        config_text="grpo:\n  val_period: 5\n",
        extras={"replay_buffer": buffer, "collector": {"in_flight": [1, 2]}},
    )
    expected = [draw() for _ in range(3)]

    save_trainer_state(tmp_path / "trainer_state", state)
    draw()  # the RNGs move on; loading must bring them back
    loaded = load_trainer_state(tmp_path / "trainer_state")
    loaded.rng.restore()
    assert [draw() for _ in range(3)] == expected
    assert (loaded.step, loaded.weight_version) == (12, 12)
    assert loaded.config_text == "grpo:\n  val_period: 5\n"
    assert loaded.sampler == sampler.state_dict()
    assert sorted(loaded.extras) == ["collector", "replay_buffer"]
    assert torch.equal(loaded.extras["replay_buffer"]["trajectories"][0], torch.arange(4))
    assert loaded.extras["replay_buffer"]["versions"] == [3, 4]
    assert loaded.extras["collector"] == {"in_flight": [1, 2]}
    files = sorted(
        str(p.relative_to(tmp_path / "trainer_state"))
        for p in (tmp_path / "trainer_state").rglob("*")
        if p.is_file()
    )
    assert files == [
        "config.yaml",
        "extras/collector.pt",
        "extras/replay_buffer.pt",
        "rng.pkl",
        "trainer_state.json",
    ]


def test_trainer_state_errors(tmp_path):
    rng = RngState.capture()
    with pytest.raises(ValueError, match=r"TrainerState\.step must be an integer >= 0"):
        TrainerState(step=-1, weight_version=0, sampler={}, rng=rng)
    with pytest.raises(ValueError, match=r"extras: name '\.\./x' must match"):
        TrainerState(step=0, weight_version=0, sampler={}, rng=rng, extras={"../x": 1})
    state = TrainerState(step=0, weight_version=0, sampler={}, rng=rng, extras={"a": 1})
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "old.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_trainer_state(tmp_path / "used", state)
    with pytest.raises(ValueError, match=r"trainer_state\.json is missing"):
        load_trainer_state(tmp_path / "used")
    save_trainer_state(tmp_path / "state", state)
    (tmp_path / "state" / "extras" / "a.pt").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        load_trainer_state(tmp_path / "state")


# --- all together: crash and resume ------------------------------------------------------------


def train(root: pathlib.Path, num_steps: int, crash_at: int | None = None) -> list[list[int]]:
    """A miniature training loop: draws a batch and a random number per step, checkpoints every
    2 steps; returns the (prompt batch, noise) it consumed per step."""
    cfg = config(save_period=2, keep_top_k=1, metric_name="val/resolve_rate")
    manager = CheckpointManager(cfg, root)
    sampler = PromptSampler(num_prompts=5, batch_size=2, seed=3)
    step = 0
    latest = manager.latest()
    if latest is not None:
        state = load_trainer_state(latest.path / "trainer_state")
        sampler.load_state_dict(state.sampler)
        state.rng.restore()
        step = state.step
    else:
        torch.manual_seed(0)
    consumed = []
    while step < num_steps:
        step += 1
        consumed.append((step, sampler.next_batch(), torch.rand(1).item()))
        if step == crash_at:
            return consumed
        if cfg.should_save(step):
            state = TrainerState(
                step=step, weight_version=step, sampler=sampler.state_dict(), rng=RngState.capture()
            )
            manager.save(
                step, lambda tmp, state=state: save_trainer_state(tmp / "trainer_state", state)
            )
            manager.record_metrics(step, {"val/resolve_rate": 1.0 / step})
    return consumed


def test_a_crashed_run_resumes_exactly(tmp_path):
    uninterrupted = train(tmp_path / "a", 9)
    crashed = train(tmp_path / "b", 9, crash_at=7)  # killed during step 7: last save was 6
    resumed = train(tmp_path / "b", 9)
    assert [s for s, _, _ in resumed] == [7, 8, 9]  # no step repeated or skipped
    assert crashed[:6] + resumed == uninterrupted  # same prompts, same random numbers
