"""Checkpoints for exact resume: config section `checkpointing`, the atomic, metric-ranked
checkpoint directory, the trainer state, and the deterministic prompt sampler.

    checkpointing:
      enabled: true
      checkpoint_dir: results/checkpoints   # relative: resolved by the caller against the run dir
      save_period: 10                       # save every N optimizer steps
      keep_top_k: 3                         # null = keep every checkpoint
      metric_name: val/resolve_rate         # validation metric that ranks checkpoints
      higher_is_better: true
      export_hf: true                       # a Hugging Face export in every checkpoint

Layout of `checkpoint_dir` (one `CheckpointManager` per directory):

    step_10/                    a complete checkpoint: its manifest exists and says so
      policy/                   the caller's: policy.save_checkpoint(tmp / "policy")
      trainer_state/            the caller's: save_trainer_state(tmp / "trainer_state", state)
        trainer_state.json      step, weight version, sampler position, extras' names (last)
        rng.pkl                 python / numpy / torch CPU / torch CUDA RNG states
        config.yaml             the resolved config, as text
        extras/<name>.pt        one torch.save file per extra payload (replay buffer, ...)
      manifest.json             written LAST, fsynced: step, metrics, time, "complete": true
    step_20/ ...

`export_hf: true` asks the policy for a Hugging Face model directory (safetensors, config,
tokenizer) in each checkpoint's `policy/`, loadable by transformers and vLLM as is: what users
evaluate or serve, and what a resumed run's engines start from. `false` saves the time and disk
of writing the full weights at every save (the sharded resume state is still complete): a resume
then has the policy export its weights once, into `<run dir>/engine_start`, for the engines.
    .tmp-step_30-<pid>-<rnd>/   a save in progress (or a crashed one: removed at the next start)
    .trash-step_10-<hex>/       a checkpoint being deleted (likewise removed)

Atomicity: `save` has the caller write into a temporary sibling directory, writes the manifest
last, fsyncs every file and directory in it, and renames the directory to `step_<N>` (atomic on
one file system), then fsyncs the parent: `publish_directory`, which the policies' own
`save_checkpoint` use as well. Deleting renames to `.trash-*` first. So a SIGKILL or power
loss at any moment leaves the complete checkpoints that were there before, or those plus the new
one; never a half-written `step_<N>` that `latest()` would pick. `step_<N>` directories without a
valid manifest (not written by this module) are ignored by `latest()` and removed at start-up.

Retention (`keep_top_k` not null), after every `save` and every `record_metrics`: keep the top
`keep_top_k` checkpoints ranked by `metrics[metric_name]` (higher or lower is better), checkpoints
without that metric ranked last, ties broken by the newer step; the latest checkpoint is always
kept in addition. Validation metrics may arrive for a step after its checkpoint was saved
(`record_metrics` rewrites the manifest atomically) or before (held until `save(step)`).

Exact resume: `TrainerState` holds what the driver process needs besides the policy's own
checkpoint (which holds weights, optimizer, scheduler and the policy workers' RNG): step, weight
version, the `PromptSampler` position, the driver's RNG states, named extra payloads and the config
text. `PromptSampler` reads seeded per-epoch permutations of the training prompts as one stream,
so a run resumed from its `state_dict()` consumes exactly the prompts an uninterrupted run would.
No sampler existed in data/datasets.py (only the one-shot `shuffled`), hence this one.

Not covered: several processes writing to one checkpoint directory at once (one driver owns it),
checkpoints spread over file systems without a shared rename (the policy must write under the
temporary directory it is given), and untrusted checkpoints: trainer state is unpickled, which
runs code, so load only checkpoints this project wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import pickle
import random
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dockyard_rl.utils.config import is_int, require

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
_TRASH_PREFIX = ".trash-step_"


# --- config ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointingConfig:
    """Config section `checkpointing` (module docstring)."""

    enabled: bool = True
    # A relative path is resolved by the caller against the run directory (`resolve_dir`).
    checkpoint_dir: str = "results/checkpoints"
    save_period: int = 10  # optimizer steps between saves
    keep_top_k: int | None = 3  # null = keep all; else top k by metric + latest
    metric_name: str | None = "val/resolve_rate"
    higher_is_better: bool = True
    export_hf: bool = True  # a Hugging Face export in every checkpoint (module docstring)

    def __post_init__(self):
        for name in ("enabled", "higher_is_better", "export_hf"):
            require(
                isinstance(getattr(self, name), bool),
                name,
                f"must be true or false, got {getattr(self, name)!r}",
            )
        require(
            isinstance(self.checkpoint_dir, str) and bool(self.checkpoint_dir.strip()),
            "checkpoint_dir",
            f"must be a directory path (absolute, or relative to the run "
            f"directory), got {self.checkpoint_dir!r}",
        )
        require(
            is_int(self.save_period) and self.save_period >= 1,
            "save_period",
            f"must be an integer >= 1 (optimizer steps between saves), got "
            f"{self.save_period!r}; set enabled: false to turn checkpointing off",
        )
        require(
            self.keep_top_k is None or (is_int(self.keep_top_k) and self.keep_top_k >= 1),
            "keep_top_k",
            f"must be an integer >= 1 or null (= keep every checkpoint), got {self.keep_top_k!r}",
        )
        require(
            self.metric_name is None
            or (isinstance(self.metric_name, str) and bool(self.metric_name.strip())),
            "metric_name",
            f"must be a metric name (e.g. 'val/resolve_rate') or null, got {self.metric_name!r}",
        )
        require(
            self.keep_top_k is None or self.metric_name is not None,
            "keep_top_k",
            f"keeping the top {self.keep_top_k} checkpoints needs a metric to rank them: set "
            f"checkpointing.metric_name (e.g. 'val/resolve_rate'), or keep_top_k: null to "
            f"keep every checkpoint",
        )

    def resolve_dir(self, run_dir: str | os.PathLike) -> pathlib.Path:
        """`checkpoint_dir` as an absolute path: kept when absolute, else under `run_dir`."""
        path = pathlib.Path(self.checkpoint_dir).expanduser()
        return path if path.is_absolute() else (pathlib.Path(run_dir) / path).absolute()

    def should_save(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) is a periodic save step."""
        return self.enabled and step > 0 and step % self.save_period == 0


