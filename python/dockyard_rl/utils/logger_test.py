"""Tests of the composed metrics logger: config errors, stage times in the rows, JSONL, resume,
TensorBoard, the console, PNG, W&B, MLflow.

Every backend writes real files into tmp_path and the tests read them back with the backend's
own reader (TensorBoard's EventAccumulator, MlflowClient, W&B's offline run directory). Backends
whose package is not installed skip with the reason.
"""

import importlib.util
import json
import logging
import math
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dockyard_rl.utils import logger as logger_lib
from dockyard_rl.utils.config import from_dict
from dockyard_rl.utils.logger import Logger, LoggerConfig
from dockyard_rl.utils.metric_names import REWARD_KEY
from dockyard_rl.utils.metrics_jsonl import read_jsonl

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
requires_matplotlib = pytest.mark.skipif(
    not HAS_MATPLOTLIB, reason="matplotlib is not installed (not in this lock yet)"
)
requires_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="wandb is not installed (not in this lock yet)",
)
requires_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None,
    reason="mlflow is not installed (not in this lock yet)",
)


def make_config(tmp_path, **overrides) -> LoggerConfig:
    data = {"log_dir": str(tmp_path / "logs"), "console": False, "plot": HAS_MATPLOTLIB}
    data.update(overrides)
    return from_dict(LoggerConfig, data, "logger")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def scalars(run_dir, tag):
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def train_rows(path):
    return [row for row in read_jsonl(path) if "train/reward" in row]


# -- config ------------------------------------------------------------------------------------


def test_default_config_is_valid_and_offline():
    config = from_dict(LoggerConfig, None, "logger")
    assert config.log_dir == "results/logs" and config.log_every == 1
    assert config.tensorboard and config.jsonl and config.console and config.plot
    assert not config.wandb.enabled and config.wandb.mode == "offline"
    assert not config.mlflow.enabled and config.mlflow.tracking_uri is None


@pytest.mark.parametrize(
    "data, message",
    [
        ({"log_every": 0}, r"^logger\.log_every: must be an integer >= 1"),
        ({"log_every": True}, r"^logger\.log_every: must be an integer >= 1"),
        ({"console": "yes"}, r"^logger\.console: must be true or false"),
        ({"log_dir": ""}, r"^logger\.log_dir: must be a directory path"),
        (
            {"jsonl": False},
            r"^logger\.plot: .*needs jsonl: true; set logger\.jsonl: true or "
            r"logger\.plot: false",
        ),
        (
            {"wandb": {"mode": "cloud"}},
            r"^logger\.wandb\.mode: must be one of offline, online, "
            r"disabled",
        ),
        ({"wandb": {"enabled": 1}}, r"^logger\.wandb\.enabled: must be true or false"),
        ({"wandb": {"project": "a b"}}, r"^logger\.wandb\.project: must be a non-empty name"),
        (
            {"wandb": {"entity": "me"}},
            r"^logger\.wandb: unknown key\(s\) 'entity'; valid keys: "
            r"enabled, mode, name, project",
        ),
        ({"mlflow": {"tracking_uri": ""}}, r"^logger\.mlflow\.tracking_uri: must be a URI"),
        ({"mlflow": {"experiment_name": " "}}, r"^logger\.mlflow\.experiment_name: must be"),
        (
            {"log_interval": 5},
            r"^logger: unknown key\(s\) 'log_interval'; valid keys: console, jsonl, "
            r"log_dir, log_every, mlflow, plot, tensorboard, wandb",
        ),
    ],
)
def test_config_errors_name_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(LoggerConfig, data, "logger")


