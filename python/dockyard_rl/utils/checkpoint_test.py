"""Tests of checkpoint.py: the `checkpointing` config, atomic saves (a failing writer, leftovers,
real SIGKILLs of a saving process), `publish_directory` and metric-ranked retention."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dockyard_rl.utils import checkpoint
from dockyard_rl.utils.checkpoint import (
    MANIFEST_NAME,
    CheckpointingConfig,
    CheckpointManager,
    publish_directory,
)
from dockyard_rl.utils.config import from_dict


def config(**overrides) -> CheckpointingConfig:
    return from_dict(CheckpointingConfig, overrides, "checkpointing")


def write_payload(step: int):
    def write(tmp: pathlib.Path) -> None:
        (tmp / "policy").mkdir()
        (tmp / "policy" / "weights.bin").write_bytes(bytes([step % 256]) * 1000)

    return write


def steps(manager: CheckpointManager) -> list[int]:
    return [info.step for info in manager.list()]


def step_dirs(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# --- config ---------------------------------------------------------------------------------


def test_defaults_are_valid_and_rank_by_resolve_rate():
    cfg = config()
    assert cfg.enabled and cfg.keep_top_k == 3 and cfg.metric_name == "val/resolve_rate"
    assert cfg.higher_is_better and cfg.save_period >= 1


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            {"keep_top_k": 2, "metric_name": None},
            r"^checkpointing\.keep_top_k: .*needs a metric.*checkpointing\.metric_name"
            r".*keep_top_k: null",
        ),
        ({"save_period": 0}, r"^checkpointing\.save_period: must be an integer >= 1"),
        ({"save_period": 2.5}, r"^checkpointing\.save_period: must be an integer >= 1"),
        ({"keep_top_k": 0}, r"^checkpointing\.keep_top_k: must be an integer >= 1 or null"),
        ({"keep_top_k": True}, r"^checkpointing\.keep_top_k: must be an integer >= 1 or null"),
        ({"metric_name": ""}, r"^checkpointing\.metric_name: must be a metric name"),
        ({"checkpoint_dir": " "}, r"^checkpointing\.checkpoint_dir: must be a directory path"),
        ({"enabled": "yes"}, r"^checkpointing\.enabled: must be true or false"),
        ({"higher_is_better": 1}, r"^checkpointing\.higher_is_better: must be true or false"),
        ({"keep_top_k_": 1}, r"^checkpointing: unknown key\(s\) 'keep_top_k_'"),
    ],
)
def test_config_errors_name_the_key(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        config(**overrides)


def test_keeping_everything_needs_no_metric():
    cfg = config(keep_top_k=None, metric_name=None)
    assert cfg.keep_top_k is None and cfg.metric_name is None


def test_relative_checkpoint_dir_is_resolved_against_the_run_dir(tmp_path):
    assert config().resolve_dir(tmp_path) == tmp_path / "results" / "checkpoints"
    assert config(checkpoint_dir="/abs/ckpt").resolve_dir(tmp_path) == pathlib.Path("/abs/ckpt")


def test_should_save_every_period():
    assert [s for s in range(0, 10) if config(save_period=3).should_save(s)] == [3, 6, 9]
    assert not config(enabled=False, save_period=1).should_save(4)


# --- saving and atomicity ---------------------------------------------------------------------


def test_save_writes_the_callers_files_and_a_manifest_last(tmp_path):
    manager = CheckpointManager(config(keep_top_k=None), tmp_path / "ckpt")
    path = manager.save(3, write_payload(3), metrics={"val/resolve_rate": 0.25})
    assert path == tmp_path / "ckpt" / "step_3"
    assert (path / "policy" / "weights.bin").read_bytes() == b"\x03" * 1000
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["complete"] is True and manifest["step"] == 3
    assert manifest["metrics"] == {"val/resolve_rate": 0.25}
    assert step_dirs(tmp_path / "ckpt") == ["step_3"]  # no temporary directory left
    latest = manager.latest()
    assert latest.step == 3 and latest.path == path and latest.metrics == {"val/resolve_rate": 0.25}


def test_a_failing_write_leaves_the_previous_checkpoints_untouched(tmp_path):
    manager = CheckpointManager(config(keep_top_k=None), tmp_path)
    manager.save(1, write_payload(1))

    def crash(tmp):
        write_payload(2)(tmp)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        manager.save(2, crash)
    assert step_dirs(tmp_path) == ["step_1"]
    assert manager.latest().step == 1
    manager.save(2, write_payload(2))  # the step can be saved again afterwards
    assert steps(manager) == [1, 2]


def test_leftovers_of_crashes_are_ignored_and_cleaned(tmp_path):
    manager = CheckpointManager(config(keep_top_k=None), tmp_path)
    manager.save(1, write_payload(1))
    # A save killed before its rename (even after writing its manifest), a save killed
    # mid-write, a deletion killed mid-rmtree, and a step directory without a manifest.
    crashed = tmp_path / ".tmp-step_2-999-abcd"
    crashed.mkdir()
    write_payload(2)(crashed)
    (crashed / MANIFEST_NAME).write_text(json.dumps({"step": 2, "complete": True}))
    (tmp_path / ".tmp-step_3-999-ef01").mkdir()
    (tmp_path / ".trash-step_0-1234" / "policy").mkdir(parents=True)
    (tmp_path / "step_5").mkdir()
    write_payload(5)(tmp_path / "step_5")
    (tmp_path / "step_6").mkdir()
    (tmp_path / "step_6" / MANIFEST_NAME).write_text('{"step": 6, "comp')  # torn write
    assert manager.latest().step == 1  # the incomplete ones are invisible

    restarted = CheckpointManager(config(keep_top_k=None), tmp_path)
    assert step_dirs(tmp_path) == ["step_1"]
    assert restarted.latest().step == 1
    assert restarted.save(2, write_payload(2)).name == "step_2"


def test_leftovers_are_also_cleaned_by_the_next_save(tmp_path):
    manager = CheckpointManager(config(keep_top_k=None), tmp_path)
    (tmp_path / ".tmp-step_1-999-abcd").mkdir()
    manager.save(1, write_payload(1))
    assert step_dirs(tmp_path) == ["step_1"]


def test_steps_must_increase_and_the_manifest_name_is_reserved(tmp_path):
    manager = CheckpointManager(config(keep_top_k=None), tmp_path)
    manager.save(4, write_payload(4))
    with pytest.raises(ValueError, match=r"cannot save step 4: .*continue at step 5"):
        manager.save(4, write_payload(4))
    with pytest.raises(ValueError, match="cannot save step 2"):
        manager.save(2, write_payload(2))
    with pytest.raises(ValueError, match="reserved"):
        manager.save(5, lambda tmp: (tmp / MANIFEST_NAME).write_text("{}"))
    with pytest.raises(ValueError, match="integer >= 0"):
        manager.save(-1, write_payload(0))
    with pytest.raises(ValueError, match=r"metrics\['x'\] must be a number"):
        manager.save(6, write_payload(6), metrics={"x": "high"})
    assert steps(manager) == [4] and step_dirs(tmp_path) == ["step_4"]


def test_a_file_as_checkpoint_dir_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"checkpointing\.checkpoint_dir: .*not a directory"):
        CheckpointManager(config(), tmp_path / "file")


_SAVER = textwrap.dedent("""
    import pathlib, sys
    from dockyard_rl.utils.checkpoint import CheckpointManager, CheckpointingConfig

    root = pathlib.Path(sys.argv[1])
    manager = CheckpointManager(CheckpointingConfig(keep_top_k=2, metric_name="m"), root)
    latest = manager.latest()
    step = 0 if latest is None else latest.step
    while True:
        step += 1
        def write(tmp, step=step):
            for index in range(20):
                (tmp / f"shard_{index}.bin").write_bytes(step.to_bytes(4, "big") * 4096)
        manager.save(step, write, metrics={"m": float(step % 3)})
        print(step, flush=True)
