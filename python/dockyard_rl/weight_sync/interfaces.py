"""The weight-sync seam: the state machine the GRPO loop drives to refresh the engine's weights.

`WeightSynchronizer` is an ABC that owns everything transports share: the state, the weight
versions, ordering checks, deadlines, thread safety and metrics. A transport (collective
NCCL/gloo, IPC/ZMQ, HTTP; each in its own module, picked by the factory) subclasses it and
implements two hooks: `_transfer_weights(version)` (move the trainer's weights into the engine)
and `_wake_engine(version)` (make the engine ready to generate with them).

States and the only legal order (anything else raises WeightSyncOrderError):

    READY --mark_stale()--> STALE --sync_weights()--> SYNCED --prepare_for_generation()--> READY

    STALE   --mark_stale()-->  STALE    (one more pending version)
    SYNCED  --mark_stale()-->  STALE    (the trainer stepped again before the wake)
    STALE   --sync_weights() whose hook raises or times out-->  FAILED
            (a hook raising TimeoutError, e.g. a transport whose peer died, is reported as
            WeightSyncTimeoutError like a missed deadline)
    FAILED  --sync_weights()-->  SYNCED (retry)          FAILED --mark_stale()--> FAILED
    SYNCED  --prepare_for_generation() whose hook raises or times out-->  SYNCED (retry)
    READY   --prepare_for_generation()-->  READY    (idempotent no-op; the hook is not called)

- READY: the engine holds the trainer's current weights (engine_version == trainer_version) and
  is awake. The state right after construction.
- STALE: the trainer has stepped since the last sync; the engine holds an older, complete
  version. `mark_stale()` again (several trainer steps without a sync) stays STALE and adds a
  pending version.
- SYNCING: `sync_weights()` is running the transfer hook. Every other state-changing call
  raises (including `mark_stale()`: the trainer must not step while its weights are read).
- SYNCED: the engine holds the trainer's current weights but has not been woken.
- FAILED: the last transfer raised or timed out. The engine's weights may be partially
  overwritten and must not be used; `is_stale` is true; `sync_weights()` retries. `mark_stale()`
  is allowed (the trainer may step before the retry) and the state stays FAILED.

Versions: weight version k = the weights after k publications: the loop calls `mark_stale()`
once per trainer step (however many optimizer steps its mini-batches made) and once after a
warm start, so sample ages count trainer steps. `trainer_version` starts at
`initial_version` (what the engine was built from) and goes up by one per `mark_stale()`;
`engine_version` is the last version fully transferred. Both only increase.

Deadlines: each hook runs in a worker thread joined with a timeout, so a transfer or wake that
cannot finish raises WeightSyncTimeoutError instead of hanging the loop. Python cannot kill a
thread: on timeout the hook is asked to stop (`_abort_requested()` becomes true; long hooks
should check it between buckets) and a retry is refused with WeightSyncError until that thread
has returned, so two transfers never write into the engine at once.

Who calls it: only the driver/controller process (the GRPO loop), never the trainer or engine
ranks themselves; the transport hooks fan out to the ranks. All methods are thread-safe (one
lock), so a metrics reporter thread may read state while the loop syncs.

`BucketSender` is the trainer-side half of a push transport: what each transport module
implements for the trainer's sending rank (sender_sessions.py drives it).

`WeightSource` and `WeightSink` (end of this file) are what weight_sync needs from the trainer
and from the engines: structural Protocols (as vLLM types its model capabilities), satisfied by
the policy and generation backends without naming them, so that weight_sync imports nothing from
models/ (models/ imports weight_sync: its processes run the transports' senders and receivers).

Not covered here: the transports, bucketing, and the check of incoming names/shapes/dtypes
(each transport validates its manifest before touching the engine), and the factory.
"""

from __future__ import annotations

import abc
import enum
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from dockyard_rl.kernels.refit_packer import Manifest

EXPECTED_ORDER = "mark_stale() -> sync_weights() -> prepare_for_generation()"


class SyncState(enum.Enum):
    READY = "READY"
    STALE = "STALE"
    SYNCING = "SYNCING"
    SYNCED = "SYNCED"
    FAILED = "FAILED"


class WeightSyncOrderError(RuntimeError):
    """A WeightSynchronizer method was called out of order; the message names the state."""


