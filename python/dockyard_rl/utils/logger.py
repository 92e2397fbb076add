"""Metrics logging of a training run: console progress, JSONL, TensorBoard, W&B, MLflow, a PNG.

    logger = Logger(config.logger, run_name="smoke_cpu", total_steps=grpo.max_num_steps)
    logger.log_hyperparams(config_dict)
    logger.resume_from(checkpoint_step)          # only when resuming; before the first log call
    for step in range(checkpoint_step + 1, ...):
        with logger.timer("generate"): ...
        with logger.timer("score"): ...
        logger.log_metrics(step, {"reward_mean": 0.4, "resolve_rate": 0.25, "loss": 0.1})
        if step % val_period == 0:
            logger.log_metrics(step, {"resolve_rate": 0.3}, prefix="val")
    logger.finish()                               # closes the backends, writes metrics.png

Where things go (`run_dir` = `<logger.log_dir>/<run_name>`; run names must be stable across a
resume, so never put a timestamp in them):
- `run_dir/metrics.jsonl`: the source of truth. One strict-JSON object per `log_metrics` call
  (so one line per step for the train metrics and one per validation), flat keys
  `{"step": 3, "time": <unix s>, "train/reward_mean": 0.4, "timing/generate_s": 12.1, ...}`.
  Each line is written whole, flushed and fsynced, so a crash loses at most the line being
  written; a torn last line is skipped when read and dropped on the next start. NaN/inf values
  are written as null and listed under `"nonfinite": {"train/loss": "nan"}`: the run goes on,
  the value is flagged (here, in a warning and on the console) instead of silently becoming a
  number.
- `run_dir/config.json`: the hyperparameters given to `log_hyperparams`.
- `run_dir/tensorboard/`: scalar event files (tensorboard's own writer; no torch import).
- `run_dir/wandb/`: W&B's offline run (mode "offline" needs no network; `wandb sync` uploads it).
- MLflow: `logger.mlflow.tracking_uri`, by default the file store `<log_dir>/mlruns`, one run per
  run name, shared by all runs under log_dir so that the MLflow UI compares them.
- `run_dir/metrics.png` (at `finish()`): training reward, training resolve rate and validation
  curves, drawn from metrics.jsonl, so a resumed run's plot covers every step.

Resume: the first write of a Logger drops every logged row/event of a step after the run's
resume point, i.e. after `resume_from(step)` or, for a fresh start, from the first logged step on
(a rerun from scratch replaces the old curves instead of interleaving with them). JSONL is
rewritten atomically without those rows; TensorBoard gets a SessionLog START event at the first
new step, which makes TensorBoard discard the old events of that step and later. A resumed run
continues the same W&B and MLflow runs (ids kept in run_dir/run_ids.json; a fresh start makes new
ones): W&B ignores steps it already has; MLflow cannot delete points, so a redone step shows both.

Timing: `timer(stage)` measures one stage of the current step; a `prefix="train"` call closes the
step and adds the breakdown to its row as `timing/<stage>_s` for the STAGES (0 when not
measured), `timing/total_s` (wall time since the previous step closed) and `timing/other_s`.

Metric names the console and the plot read (the contract with the training loop): REWARD_KEY,
RESOLVE_RATE_KEY and APPLY_RATE_KEY under the "train" and "val" prefixes.

Not covered: aggregating metrics across ranks (callers log from the driver only), images,
histograms, and uploading (W&B online mode works but is up to the user).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import pathlib
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dockyard_rl.utils.config import is_int, require

_log = logging.getLogger(__name__)

# Stages of a GRPO step, always present in the breakdown (0.0 when a step had none of it).
STAGES = ("generate", "score", "logprobs", "train", "weight_sync", "buffer_wait")
REWARD_KEY = "reward_mean"  # mean training / validation reward of the step
RESOLVE_RATE_KEY = "resolve_rate"  # fraction of samples whose patch made the tests pass
APPLY_RATE_KEY = "apply_rate"  # fraction of samples whose patch applied

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
PLOT_FILE = "metrics.png"
RUN_IDS_FILE = "run_ids.json"
TIMING_PREFIX = "timing"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_METRIC_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")  # "loss", "loss/clip_frac"
_WANDB_MODES = ("offline", "online", "disabled")
_STAGE_ABBREVIATIONS = {
    "generate": "gen",
    "score": "score",
    "logprobs": "lp",
    "train": "train",
    "weight_sync": "sync",
    "buffer_wait": "wait",
}


# ----------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """`logger.wandb`: Weights & Biases, offline by default (no network, no account)."""

    enabled: bool = False
    project: str = "dockyard_rl"
    name: str | None = None  # the W&B run's display name; null = the Logger's run name
    mode: str = "offline"  # offline (files under run_dir/wandb) | online | disabled

    def __post_init__(self):
        require(
            isinstance(self.enabled, bool),
            "enabled",
            f"must be true or false, got {self.enabled!r}",
        )
        require(
            _is_name(self.project),
            "project",
            f"must be a non-empty name of letters, digits, '_', '.', '-', got {self.project!r}",
        )
        require(
            self.name is None or (isinstance(self.name, str) and bool(self.name)),
            "name",
            f"must be a non-empty string or null (= the run name), got {self.name!r}",
        )
        require(
            self.mode in _WANDB_MODES,
            "mode",
            f"must be one of {', '.join(_WANDB_MODES)} (offline needs no network), "
            f"got {self.mode!r}",
        )


@dataclasses.dataclass(frozen=True)
class MlflowConfig:
    """`logger.mlflow`: MLflow tracking, by default into a file store under log_dir."""

    enabled: bool = False
    tracking_uri: str | None = None  # null = file store <log_dir>/mlruns (absolute file:// URI)
    experiment_name: str = "dockyard_rl"
    run_name: str | None = None  # null = the Logger's run name

    def __post_init__(self):
        require(
            isinstance(self.enabled, bool),
            "enabled",
            f"must be true or false, got {self.enabled!r}",
        )
        require(
            self.tracking_uri is None
            or (isinstance(self.tracking_uri, str) and bool(self.tracking_uri)),
            "tracking_uri",
            f"must be a URI (file:///abs/path/mlruns, http://host:5000) or "
            f"null (= <log_dir>/mlruns), got {self.tracking_uri!r}",
        )
        require(
            isinstance(self.experiment_name, str) and bool(self.experiment_name.strip()),
            "experiment_name",
            f"must be a non-empty string, got {self.experiment_name!r}",
        )
        require(
            self.run_name is None or (isinstance(self.run_name, str) and bool(self.run_name)),
            "run_name",
            f"must be a non-empty string or null (= the run name), got {self.run_name!r}",
        )


@dataclasses.dataclass(frozen=True)
class LoggerConfig:
    """The `logger` section; build with `from_dict(LoggerConfig, data, "logger")`."""

    log_dir: str = "results/logs"  # each run writes to <log_dir>/<run name>/
    console: bool = True  # progress bar (a TTY) or one line per logged step (a log file)
    tensorboard: bool = True
    jsonl: bool = True
    plot: bool = True  # metrics.png at finish(), drawn from metrics.jsonl
    log_every: int = 1  # train metrics to console/TensorBoard/W&B/MLflow every N steps
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    mlflow: MlflowConfig = dataclasses.field(default_factory=MlflowConfig)

    def __post_init__(self):
        require(
            isinstance(self.log_dir, str) and bool(self.log_dir),
            "log_dir",
            f"must be a directory path, got {self.log_dir!r}",
        )
        for key in ("console", "tensorboard", "jsonl", "plot"):
            value = getattr(self, key)
            require(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        require(
            is_int(self.log_every) and self.log_every >= 1,
            "log_every",
            f"must be an integer >= 1 (1 = every step), got {self.log_every!r}",
        )
        require(
            not self.plot or self.jsonl,
            "plot",
            "the plot is drawn from metrics.jsonl, so it needs jsonl: true; set "
            "logger.jsonl: true or logger.plot: false",
        )
        require(
            isinstance(self.wandb, WandbConfig),
            "wandb",
            f"must be a mapping of W&B settings, got {self.wandb!r}",
        )
        require(
            isinstance(self.mlflow, MlflowConfig),
            "mlflow",
            f"must be a mapping of MLflow settings, got {self.mlflow!r}",
        )


# ----------------------------------------------------------------------------------------------
# Timing


class StepTimer:
    """Seconds spent per stage within one step.

    `stage(name)` times a block; `add(name, seconds)` records a time measured elsewhere (e.g. by
    the trajectory collector in async mode). `pop()` returns the breakdown and starts the next
    step. Stages may repeat within a step (their times add up) but must not nest (the breakdown
    would count the inner time twice). Not thread-safe: one timer belongs to one loop.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._active: str | None = None
        self._step_start = clock()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        _check_name(name, "stage")
        if self._active is not None:
            raise RuntimeError(
                f"timer stage {name!r} started inside stage {self._active!r}; "
                f"stages must not nest (the time would be counted twice)"
            )
        self._active = name
        start = self._clock()
        try:
            yield
        finally:
            self._active = None
            self._add(name, self._clock() - start)

    def add(self, name: str, seconds: float) -> None:
        _check_name(name, "stage")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            raise ValueError(f"stage {name!r}: seconds must be a number >= 0, got {seconds!r}")
        self._add(name, float(seconds))

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """{stage: seconds} for every STAGE and any other stage timed, plus `total` and `other`.

        `total` is the wall time since the previous pop (or the timer's creation); `other` is
        the part of it no stage covered (>= 0; stages timed by `add` may overlap the loop).
        """
        now = self._clock()
        breakdown = {stage: 0.0 for stage in STAGES}
        breakdown.update(self._seconds)
        total = now - self._step_start
        breakdown["total"] = total
        breakdown["other"] = max(0.0, total - sum(self._seconds.values()))
        self._seconds = {}
        self._step_start = now
        return breakdown