@pytest.mark.parametrize(
    "module, overrides, key",
    [
        ("wandb", {"wandb": {"enabled": True}}, "logger.wandb.enabled"),
        ("mlflow", {"mlflow": {"enabled": True}}, "logger.mlflow.enabled"),
        ("matplotlib", {"plot": True}, "logger.plot"),
    ],
)
def test_missing_backend_package_is_a_setup_error_naming_the_key(
    tmp_path, monkeypatch, module, overrides, key
):
    # sys.modules[name] = None is how Python itself marks a module as not importable.
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        ValueError,
        match=rf"^{key}: is true but the '{module}' package is not "
        rf"installed.*or set {key}: false$",
    ):
        Logger(make_config(tmp_path, **overrides), "run")
    assert not (tmp_path / "logs").exists()  # nothing was created before the error


@pytest.mark.parametrize("run_name", ["", "a/b", "..", "x y", None])
def test_run_name_must_be_a_plain_directory_name(tmp_path, run_name):
    with pytest.raises(ValueError, match="run name"):
        Logger(make_config(tmp_path), run_name)


# -- stage times --------------------------------------------------------------------------------


def test_stage_times_join_the_train_row_each_step(tmp_path):
    clock = FakeClock()
    logger = Logger(make_config(tmp_path, plot=False), "run", clock=clock)
    for step in (1, 2):
        with logger.timer("generate"):
            clock.now += 2.0
        with logger.timer("train"):
            clock.now += 1.0 * step
        logger.add_time("weight_sync", 0.5)
        logger.log_metrics(step, {"reward": 0.1})
    logger.log_metrics(2, {"resolve_rate": 0.5}, prefix="val")  # no timing in validation rows
    logger.finish()
    rows = read_jsonl(logger.metrics_path)
    assert [row["timing/train_s"] for row in rows[:2]] == [1.0, 2.0]
    assert all(
        row["timing/generate_s"] == 2.0
        and row["timing/weight_sync_s"] == 0.5
        and row["timing/score_s"] == 0.0
        and row["timing/buffer_wait_s"] == 0.0
        for row in rows[:2]
    )
    assert rows[1]["timing/total_s"] == 4.0
    assert not any(key.startswith("timing/") for key in rows[2])
    assert scalars(logger.run_dir, "timing/train_s") == [(1, 1.0), (2, 2.0)]


# -- JSONL -------------------------------------------------------------------------------------


def test_jsonl_one_strict_json_line_per_call_flushed_as_written(tmp_path):
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.log_hyperparams({"grpo": {"num_prompts_per_step": 4}})
    logger.log_metrics(1, {"reward": 0.5, "resolve_rate": np.float32(0.25), "count": 3})
    # Readable before finish(): each line is flushed as it is written.
    lines = logger.metrics_path.read_text().splitlines()
    assert len(lines) == 1
    logger.log_metrics(1, {"reward": 0.75, "loss/clip_fraction": 0.1}, prefix="val")
    logger.finish()
    rows = [
        json.loads(line, parse_constant=pytest.fail)  # NaN/Infinity would not be JSON
        for line in logger.metrics_path.read_text().splitlines()
    ]
    assert rows[0]["step"] == 1 and rows[0]["train/reward"] == 0.5
    assert rows[0]["train/resolve_rate"] == 0.25 and rows[0]["train/count"] == 3.0
    assert rows[1] == {
        "step": 1,
        "time": rows[1]["time"],
        "val/reward": 0.75,
        "val/loss/clip_fraction": 0.1,
    }
    config = json.loads((logger.run_dir / "config.json").read_text())
    assert config == {"grpo": {"num_prompts_per_step": 4}}


def test_nonfinite_metrics_are_logged_and_flagged_not_raised(tmp_path, caplog, capsys):
    logger = Logger(make_config(tmp_path, plot=False, console=True), "run")
    with caplog.at_level(logging.WARNING, logger=logger_lib.__name__):
        logger.log_metrics(1, {"reward": 0.5, "loss": float("nan"), "grad_norm": float("inf")})
        logger.log_metrics(2, {"reward": 0.6, "loss": 0.3})
    logger.finish()
    first, second = read_jsonl(logger.metrics_path)
    assert first["train/loss"] is None and first["train/grad_norm"] is None
    assert first["nonfinite"] == {"train/loss": "nan", "train/grad_norm": "inf"}
    assert "nonfinite" not in second and second["train/loss"] == 0.3
    assert "non-finite metric(s) train/grad_norm=inf, train/loss=nan" in caplog.text
    assert "NONFINITE: train/grad_norm, train/loss" in capsys.readouterr().err
    # TensorBoard keeps the raw value (it draws NaN as a gap).
    assert math.isnan(scalars(logger.run_dir, "train/loss")[0][1])


