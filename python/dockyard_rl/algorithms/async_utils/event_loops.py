"""Closing a private asyncio event loop after whatever stopped it.

The synchronous loop, the async trainer and the trajectory collector each drive their own event
loop from a plain thread (`loop.run_until_complete`); all three close it with `close_loop`.
"""

from __future__ import annotations

import asyncio

# How long closing a loop waits for the coroutines an interrupted step left running (a SIGTERM
# or an error mid-generation) to handle their cancellation.
_CANCEL_WAIT_S = 10.0


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancels what an interrupted step left running on `loop`, gives it `_CANCEL_WAIT_S` to
    unwind, then closes the loop. A plain `loop.close()` would drop the pending tasks and asyncio
    would log "Task was destroyed but it is pending!" for each, at ERROR, on every Ctrl-C."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=_CANCEL_WAIT_S))
    loop.close()