# --- the checkpoint directory -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint: `path` is `<checkpoint_dir>/step_<step>`."""

    step: int
    path: pathlib.Path
    metrics: Mapping[str, float]
    saved_at_unix: float


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"metrics must be a mapping of name -> number, got {type(metrics).__name__}"
        )
    result = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or isinstance(value, bool):
            raise ValueError(f"metrics: {name!r} -> {value!r} is not a name -> number pair")
        try:
            result[name] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metrics[{name!r}] must be a number, got {value!r}") from None
    return result


def _fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
    """fsyncs every regular file and directory under `root` (links are not followed): the
    manifest must not reach the disk before the data it vouches for."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = pathlib.Path(directory) / name
            if path.is_file() and not path.is_symlink():
                _fsync_path(path)
        _fsync_path(pathlib.Path(directory))


def _write_json_durably(path: pathlib.Path, payload: Mapping[str, Any]) -> None:
    """Writes `path` through a temporary file + os.replace, fsyncing the file and its directory,
    so readers see the old content or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def publish_directory(
    directory: str | os.PathLike,
    write: Callable[[pathlib.Path], None],
    *,
    tmp_prefix: str | None = None,
) -> pathlib.Path:
    """Writes the directory `directory` as one atomic step; returns its absolute path.

    `write(tmp)` fills a fresh temporary sibling directory (named `<tmp_prefix><random>`, by
    default `.<name>.tmp-<random>`; mode 0755, as other processes, e.g. Ray workers of the same
    user, may write into it). Then every file and directory in it is fsynced, it is renamed to
    `directory`, and the parent directory is fsynced, so the rename itself survives a power loss.
    A directory already at `directory` is first renamed aside to `.<name>.old-<random>` and
    removed once the new one is in place.

    Readers see the previous directory or the new one, complete: never a mixture. A crash while
    writing leaves the temporary directory (the caller may remove such leftovers); a crash between
    the two renames leaves the previous directory, complete, at `.<name>.old-<random>`. Both names
    start with "." so that listings of checkpoints skip them. All of it must be on one file system.

    Raises:
        Whatever `write` raises, or an OSError of the publishing: the temporary directory is
            removed, and when the new directory did not get into place, a previous one stays at
            (or is renamed back to) `directory`.
    """
    directory = pathlib.Path(directory).absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{directory.name}.tmp-" if tmp_prefix is None else tmp_prefix
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=directory.parent))
    old: pathlib.Path | None = None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        write(tmp)
        _fsync_tree(tmp)
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{secrets.token_hex(4)}"
            os.rename(directory, old)
        os.rename(tmp, directory)
        _fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not directory.exists():
            os.rename(old, directory)  # the new one never arrived: put the previous one back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory


