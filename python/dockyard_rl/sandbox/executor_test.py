"""Tests of the executor entry point's flags -> ExecutorConfig mapping (the process itself is
started for real in executor_restart_test.py)."""

import pytest

from dockyard_rl.sandbox.executor import TOKEN_ENV_VAR, config_from_args, main, parse_args


def test_defaults_come_from_the_config():
    config = config_from_args(parse_args([]), environ={})
    assert (config.host, config.port, config.auth_token) == ("127.0.0.1", 9090, None)


def test_flags_map_onto_config_keys(tmp_path):
    args = parse_args(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--workers",
            "2",
            "--work-dir",
            str(tmp_path),
            "--db",
            str(tmp_path / "t.db"),
            "--max-queue",
            "7",
            "--max-patch-bytes",
            "1000",
            "--max-infra-attempts",
            "1",
            "--retry-backoff-s",
            "0.5",
            "--default-timeout-s",
            "60",
            "--shutdown-grace-s",
            "1",
            "--image-cache-dir",
            str(tmp_path / "img"),
            "--image-cache-max-bytes",
            "5000000000",
        ]
    )
    config = config_from_args(args, environ={})
    assert (config.port, config.num_workers, config.max_queue, config.max_patch_bytes) == (
        0,
        2,
        7,
        1000,
    )
    assert config.db_file == tmp_path / "t.db" and config.work_path == tmp_path
    assert (
        config.max_infra_attempts,
        config.retry_backoff_s,
        config.pipeline.timeout_s,
        config.shutdown_grace_s,
    ) == (1, 0.5, 60.0, 1.0)
    assert (config.pipeline.image_cache_dir, config.pipeline.image_cache_max_bytes) == (
        str(tmp_path / "img"),
        5_000_000_000,
    )


def test_token_from_file_or_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token-0123456789\n")
    from_file = config_from_args(
        parse_args(["--auth-token-file", str(token_file)]),
        environ={TOKEN_ENV_VAR: "env-token-0123456789"},
    )
    assert from_file.auth_token == "file-token-0123456789"  # the file wins over the environment
    from_env = config_from_args(parse_args([]), environ={TOKEN_ENV_VAR: "env-token-0123456789"})
    assert from_env.auth_token == "env-token-0123456789"
    with pytest.raises(ValueError, match="--auth-token-file: cannot read"):
        config_from_args(parse_args(["--auth-token-file", str(tmp_path / "missing")]), environ={})


def test_invalid_configuration_exits_2_naming_the_key(capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV_VAR, raising=False)
    assert main(["--workers", "0"]) == 2
    assert "executor.num_workers: must be an integer >= 1" in capsys.readouterr().err
    assert main(["--host", "0.0.0.0"]) == 2
    assert "requires auth_token" in capsys.readouterr().err
    assert main(["--image-cache-max-bytes", "0"]) == 2
    assert (
        "executor.pipeline.image_cache_max_bytes: must be a positive integer"
        in capsys.readouterr().err
    )
