"""Where the Ray token comes from, and a real local Ray start on a machine that never ran Ray:
a fresh, empty home directory, no RAY_AUTH_* variables. Runs inside Bazel's sandbox on purpose
(the home directory there is read-only, which is how the missing-token write failed)."""

import os
import pathlib
import subprocess
import sys

import pytest

from dockyard_rl.cluster import local_ray


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_token_sources_in_order(home, tmp_path):
    assert local_ray.ensure_ray_auth_token({"RAY_AUTH_MODE": "disabled"}) == "disabled"
    assert local_ray.ensure_ray_auth_token({"RAY_AUTH_TOKEN": "abc"}) == "RAY_AUTH_TOKEN"
    token_file = tmp_path / "token"
    token_file.write_text("abc\n")
    assert (
        local_ray.ensure_ray_auth_token({"RAY_AUTH_TOKEN_PATH": str(token_file)})
        == "RAY_AUTH_TOKEN_PATH"
    )
    environ = {}
    assert local_ray.ensure_ray_auth_token(environ) == "generated"
    assert len(environ["RAY_AUTH_TOKEN"]) == 64 and list(home.iterdir()) == []
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("from-home")
    environ = {}
    assert local_ray.ensure_ray_auth_token(environ) == "home" and environ == {}


@pytest.mark.parametrize("content, message", [(None, "cannot read"), ("", "empty")])
def test_a_token_path_without_a_token_is_an_error_naming_the_variable(tmp_path, content, message):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"RAY_AUTH_TOKEN_PATH=.*{message}"):
        local_ray.ensure_ray_auth_token({"RAY_AUTH_TOKEN_PATH": str(path)})


def _run_python(script, cwd, home=None):
    """Runs `script` in a fresh interpreter with no RAY_* variables (and HOME=`home` if given)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    if home is not None:
        env["HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("writable_home", [True, False], ids=["fresh-home", "read-only-home"])
def test_ray_starts_with_token_auth_and_writes_nothing_to_home(tmp_path, writable_home):
    # A fresh empty home must stay empty; a home where nothing can be created (under /proc, which
    # refuses even root) is what Bazel's sandbox gives a machine that never ran Ray.
    home = tmp_path / "fresh-home" if writable_home else pathlib.Path("/proc/dockyard-no-home")
    if writable_home:
        home.mkdir()
    script = (
        "import os, ray\n"
        "from dockyard_rl.cluster.local_ray import init_local_ray\n"
        "init_local_ray(num_cpus=1, log_to_driver=False)\n"
        "init_local_ray(num_cpus=1)  # idempotent\n"
        "print('answer', ray.get(ray.remote(lambda: 41 + 1).remote()))\n"
        "print('mode', os.environ.get('RAY_AUTH_MODE'), 'token',\n"
        "      len(os.environ.get('RAY_AUTH_TOKEN', '')))\n"
        "ray.shutdown()\n"
    )
    result = _run_python(script, tmp_path, home=home)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "answer 42" in result.stdout
    assert "mode token token 64" in result.stdout, result.stdout  # token auth stayed on
    if writable_home:
        assert list(home.iterdir()) == []


def test_a_program_sigterm_handler_survives_ray_init(tmp_path):
    # ray.init puts its own SIGTERM handling in place, which in a busy process (the launcher's)
    # aborts before Python unwinds; the program's handler, installed before, must be back after
    # it, so SIGTERM runs `finally` blocks (the fleets' close, ray.shutdown) and exits 128 + 15.
    script = (
        "import os, signal, time, ray\n"
        "from dockyard_rl.cluster.local_ray import init_local_ray\n"
        "def on_sigterm(signum, frame):\n"
        "    raise SystemExit(128 + signum)\n"
        "signal.signal(signal.SIGTERM, on_sigterm)\n"
        "init_local_ray(num_cpus=1, log_to_driver=False)\n"
        "print('kept', signal.getsignal(signal.SIGTERM) is on_sigterm, flush=True)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    ray.shutdown()\n"
        "    print('unwound', flush=True)\n"
    )
    result = _run_python(script, tmp_path)
    assert "kept True" in result.stdout, (result.stdout, result.stderr[-3000:])
    assert "unwound" in result.stdout and result.returncode == 128 + 15, result.stderr[-3000:]
    assert "SIGTERM received" not in result.stderr  # Ray's C++ handler never ran
