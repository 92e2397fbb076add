"""Where a run's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases and MLflow, each a
`MetricBackend` (the same three calls), with the W&B and MLflow sections of the `logger` config.

- `TensorBoardBackend`: scalar event files under `run_dir/tensorboard/` (tensorboard's own writer;
  no torch or TensorFlow import). It starts with a SessionLog START event at the first new step,
  which makes TensorBoard discard the events of that step and later that an earlier run wrote.
- `WandbBackend`: a W&B run under `run_dir/wandb/`; mode "offline" needs no network (`wandb sync`
  uploads it). A resumed run continues the same run (the Logger keeps its id); W&B ignores steps
  it already has.
- `MlflowBackend`: an MLflow run, by default in the file store `<log_dir>/mlruns`, one run per run
  name, continued on resume. MLflow cannot delete points, so a redone step shows both.

The Logger constructs them when it opens, calls them with flat `<prefix>/<name>` keys, and turns
off one that fails mid-run. Each imports its package only when constructed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any, Protocol

from dockyard_rl.utils.config import require, require_bool
from dockyard_rl.utils.metric_names import is_name

_log = logging.getLogger(__name__)

_WANDB_MODES = ("offline", "online", "disabled")
# The name of the config artifact of an MLflow run (the same as the run directory's config.json).
_MLFLOW_CONFIG_ARTIFACT = "config.json"


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """`logger.wandb`: Weights & Biases, offline by default (no network, no account)."""

    enabled: bool = False
    project: str = "dockyard_rl"
    name: str | None = None  # the W&B run's display name; null = the Logger's run name
    mode: str = "offline"  # offline (files under run_dir/wandb) | online | disabled

    def __post_init__(self) -> None:
        require_bool(self, "enabled")
        require(
            is_name(self.project),
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

    def __post_init__(self) -> None:
        require_bool(self, "enabled")
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


class MetricBackend(Protocol):
    """What the Logger calls on every backend: metrics of a step, the run's config, the end."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_hyperparams(self, params: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
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


class WandbBackend:
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


class MlflowBackend:
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
        resumed_run_id = None
        if run_id is not None:
            try:
                self._client.update_run(run_id, status="RUNNING")
                resumed_run_id = run_id
            except MlflowException as error:  # the store was moved or deleted since
                _log.warning(
                    "MLflow run %s of the resumed run is not in %s (%s); starting a new MLflow run",
                    run_id,
                    tracking_uri,
                    error,
                )
        self.run_id: str = (
            resumed_run_id
            if resumed_run_id is not None
            else self._client.create_run(
                experiment_id, run_name=config.run_name or run_name
            ).info.run_id
        )

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
        self._client.log_dict(self.run_id, dict(params), _MLFLOW_CONFIG_ARTIFACT)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (MLflow params are flat)."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
