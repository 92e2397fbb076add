"""`close_loop`: what an interrupted step leaves on the event loop is cancelled and unwound."""

import asyncio
import logging

import pytest

from dockyard_rl.algorithms.async_utils.event_loops import close_loop


def test_close_loop_cancels_and_unwinds_what_an_interrupted_step_left(caplog):
    loop = asyncio.new_event_loop()
    unwound = []

    async def generate(index):
        try:
            await asyncio.sleep(3600)
        finally:
            unwound.append(index)  # a runner closes its sessions / aborts its requests here

    async def step():
        for index in range(3):
            loop.create_task(generate(index))
        await asyncio.sleep(0)
        raise KeyboardInterrupt  # what SIGTERM's SystemExit or Ctrl-C does mid-step

    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(step())
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        close_loop(loop)
    assert sorted(unwound) == [0, 1, 2] and loop.is_closed()
    assert "Task was destroyed" not in caplog.text


def test_close_loop_of_a_finished_loop_just_closes_it():
    loop = asyncio.new_event_loop()
    loop.run_until_complete(asyncio.sleep(0))
    close_loop(loop)
    assert loop.is_closed()
