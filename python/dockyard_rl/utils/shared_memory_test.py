"""The reclaim rules of shared_memory.py against real processes and real /dev/shm segments."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from multiprocessing import shared_memory as mp_shared_memory

import pytest

from dockyard_rl.utils import shared_memory

# A vLLM-like creator: a `psm_*` segment through multiprocessing.shared_memory (registered with
# Python's resource tracker, as vLLM's rings are), kept mapped until the process dies.
_PSM_CREATOR = """
from multiprocessing import shared_memory
import time
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
print(segment.name, flush=True)
time.sleep(600)
"""


def _path(name: str) -> str:
    return os.path.join(shared_memory.SHM_DIR, name)


def _age(name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(_path(name), (then, then))


def test_owner_tag_names_this_process_and_survives_only_with_it():
    tag = shared_memory.owner_tag()
    pid, start, namespace = map(int, tag[1:].split("."))
    assert pid == os.getpid() and shared_memory.owner_alive(pid, start)
    assert namespace == shared_memory.pid_namespace()
    assert shared_memory.segment_owner(f"dockyard-refit-{tag}-s-0") == (pid, start, namespace)
    assert shared_memory.segment_owner(f"psm_{tag}") is None  # only our own names carry owners
    assert not shared_memory.owner_alive(pid, start + 1)  # same pid, another process


def test_a_tagged_segment_is_stale_exactly_when_its_owner_is_dead(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead_tag = shared_memory.owner_tag(child.pid)  # taken while it runs
    child.kill()
    child.wait()
    namespace = shared_memory.pid_namespace()
    prefix = f"dockyard-test-{uuid.uuid4().hex[:8]}-"
    names = {
        "live": f"{prefix}{shared_memory.owner_tag()}-x",
        "dead": f"{prefix}{dead_tag}-x",
        # pid of a live process (ours), but another start time: the pid was reused
        "reused": f"{prefix}o{os.getpid()}.1.{namespace}-x",
        # a dead pid, but of another pid namespace: its pid means nothing here
        "foreign": f"{prefix}o{child.pid}.1.{namespace + 1}-x",
    }
    for name in names.values():
        open(_path(name), "wb").close()  # unmapped, just created: only the owner decides
    monkeypatch.setattr(shared_memory, "sees_every_process", lambda: True)
    try:
        reclaimed = shared_memory.reclaim_stale_segments(prefixes=(prefix,))
        assert sorted(reclaimed) == sorted([names["dead"], names["reused"]])
        assert os.path.exists(_path(names["live"])) and os.path.exists(_path(names["foreign"]))
        _age(names["foreign"], 3600)  # judged as untagged: unmapped and old
        assert shared_memory.reclaim_stale_segments(prefixes=(prefix,)) == [names["foreign"]]
    finally:
        for name in names.values():
            if os.path.exists(_path(name)):
                os.unlink(_path(name))


def test_an_untagged_segment_is_reclaimed_only_unmapped_and_old(monkeypatch):
    # A creator SIGKILLed together with its resource tracker (its process group): the leak.
    creator = subprocess.Popen(
        [sys.executable, "-c", _PSM_CREATOR],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert creator.stdout is not None
    leaked = creator.stdout.readline().strip()
    assert leaked.startswith(shared_memory.PSM_PREFIX)
    os.killpg(creator.pid, signal.SIGKILL)
    creator.wait(30)
    time.sleep(1)  # the resource tracker is gone too: nothing unlinks it
    assert os.path.exists(_path(leaked))

    mapped = mp_shared_memory.SharedMemory(create=True, size=4096)  # a live process maps it
    young = f"psm_{uuid.uuid4().hex[:8]}"
    open(_path(young), "wb").close()  # unmapped, but maybe not mapped *yet*
    # Only these three are candidates (prefix = the whole name): under Bazel this test runs in
    # its own pid namespace, where it must not judge other runs' segments (it cannot see them).
    ours = (leaked, mapped.name, young)
    monkeypatch.setattr(shared_memory, "sees_every_process", lambda: True)
    try:
        _age(mapped.name, 3600)
        assert leaked not in shared_memory.stale_segments(min_age_s=3600, prefixes=ours)
        _age(leaked, 3600)
        reclaimed = shared_memory.reclaim_stale_segments(prefixes=ours)
        assert reclaimed == [leaked] and not os.path.exists(_path(leaked))
        assert os.path.exists(_path(mapped.name)) and os.path.exists(_path(young))
        monkeypatch.setattr(shared_memory, "sees_every_process", lambda: False)
        _age(young, 3600)
        assert shared_memory.reclaim_stale_segments(prefixes=ours) == []  # processes hidden
    finally:
        mapped.close()
        mapped.unlink()
        os.unlink(_path(young))
        if os.path.exists(_path(leaked)):
            os.unlink(_path(leaked))


def test_segments_in_use_sees_mappings_and_open_files_of_the_given_processes(monkeypatch):
    mapped = mp_shared_memory.SharedMemory(create=True, size=4096)
    # A named semaphore is mapped under a temporary name that glibc then renames: same inode.
    lock = multiprocessing.get_context("spawn").Lock()
    semaphore = "sem." + lock._semlock.name.lstrip("/")  # type: ignore[attr-defined]
    monkeypatch.setattr(shared_memory, "sees_every_process", lambda: True)
    try:
        in_use = shared_memory.segments_in_use([os.getpid()]).in_use
        assert mapped.name in in_use and semaphore in in_use
        assert semaphore not in shared_memory.stale_segments(min_age_s=0, prefixes=(semaphore,))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert child.pid in shared_memory.descendants(os.getpid())
            assert mapped.name not in shared_memory.segments_in_use([child.pid]).in_use
        finally:
            child.kill()
            child.wait()
    finally:
        mapped.close()
        mapped.unlink()


def test_sees_every_process_here_but_not_in_a_nested_pid_namespace():
    # Where it runs: true on a plain machine, false inside Bazel's linux-sandbox.
    assert shared_memory.sees_every_process() in (True, False)
    unshare = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            "from dockyard_rl.utils import shared_memory as s; print(s.sees_every_process())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if unshare.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {unshare.stderr.strip()[:200]}")
    assert unshare.stdout.strip() == "False"