@pytest.mark.parametrize(
    "metrics, message",
    [
        ({"reward": "high"}, r"metric 'train/reward': expected a real number, got str"),
        ({"reward": None}, r"metric 'train/reward': expected a real number, got NoneType"),
        ({"reward": np.ones(2)}, r"metric 'train/reward': cannot convert"),
        ({"a b": 1.0}, r"metric name 'a b'"),
        ({"/x": 1.0}, r"metric name '/x'"),
    ],
)
def test_bad_metrics_raise_value_error(tmp_path, metrics, message):
    logger = Logger(make_config(tmp_path, plot=False), "run")
    with pytest.raises(ValueError, match=message):
        logger.log_metrics(1, metrics)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        logger.log_metrics(-1, {"reward": 1.0})
    with pytest.raises(ValueError, match="prefix 'a/b'"):
        logger.log_metrics(1, {"reward": 1.0}, prefix="a/b")
    logger.finish()


# -- resume ------------------------------------------------------------------------------------


def crashed_run(tmp_path, last_step):
    """A run that logged steps 1..last_step and died without finish(), mid-line."""
    logger = Logger(make_config(tmp_path, plot=False), "run")
    for step in range(1, last_step + 1):
        logger.log_metrics(step, {"reward": step / 10})
        if step % 2 == 0:
            logger.log_metrics(step, {"resolve_rate": step / 100}, prefix="val")
    logger._backends[0]._writer.flush()  # what TensorBoard's writer thread does every 10 s
    with open(logger.metrics_path, "a") as file:
        file.write('{"step": 6, "train/rew')  # SIGKILL in the middle of a write
    return logger.run_dir


def test_resume_from_drops_rows_after_the_checkpoint_and_appends(tmp_path):
    run_dir = crashed_run(tmp_path, last_step=5)
    # The last checkpoint was at step 3: steps 4 and 5 are redone with new values.
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.resume_from(3)
    with pytest.raises(RuntimeError, match="before the first log_metrics"):
        logger.resume_from(2)
    for step in (4, 5, 6):
        logger.log_metrics(step, {"reward": step})
    logger.finish()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [
        (row["step"], row["train/reward"]) for row in train_rows(run_dir / "metrics.jsonl")
    ] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0), (5, 5.0), (6, 6.0)]
    assert [row["step"] for row in rows if "val/resolve_rate" in row] == [2]  # step 4's is gone
    assert all(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    # TensorBoard: the START event at step 4 hides the crashed run's steps 4 and 5.
    assert scalars(run_dir, "train/reward") == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
        (3, pytest.approx(0.3)),
        (4, 4.0),
        (5, 5.0),
        (6, 6.0),
    ]
    assert scalars(run_dir, "val/resolve_rate") == [(2, pytest.approx(0.02))]


def test_a_fresh_start_replaces_an_old_run_of_the_same_name(tmp_path):
    run_dir = crashed_run(tmp_path, last_step=3)
    old_ids = json.loads((run_dir / "run_ids.json").read_text())
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.log_metrics(1, {"reward": 1.0})
    logger.finish()
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1]
    assert scalars(run_dir, "train/reward") == [(1, 1.0)]
    assert json.loads((run_dir / "run_ids.json").read_text())["wandb"] != old_ids["wandb"]