""")


def test_sigkill_at_any_moment_leaves_only_complete_checkpoints(tmp_path):
    """A real process saving in a loop, SIGKILLed at random moments and restarted: every
    checkpoint that latest()/list() report is complete, and the steps keep growing."""
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    root = tmp_path / "ckpt"
    # The child imports what this process imports (a plain checkout or Bazel's runfiles).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    rng = random.Random(0)
    previous_latest = 0
    num_kills_mid_save = 0
    for _ in range(6):
        process = subprocess.Popen(
            [sys.executable, str(script), str(root)], env=env, stdout=subprocess.PIPE, text=True
        )
        process.stdout.readline()  # at least one save finished in this run
        time.sleep(rng.uniform(0.0, 0.15))
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        num_kills_mid_save += any(p.name.startswith(".") for p in root.iterdir())
        manager = CheckpointManager(CheckpointingConfig(keep_top_k=2, metric_name="m"), root)
        infos = manager.list()
        assert infos and infos[-1].step > previous_latest
        previous_latest = infos[-1].step
        for info in infos:
            shards = sorted(info.path.glob("shard_*.bin"))
            assert len(shards) == 20
            assert all(s.read_bytes() == info.step.to_bytes(4, "big") * 4096 for s in shards)
        assert not [p for p in root.iterdir() if p.name.startswith(".")]  # cleaned at start
        # Top 2 + the latest, plus one more when the kill fell between a save's rename and its
        # retention (the next save prunes it).
        assert len(infos) <= 4
    assert num_kills_mid_save > 0  # (saving is most of the loop's time: nearly every kill)


# --- publish_directory (also what the policies' save_checkpoint use) ----------------------------


def write_files(content: bytes):
    def write(tmp: pathlib.Path) -> None:
        (tmp / "sub").mkdir()
        (tmp / "model.bin").write_bytes(content)
        (tmp / "sub" / "state.json").write_bytes(content)

    return write


def test_publish_directory_writes_replaces_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "runs" / "ckpt"  # the parent is created
    assert publish_directory(target, write_files(b"one")) == target
    assert (target / "model.bin").read_bytes() == b"one"
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)
    publish_directory(target, write_files(b"two"))  # an existing directory is replaced
    assert (target / "sub" / "state.json").read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["ckpt"]


def test_publish_directory_fsyncs_every_file_before_the_rename_and_the_parent_after(
    tmp_path, monkeypatch
):
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "rename", rename)
    target = tmp_path / "ckpt"
    publish_directory(target, write_files(b"x"))
    publish_at = events.index(("rename", str(target)))
    synced_before = {
        pathlib.Path(path).relative_to(tmp_path).parts[1:]
        for kind, path in events[:publish_at]
        if kind == "fsync"
    }
    assert {("model.bin",), ("sub", "state.json"), ("sub",), ()} <= synced_before
    assert ("fsync", str(tmp_path)) in events[publish_at:]


def test_publish_directory_keeps_the_previous_directory_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    publish_directory(target, write_files(b"old"))

    def failing(tmp: pathlib.Path) -> None:
        (tmp / "model.bin").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_directory(target, failing)
    assert (target / "model.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # The rename of the new directory fails after the old one was moved aside: it is put back.
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        publish_directory(target, write_files(b"new"))
    assert (target / "model.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# --- retention ----------------------------------------------------------------------------------


def test_top_k_with_metrics_given_before_during_and_after_saving(tmp_path):
    manager = CheckpointManager(config(keep_top_k=2, metric_name="val/resolve_rate"), tmp_path)
    metric = "val/resolve_rate"
    manager.save(1, write_payload(1), metrics={metric: 0.5})
    manager.save(2, write_payload(2))  # validation comes later
    assert steps(manager) == [1, 2]
    manager.record_metrics(2, {metric: 0.1})  # after the save
    manager.save(3, write_payload(3), metrics={metric: 0.7})
    assert steps(manager) == [1, 3]  # top 2 = {3: 0.7, 1: 0.5}
    manager.record_metrics(4, {metric: 0.2})  # before the save
    manager.save(4, write_payload(4))
    assert manager.latest().metrics == {metric: 0.2}
    assert steps(manager) == [1, 3, 4]  # top 2 + the latest
    manager.save(5, write_payload(5))  # no metric yet: ranks last, kept as latest
    assert steps(manager) == [1, 3, 5]
    manager.record_metrics(5, {metric: 0.9, "val/mean_reward": 1.5})
    assert steps(manager) == [3, 5]  # 5 (0.9) and 3 (0.7); 1 falls out
    manager.save(6, write_payload(6), metrics={metric: 0.0})
    assert steps(manager) == [3, 5, 6]
    assert manager.list()[1].metrics == {metric: 0.9, "val/mean_reward": 1.5}
    # The metrics live in the manifests: a restarted manager ranks the same way (without them,
    # 7 and the newest, 6, would be kept).
    restarted = CheckpointManager(config(keep_top_k=2, metric_name=metric), tmp_path)
    restarted.save(7, write_payload(7), metrics={metric: 0.1})
    assert steps(restarted) == [3, 5, 7]


def test_lower_is_better(tmp_path):
    manager = CheckpointManager(
        config(keep_top_k=2, metric_name="val/loss", higher_is_better=False), tmp_path
    )
    for step, loss in enumerate([3.0, 1.0, 2.0, 0.5, 4.0, 5.0], start=1):
        manager.save(step, write_payload(step), metrics={"val/loss": loss})
    assert steps(manager) == [2, 4, 6]  # 0.5 and 1.0 are best; 6 is the latest


def test_the_latest_is_kept_even_when_it_ranks_worst(tmp_path):
    manager = CheckpointManager(config(keep_top_k=1, metric_name="m"), tmp_path)
    manager.save(1, write_payload(1), metrics={"m": 1.0})
    for step in range(2, 5):
        manager.save(step, write_payload(step), metrics={"m": 0.0})
        assert steps(manager) == [1, step]
    manager.record_metrics(4, {"m": -5.0})
    assert steps(manager) == [1, 4]


def test_missing_metric_ranks_last_and_ties_prefer_the_newer_step(tmp_path):
    manager = CheckpointManager(config(keep_top_k=2, metric_name="m"), tmp_path)
    manager.save(1, write_payload(1), metrics={"m": 0.3})
    manager.save(2, write_payload(2), metrics={"other": 9.0})
    manager.save(3, write_payload(3), metrics={"m": 0.3})
    manager.save(4, write_payload(4), metrics={"m": float("nan")})  # NaN counts as missing
    assert steps(manager) == [1, 3, 4]
    manager.save(5, write_payload(5), metrics={"m": 0.3})
    assert steps(manager) == [3, 5]  # three-way tie at 0.3: the two newest win
    # Without any metric the newest ones are kept.
    manager = CheckpointManager(config(keep_top_k=2, metric_name="m"), tmp_path / "none")
    for step in range(1, 5):
        manager.save(step, write_payload(step))
    assert steps(manager) == [3, 4]


def test_keep_all(tmp_path):
    manager = CheckpointManager(config(keep_top_k=None), tmp_path)
    for step in range(1, 6):
        manager.save(step, write_payload(step), metrics={"val/resolve_rate": -step})
    assert steps(manager) == [1, 2, 3, 4, 5]


def test_metrics_for_an_unsaved_older_step_are_dropped(tmp_path):
    manager = CheckpointManager(config(keep_top_k=2, metric_name="m"), tmp_path)
    manager.record_metrics(1, {"m": 1.0})  # validation at step 1, no save at step 1
    manager.save(2, write_payload(2))
    manager.record_metrics(1, {"m": 1.0})
    assert manager.latest().metrics == {}
    manager.save(3, write_payload(3))
    assert [info.metrics for info in manager.list()] == [{}, {}]