# ----------------------------------------------------------------------------------------------
# JSONL


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file, in file order; a torn or garbled line is skipped."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    rows, num_bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            num_bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            num_bad += 1
    if num_bad:
        _log.warning("%s: skipped %d unreadable line(s) (a crash while writing?)", path, num_bad)
    return rows


class _JsonlWriter:
    """Appends rows to metrics.jsonl; `truncate_after(step)` drops the rows of later steps."""

    def __init__(self, path: pathlib.Path):
        self._path = path
        self._file = None

    def truncate_after(self, step: int) -> int:
        """Keeps rows with step <= `step` (and drops a torn last line); returns the number dropped.

        The kept rows go to a temporary file that replaces the old one atomically, so a crash
        here leaves either the old file or the new one.
        """
        if not self._path.exists():
            return 0
        rows = read_jsonl(self._path)
        kept = [row for row in rows if row["step"] <= step]
        _atomic_write_text(
            self._path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept)
        )
        return len(rows) - len(kept)

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self._path, "a", encoding="utf-8")
        # One write of one whole line: a crash can tear at most this line.
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ----------------------------------------------------------------------------------------------
# Backends (TensorBoard, W&B, MLflow): the same four calls each.


class _TensorBoardBackend:
    """Scalars through tensorboard's own event writer (no torch or TensorFlow import)."""

    def __init__(self, log_dir: pathlib.Path, first_step: int):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2 = event_pb2
        self._writer = EventFileWriter(str(log_dir), max_queue_size=100, flush_secs=10)
        # TensorBoard drops every event of a step >= first_step seen before this START: the
        # steps a crashed run logged after its last checkpoint, or an older run's curves.
        self._writer.add_event(
            event_pb2.Event(
                wall_time=time.time(),
                step=first_step,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
            )
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2

        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(tag=key, simple_value=value)
                for key, value in metrics.items()
            ]
        )
        self._writer.add_event(
            self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary)
        )
        self._writer.flush()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        # A text summary (what TensorBoard's text plugin shows): the config as indented JSON.
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

        text = "```\n" + json.dumps(params, indent=2, sort_keys=True, default=str) + "\n```"
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]
            ),
        )
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        )
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="config", metadata=metadata, tensor=tensor)]
        )
        self._writer.add_event(
            self._event_pb2.Event(wall_time=time.time(), step=0, summary=summary)
        )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WandbBackend:
    """A W&B run under run_dir/wandb; offline mode writes files only (`wandb sync` uploads)."""

    def __init__(self, config: WandbConfig, run_dir: pathlib.Path, run_id: str, run_name: str):
        import wandb

        self._run = wandb.init(
            project=config.project,
            name=config.name or run_name,
            id=run_id,
            dir=str(run_dir),
            mode=config.mode,
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # W&B refuses steps below its current one (a resumed run re-logging a step): it warns.
        self._run.log(dict(metrics), step=step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


class _MlflowBackend:
    """An MLflow run (one per run name, continued on resume) through MlflowClient."""

    # MLflow rejects longer params (its limit has changed across versions; this fits all).
    _MAX_PARAM_CHARS = 500

    def __init__(self, config: MlflowConfig, tracking_uri: str, run_id: str | None, run_name: str):
        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            # MLflow 3 keeps its file store in maintenance mode and refuses to open one unless
            # this is set. We keep it: it needs nothing but a folder (no database packages),
            # holds runs and artifacts under log_dir, and `mlflow ui` reads it (with the same
            # variable). The alternative is `tracking_uri: sqlite:///<path>/mlflow.db`, which
            # needs the full `mlflow` package (sqlalchemy, alembic).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        experiment = self._client.get_experiment_by_name(config.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(config.experiment_name)
        )
        self.run_id = None
        if run_id is not None:
            try:
                self._client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            except MlflowException as error:  # the store was moved or deleted since
                _log.warning(
                    "MLflow run %s of the resumed run is not in %s (%s); starting a new MLflow run",
                    run_id,
                    tracking_uri,
                    error,
                )
        if self.run_id is None:
            self.run_id = self._client.create_run(
                experiment_id, run_name=config.run_name or run_name
            ).info.run_id

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id,
            metrics=[Metric(key, value, timestamp_ms, step) for key, value in metrics.items()],
        )

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        logged = self._client.get_run(self.run_id).data.params
        new = [
            Param(key, value)
            for key, value in (
                (key, str(value)[: self._MAX_PARAM_CHARS])
                for key, value in _flatten(params).items()
            )
            if logged.get(key) != value
        ]
        changed = sorted(param.key for param in new if param.key in logged)
        if changed:  # MLflow params are immutable; a resumed run with new values keeps the old.
            _log.warning(
                "MLflow run %s already has different values for %s; keeping the old "
                "ones (MLflow params cannot change)",
                self.run_id,
                ", ".join(changed),
            )
        new = [param for param in new if param.key not in logged]
        for start in range(0, len(new), 100):  # MLflow's batch limit is 100 params
            self._client.log_batch(self.run_id, params=new[start : start + 100])
        self._client.log_dict(self.run_id, dict(params), CONFIG_FILE)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


