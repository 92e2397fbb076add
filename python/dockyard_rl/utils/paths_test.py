"""Tests of caller_path."""

import pathlib

from dockyard_rl.utils.paths import caller_path


def test_relative_paths_follow_the_caller(monkeypatch, tmp_path):
    monkeypatch.delenv("DOCKYARD_CALLER_DIR", raising=False)
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    assert caller_path("out") == tmp_path / "out"
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", "/srv/workspace")
    assert caller_path("out/x.jsonl") == pathlib.Path("/srv/workspace/out/x.jsonl")
    monkeypatch.setenv("DOCKYARD_CALLER_DIR", "/home/me/runs")
    assert caller_path("out") == pathlib.Path("/home/me/runs/out")
    assert caller_path("/abs/out") == pathlib.Path("/abs/out")
    assert caller_path("~/x") == pathlib.Path.home() / "x"