class CheckpointManager:
    """Saves, lists and prunes the checkpoints under `root` (module docstring).

    Only the driver process uses it, from one thread. Construction creates `root` and removes
    leftovers of crashed saves and deletions and `step_*` directories without a valid manifest.
    """

    def __init__(self, config: CheckpointingConfig, root: str | os.PathLike):
        self.config = config
        self.root = pathlib.Path(root).absolute()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(
                f"checkpointing.checkpoint_dir: {str(self.root)!r} exists and is "
                f"not a directory; point checkpoint_dir elsewhere"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        # Metrics recorded for a step before its checkpoint exists; merged in by save(step).
        self._pending_metrics: dict[int, dict[str, float]] = {}
        self._clean_leftovers()

    # Reading ------------------------------------------------------------------------------------

    def _read(self, path: pathlib.Path) -> CheckpointInfo | None:
        """The checkpoint at `path`, or None when it is not complete (no valid manifest)."""
        match = _STEP_DIR.match(path.name)
        if match is None or not path.is_dir():
            return None
        try:
            manifest = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
            step = int(match.group(1))
            if (
                not isinstance(manifest, dict)
                or manifest.get("complete") is not True
                or manifest.get("step") != step
            ):
                return None
            return CheckpointInfo(
                step=step,
                path=path,
                metrics=_check_metrics(manifest.get("metrics") or {}),
                saved_at_unix=float(manifest.get("saved_at_unix", 0.0)),
            )
        except (OSError, ValueError, TypeError):
            return None

    def list(self) -> list[CheckpointInfo]:
        """The complete checkpoints, oldest step first."""
        infos = (self._read(path) for path in self.root.iterdir())
        return sorted((info for info in infos if info is not None), key=lambda i: i.step)

    def latest(self) -> CheckpointInfo | None:
        """The complete checkpoint with the highest step (what a restart resumes from)."""
        infos = self.list()
        return infos[-1] if infos else None

    def best(self) -> CheckpointInfo | None:
        """The checkpoint with the best `metric_name` (ties: newer step); None when no
        metric is configured or no checkpoint has it yet."""
        ranked = [info for info in self.list() if self._score(info) is not None]
        return max(ranked, key=lambda i: (self._score(i), i.step)) if ranked else None

    def _score(self, info: CheckpointInfo) -> float | None:
        """The ranking value, larger = better; None when the metric is absent (or NaN)."""
        if self.config.metric_name is None:
            return None
        value = info.metrics.get(self.config.metric_name)
        if value is None or math.isnan(value):
            return None
        return value if self.config.higher_is_better else -value

    # Writing ------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        write: Callable[[pathlib.Path], None],
        metrics: Mapping[str, float] | None = None,
    ) -> pathlib.Path:
        """Writes checkpoint `step_<step>` atomically and applies retention; returns its path.

        `write(tmp)` fills the temporary directory `tmp` (e.g. `tmp / "policy"`,
        `tmp / "trainer_state"`); it must not write `manifest.json`. `metrics` are merged over
        metrics recorded earlier for this step with `record_metrics`.

        Raises:
            ValueError: `step` is not an integer >= 0 or not above the latest saved step
                (steps only grow; a resumed run continues after its checkpoint), bad metrics,
                or `write` wrote `manifest.json`.
            Whatever `write` raises: the temporary directory is removed and the existing
                checkpoints are untouched.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
        metrics = _check_metrics(metrics)
        latest = self.latest()
        if latest is not None and step <= latest.step:
            raise ValueError(
                f"cannot save step {step}: {latest.path} is already saved and steps "
                f"must increase; resume from it (continue at step {latest.step + 1}) "
                f"or use a new checkpointing.checkpoint_dir"
            )
        self._clean_leftovers()

        def write_with_manifest(tmp: pathlib.Path) -> None:
            write(tmp)
            if (tmp / MANIFEST_NAME).exists():
                raise ValueError(
                    f"write() created {MANIFEST_NAME} in the checkpoint directory; "
                    f"that name is reserved for the completeness marker"
                )
            merged = {**self._pending_metrics.get(step, {}), **metrics}
            # The marker goes last: its presence in step_<N> vouches for everything else.
            _write_json_durably(
                tmp / MANIFEST_NAME,
                {
                    "format_version": FORMAT_VERSION,
                    "step": step,
                    "metrics": merged,
                    "saved_at_unix": time.time(),
                    "complete": True,
                },
            )

        final = publish_directory(
            self.root / f"step_{step}",
            write_with_manifest,
            tmp_prefix=f"{_TMP_PREFIX}{step}-{os.getpid()}-",
        )
        # Steps only grow, so metrics pending for this step or older ones can never be used.
        self._pending_metrics = {s: m for s, m in self._pending_metrics.items() if s > step}
        logger.info("saved checkpoint %s", final)
        self._apply_retention()
        return final

    def record_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Attaches validation `metrics` to step `step`'s checkpoint, whether it is already
        saved (its manifest is rewritten atomically, then retention runs) or not yet (held until
        `save(step)`). Metrics for an older step that was never saved are dropped."""
        if not is_int(step) or step < 0:
            raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
        metrics = _check_metrics(metrics)
        infos = {info.step: info for info in self.list()}
        if step in infos:
            info = infos[step]
            _write_json_durably(
                info.path / MANIFEST_NAME,
                {
                    "format_version": FORMAT_VERSION,
                    "step": step,
                    "metrics": {**info.metrics, **metrics},
                    "saved_at_unix": info.saved_at_unix,
                    "complete": True,
                },
            )
            self._apply_retention()
        elif not infos or step > max(infos):
            self._pending_metrics.setdefault(step, {}).update(metrics)
        else:
            logger.debug("metrics for step %d dropped: no checkpoint of that step", step)

    def _apply_retention(self) -> None:
        if self.config.keep_top_k is None:
            return
        infos = self.list()
        if not infos:
            return
        # Best first: has the metric, then its (oriented) value, then the newer step.
        ranked = sorted(
            infos,
            key=lambda i: (self._score(i) is not None, self._score(i) or 0.0, i.step),
            reverse=True,
        )
        keep = {info.step for info in ranked[: self.config.keep_top_k]} | {infos[-1].step}
        for info in infos:
            if info.step not in keep:
                self._delete(info.path)

    def _delete(self, path: pathlib.Path) -> None:
        # Renamed away first so that no reader ever sees a half-deleted step_<N>.
        trash = self.root / f"{_TRASH_PREFIX}{path.name[len('step_') :]}-{secrets.token_hex(4)}"
        os.rename(path, trash)
        _fsync_path(self.root)
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("deleted checkpoint %s (retention)", path)

    def _clean_leftovers(self) -> None:
        for path in self.root.iterdir():
            if path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                logger.warning("removing %s: left over by an interrupted save or delete", path)
                shutil.rmtree(path, ignore_errors=True)
            elif _STEP_DIR.match(path.name) and path.is_dir() and self._read(path) is None:
                logger.warning(
                    "removing %s: it has no valid %s, so it is not a complete checkpoint",
                    path,
                    MANIFEST_NAME,
                )
                self._delete(path)


