"""Tests of the venv builder's checks (building a whole venv is what every other test relies on)."""

import sys

import pytest

from tools.python import build_venv


def write_lock(tmp_path, body, python="3.11"):
    lock = tmp_path / "cpu.lock.txt"
    lock.write_text(
        f"# Generated\n# Target: CPython {python} on Linux x86_64. Install with:\n{body}"
    )
    return lock


def test_target_python_is_read_from_the_header(tmp_path):
    assert build_venv.target_python(write_lock(tmp_path, "", python="3.12")) == "3.12"


def test_lock_without_header_is_rejected_with_the_fix(tmp_path):
    lock = tmp_path / "x.lock.txt"
    lock.write_text("torch==2.13.0\n")
    with pytest.raises(SystemExit, match="regenerate it"):
        build_venv.target_python(lock)


def test_interpreter_mismatch_names_the_fix(tmp_path):
    lock = write_lock(tmp_path, "", python="2.7")
    with pytest.raises(SystemExit, match="DOCKYARD_PYTHON"):
        build_venv.check_interpreter(lock)


def test_matching_interpreter_passes(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    build_venv.check_interpreter(write_lock(tmp_path, "", python=version))


def test_venv_path_changes_with_the_lock_content_only(tmp_path):
    lock = write_lock(tmp_path, "a==1 --hash=sha256:00\n")
    first = build_venv.venv_path(lock, tmp_path / "cache")
    assert first == build_venv.venv_path(lock, tmp_path / "cache")
    assert first.name.startswith("cpu-")
    lock.write_text(lock.read_text() + "b==2 --hash=sha256:11\n")
    assert build_venv.venv_path(lock, tmp_path / "cache") != first
