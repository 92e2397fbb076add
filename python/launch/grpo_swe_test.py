"""Tests of the grpo_swe launcher as a process: --help, --dry-run of every recipe, bad configs."""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

# python/launch/<this file> -> the workspace root (also in Bazel's runfiles tree).
WORKSPACE = pathlib.Path(__file__).absolute().parents[2]
LAUNCHER = WORKSPACE / "python/launch/grpo_swe.py"
RECIPES = sorted((WORKSPACE / "configs").glob("*.yaml"))


def _launch(*args, cwd=WORKSPACE, env=None):
    environment = {**os.environ, "PYTHONPATH": str(WORKSPACE / "python"), **(env or {})}
    for name in ("BUILD_WORKSPACE_DIRECTORY", "BUILD_WORKING_DIRECTORY", "DOCKYARD_CALLER_DIR"):
        if not env or name not in env:
            environment.pop(name, None)
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_help_lists_sections_and_keys_with_defaults():
    result = _launch("--help")
    assert result.returncode == 0, result.stderr
    for text in (
        "--config",
        "--dry-run",
        "KEY=VALUE",
        "grpo:  (GRPOConfig",
        "  grpo.num_prompts_per_step: int = 32",
        "  grpo.val_period: int = 0",
        "  loss_fn.use_importance_sampling_correction: bool = false",
        "  async_grpo.max_trajectory_age_steps: int = 1",
        '  weight_sync.transport: str = "auto"',
        "data_plane:  (DataPlaneConfig",
        "  checkpointing.metric_name: ",
        "  logger.log_dir: ",
    ):
        assert text in result.stdout, text


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_dry_run_prints_the_resolved_config(recipe):
    result = _launch("--config", f"configs/{recipe.name}", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "config OK (dry run: nothing started)" in result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["grpo"]["run_name"] == recipe.stem
    # Every section is printed, defaults included, except what this path of the loop does not
    # read (grpo_config.UNREAD_UNLESS): async_grpo in sync mode.
    assert ("async_grpo" in resolved) == (resolved["grpo"]["mode"] == "async")
    assert {
        "grpo",
        "policy",
        "generation",
        "loss_fn",
        "data",
        "env",
        "rewards",
        "cluster",
        "weight_sync",
        "data_plane",
        "checkpointing",
        "logger",
    } <= set(resolved)
    assert resolved["data"]["train_path"].startswith("/")  # paths are resolved
    assert resolved["grpo"]["mode"] in ("sync", "async")


def test_dry_run_applies_overrides():
    result = _launch(
        "--config",
        "configs/smoke_cpu.yaml",
        "grpo.max_num_steps=9",
        "--dry-run",
        "data_plane.tensor_transport=gloo",
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["grpo"]["max_num_steps"] == 9
    assert resolved["data_plane"]["transport"] == "ray_direct"


@pytest.mark.parametrize(
    "override, key",
    [
        ("grpo.val_perod=3", "grpo.val_perod"),
        ("grpo.val_period=-1", "grpo.val_period"),
        (
            "loss_fn.use_importance_sampling_correction=false",
            "loss_fn.use_importance_sampling_correction",
        ),
        ("policy.micro_batch_size=four", "policy.micro_batch_size"),
    ],
)
def test_bad_override_exits_2_naming_the_key(override, key):
    result = _launch("--config", "configs/smoke_cpu_async.yaml", override, "--dry-run")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("grpo_swe: config error: ")
    assert "smoke_cpu_async.yaml" in lines[0] and key in lines[0]
    assert result.stdout == ""


def test_missing_recipe_exits_2():
    result = _launch("--config", "configs/no_such_recipe.yaml", "--dry-run")
    assert result.returncode == 2
    assert "no_such_recipe.yaml: cannot read the config file" in result.stderr


def test_config_is_required():
    result = _launch("--dry-run")
    assert result.returncode == 2
    assert "--config" in result.stderr


def test_bazel_run_paths(tmp_path):
    # `bazel run` starts the binary elsewhere: --config is relative to where the user typed the
    # command, paths in the recipe to the workspace root.
    workspace = tmp_path / "ws"
    result = _launch(
        "--config",
        "configs/smoke_cpu.yaml",
        "--dry-run",
        cwd=tmp_path,
        env={
            "BUILD_WORKING_DIRECTORY": str(WORKSPACE),
            "BUILD_WORKSPACE_DIRECTORY": str(workspace),
        },
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["logger"]["log_dir"] == str(workspace / "results")


def test_dry_run_starts_nothing(capsys):
    # In process: the dry run must not import the training loop, Ray or vLLM.
    spec = importlib.util.spec_from_file_location("grpo_swe", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    before = set(sys.modules)
    assert launcher.main(["--config", str(WORKSPACE / "configs/smoke_cpu.yaml"), "--dry-run"]) == 0
    assert "run_name: smoke_cpu" in capsys.readouterr().out
    imported = set(sys.modules) - before
    assert not {"ray", "vllm", "dockyard_rl.algorithms.grpo"} & (imported | set(sys.modules))


def test_sigterm_unwinds_the_run_so_its_cleanup_runs(tmp_path):
    # The training loop is replaced by one that waits in a try/finally, as grpo.run waits in
    # its own: SIGTERM must reach that finally (set-up before Ray starts; ray.init then installs
    # an unwinding handler of its own), and the launcher exits 128 + 15.
    marker = tmp_path / "marker"
    script = (
        "import pathlib, sys, time\n"
        f"sys.argv = ['grpo_swe', '--config', {str(WORKSPACE / 'configs/smoke_cpu.yaml')!r}]\n"
        # A stand-in for the loop module (the launcher imports it by name when training starts).
        "import types, dockyard_rl.algorithms\n"
        "grpo = types.ModuleType('dockyard_rl.algorithms.grpo')\n"
        "sys.modules[grpo.__name__] = grpo\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "def run(config):\n"
        "    marker.write_text('started')\n"
        "    try:\n"
        "        time.sleep(120)\n"
        "    finally:\n"
        "        marker.write_text('cleaned up')\n"
        "grpo.run = run\n"
        "import runpy\n"
        f"runpy.run_path({str(LAUNCHER)!r}, run_name='__main__')\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(WORKSPACE / "python")}
    process = subprocess.Popen([sys.executable, "-c", script], env=environment, cwd=WORKSPACE)
    try:
        for _ in range(600):
            if marker.exists():
                break
            time.sleep(0.1)
        assert marker.read_text() == "started"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        process.kill()
    assert marker.read_text() == "cleaned up"
