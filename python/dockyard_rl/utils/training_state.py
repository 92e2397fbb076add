"""The driver's state for exact resume, besides the policy's own checkpoint: `TrainerState` (step,
weight version, prompt sampler position, named extra payloads, the resolved config) and `RngState`
(the driver process's python / numpy / torch RNG states), written into and read from one directory.

    state = TrainerState(step=12, weight_version=12, sampler=sampler.state_dict(),
                         rng=RngState.capture(), config_text=yaml_text,
                         extras={"replay_buffer": buffer})
    manager.save(12, lambda tmp: save_trainer_state(tmp / "trainer_state", state))
    ...
    state = load_trainer_state(latest.path / "trainer_state")
    state.rng.restore()

Layout of the directory (inside a checkpoint: `<checkpoint_dir>/step_<N>/trainer_state/`):

    trainer_state.json      step, weight version, sampler position, extras' names (written last)
    rng.pkl                 python / numpy / torch CPU / torch CUDA RNG states
    config.yaml             the resolved config, as text
    extras/<name>.pt        one torch.save file per extra payload (replay buffer, ...)

The policy's checkpoint holds the rest (weights, optimizer, scheduler and the policy workers'
RNG); `data/prompt_sampler.py`'s `PromptSampler` writes the sampler position. Atomicity is the
checkpoint directory's (`utils/checkpoint.py`): `save_trainer_state` writes into the temporary
directory `CheckpointManager.save` gives it.

Not covered: untrusted checkpoints: the RNG states and extras are unpickled, which runs code, so
load only checkpoints this project wrote.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import pickle
import random
import re
from collections.abc import Mapping
from typing import Any

from dockyard_rl.utils.config import is_int

logger = logging.getLogger(__name__)

# The version of trainer_state.json's layout; load_trainer_state reads only this one.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RngState:
    """The driver process's RNG states; a library that is not installed (or CUDA that was never
    initialised here) is None and left alone by `restore`."""

    python: Any
    numpy: Any = None
    torch_cpu: Any = None
    torch_cuda: Any = None  # one state per visible device

    @classmethod
    def capture(cls) -> RngState:
        try:
            import numpy as np

            numpy_state = np.random.get_state()
        except ImportError:
            numpy_state = None
        torch_cpu = torch_cuda = None
        try:
            import torch

            torch_cpu = torch.get_rng_state()
            # Only when already initialised: querying would create a CUDA context in a driver
            # that never uses the GPU, and an unused generator needs no saving.
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch_cuda = torch.cuda.get_rng_state_all()
        except ImportError:
            pass
        return cls(
            python=random.getstate(), numpy=numpy_state, torch_cpu=torch_cpu, torch_cuda=torch_cuda
        )

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)
        if self.torch_cpu is not None or self.torch_cuda is not None:
            import torch

            if self.torch_cpu is not None:
                torch.set_rng_state(self.torch_cpu)
            if self.torch_cuda is not None and torch.cuda.is_available():
                num_devices = torch.cuda.device_count()
                if num_devices != len(self.torch_cuda):
                    logger.warning(
                        "checkpoint has CUDA RNG states for %d devices, this process "
                        "sees %d; restoring the first %d",
                        len(self.torch_cuda),
                        num_devices,
                        min(num_devices, len(self.torch_cuda)),
                    )
                for device, state in enumerate(self.torch_cuda[:num_devices]):
                    torch.cuda.set_rng_state(state, device)


_EXTRA_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_STATE_FILE = "trainer_state.json"
_RNG_FILE = "rng.pkl"
_CONFIG_FILE = "config.yaml"
_EXTRAS_DIR = "extras"


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What the driver needs to resume exactly, besides the policy's own checkpoint.

    `step` is the last finished optimizer step (a resumed run continues at step + 1);
    `weight_version` the version the generation engines hold; `sampler` is
    `PromptSampler.state_dict()` (prompts handed out so far; in async mode those in flight are
    part of the collector's extra payload); `extras` are named picklable payloads (replay buffer
    contents, collector bookkeeping), one file each; `config_text` the resolved config (YAML or
    JSON text).
    """

    step: int
    weight_version: int
    sampler: Mapping[str, int]
    rng: RngState
    config_text: str = ""
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("step", "weight_version"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"TrainerState.{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.sampler, Mapping):
            raise ValueError(
                f"TrainerState.sampler must be PromptSampler.state_dict(), got "
                f"{type(self.sampler).__name__}"
            )
        if not isinstance(self.rng, RngState):
            raise ValueError(
                f"TrainerState.rng must be an RngState (RngState.capture()), got "
                f"{type(self.rng).__name__}"
            )
        if not isinstance(self.config_text, str):
            raise ValueError(
                f"TrainerState.config_text must be text, got {type(self.config_text).__name__}"
            )
        for name in self.extras:
            if not isinstance(name, str) or not _EXTRA_NAME.match(name):
                raise ValueError(
                    f"TrainerState.extras: name {name!r} must match "
                    f"{_EXTRA_NAME.pattern} (it becomes a file name)"
                )


def save_trainer_state(directory: str | os.PathLike[str], state: TrainerState) -> None:
    """Writes `state` into `directory` (created; must be absent or empty so that no stale extra
    survives). trainer_state.json is written last. Not atomic by itself: call it inside
    `CheckpointManager.save`'s `write`."""
    import torch  # extras may hold tensors: torch.save stores them compactly

    directory = pathlib.Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(
            f"trainer state directory {str(directory)!r} exists and is not empty; "
            f"save into a fresh directory (CheckpointManager.save gives one)"
        )
    (directory / _EXTRAS_DIR).mkdir(parents=True, exist_ok=True)
    with open(directory / _RNG_FILE, "wb") as handle:
        # Plain fields, not the class: the file stays readable if RngState moves.
        pickle.dump(
            {field.name: getattr(state.rng, field.name) for field in dataclasses.fields(RngState)},
            handle,
            protocol=pickle.HIGHEST_PROTOCOL,
        )
    (directory / _CONFIG_FILE).write_text(state.config_text, encoding="utf-8")
    for name, payload in state.extras.items():
        torch.save(payload, directory / _EXTRAS_DIR / f"{name}.pt")
    (directory / _STATE_FILE).write_text(
        json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": state.step,
                "weight_version": state.weight_version,
                "sampler": dict(state.sampler),
                "extras": sorted(state.extras),
            },
            indent=2,
            sort_keys=True,
        )
        + "\n",
        encoding="utf-8",
    )