# --- trainer state ------------------------------------------------------------------------------


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

    def __post_init__(self):
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


def save_trainer_state(directory: str | os.PathLike, state: TrainerState) -> None:
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


def load_trainer_state(directory: str | os.PathLike) -> TrainerState:
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


# --- prompt order -------------------------------------------------------------------------------


class PromptSampler:
    """Batches of prompt indices from seeded per-epoch permutations of range(num_prompts).

    The permutations are read as one continuous stream: a batch may end one epoch and start the
    next, so every epoch hands out each prompt exactly once and none is dropped (a batch that
    crosses a boundary can hold a prompt twice, once per epoch, when num_prompts is small).
    Epoch e's order depends only on (seed, e): the seed is hashed with the epoch and the shuffle
    draws from `random.Random.random()`, whose sequence Python keeps stable across versions.

    `state_dict()` is (seed, num_prompts, epoch, position); a sampler that loads it continues
    with the very next prompt. The batch size may differ after a resume; the seed and the number
    of prompts may not (it would not be the same order).
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int):
        for name, value, low in (
            ("num_prompts", num_prompts, 1),
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
        ):
            if not is_int(value) or value < low:
                raise ValueError(f"PromptSampler {name} must be an integer >= {low}, got {value!r}")
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._position = 0  # index into the current epoch's permutation, < num_prompts
        self._order: list[int] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    @property
    def num_consumed(self) -> int:
        return self._epoch * self.num_prompts + self._position

    def permutation(self, epoch: int) -> list[int]:
        digest = hashlib.sha256(f"dockyard_rl.PromptSampler/{self.seed}/{epoch}".encode())
        rng = random.Random(int.from_bytes(digest.digest()[:8], "big"))
        order = list(range(self.num_prompts))
        for i in range(len(order) - 1, 0, -1):  # Fisher-Yates
            j = int(rng.random() * (i + 1))
            order[i], order[j] = order[j], order[i]
        return order

    def next_batch(self) -> list[int]:
        batch = []
        while len(batch) < self.batch_size:
            if self._order is None:
                self._order = self.permutation(self._epoch)
            take = min(self.batch_size - len(batch), self.num_prompts - self._position)
            batch.extend(self._order[self._position : self._position + take])
            self._position += take
            if self._position == self.num_prompts:
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "format_version": FORMAT_VERSION,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continues where the sampler that wrote `state` stopped.

        Raises:
            ValueError: the state was written for another seed or number of prompts (the data
                or its seed changed: the order would differ), or it is malformed.
        """
        missing = sorted({"seed", "num_prompts", "epoch", "position"} - set(state))
        if missing:
            raise ValueError(f"sampler state lacks {missing}; not a PromptSampler.state_dict()")
        if state["seed"] != self.seed or state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"sampler state was written for seed {state['seed']} over "
                f"{state['num_prompts']} prompts, this run has seed {self.seed} over "
                f"{self.num_prompts}: resuming would change the prompt order; keep "
                f"the dataset and its seed, or start a new run"
            )
        epoch, position = state["epoch"], state["position"]
        if not (
            is_int(epoch) and epoch >= 0 and is_int(position) and 0 <= position < self.num_prompts
        ):
            raise ValueError(
                f"sampler state has epoch {epoch!r}, position {position!r}; expected "
                f"integers with epoch >= 0 and 0 <= position < {self.num_prompts}"
            )
        self._epoch, self._position, self._order = epoch, position, None
