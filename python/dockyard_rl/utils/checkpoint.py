"""The checkpoint directory: config section `checkpointing`, atomic saves of metric-ranked
checkpoints with top-k retention, and `publish_directory`, the atomic directory write they use.

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
                                (utils/training_state.py: step, RNG states, sampler, extras)
      manifest.json             written LAST, fsynced: step, metrics, time, "complete": true
    step_20/ ...
    .tmp-step_30-<pid>-<rnd>/   a save in progress (or a crashed one: removed at the next start)
    .trash-step_10-<hex>/       a checkpoint being deleted (likewise removed)

`export_hf: true` asks the policy for a Hugging Face model directory (safetensors, config,
tokenizer) in each checkpoint's `policy/`, loadable by transformers and vLLM as is: what users
evaluate or serve, and what a resumed run's engines start from. `false` saves the time and disk
of writing the full weights at every save (the sharded resume state is still complete): a resume
then has the policy export its weights once, into `<run dir>/engine_start`, for the engines.

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

What a checkpoint holds for exact resume is the callers' business: the policy's own checkpoint
(weights, optimizer, scheduler, the policy workers' RNG) and the driver's `TrainerState`
(utils/training_state.py), which includes the position of data/prompt_sampler.py's
`PromptSampler`.

Not covered: several processes writing to one checkpoint directory at once (one driver owns it),
and checkpoints spread over file systems without a shared rename (the policy must write under the
temporary directory it is given).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from dockyard_rl.utils.config import is_int, require, require_bool

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
# The version of manifest.json's layout.
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

    def __post_init__(self) -> None:
        require_bool(self, "enabled", "higher_is_better", "export_hf")
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

    def resolve_dir(self, run_dir: str | os.PathLike[str]) -> pathlib.Path:
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
    directory: str | os.PathLike[str],
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

    def __init__(self, config: CheckpointingConfig, root: str | os.PathLike[str]):
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