def load_trainer_state(directory: str | os.PathLike[str]) -> TrainerState:
    """Reads what `save_trainer_state` wrote (extras' tensors onto the CPU). It unpickles:
    trusted checkpoints only. The RNG states are returned, not applied: call
    `state.rng.restore()`.

    Raises:
        ValueError: a file is missing or unreadable, or the format version is unknown.
    """
    import torch

    directory = pathlib.Path(directory)
    state_file = directory / _STATE_FILE
    try:
        meta = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{state_file} is missing or unreadable ({error}); the directory is not "
            f"a trainer state written by save_trainer_state"
        ) from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{state_file}: format_version {meta.get('format_version')!r}, this "
            f"code reads {FORMAT_VERSION}"
        )
    try:
        with open(directory / _RNG_FILE, "rb") as handle:
            rng = RngState(**pickle.load(handle))
        config_text = (directory / _CONFIG_FILE).read_text(encoding="utf-8")
        extras = {
            name: torch.load(
                directory / _EXTRAS_DIR / f"{name}.pt", map_location="cpu", weights_only=False
            )
            for name in meta["extras"]
        }
        return TrainerState(
            step=meta["step"],
            weight_version=meta["weight_version"],
            sampler=meta["sampler"],
            rng=rng,
            config_text=config_text,
            extras=extras,
        )
    except (OSError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as error:
        raise ValueError(
            f"trainer state in {directory} is incomplete or malformed: "
            f"{type(error).__name__}: {error}"
        ) from None
