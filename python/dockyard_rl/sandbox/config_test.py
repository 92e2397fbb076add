"""Tests of ExecutorConfig: defaults, validation messages, derived paths."""

import dataclasses
import os

import pytest

from dockyard_rl.sandbox.config import ExecutorConfig, default_num_workers
from dockyard_rl.utils.config import from_dict


def test_defaults_bind_loopback_on_9090():
    cfg = from_dict(ExecutorConfig, None, "executor")
    assert (cfg.host, cfg.port) == ("127.0.0.1", 9090)
    assert cfg.auth_token is None
    assert cfg.num_workers == default_num_workers() >= 1
    assert cfg.db_file == cfg.work_path / "tasks.sqlite3"


def test_default_num_workers_is_three_quarters_of_the_cpus_at_least_one():
    num_cpus = len(os.sched_getaffinity(0))
    assert default_num_workers() == max(1, int(0.75 * num_cpus))


def test_paths_expand_user_and_explicit_db(tmp_path):
    cfg = from_dict(ExecutorConfig, {"work_dir": "~/x", "db_path": str(tmp_path / "t.db")}, "e")
    assert cfg.work_path == cfg.work_path.expanduser() and not str(cfg.work_path).startswith("~")
    assert cfg.db_file == tmp_path / "t.db"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("port", 70000, r"executor\.port: must be an integer in \[0, 65535\]"),
        ("port", True, r"executor\.port: must be an integer"),
        ("num_workers", 0, r"executor\.num_workers: must be an integer >= 1"),
        ("max_queue", 0, r"executor\.max_queue: must be an integer >= 1"),
        ("max_patch_bytes", -1, r"executor\.max_patch_bytes: must be an integer >= 1"),
        ("auth_token", "short", r"executor\.auth_token: must be a string of at least 16"),
        ("auth_token", "has space in it 0123456789", r"executor\.auth_token: .*without whitespace"),
        ("work_dir", "", r"executor\.work_dir: must be a directory path"),
        ("db_path", "", r"executor\.db_path: must be a file path or null"),
        ("max_infra_attempts", 0, r"executor\.max_infra_attempts: must be an integer >= 1"),
        ("retry_backoff_s", -1.0, r"executor\.retry_backoff_s: must be a number of seconds >= 0"),
        ("retry_after_s", 0, r"executor\.retry_after_s: must be an integer number of seconds >= 1"),
        ("shutdown_grace_s", -2, r"executor\.shutdown_grace_s: must be a number of seconds >= 0"),
    ],
)
def test_invalid_values_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        from_dict(ExecutorConfig, {key: value}, "executor")


def test_non_loopback_host_requires_a_token():
    with pytest.raises(
        ValueError, match=r"executor\.host: '0\.0\.0\.0' is not a loopback.*auth_token"
    ):
        from_dict(ExecutorConfig, {"host": "0.0.0.0"}, "executor")
    cfg = from_dict(ExecutorConfig, {"host": "0.0.0.0", "auth_token": "x" * 32}, "executor")
    assert cfg.host == "0.0.0.0"
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert from_dict(ExecutorConfig, {"host": host}, "executor").host == host


def test_nested_pipeline_section_is_built_and_validated():
    cfg = from_dict(ExecutorConfig, {"pipeline": {"timeout_s": 60}}, "executor")
    assert cfg.pipeline.timeout_s == 60
    with pytest.raises(ValueError, match=r"^executor\.pipeline\.timeout_s: must be a number"):
        from_dict(ExecutorConfig, {"pipeline": {"timeout_s": -1}}, "executor")


def test_unknown_key_is_rejected():
    with pytest.raises(ValueError, match=r"executor: unknown key\(s\) 'workers'"):
        from_dict(ExecutorConfig, {"workers": 2}, "executor")


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ExecutorConfig().port = 1