def test_resume_keeps_the_backend_run_ids(tmp_path):
    run_dir = crashed_run(tmp_path, last_step=2)
    old_ids = json.loads((run_dir / "run_ids.json").read_text())
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.resume_from(2)
    logger.finish()
    assert json.loads((run_dir / "run_ids.json").read_text()) == old_ids


# -- TensorBoard, console, log_every, backend failures -------------------------------------------


def test_tensorboard_scalars_and_config_text(tmp_path):
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.log_hyperparams({"loss_fn": {"ratio_clip_low": 0.2}})
    for step in (1, 2, 3):
        logger.log_metrics(step, {"reward": step / 4, "resolve_rate": step / 8})
    logger.log_metrics(3, {"resolve_rate": 0.5}, prefix="val")
    logger.finish()
    assert len(list((logger.run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    accumulator = EventAccumulator(str(logger.run_dir / "tensorboard"))
    accumulator.Reload()
    tags = accumulator.Tags()
    assert {
        "train/reward",
        "train/resolve_rate",
        "val/resolve_rate",
        "timing/generate_s",
        "timing/total_s",
    } <= set(tags["scalars"])
    assert [(e.step, e.value) for e in accumulator.Scalars("train/reward")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
    assert [(e.step, e.value) for e in accumulator.Scalars("val/resolve_rate")] == [(3, 0.5)]
    config_text = accumulator.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert '"ratio_clip_low": 0.2' in config_text


def test_log_every_thins_backends_but_not_jsonl(tmp_path, capsys):
    logger = Logger(make_config(tmp_path, plot=False, console=True, log_every=2), "run")
    for step in range(1, 6):
        logger.log_metrics(step, {"reward": float(step), REWARD_KEY: float(step)})
    logger.log_metrics(5, {"resolve_rate": 0.5}, prefix="val")  # validation always goes through
    logger.finish()
    assert [row["step"] for row in train_rows(logger.metrics_path)] == [1, 2, 3, 4, 5]
    assert [step for step, _ in scalars(logger.run_dir, "train/reward")] == [2, 4]
    assert scalars(logger.run_dir, "val/resolve_rate") == [(5, 0.5)]
    err = capsys.readouterr().err
    assert "step 2: reward=2.000" in err and "step 3:" not in err
    assert "step 5 val/resolve_rate=0.5" in err


def test_console_line_shows_reward_resolve_rate_and_stage_times(tmp_path, capsys):
    clock = FakeClock()
    logger = Logger(
        make_config(tmp_path, plot=False, console=True, tensorboard=False),
        "run",
        total_steps=10,
        clock=clock,
    )
    with logger.timer("generate"):
        clock.now += 12.34
    with logger.timer("weight_sync"):
        clock.now += 0.5
    logger.log_metrics(1, {REWARD_KEY: 0.4, "resolve_rate": 0.25})
    logger.finish()
    assert "step 1: reward=0.400 resolve=0.250 | gen 12.3s sync 0.5s" in capsys.readouterr().err


def test_a_backend_failing_mid_run_is_turned_off_with_a_warning(tmp_path, caplog):
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.log_metrics(1, {"reward": 0.1})
    logger._backends[0]._writer.close()  # e.g. the event file's disk went away
    with caplog.at_level(logging.WARNING, logger=logger_lib.__name__):
        logger.log_metrics(2, {"reward": 0.2})
        logger.log_metrics(3, {"reward": 0.3})
    logger.finish()
    assert caplog.text.count("TensorBoardBackend backend failed in log_metrics") == 1
    assert [row["step"] for row in read_jsonl(logger.metrics_path)] == [1, 2, 3]


def test_finish_is_idempotent_and_closes_logging(tmp_path):
    logger = Logger(make_config(tmp_path, plot=False), "run")
    logger.log_hyperparams({"lr": 1e-6})
    logger.log_metrics(1, {"reward": 0.1})
    assert logger.finish() is None
    assert logger.finish() is None
    with pytest.raises(RuntimeError, match="after finish"):
        logger.log_metrics(2, {"reward": 0.2})
    assert json.loads((logger.run_dir / "config.json").read_text()) == {"lr": 1e-6}


# -- PNG ---------------------------------------------------------------------------------------


@requires_matplotlib
def test_finish_writes_a_png_covering_a_resumed_run(tmp_path):
    crashed_run(tmp_path, last_step=30)
    logger = Logger(make_config(tmp_path, plot=True), "run")
    logger.resume_from(25)
    for step in range(26, 41):
        logger.log_metrics(
            step,
            {
                "reward": step / 40,
                "resolve_rate": step / 80,
                "apply_rate": 0.9,
                "loss": float("nan"),
            },
        )
        if step % 5 == 0:
            logger.log_metrics(step, {"resolve_rate": step / 70, "reward": step / 50}, prefix="val")
    path = logger.finish()
    assert path == logger.run_dir / "metrics.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from matplotlib.image import imread

    height, width = imread(str(path)).shape[:2]
    assert (width, height) == (1500, 420)
    assert not list(logger.run_dir.glob("*.tmp"))


@requires_matplotlib
def test_plot_with_no_metrics_still_writes_a_png(tmp_path):
    logger = Logger(make_config(tmp_path, plot=True), "run")
    assert logger.finish().read_bytes()[:4] == b"\x89PNG"


# -- W&B and MLflow (offline) --------------------------------------------------------------------


@pytest.fixture
def no_network_wandb(tmp_path, monkeypatch):
    # W&B's own settings and caches go under tmp_path (HOME may be read-only under Bazel).
    for variable, folder in (
        ("WANDB_CONFIG_DIR", "wandb_config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(variable, str(tmp_path / folder))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


@requires_wandb
def test_wandb_offline_run_is_written_under_the_run_dir(tmp_path, no_network_wandb):
    config = make_config(tmp_path, plot=False, wandb={"enabled": True, "project": "test"})
    logger = Logger(config, "run")
    logger.log_hyperparams({"grpo": {"val_period": 5}})
    for step in (1, 2):
        logger.log_metrics(step, {"reward": step / 2})
    logger.log_metrics(2, {"resolve_rate": 0.5}, prefix="val")
    logger.finish()
    run_id = json.loads((logger.run_dir / "run_ids.json").read_text())["wandb"]
    run_dirs = list((logger.run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(run_dirs) == 1, list((logger.run_dir / "wandb").iterdir())
    assert (run_dirs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    assert len(logger._backends) == 1 + 1  # TensorBoard and W&B never failed


@requires_mlflow
def test_mlflow_file_store_run_and_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    config = make_config(tmp_path, plot=False, mlflow={"enabled": True, "experiment_name": "exp"})
    logger = Logger(config, "run")
    assert logger.mlflow_tracking_uri == (tmp_path / "logs" / "mlruns").resolve().as_uri()
    logger.log_hyperparams({"grpo": {"val_period": 5}, "policy": {"backend": "dtensor"}})
    for step in (1, 2, 3):
        logger.log_metrics(step, {"reward": step / 4, "loss": float("nan") if step == 2 else 1.0})
    logger.finish()
    run_id = json.loads((logger.run_dir / "run_ids.json").read_text())["mlflow"]

    # Resume at step 2 of the same run: the same MLflow run continues.
    logger = Logger(config, "run")
    logger.resume_from(2)
    logger.log_hyperparams({"grpo": {"val_period": 5}, "policy": {"backend": "dtensor"}})
    logger.log_metrics(3, {"reward": 3.0})
    logger.finish()

    client = MlflowClient(tracking_uri=logger.mlflow_tracking_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params == {"grpo.val_period": "5", "policy.backend": "dtensor"}
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/reward")]
    assert sorted(history) == [(1, 0.25), (2, 0.5), (3, 0.75), (3, 3.0)]
    assert len(client.search_runs([run.info.experiment_id])) == 1