# ----------------------------------------------------------------------------------------------
# Console


class _Console:
    """A tqdm bar on a terminal; one plain line per logged step when stderr is not a terminal."""

    def __init__(self, total_steps: int | None, initial_step: int):
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
        self._step = initial_step

    def update(self, step: int, text: str) -> None:
        if self._bar is not None:
            self._bar.update(max(0, step - self._step))
            self._bar.set_postfix_str(text, refresh=True)
        else:
            print(f"step {step}: {text}", file=sys.stderr, flush=True)
        self._step = max(self._step, step)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _progress_text(row: Mapping[str, float], nonfinite: Mapping[str, str]) -> str:
    parts = []
    for label, key in (
        ("reward", f"train/{REWARD_KEY}"),
        ("resolve", f"train/{RESOLVE_RATE_KEY}"),
        ("val_resolve", f"val/{RESOLVE_RATE_KEY}"),
    ):
        if isinstance(row.get(key), float):
            parts.append(f"{label}={row[key]:.3f}")
    times = [
        f"{_STAGE_ABBREVIATIONS[stage]} {row[key]:.1f}s"
        for stage in STAGES
        if row.get(key := f"{TIMING_PREFIX}/{stage}_s")
    ]
    if times:
        parts.append("| " + " ".join(times))
    if nonfinite:
        parts.append(f"| NONFINITE: {', '.join(sorted(nonfinite))}")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# Logger


