"""Tests of metrics_jsonl.py: reading skips a torn line; truncating keeps earlier steps only."""

import json

from dockyard_rl.utils.metrics_jsonl import JsonlWriter, read_jsonl


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/reward": 0.1}\n{"step": 2, "train/rew')
    assert read_jsonl(path) == [{"step": 1, "train/reward": 0.1}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_writer_appends_whole_lines_and_truncates_later_steps_atomically(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    for step in (1, 2, 3):
        writer.write({"step": step, "train/reward": step / 10})
    writer.close()
    with open(path, "a") as file:
        file.write('{"step": 4, "train/rew')  # a crash in the middle of a write
    assert JsonlWriter(path).truncate_after(2) == 1  # step 3 dropped; the torn line too
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    assert JsonlWriter(tmp_path / "missing.jsonl").truncate_after(0) == 0
