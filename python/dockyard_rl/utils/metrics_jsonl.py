"""metrics.jsonl, the source of truth of a run's metrics: `read_jsonl`, `JsonlWriter`, and
`atomic_write_text` (the Logger writes its other small files with it too).

One strict-JSON object per line, flat keys, `step` an integer:
`{"step": 3, "time": <unix s>, "train/reward_mean": 0.4, "timing/generate_s": 12.1, ...}`.
Each line is written whole, flushed and fsynced, so a crash loses at most the line being written;
`read_jsonl` skips a torn or garbled line, and `JsonlWriter.truncate_after` (the Logger's resume)
rewrites the file atomically without it and without the rows of later steps.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any, TextIO

_log = logging.getLogger(__name__)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file, in file order; a torn or garbled line is skipped."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    rows, num_bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            num_bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            num_bad += 1
    if num_bad:
        _log.warning("%s: skipped %d unreadable line(s) (a crash while writing?)", path, num_bad)
    return rows


class JsonlWriter:
    """Appends rows to metrics.jsonl; `truncate_after(step)` drops the rows of later steps."""

    def __init__(self, path: pathlib.Path):
        self._path = path
        self._file: TextIO | None = None

    def truncate_after(self, step: int) -> int:
        """Keeps rows with step <= `step` (and drops a torn last line); returns the number dropped.

        The kept rows go to a temporary file that replaces the old one atomically, so a crash
        here leaves either the old file or the new one.
        """
        if not self._path.exists():
            return 0
        rows = read_jsonl(self._path)
        kept = [row for row in rows if row["step"] <= step]
        atomic_write_text(
            self._path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept)
        )
        return len(rows) - len(kept)

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self._path, "a", encoding="utf-8")
        # One write of one whole line: a crash can tear at most this line.
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Writes via a temporary file + rename, so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