class Logger:
    """Logs a run's metrics to every enabled backend (module docstring).

    Call order: `resume_from` (when resuming) before the first `log_metrics`; `log_hyperparams`
    at any time; `finish()` once at the end (safe to repeat; also via `with Logger(...)`).
    Call from one process (the driver); calls are serialized by a lock, so threads may share it.
    A TensorBoard/W&B/MLflow backend that fails after set-up is turned off with a warning (the
    run goes on); JSONL write errors raise.

    Raises (at construction, before anything runs): ValueError naming `logger.wandb.enabled`,
    `logger.mlflow.enabled` or `logger.plot` when the package that backend needs is missing, and
    for a run name that is not a plain directory name.
    """

    def __init__(
        self,
        config: LoggerConfig,
        run_name: str,
        total_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not isinstance(config, LoggerConfig):
            raise ValueError(f"logger: expected a LoggerConfig, got {type(config).__name__}")
        if not _is_name(run_name) or run_name in (".", ".."):
            raise ValueError(
                f"run name {run_name!r} must be a non-empty directory name of "
                f"letters, digits, '_', '.', '-' (it names <logger.log_dir>/<run>)"
            )
        for enabled, module, key, distribution in (
            (config.wandb.enabled, "wandb", "logger.wandb.enabled", "wandb"),
            (config.mlflow.enabled, "mlflow", "logger.mlflow.enabled", "mlflow-skinny"),
            (config.plot, "matplotlib", "logger.plot", "matplotlib"),
        ):
            if enabled and importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"{key}: is true but the {module!r} package is not installed in "
                    f"this environment (requirements/*.lock.txt pins it: use the "
                    f"project's venv, or pip install {distribution}); "
                    f"or set {key}: false"
                )
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 0):
            raise ValueError(f"total_steps must be an integer >= 0 or None, got {total_steps!r}")
        self.config = config
        self.run_name = run_name
        self.run_dir = pathlib.Path(config.log_dir).expanduser().resolve() / run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        self.num_nonfinite = 0  # metric values that were NaN or inf, over this Logger's life
        self._total_steps = total_steps
        self._timer = StepTimer(clock)
        self._lock = threading.RLock()
        self._resume_step: int | None = None
        self._opened = False
        self._finished = False
        self._hyperparams: dict[str, Any] | None = None
        self._jsonl = _JsonlWriter(self.metrics_path) if config.jsonl else None
        self._backends: list[Any] = []
        self._console: _Console | None = None

    # -- public API ------------------------------------------------------------------------

    def timer(self, stage: str) -> contextlib.AbstractContextManager[None]:
        """`with logger.timer("generate"): ...` adds the block's seconds to this step's stage."""
        return self._timer.stage(stage)

    def add_time(self, stage: str, seconds: float) -> None:
        """Adds seconds measured elsewhere (e.g. by the async collector) to this step's stage."""
        self._timer.add(stage, seconds)

    def resume_from(self, step: int) -> None:
        """Continues a run whose last completed (checkpointed) step is `step`.

        Drops what a crashed run logged for later steps (module docstring). Must come before the
        first `log_metrics`; logging then continues at `step + 1`.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"resume_from: step must be an integer >= 0, got {step!r}")
        with self._lock:
            if self._opened:
                raise RuntimeError("resume_from() must be called before the first log_metrics()")
            self._resume_step = step
            self._open(first_step=step + 1)

    def log_hyperparams(self, params: Mapping[str, Any] | Any) -> None:
        """Records the run's config (a mapping or a dataclass) in config.json and the backends."""
        if dataclasses.is_dataclass(params) and not isinstance(params, type):
            params = dataclasses.asdict(params)
        if not isinstance(params, Mapping):
            raise ValueError(
                f"log_hyperparams: expected a mapping or a dataclass, got {type(params).__name__}"
            )
        # JSON round trip: plain types only, so every backend can store it.
        params = json.loads(json.dumps(dict(params), default=str))
        with self._lock:
            self._hyperparams = params
            _atomic_write_text(
                self.run_dir / CONFIG_FILE, json.dumps(params, indent=2, sort_keys=True) + "\n"
            )
            if self._opened:
                self._send_hyperparams()

    def log_metrics(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
        """Logs `metrics` (name -> number) of `step` as `<prefix>/<name>`.

        A "train" call also closes the step: the timer's breakdown joins its row (module
        docstring) and the console advances. Train rows reach the console and the TensorBoard /
        W&B / MLflow backends every `log_every` steps; JSONL gets every row, and other prefixes
        (validation) always go everywhere. NaN/inf values are logged and flagged, never raised.

        Raises:
            ValueError: a step that is not an integer >= 0, a bad prefix or metric name, or a
                value that is not a real number (a bug in the caller, caught on its first step).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"log_metrics: step must be an integer >= 0, got {step!r}")
        _check_name(prefix, "prefix")
        row: dict[str, float] = {}
        for name, value in metrics.items():
            if not (isinstance(name, str) and _METRIC_RE.match(name)):
                raise ValueError(
                    f"metric name {name!r} (prefix {prefix!r}) must be made of "
                    f"letters, digits, '_', '.', '-', with '/' only between parts"
                )
            row[f"{prefix}/{name}"] = _to_float(f"{prefix}/{name}", value)
        with self._lock:
            if self._finished:
                raise RuntimeError("log_metrics() after finish()")
            if not self._opened:
                self._open(first_step=step)
            is_train = prefix == "train"
            if is_train:
                for stage, seconds in self._timer.pop().items():
                    row[f"{TIMING_PREFIX}/{stage}_s"] = round(seconds, 6)
            nonfinite = {key: str(value) for key, value in row.items() if not math.isfinite(value)}
            if nonfinite:
                self.num_nonfinite += len(nonfinite)
                _log.warning(
                    "step %d: non-finite metric(s) %s",
                    step,
                    ", ".join(f"{k}={v}" for k, v in sorted(nonfinite.items())),
                )
            if self._jsonl is not None:
                json_row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
                json_row.update(
                    {key: None if key in nonfinite else value for key, value in row.items()}
                )
                if nonfinite:
                    json_row["nonfinite"] = nonfinite
                self._jsonl.write(json_row)
            if is_train and step % self.config.log_every != 0:
                return
            self._call_backends("log_metrics", step, row)
            if self._console is not None:
                if is_train:
                    self._console.update(step, _progress_text(row, nonfinite))
                else:
                    values = " ".join(f"{key}={value:.4g}" for key, value in row.items())
                    self._console.message(f"step {step} {values}")

    def finish(self) -> pathlib.Path | None:
        """Closes every backend and writes the PNG (when `plot`); returns its path or None.

        Safe to call more than once. A failing backend does not keep the others from closing
        (the first error is raised after all of them were tried).
        """
        with self._lock:
            if self._finished:
                return self.plot_path if self.config.plot and self.plot_path.exists() else None
            self._finished = True
            errors = []
            for close in (
                ([self._console.close] if self._console is not None else [])
                + [backend.close for backend in self._backends]
                + ([self._jsonl.close] if self._jsonl is not None else [])
            ):
                try:
                    close()
                except Exception as error:  # noqa: BLE001 - close the rest, then re-raise
                    errors.append(error)
            plot_path = None
            if self.config.plot:
                plot_path = plot_metrics(self.metrics_path, self.plot_path, title=self.run_name)
            if errors:
                raise errors[0]
            return plot_path

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.finish()

    # -- internals ---------------------------------------------------------------------------

    def _open(self, first_step: int) -> None:
        """Starts the backends; drops what was logged for steps >= first_step (module doc)."""
        self._opened = True
        if self._jsonl is not None:
            num_dropped = self._jsonl.truncate_after(first_step - 1)
            if num_dropped:
                _log.info(
                    "%s: dropped %d row(s) of steps >= %d (logged after the resume point)",
                    self.metrics_path,
                    num_dropped,
                    first_step,
                )
        run_ids = self._run_ids(resuming=self._resume_step is not None)
        if self.config.tensorboard:
            self._backends.append(_TensorBoardBackend(self.run_dir / "tensorboard", first_step))
        if self.config.wandb.enabled:
            self._backends.append(
                _WandbBackend(self.config.wandb, self.run_dir, run_ids["wandb"], self.run_name)
            )
        if self.config.mlflow.enabled:
            backend = _MlflowBackend(
                self.config.mlflow, self.mlflow_tracking_uri, run_ids.get("mlflow"), self.run_name
            )
            run_ids["mlflow"] = backend.run_id
            self._backends.append(backend)
        _atomic_write_text(self.run_dir / RUN_IDS_FILE, json.dumps(run_ids, indent=2) + "\n")
        if self.config.console:
            self._console = _Console(self._total_steps, initial_step=max(0, first_step - 1))
        if self._hyperparams is not None:
            self._send_hyperparams()

    def _run_ids(self, resuming: bool) -> dict[str, str]:
        """The W&B / MLflow run ids: the previous ones when resuming, new ones otherwise."""
        path = self.run_dir / RUN_IDS_FILE
        run_ids = {}
        if resuming and path.exists():
            try:
                run_ids = dict(json.loads(path.read_text()))
            except (ValueError, TypeError):
                _log.warning("%s is unreadable; starting new W&B/MLflow runs", path)
        run_ids.setdefault("wandb", secrets.token_hex(8))
        return run_ids

    def _send_hyperparams(self) -> None:
        self._call_backends("log_hyperparams", self._hyperparams)

    def _call_backends(self, method: str, *args) -> None:
        # A backend is a side channel: one that fails mid-run (a full disk, a W&B hiccup) is
        # dropped with a warning rather than ending a long training run. Set-up errors raise
        # (in _open), and JSONL, the source of truth, is not a backend.
        for backend in list(self._backends):
            try:
                getattr(backend, method)(*args)
            except Exception as error:  # noqa: BLE001 - any failure of an optional side channel
                self._backends.remove(backend)
                message = (
                    f"logger: the {type(backend).__name__} backend failed in {method} "
                    f"({type(error).__name__}: {error}); it is off for the rest of the run"
                )
                _log.warning(message)
                if self._console is not None:
                    self._console.message(message)

    @property
    def mlflow_tracking_uri(self) -> str:
        if self.config.mlflow.tracking_uri is not None:
            return self.config.mlflow.tracking_uri
        return (pathlib.Path(self.config.log_dir).expanduser().resolve() / "mlruns").as_uri()


# ----------------------------------------------------------------------------------------------
# The PNG


def plot_metrics(
    metrics_path: str | os.PathLike, plot_path: str | os.PathLike, title: str = ""
) -> pathlib.Path:
    """Draws training reward, training resolve rate and validation curves from metrics.jsonl.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch, no display).
    Non-finite values are gaps. Written atomically; returns `plot_path`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series: dict[str, dict[int, float]] = {}
    for row in read_jsonl(metrics_path):
        for key, value in row.items():
            if "/" in key and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(key, {})[row["step"]] = float(value)  # last row of a step wins

    figure = Figure(figsize=(15, 4.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3)
    panels = (
        ("Training reward", [f"train/{REWARD_KEY}"]),
        ("Training resolve rate", [f"train/{RESOLVE_RATE_KEY}", f"train/{APPLY_RATE_KEY}"]),
        ("Validation", [f"val/{RESOLVE_RATE_KEY}", f"val/{REWARD_KEY}", f"val/{APPLY_RATE_KEY}"]),
    )
    for ax, (panel_title, keys) in zip(axes, panels):
        drawn = False
        for key in keys:
            if key not in series:
                continue
            steps = sorted(series[key])
            values = [series[key][s] for s in steps]
            style = {"marker": "o", "markersize": 4} if key.startswith("val/") else {}
            (line,) = ax.plot(
                steps, values, label=key, alpha=0.5 if len(steps) > 20 else 1, **style
            )
            if not key.startswith("val/") and len(steps) > 20:
                window = max(2, len(steps) // 10)
                ax.plot(
                    steps[window - 1 :],
                    _moving_average(values, window),
                    color=line.get_color(),
                    label=f"{key} (mean of {window})",
                )
            drawn = True
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    plot_path = pathlib.Path(plot_path)
    tmp = plot_path.with_name(plot_path.name + ".tmp")
    figure.savefig(tmp, format="png")
    os.replace(tmp, plot_path)
    return plot_path


# ----------------------------------------------------------------------------------------------
# Helpers


def _moving_average(values: list[float], window: int) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [(sums[i] - sums[i - window]) / window for i in range(window, len(sums))]


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (MLflow params are flat)."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _to_float(key: str, value: Any) -> float:
    # Accepts Python/NumPy numbers and 0-d tensors (anything with __float__ but not bool/str).
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise ValueError(
            f"metric {key!r}: expected a real number, got {type(value).__name__} ({value!r})"
        )
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as error:  # RuntimeError: a tensor of size > 1
        raise ValueError(f"metric {key!r}: cannot convert {value!r} to a float ({error})") from None


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(_NAME_RE.match(value))


def _check_name(name: Any, what: str) -> None:
    if not _is_name(name):
        raise ValueError(
            f"{what} {name!r} must be a non-empty name of letters, digits, '_', "
            f"'.', '-' (a '/' is added between prefix and name)"
        )


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Writes via a temporary file + rename, so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
