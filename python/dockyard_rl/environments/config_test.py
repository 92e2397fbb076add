"""Validation of the `env.swe` config section."""

import pytest

from dockyard_rl.environments.config import SweEnvironmentConfig
from dockyard_rl.sandbox.task import RewardMode
from dockyard_rl.utils.config import from_dict


@pytest.mark.parametrize(
    "key, value",
    [
        ("executor_url", "127.0.0.1:9090"),
        ("max_concurrency", 0),
        ("request_timeout_s", 0),
        ("task_timeout_s", -1.0),
        ("poll_interval_s", float("nan")),
        ("max_infra_retries", -1),
        ("max_infra_retries", True),
        ("reward_mode", "binaryy"),
        ("task_id_prefix", "run/a"),
        ("task_id_prefix", "-a"),
        ("auth_token_env", "s3cr3t-token value"),
        ("auth_token_env", ""),
    ],
)
def test_config_rejects_bad_values_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^env\.swe\.{key}: "):
        from_dict(SweEnvironmentConfig, {key: value}, "env.swe")


def test_config_defaults_are_valid():
    config = from_dict(SweEnvironmentConfig, {}, "env.swe")
    assert config.max_infra_retries >= 0 and config.reward_mode_enum is RewardMode.BINARY


def test_config_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match="unknown key.*max_infra_retries"):
        from_dict(SweEnvironmentConfig, {"max_retries": 3}, "env.swe")


def test_auth_token_comes_from_the_named_environment_variable(monkeypatch):
    config = from_dict(SweEnvironmentConfig, {"auth_token_env": "MY_EXECUTOR_TOKEN"}, "env.swe")
    monkeypatch.delenv("MY_EXECUTOR_TOKEN", raising=False)
    assert config.auth_token is None
    monkeypatch.setenv("MY_EXECUTOR_TOKEN", "")
    assert config.auth_token is None
    monkeypatch.setenv("MY_EXECUTOR_TOKEN", "abcdefghijklmnopqrstuvwxyz")
    assert config.auth_token == "abcdefghijklmnopqrstuvwxyz"
