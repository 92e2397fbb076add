"""pytest_main.py fails a test target that leaves shared-memory segments in /dev/shm, and
blames it for nothing another process leaves there meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

PYTEST_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest_main.py")
SHM_DIR = "/dev/shm"

# A vLLM-like creator: a multiprocessing.shared_memory segment, mapped until the creator and its
# resource tracker are SIGKILLed together (its process group), as Ray kills a worker's children.
_LEAKING_TEST = """
import os, signal, subprocess, sys, time

CREATOR = '''
from multiprocessing import shared_memory
import time
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
print(segment.name, flush=True)
time.sleep({sleep})
'''

def test_leaks_a_segment():
    creator = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    name = creator.stdout.readline().strip()
    with open({record!r}, "w") as f:
        f.write(name)
    time.sleep(1.5)  # in use for a while, as an engine's rings are (the check samples /proc)
    if {kill}:
        os.killpg(creator.pid, signal.SIGKILL)
    creator.wait()
"""


def _run(tmp_path, kill: bool, sleep: float = 1.0) -> tuple[subprocess.CompletedProcess, str]:
    record = tmp_path / f"segment-{uuid.uuid4().hex[:8]}"
    test_file = tmp_path / f"leak_{uuid.uuid4().hex[:8]}_test.py"
    test_file.write_text(
        textwrap.dedent(_LEAKING_TEST).format(record=str(record), kill=kill, sleep=sleep)
    )
    env = {key: value for key, value in os.environ.items() if key != "XML_OUTPUT_FILE"}
    result = subprocess.run(
        [sys.executable, PYTEST_MAIN, str(test_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return result, record.read_text()


def test_a_test_whose_processes_leak_a_segment_fails_and_the_segment_is_removed(tmp_path):
    result, name = _run(tmp_path, kill=True, sleep=600)
    still_there = os.path.exists(os.path.join(SHM_DIR, name))
    assert result.returncode != 0, f"{name} left: {still_there}\n{result.stdout}{result.stderr}"
    assert "1 passed" in result.stdout  # the test itself passed: the check failed the target
    assert f"/dev/shm/{name}" in result.stderr and "was not left as found" in result.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_test_whose_processes_clean_up_passes(tmp_path):
    result, name = _run(tmp_path, kill=False)  # the creator exits and unlinks its segment
    assert result.returncode == 0, result.stdout + result.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_segment_leaked_meanwhile_by_another_process_is_not_blamed(tmp_path):
    foreign = os.path.join(SHM_DIR, f"psm_{uuid.uuid4().hex[:8]}")
    test_file = tmp_path / "busy_test.py"
    # While the target runs, a process outside its tree leaks a segment it briefly mapped.
    test_file.write_text("import time\n\ndef test_busy():\n    time.sleep(3)\n")
    target = subprocess.Popen(
        [sys.executable, PYTEST_MAIN, str(test_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={key: value for key, value in os.environ.items() if key != "XML_OUTPUT_FILE"},
    )
    try:
        time.sleep(1)
        with open(foreign, "wb") as f:
            f.truncate(4096)
        stdout, stderr = target.communicate(timeout=120)
        assert target.returncode == 0, stdout + stderr
        assert os.path.exists(foreign)
    finally:
        if os.path.exists(foreign):
            os.unlink(foreign)


@pytest.mark.parametrize("argv", [["--co"]])
def test_the_child_runs_pytest_with_the_given_arguments(tmp_path, argv):
    test_file = tmp_path / "two_test.py"
    test_file.write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    result = subprocess.run(
        [sys.executable, PYTEST_MAIN, str(test_file), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "2 tests collected" in result.stdout, result.stdout
