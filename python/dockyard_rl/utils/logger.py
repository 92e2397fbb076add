"""Metrics logging of a training run, composed: `Logger` sends each step's metrics to
metrics.jsonl, the console, TensorBoard, W&B and MLflow, and draws a PNG at the end; `LoggerConfig`
is the `logger` config section.

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
resume, so never put a timestamp in them), each part in its own module:
- `run_dir/metrics.jsonl` (metrics_jsonl.py): the source of truth. One strict-JSON object per
  `log_metrics` call (so one line per step for the train metrics and one per validation), flat
  keys `<prefix>/<name>` (metric_names.py). NaN/inf values are written as null and listed under
  `"nonfinite": {"train/loss": "nan"}`: the run goes on, the value is flagged (here, in a warning
  and on the console) instead of silently becoming a number.
- `run_dir/config.json`: the hyperparameters given to `log_hyperparams`.
- TensorBoard (`run_dir/tensorboard/`), W&B (`run_dir/wandb/`, offline by default) and MLflow
  (by default the file store `<log_dir>/mlruns`, shared by all runs under log_dir so that the
  MLflow UI compares them): metric_backends.py.
- The console (console.py): a progress bar on a terminal, else one line per logged step.
- `run_dir/metrics.png` (at `finish()`, metrics_plot.py): drawn from metrics.jsonl, so a resumed
  run's plot covers every step.

Resume: the first write of a Logger drops every logged row/event of a step after the run's
resume point, i.e. after `resume_from(step)` or, for a fresh start, from the first logged step on
(a rerun from scratch replaces the old curves instead of interleaving with them). JSONL is
rewritten atomically without those rows; TensorBoard gets a SessionLog START event at the first
new step, which makes TensorBoard discard the old events of that step and later. A resumed run
continues the same W&B and MLflow runs (ids kept in run_dir/run_ids.json; a fresh start makes new
ones): W&B ignores steps it already has; MLflow cannot delete points, so a redone step shows both.

Timing: `timer(stage)` measures one stage of the current step (step_timer.py); a
`prefix="train"` call closes the step and adds the breakdown to its row as `timing/<stage>_s` for
the STAGES (0 when not measured), `timing/total_s` (wall time since the previous step closed) and
`timing/other_s`.

Metric names the console and the plot read (the contract with the training loop): REWARD_KEY,
RESOLVE_RATE_KEY and APPLY_RATE_KEY of metric_names.py under the "train" and "val" prefixes.

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
import pathlib
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from dockyard_rl.utils.config import is_int, require, require_bool
from dockyard_rl.utils.console import Console, progress_text
from dockyard_rl.utils.metric_backends import (
    MetricBackend,
    MlflowBackend,
    MlflowConfig,
    TensorBoardBackend,
    WandbBackend,
    WandbConfig,
)
from dockyard_rl.utils.metric_names import TIMING_PREFIX, check_name, is_metric_name, is_name
from dockyard_rl.utils.metrics_jsonl import JsonlWriter, atomic_write_text
from dockyard_rl.utils.metrics_plot import plot_metrics
from dockyard_rl.utils.step_timer import StepTimer

_log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
PLOT_FILE = "metrics.png"
RUN_IDS_FILE = "run_ids.json"


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

    def __post_init__(self) -> None:
        require(
            isinstance(self.log_dir, str) and bool(self.log_dir),
            "log_dir",
            f"must be a directory path, got {self.log_dir!r}",
        )
        require_bool(self, "console", "tensorboard", "jsonl", "plot")
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


class Logger:
    """Logs a run's metrics to every enabled backend (module docstring).

    Call order: `resume_from` (when resuming) before the first `log_metrics`; `log_hyperparams`
    at any time; `finish()` once at the end (safe to repeat).
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
        if not is_name(run_name) or run_name in (".", ".."):
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
        self._total_steps = total_steps
        self._timer = StepTimer(clock)
        self._lock = threading.RLock()
        self._resume_step: int | None = None
        self._opened = False
        self._finished = False
        self._hyperparams: dict[str, Any] | None = None
        self._jsonl = JsonlWriter(self.metrics_path) if config.jsonl else None
        self._backends: list[MetricBackend] = []
        self._console: Console | None = None

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

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Records the run's config (a mapping, e.g. `config_to_dict(config)`) in config.json and
        the backends."""
        if not isinstance(params, Mapping):
            raise ValueError(
                f"log_hyperparams: expected a mapping (e.g. config_to_dict(config)), got "
                f"{type(params).__name__}"
            )
        # JSON round trip: plain types only, so every backend can store it.
        plain: dict[str, Any] = json.loads(json.dumps(dict(params), default=str))
        with self._lock:
            self._hyperparams = plain
            atomic_write_text(
                self.run_dir / CONFIG_FILE, json.dumps(plain, indent=2, sort_keys=True) + "\n"
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
        check_name(prefix, "prefix")
        row: dict[str, float] = {}
        for name, value in metrics.items():
            if not is_metric_name(name):
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
                    self._console.update(step, progress_text(row, nonfinite))
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
            self._backends.append(TensorBoardBackend(self.run_dir / "tensorboard", first_step))
        if self.config.wandb.enabled:
            self._backends.append(
                WandbBackend(self.config.wandb, self.run_dir, run_ids["wandb"], self.run_name)
            )
        if self.config.mlflow.enabled:
            backend = MlflowBackend(
                self.config.mlflow, self.mlflow_tracking_uri, run_ids.get("mlflow"), self.run_name
            )
            run_ids["mlflow"] = backend.run_id
            self._backends.append(backend)
        atomic_write_text(self.run_dir / RUN_IDS_FILE, json.dumps(run_ids, indent=2) + "\n")
        if self.config.console:
            self._console = Console(self._total_steps, initial_step=max(0, first_step - 1))
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

    def _call_backends(self, method: str, *args: Any) -> None:
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