class WeightSyncError(RuntimeError):
    """A transfer or wake hook failed (its exception is the __cause__), or cannot be retried yet."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A transfer or wake hook did not finish within its deadline."""


class WeightSynchronizer(abc.ABC):
    """Drives weight refreshes of the generation engine: READY -> STALE -> SYNCED -> READY.

    Loop usage (driver process only):

        sync.mark_stale()                 # after every optimizer step
        ...
        if sync.is_stale:                 # before generating
            sync.sync_weights()
        sync.prepare_for_generation()     # no-op when READY
    """

    def __init__(self, *, sync_timeout_s: float, wake_timeout_s: float, initial_version: int = 0):
        """
        Args:
            sync_timeout_s: deadline for one `_transfer_weights` call, seconds > 0.
            wake_timeout_s: deadline for one `_wake_engine` call, seconds > 0.
            initial_version: the weight version the engine was built from (e.g. the
                checkpoint's step when resuming), an integer >= 0.

        Raises:
            ValueError: a timeout is not a positive number or initial_version is negative.
        """
        for name, value in (("sync_timeout_s", sync_timeout_s), ("wake_timeout_s", wake_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(
                    f"{name} must be a number of seconds > 0 (a sync must never "
                    f"wait forever), got {value!r}"
                )
        if (
            isinstance(initial_version, bool)
            or not isinstance(initial_version, int)
            or initial_version < 0
        ):
            raise ValueError(
                f"initial_version must be an integer >= 0 (the weight version "
                f"the engine starts from), got {initial_version!r}"
            )
        self._sync_timeout_s = float(sync_timeout_s)
        self._wake_timeout_s = float(wake_timeout_s)
        self._lock = threading.Lock()
        self._state = SyncState.READY
        self._trainer_version = initial_version
        self._engine_version = initial_version
        # The worker thread of the last hook call and the event asking it to stop; kept so a
        # retry can refuse to run while a timed-out hook is still writing.
        self._hook_thread: threading.Thread | None = None
        self._abort_event = threading.Event()
        self._num_syncs = 0
        self._num_failed_syncs = 0
        self._num_wakes = 0
        self._last_sync_seconds = 0.0
        self._total_sync_seconds = 0.0
        self._last_error: str | None = None

    # ----------------------------------------------------------------------------- transport hooks

    @abc.abstractmethod
    def _transfer_weights(self, version: int) -> None:
        """Copies the trainer's weights (version `version`) into the engine.

        Runs in a worker thread, without the lock, under the `sync_timeout_s` deadline. Raise on
        any failure; check `_abort_requested()` between buckets so a timed-out call stops soon.
        Must not leave the engine serving a mix of versions as if it were complete: the base
        class keeps the state FAILED (engine must not generate) until a transfer succeeds.
        """

    @abc.abstractmethod
    def _wake_engine(self, version: int) -> None:
        """Makes the engine ready to generate with the freshly transferred `version`.

        Runs in a worker thread under the `wake_timeout_s` deadline; raise on failure.
        """

    def _abort_requested(self) -> bool:
        """True once the running hook's deadline passed; hooks poll it to stop early."""
        return self._abort_event.is_set()

    # ---------------------------------------------------------------------------------- state

    @property
    def state(self) -> SyncState:
        with self._lock:
            return self._state

    @property
    def is_stale(self) -> bool:
        """True when the engine lacks the trainer's current weights (STALE or FAILED)."""
        with self._lock:
            return self._state in (SyncState.STALE, SyncState.FAILED)

    @property
    def trainer_version(self) -> int:
        with self._lock:
            return self._trainer_version

    @property
    def engine_version(self) -> int:
        """The last version fully transferred to the engine."""
        with self._lock:
            return self._engine_version

    @property
    def num_pending_versions(self) -> int:
        """Optimizer steps the engine is behind: trainer_version - engine_version."""
        with self._lock:
            return self._trainer_version - self._engine_version

    # ---------------------------------------------------------------------------- transitions

    def mark_stale(self) -> int:
        """Records one optimizer step: the trainer's weights moved to a new version.

        Call after every optimizer step. READY/SYNCED/STALE -> STALE; FAILED stays FAILED.
        Idempotent in state (several steps without a sync stay STALE) but each call adds one
        pending version.

        Returns:
            The new trainer_version.

        Raises:
            WeightSyncOrderError: while a sync is in progress (SYNCING).
        """
        with self._lock:
            if self._state is SyncState.SYNCING:
                raise self._order_error(
                    "mark_stale()",
                    "a sync is in progress; wait for sync_weights() to return "
                    "before the next optimizer step changes the weights",
                )
            self._trainer_version += 1
            if self._state is not SyncState.FAILED:
                self._state = SyncState.STALE
            return self._trainer_version

    def sync_weights(self, timeout_s: float | None = None) -> int:
        """Transfers the trainer's current weights to the engine: STALE/FAILED -> SYNCED.

        Blocks until the transfer hook returns, raises, or its deadline passes.

        Args:
            timeout_s: deadline for this call, seconds > 0; defaults to sync_timeout_s.

        Returns:
            The version now in the engine (== trainer_version).

        Raises:
            WeightSyncOrderError: the state is READY (nothing to sync: call mark_stale() after
                an optimizer step first), SYNCED (call prepare_for_generation()), or SYNCING.
            WeightSyncTimeoutError: the transfer missed its deadline; state -> FAILED.
            WeightSyncError: the transfer raised (the cause is chained); state -> FAILED. Also
                raised, with the state left FAILED, when a timed-out earlier transfer is still
                running.
        """
        timeout_s = self._check_timeout(timeout_s, self._sync_timeout_s)
        with self._lock:
            if self._state not in (SyncState.STALE, SyncState.FAILED):
                hint = {
                    SyncState.READY: "the engine already holds the current weights; call "
                    "mark_stale() after an optimizer step first",
                    SyncState.SYNCED: "weights are already transferred; call "
                    "prepare_for_generation() next",
                    SyncState.SYNCING: "another sync_weights() call is in progress",
                }[self._state]
                raise self._order_error("sync_weights()", hint)
            self._check_no_running_hook_locked()
            version = self._trainer_version
            previous_state = self._state
            self._state = SyncState.SYNCING
        start = time.monotonic()
        try:
            self._run_hook(self._transfer_weights, version, timeout_s, "_transfer_weights")
        except BaseException as error:
            # Also on KeyboardInterrupt: never leave the state SYNCING with nobody syncing.
            with self._lock:
                self._state = SyncState.FAILED
                self._num_failed_syncs += 1
                self._last_error = f"{error} (sync attempted from {previous_state.value})"
            raise
        seconds = time.monotonic() - start
        with self._lock:
            assert self._state is SyncState.SYNCING and self._trainer_version == version
            self._state = SyncState.SYNCED
            self._engine_version = version
            self._num_syncs += 1
            self._last_sync_seconds = seconds
            self._total_sync_seconds += seconds
            self._last_error = None
            return version

    def prepare_for_generation(self) -> None:
        """Wakes the engine with the synced weights: SYNCED -> READY; READY is a no-op.

        Idempotent: calling it again when READY does nothing (the hook is not called).

        Raises:
            WeightSyncOrderError: the state is STALE or FAILED (call sync_weights() first) or
                SYNCING.
            WeightSyncTimeoutError / WeightSyncError: the wake hook timed out or raised; the
                state stays SYNCED, so calling prepare_for_generation() again retries the wake.
        """
        with self._lock:
            if self._state is SyncState.READY:
                return
            if self._state is not SyncState.SYNCED:
                hint = (
                    "a sync is in progress"
                    if self._state is SyncState.SYNCING
                    else "the engine's weights are out of date; call sync_weights() first"
                )
                raise self._order_error("prepare_for_generation()", hint)
            self._check_no_running_hook_locked()
            version = self._engine_version
        try:
            self._run_hook(self._wake_engine, version, self._wake_timeout_s, "_wake_engine")
        except WeightSyncError as error:
            with self._lock:
                self._last_error = str(error)
            raise
        with self._lock:
            assert self._state is SyncState.SYNCED
            self._state = SyncState.READY
            self._num_wakes += 1

    def wait_for_stuck_hook(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for a timed-out hook's thread to return.

        For retry logic after a WeightSyncTimeoutError: a retry is refused while that thread
        runs. Returns True when no hook thread is running (the retry may proceed).
        """
        with self._lock:
            thread = self._hook_thread
        if thread is None:
            return True
        thread.join(self._check_timeout(timeout_s, timeout_s))
        return not thread.is_alive()

    def metrics(self) -> dict[str, Any]:
        """Counters for logging; all keys always present."""
        with self._lock:
            return {
                "state": self._state.value,
                "trainer_version": self._trainer_version,
                "engine_version": self._engine_version,
                "num_pending_versions": self._trainer_version - self._engine_version,
                "num_syncs": self._num_syncs,
                "num_failed_syncs": self._num_failed_syncs,
                "num_wakes": self._num_wakes,
                "last_sync_seconds": self._last_sync_seconds,
                "total_sync_seconds": self._total_sync_seconds,
                "last_error": self._last_error,
            }

    # ------------------------------------------------------------------------------ internals

    def _order_error(self, call: str, hint: str) -> WeightSyncOrderError:
        return WeightSyncOrderError(
            f"{type(self).__name__}.{call} called in state {self._state.value}: {hint}. "
            f"Expected order: {EXPECTED_ORDER} (trainer_version={self._trainer_version}, "
            f"engine_version={self._engine_version})"
        )

    def _check_no_running_hook_locked(self) -> None:
        if self._hook_thread is not None and self._hook_thread.is_alive():
            raise WeightSyncError(
                f"the previous {self._hook_thread.name} timed out and is still running (asked "
                f"to abort); retry once it has returned, so two transfers never write into the "
                f"engine at once"
            )

    @staticmethod
    def _check_timeout(timeout_s: float | None, default: float) -> float:
        if timeout_s is None:
            return default
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        return float(timeout_s)

    def _run_hook(
        self, hook: Callable[[int], None], version: int, timeout_s: float, name: str
    ) -> None:
        """Runs `hook(version)` in a daemon thread and waits at most `timeout_s` for it."""
        outcome: dict[str, BaseException] = {}

        def target() -> None:
            try:
                hook(version)
            except BaseException as error:  # re-raised in the caller's thread
                outcome["error"] = error

        abort_event = threading.Event()
        # Daemon: a hook stuck forever must not keep the process alive at exit.
        thread = threading.Thread(target=target, name=f"{name}(version={version})", daemon=True)
        with self._lock:
            self._abort_event = abort_event
            self._hook_thread = thread
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            abort_event.set()
            raise WeightSyncTimeoutError(
                f"{type(self).__name__}.{name} for weight version {version} did not finish "
                f"within {timeout_s:g}s; the engine's weights are not trusted until a sync "
                f"succeeds (raise the timeout if the model is large, or check the transport)"
            )
        if "error" in outcome:
            error = outcome["error"]
            if isinstance(error, TimeoutError):
                # The transport's own deadline: a peer died or went silent mid-transfer.
                raise WeightSyncTimeoutError(
                    f"{type(self).__name__}.{name} for weight version {version} timed out: {error}"
                ) from error
            raise WeightSyncError(
                f"{type(self).__name__}.{name} for weight version {version} "
                f"failed: {type(error).__name__}: {error}"
            ) from error


class BucketSender(abc.ABC):
    """The sending endpoint of one transport session (lives in the trainer's sending rank).

    Call order per sync: `buffer(b)` -> pack into it -> `send(b, bucket)`, for b = 0, 1, ... in
    order, then `finish()`. `close()` ends the session (idempotent). Any method may raise; the
    session is then unusable and the driver closes it.
    """

    num_buffers = 2

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.version = -1

    def begin(self, manifest: Manifest, version: int) -> None:
        """Starts one sync of `manifest` at weight `version` (the session may outlive a
        manifest: the trainer's refit layout never changes, but it is re-checked)."""
        if manifest.to_dict() != self.manifest.to_dict():
            raise ValueError(
                "the manifest changed since the session was opened; close the "
                "session and open a new one"
            )
        self.version = version

    @abc.abstractmethod
    def buffer(self, bucket_index: int) -> torch.Tensor:
        """A 1-D uint8 tensor of at least the bucket's size to pack bucket `bucket_index` into;
        blocks until the send that last used it has completed."""

    @abc.abstractmethod
    def send(self, bucket_index: int, bucket: torch.Tensor) -> None:
        """Starts sending the packed bucket (may return before it is delivered)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Blocks until every bucket of this sync is delivered (raises on failure/timeout)."""

    def endpoint(self) -> dict[str, Any]:
        """What the engine side needs to reach this sender (plain data)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook: a no-op for senders holding nothing
        """Releases the session's resources. Idempotent."""


class WeightSource(Protocol):
    """What the synchronizers and transports need from the trainer (a policy backend).

    Only the driver's synchronizer calls these. The sender runs in the process that holds the
    weights (a multi-rank backend's rank 0): `open_weight_sender` creates it there through
    `sender_sessions.open_session`, `send_weights` feeds it the manifest's buckets through
    `sender_sessions.send_weights`, `close_weight_sender` ends the session.
    """

    def prepare_refit_info(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (shape, dtype) of every weight the engine receives, in the order
        `iter_refit_weights` yields them; the manifest is built from it once."""
        ...

    def iter_refit_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in `prepare_refit_info` order, into the caller's process
        (object_store: the driver packs the buckets)."""
        ...

    def weight_sender_node_id(self) -> str | None:
        """The Ray node id of the process that sends weights (None: Ray is not running), for
        the `auto` transport choice."""
        ...

    def open_weight_sender(
        self, session: str, transport: str, manifest_dict: dict[str, Any], options: dict[str, Any]
    ) -> dict[str, Any]:
        """Creates `transport`'s sender for `session` in the sending process (idempotent) and
        returns its endpoint (plain data for the engines). Raises ValueError for an unknown
        transport or a bad manifest."""
        ...

    def send_weights(
        self, session: str, manifest_dict: dict[str, Any], version: int
    ) -> dict[str, float]:
        """Packs every refit weight into the manifest's buckets and sends them through the open
        `session` (blocking; the engines receive concurrently). Returns timing figures
        (`send_seconds`, `pack_seconds`, `num_bytes`). Raises whatever the transport raises
        (TimeoutError: the engine side died or went silent)."""
        ...

    def close_weight_sender(self, session: str) -> None:
        """Closes `session`'s sender. Idempotent; unknown sessions are ignored."""
        ...


class WeightSink(Protocol):
    """What the synchronizers and transports need from the engines (a generation backend).

    The contracts are the generation interface's (models/generation/interfaces.py), plus the
    two figures a transport reads after a load (`expected_refit_info`, `last_update_stats`).
    """

    @property
    def weight_version(self) -> int:
        """The weight version the engines hold now."""
        ...

    @property
    def expected_refit_info(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """HF name -> (shape, dtype name) that every manifest must match."""
        ...

    @property
    def last_update_stats(self) -> Sequence[Mapping[str, float]]:
        """Per engine, the figures of the last `update_weights_from_buckets` (at least
        `load_seconds`)."""
        ...

    async def prepare_refit_info(
        self, refit_info: Mapping[str, tuple[Sequence[int], torch.dtype | str]]
    ) -> None:
        """Declares the weights the trainer will send; raises ValueError on a mismatch."""
        ...

    def engine_node_ids(self) -> list[str]:
        """The Ray node id of every engine, for the `auto` transport choice."""
        ...

    def open_weight_receiver(
        self, transport: str, *, host: str = "127.0.0.1", max_bucket_bytes: int = 1 << 30
    ) -> list[dict[str, Any]]:
        """Per engine, what `transport` needs to reach it (plain data). Idempotent."""
        ...

    async def begin_weight_update(
        self,
        manifest_dict: Mapping[str, Any],
        version: int,
        *,
        recompute_kv_cache: bool | None = None,
    ) -> None:
        """Checks the manifest, pauses every engine and opens a pending update of `version`."""
        ...

    async def finish_weight_update(
        self, receive_specs: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, float]]:
        """Engine i receives the buckets as `receive_specs[i]` says, loads them and resumes;
        returns per-engine timing figures (at least `load_seconds`)."""
        ...

    async def abort_weight_update(self) -> None:
        """Drops a pending update everywhere; the models keep their weights. Idempotent."""
        ...

    async def update_weights_from_buckets(
        self,
        manifest_dict: Mapping[str, Any],
        buckets: Sequence[torch.Tensor],
        version: int,
        *,
        recompute_kv_cache: bool | None = None,
    ) -> None:
        """Loads already packed buckets into every engine (object_store)."""
        ...

    async def prepare_for_generation(self) -> None:
        """Makes the engines ready to generate (the synchronizer's wake hook)."""
        ...
