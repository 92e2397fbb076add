"""A SIGKILLed trainer's refit segments are reclaimed by the restart; a live one's are not.

The trainers are real processes that open an ipc_zmq sender session (the segments are created
the way a run creates them) and are then SIGKILLed with their whole process group, as the OOM
killer or Ray would: nothing of theirs runs, neither `close` nor atexit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.utils import shared_memory
from dockyard_rl.weight_sync import ipc_zmq, sender_sessions

_TRAINER = """
import sys, time
import torch
from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync import sender_sessions
weights = {"embed.weight": torch.ones(64, 32), "head.weight": torch.zeros(64, 32)}
manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(weights), 8192)
sender_sessions.open_session(sys.argv[1], "ipc_zmq", manifest.to_dict(),
                    {"num_receivers": 1, "timeout_s": 5})
print("ready", flush=True)
time.sleep(600)
"""


def _start_trainer(session: str) -> subprocess.Popen:
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, session],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, killed as a whole
    )
    assert trainer.stdout is not None
    assert trainer.stdout.readline() == "ready\n", "the trainer stand-in failed to start"
    return trainer


def _kill(trainer: subprocess.Popen) -> None:
    try:
        os.killpg(trainer.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    trainer.wait(30)


def _segments(session: str) -> list[str]:
    return sorted(name for name in os.listdir(ipc_zmq.SHM_DIR) if session in name)


@pytest.fixture
def trainers():
    started: list[subprocess.Popen] = []
    yield lambda session: started.append(_start_trainer(session)) or started[-1]
    for trainer in started:
        _kill(trainer)
    shared_memory.reclaim_stale_segments(prefixes=(ipc_zmq.SEGMENT_PREFIX,))


def test_sigkilled_trainers_segments_are_reclaimed_at_restart_and_a_live_ones_stay(trainers):
    dead_session, live_session = (f"test-{uuid.uuid4().hex[:8]}" for _ in range(2))
    dead, live = trainers(dead_session), trainers(live_session)
    dead_segments, live_segments = _segments(dead_session), _segments(live_session)
    assert dead_segments and live_segments
    assert all(f"-o{dead.pid}." in name for name in dead_segments)

    _kill(dead)
    assert _segments(dead_session) == dead_segments  # SIGKILL unlinked nothing: the leak

    # The launcher's start-up path.
    reclaimed = shared_memory.reclaim_stale_segments()
    assert set(dead_segments) <= set(reclaimed)
    assert _segments(dead_session) == []
    assert _segments(live_session) == live_segments  # another run's, still alive
    assert live.poll() is None


def test_a_new_sender_session_reclaims_a_killed_trainers_segments(trainers):
    dead_session = f"test-{uuid.uuid4().hex[:8]}"
    _kill(trainers(dead_session))
    assert _segments(dead_session)

    weights = {"w": torch.ones(16)}
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(weights), 8192)
    session = f"test-{uuid.uuid4().hex[:8]}"
    sender_sessions.open_session(
        session, "ipc_zmq", manifest.to_dict(), {"num_receivers": 1, "timeout_s": 5}
    )
    try:
        assert _segments(dead_session) == []
        assert len(_segments(session)) == manifest.num_buckets
    finally:
        sender_sessions.close_session(session)
    assert _segments(session) == []


def test_close_all_sessions_unlinks_every_segment_of_this_process():
    # What a policy worker's shutdown calls before Ray kills its process.
    weights = {"w": torch.ones(16)}
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(weights), 8192)
    sessions = [f"test-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for session in sessions:
        sender_sessions.open_session(
            session, "ipc_zmq", manifest.to_dict(), {"num_receivers": 1, "timeout_s": 5}
        )
    assert all(_segments(session) for session in sessions)
    sender_sessions.close_all_sessions()
    sender_sessions.close_all_sessions()  # idempotent
    assert not any(_segments(session) for session in sessions)
