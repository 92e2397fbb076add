"""The driver side shared by every transport: one sync = begin -> (send || receive) -> finish.

`PushWeightSynchronizer` implements `WeightSynchronizer._transfer_weights` once for all
transports; a transport module subclasses it with its name and how it opens a session
(`_open_session`: returns the per-engine receive specs). One sync:

1. The manifest (built once from `policy.prepare_refit_info()` with the configured bucket
   size) is checked against the engine's expected refit info (`generation.expected_refit_info`,
   set by `generation.prepare_refit_info`) BEFORE the engine is touched: a trainer that would
   send other names, shapes or dtypes fails here with the engines still serving.
2. `generation.begin_weight_update` pauses every engine (requests kept) and starts a pending
   update in its workers.
3. Concurrently: the trainer's sending rank packs and sends every bucket
   (`policy.send_weights`, in a thread) and every engine receives them
   (`generation.finish_weight_update`), then loads them in one reload and resumes.
4. On any failure the engines' pending updates are aborted (`abort_weight_update`: the model is
   untouched unless the reload itself failed, in which case the engine refuses to generate until
   a sync succeeds), the session is closed (a broken process group or socket is never reused),
   and the error propagates: the base class leaves the state FAILED and a retry opens a new
   session. A peer that died or went silent surfaces as a TimeoutError, which the base class
   raises as WeightSyncTimeoutError.

Threads and loops: the hook runs in the base class's worker thread; it drives the generation's
async API with its own event loop (`asyncio.run`), so it never touches the caller's loop.

Metrics: `transfer_metrics()` (merged into `metrics()`) reports the transport, bytes per sync,
seconds and GB/s of the last transfer, the trainer's pack seconds and the engines' load seconds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, ClassVar

import ray

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync.config import WeightSyncConfig
from dockyard_rl.weight_sync.interfaces import WeightSink, WeightSource, WeightSynchronizer
from dockyard_rl.weight_sync.manifest_check import check_manifest_against_refit_info


class PushWeightSynchronizer(WeightSynchronizer):
    """Trainer -> engine weight sync through one transport session (module docstring).

    Args:
        config: the `weight_sync` section.
        policy: the trainer (`WeightSource`): prepare_refit_info, open_weight_sender,
            send_weights, close_weight_sender.
        generation: the engines (`WeightSink`): prepare_refit_info, expected_refit_info,
            begin/finish/abort_weight_update, open_weight_receiver.

    Raises:
        ValueError: the engine rejects the trainer's refit info (names, shapes, dtypes).
    """

    transport: ClassVar[str]

    def __init__(self, config: WeightSyncConfig, policy: WeightSource, generation: WeightSink):
        super().__init__(
            sync_timeout_s=config.sync_timeout_s,
            wake_timeout_s=config.wake_timeout_s,
            initial_version=generation.weight_version,
        )
        self.config = config
        self.policy = policy
        self.generation = generation
        refit_info = policy.prepare_refit_info()
        asyncio.run(generation.prepare_refit_info(refit_info))
        self.manifest = refit_packer.plan_buckets(
            refit_info, bucket_size_bytes=config.bucket_size_bytes
        )
        self._session: str | None = None
        self._receive_specs: list[dict[str, Any]] = []
        self._last: dict[str, Any] = {}

    # -- what a transport module provides

    def _open_session(self, session: str) -> list[dict[str, Any]]:
        """Opens the sender (through the policy) and the receivers (through the generation);
        returns one receive spec per engine, handed to `finish_weight_update`."""
        raise NotImplementedError

    # -- the hooks

    def _transfer_weights(self, version: int) -> None:
        # Step 1: before any engine is touched.
        check_manifest_against_refit_info(self.manifest, self.generation.expected_refit_info)
        try:
            if self._session is None:
                session = f"{self.transport}-{uuid.uuid4().hex[:12]}"
                self._session = session
                self._receive_specs = self._open_session(session)
            asyncio.run(self._push(version))
        except BaseException as error:
            self._close_session()
            if _is_peer_loss(error):
                raise TimeoutError(
                    f"{self.transport} transport: a peer died or stopped "
                    f"answering during the sync of weight version {version} "
                    f"({type(error).__name__}: {error})"
                ) from error
            raise

    def _wake_engine(self, version: int) -> None:
        asyncio.run(self.generation.prepare_for_generation())

    async def _push(self, version: int) -> None:
        manifest_dict = self.manifest.to_dict()
        generation = self.generation
        start = time.monotonic()
        await generation.begin_weight_update(manifest_dict, version)
        send = asyncio.ensure_future(
            asyncio.to_thread(self.policy.send_weights, self._session, manifest_dict, version)
        )
        receive = asyncio.ensure_future(
            generation.finish_weight_update(
                [{**spec, "version": version} for spec in self._receive_specs]
            )
        )
        done, _ = await asyncio.wait({send, receive}, return_when=asyncio.FIRST_EXCEPTION)
        failed = [task for task in done if task.exception() is not None]
        if failed:
            # The other side may still be waiting for its peer; it gives up within the
            # transport's timeout. Abort the engines' pending update once they return.
            others = [task for task in (send, receive) if task not in done]
            await asyncio.gather(*others, return_exceptions=True)
            await generation.abort_weight_update()
            raise failed[0].exception()
        send_stats, load_stats = send.result(), receive.result()
        seconds = time.monotonic() - start
        num_bytes = int(send_stats["num_bytes"]) if send_stats else self.manifest.total_bytes
        self._last = {
            "last_sync_bytes": num_bytes,
            "last_transfer_seconds": seconds,
            "last_transfer_gb_per_s": num_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "last_pack_seconds": send_stats["pack_seconds"] if send_stats else 0.0,
            "last_engine_load_seconds": max(s["load_seconds"] for s in load_stats),
        }

    def metrics(self) -> dict[str, Any]:
        """The base class's counters plus this transport's last transfer figures."""
        keys = (
            "last_sync_bytes",
            "last_transfer_seconds",
            "last_transfer_gb_per_s",
            "last_pack_seconds",
            "last_engine_load_seconds",
        )
        return {
            **super().metrics(),
            "transport": self.transport,
            **{key: self._last.get(key, 0) for key in keys},
        }

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                self.policy.close_weight_sender(session)
            except Exception:  # a dead sender has nothing left to close
                pass

    def close(self) -> None:
        """Closes the transport session (the policy and the engines stay up). Idempotent."""
        self._close_session()


def _is_peer_loss(error: BaseException) -> bool:
    """A dead or silent peer, as opposed to a bad request: worth a retry after a restart."""
    if isinstance(
        error,
        (
            TimeoutError,
            ConnectionError,
            ray.exceptions.RayActorError,
            ray.exceptions.GetTimeoutError,
        ),
    ):
        return True
    # Ray's task errors keep the original in `cause`; our own wrappers chain it.
    cause = getattr(error, "cause", None)
    if not isinstance(cause, BaseException):
        cause = error.__cause__
    return cause is not None and cause is not error and _is_peer_loss(cause)
