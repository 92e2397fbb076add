"""Tests for the WeightSynchronizer state machine with a real in-process transport that copies
a dict of torch tensors (the trainer's state) into another (the engine's)."""

import threading
import time

import pytest
import torch

from dockyard_rl.weight_sync.interfaces import (
    EXPECTED_ORDER,
    SyncState,
    WeightSyncError,
    WeightSynchronizer,
    WeightSyncOrderError,
    WeightSyncTimeoutError,
)


class DictCopyWeightSynchronizer(WeightSynchronizer):
    """Copies `trainer_weights` into `engine_weights` tensor by tensor.

    Test controls: `fail_next_transfer` makes the next transfer raise after copying one tensor
    (a half-written engine), `block_transfer` / `block_wake` hold a hook until the event is set
    or the hook is asked to abort.
    """

    def __init__(self, trainer_weights, engine_weights, **kwargs):
        kwargs.setdefault("sync_timeout_s", 5.0)
        kwargs.setdefault("wake_timeout_s", 5.0)
        super().__init__(**kwargs)
        self.trainer_weights = trainer_weights
        self.engine_weights = engine_weights
        self.transferred_versions = []
        self.woken_versions = []
        self.fail_next_transfer = False
        self.fail_next_wake = False
        self.block_transfer = None
        self.block_wake = None
        self.saw_abort = threading.Event()

    def _transfer_weights(self, version):
        if self.block_transfer is not None:
            while not self.block_transfer.wait(0.01):
                if self._abort_requested():
                    self.saw_abort.set()
                    # Keep "running" until released, like a stuck collective.
            self.block_transfer = None
        with torch.no_grad():
            for index, (name, source) in enumerate(self.trainer_weights.items()):
                target = self.engine_weights[name]
                if target.shape != source.shape or target.dtype != source.dtype:
                    raise ValueError(
                        f"{name}: engine {tuple(target.shape)} {target.dtype} vs "
                        f"trainer {tuple(source.shape)} {source.dtype}"
                    )
                target.copy_(source)
                if self.fail_next_transfer and index == 0:
                    self.fail_next_transfer = False
                    raise ConnectionError("peer went away mid-transfer")
        self.transferred_versions.append(version)

    def _wake_engine(self, version):
        if self.block_wake is not None:
            self.block_wake.wait()
            self.block_wake = None
            if self._abort_requested():
                return  # gave up: the caller already reported the timeout
        if self.fail_next_wake:
            self.fail_next_wake = False
            raise RuntimeError("engine failed to resume")
        self.woken_versions.append(version)


def make_weights(seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(8, 4, generator=generator),
        "layers.0.mlp.weight": torch.randn(4, 4, generator=generator),
        "lm_head.bias": torch.randn(8, generator=generator),
    }


def optimizer_step(weights, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in weights.values():
            tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))


@pytest.fixture
def sync():
    trainer = make_weights(0)
    engine = {name: tensor.clone() for name, tensor in trainer.items()}
    return DictCopyWeightSynchronizer(trainer, engine)


def assert_engine_matches_trainer(sync):
    for name, tensor in sync.trainer_weights.items():
        torch.testing.assert_close(sync.engine_weights[name], tensor, rtol=0, atol=0)


def engine_differs(sync):
    return any(not torch.equal(sync.engine_weights[n], t) for n, t in sync.trainer_weights.items())


def test_full_cycles_copy_weights_and_track_versions(sync):
    assert sync.state is SyncState.READY and not sync.is_stale
    assert (sync.trainer_version, sync.engine_version) == (0, 0)
    for step in range(1, 4):
        optimizer_step(sync.trainer_weights, seed=step)
        assert sync.mark_stale() == step
        assert sync.state is SyncState.STALE and sync.is_stale
        assert engine_differs(sync)
        assert sync.sync_weights() == step
        assert sync.state is SyncState.SYNCED and not sync.is_stale
        assert_engine_matches_trainer(sync)
        sync.prepare_for_generation()
        assert sync.state is SyncState.READY
        assert (sync.trainer_version, sync.engine_version) == (step, step)
    assert sync.transferred_versions == [1, 2, 3]
    assert sync.woken_versions == [1, 2, 3]
    metrics = sync.metrics()
    assert metrics["num_syncs"] == 3 and metrics["num_wakes"] == 3
    assert metrics["num_failed_syncs"] == 0 and metrics["last_error"] is None
    assert metrics["last_sync_seconds"] > 0
    assert metrics["total_sync_seconds"] >= metrics["last_sync_seconds"]


def test_mark_stale_is_idempotent_in_state_and_counts_pending_versions(sync):
    for step in range(1, 4):
        optimizer_step(sync.trainer_weights, seed=step)
        sync.mark_stale()
        assert sync.state is SyncState.STALE
        assert sync.num_pending_versions == step
    assert sync.sync_weights() == 3
    assert sync.num_pending_versions == 0
    # One transfer carries the latest weights, skipping versions 1 and 2.
    assert sync.transferred_versions == [3]
    assert_engine_matches_trainer(sync)


def test_prepare_for_generation_when_ready_is_a_noop(sync):
    sync.prepare_for_generation()
    sync.prepare_for_generation()
    assert sync.state is SyncState.READY
    assert sync.woken_versions == []  # no wake hook call when already READY
    sync.mark_stale()
    sync.sync_weights()
    sync.prepare_for_generation()
    sync.prepare_for_generation()
    assert sync.woken_versions == [1]


def test_mark_stale_after_synced_needs_another_sync(sync):
    sync.mark_stale()
    sync.sync_weights()
    sync.mark_stale()  # the trainer stepped again before generation
    assert sync.state is SyncState.STALE and sync.num_pending_versions == 1
    with pytest.raises(WeightSyncOrderError):
        sync.prepare_for_generation()
    assert sync.sync_weights() == 2


def _to_state(sync, state):
    if state in (SyncState.STALE, SyncState.SYNCED):
        sync.mark_stale()
    if state is SyncState.SYNCED:
        sync.sync_weights()
    assert sync.state is state


@pytest.mark.parametrize(
    "state, call, fragment",
    [
        (SyncState.READY, "sync_weights", "call mark_stale() after an optimizer step first"),
        (SyncState.SYNCED, "sync_weights", "call prepare_for_generation() next"),
        (SyncState.STALE, "prepare_for_generation", "call sync_weights() first"),
    ],
)
def test_illegal_transitions_name_state_and_expected_order(sync, state, call, fragment):
    _to_state(sync, state)
    versions = (sync.trainer_version, sync.engine_version)
    with pytest.raises(WeightSyncOrderError) as info:
        getattr(sync, call)()
    message = str(info.value)
    assert f"{call}() called in state {state.value}" in message
    assert fragment in message
    assert EXPECTED_ORDER in message
    assert EXPECTED_ORDER == "mark_stale() -> sync_weights() -> prepare_for_generation()"
    # A refused call changes nothing.
    assert sync.state is state
    assert (sync.trainer_version, sync.engine_version) == versions


def test_calls_during_an_in_progress_sync_are_refused(sync):
    sync.mark_stale()
    release = threading.Event()
    sync.block_transfer = release
    syncer = threading.Thread(target=sync.sync_weights)
    syncer.start()
    try:
        deadline = time.monotonic() + 5
        while sync.state is not SyncState.SYNCING:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for call, fragment in (
            ("mark_stale", "a sync is in progress"),
            ("sync_weights", "another sync_weights() call is in progress"),
            ("prepare_for_generation", "a sync is in progress"),
        ):
            with pytest.raises(WeightSyncOrderError, match="called in state SYNCING") as info:
                getattr(sync, call)()
            assert fragment in str(info.value) and EXPECTED_ORDER in str(info.value)
        # Reads never block on a running sync.
        assert sync.metrics()["state"] == "SYNCING"
        assert sync.trainer_version == 1
    finally:
        release.set()
        syncer.join(5)
    assert sync.state is SyncState.SYNCED
    assert_engine_matches_trainer(sync)


def test_failing_transfer_surfaces_and_retry_succeeds(sync):
    optimizer_step(sync.trainer_weights, seed=1)
    sync.mark_stale()
    sync.fail_next_transfer = True
    with pytest.raises(WeightSyncError, match="peer went away mid-transfer") as info:
        sync.sync_weights()
    assert isinstance(info.value.__cause__, ConnectionError)
    assert sync.state is SyncState.FAILED and sync.is_stale
    assert sync.engine_version == 0  # the half-written engine is not counted as version 1
    assert engine_differs(sync)
    with pytest.raises(WeightSyncOrderError, match="called in state FAILED"):
        sync.prepare_for_generation()
    # The trainer may step again before the retry; the retry carries the newest weights.
    optimizer_step(sync.trainer_weights, seed=2)
    assert sync.mark_stale() == 2
    assert sync.state is SyncState.FAILED
    assert sync.sync_weights() == 2
    assert_engine_matches_trainer(sync)
    sync.prepare_for_generation()
    metrics = sync.metrics()
    assert (metrics["num_syncs"], metrics["num_failed_syncs"]) == (1, 1)
    assert metrics["state"] == "READY" and metrics["last_error"] is None


def test_shape_mismatch_in_transfer_is_an_error_not_a_hang(sync):
    sync.engine_weights["lm_head.bias"] = torch.zeros(9)
    sync.mark_stale()
    with pytest.raises(WeightSyncError, match=r"lm_head.bias: engine \(9,\)"):
        sync.sync_weights()
    assert sync.state is SyncState.FAILED


def test_transfer_timeout_raises_and_retry_waits_for_the_stuck_hook(sync):
    sync.mark_stale()
    release = threading.Event()
    sync.block_transfer = release
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="did not finish within 0.2s") as info:
        sync.sync_weights(timeout_s=0.2)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - start < 3
    assert sync.state is SyncState.FAILED
    assert sync.saw_abort.wait(5), "the stuck hook must be asked to abort"
    # The stuck hook still runs: a retry must not start a second writer.
    with pytest.raises(WeightSyncError, match="still running"):
        sync.sync_weights()
    assert not sync.wait_for_stuck_hook(0.05)
    assert sync.state is SyncState.FAILED
    release.set()
    assert sync.wait_for_stuck_hook(5)
    assert sync.sync_weights() == 1
    sync.prepare_for_generation()
    assert sync.state is SyncState.READY
    assert sync.metrics()["num_failed_syncs"] == 1


def test_wake_failure_and_timeout_keep_synced_for_retry():
    trainer = make_weights(3)
    sync = DictCopyWeightSynchronizer(
        trainer, {n: t.clone() for n, t in trainer.items()}, wake_timeout_s=0.2
    )
    sync.mark_stale()
    sync.sync_weights()
    sync.fail_next_wake = True
    with pytest.raises(WeightSyncError, match="engine failed to resume"):
        sync.prepare_for_generation()
    assert sync.state is SyncState.SYNCED
    release = threading.Event()
    sync.block_wake = release
    with pytest.raises(WeightSyncTimeoutError, match="_wake_engine"):
        sync.prepare_for_generation()
    assert sync.state is SyncState.SYNCED
    release.set()
    assert sync.wait_for_stuck_hook(5)
    sync.prepare_for_generation()
    assert sync.state is SyncState.READY and sync.woken_versions == [1]


def test_initial_version_and_constructor_validation():
    trainer = make_weights(1)
    engine = {n: t.clone() for n, t in trainer.items()}
    sync = DictCopyWeightSynchronizer(trainer, engine, initial_version=7)
    assert (sync.trainer_version, sync.engine_version) == (7, 7)
    assert sync.mark_stale() == 8
    for kwargs, match in (
        ({"sync_timeout_s": 0}, "sync_timeout_s"),
        ({"wake_timeout_s": -1.0}, "wake_timeout_s"),
        ({"sync_timeout_s": None}, "sync_timeout_s"),
        ({"initial_version": -1}, "initial_version"),
    ):
        with pytest.raises(ValueError, match=match):
            DictCopyWeightSynchronizer(trainer, engine, **kwargs)
    with pytest.raises(ValueError, match="timeout_s"):
        sync.sync_weights(timeout_s=0)
    assert sync.state is SyncState.STALE


def test_the_abc_requires_both_hooks():
    class TransferOnly(WeightSynchronizer):
        def _transfer_weights(self, version):
            pass

    with pytest.raises(TypeError, match="_wake_engine"):
        TransferOnly(sync_timeout_s=1, wake_timeout_s=1)


def test_concurrent_readers_during_cycles(sync):
    """A metrics thread reading while the loop cycles sees consistent, monotonic versions."""
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            metrics = sync.metrics()
            seen.append((metrics["trainer_version"], metrics["engine_version"]))

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(1, 21):
        sync.mark_stale()
        sync.sync_weights()
        sync.prepare_for_generation()
    stop.set()
    thread.join(5)
    assert seen
    assert all(0 <= t - e <= 1 for t, e in seen)
    assert [t for t, _ in seen] == sorted(t for t, _ in seen)
    assert [e for _, e in seen] == sorted(e for _, e in seen)
    assert (sync.trainer_version, sync.engine_version) == (20, 20)


def test_a_transport_timeout_is_a_weight_sync_timeout_and_the_retry_succeeds():
    """A hook raising TimeoutError (a transport whose peer died) -> WeightSyncTimeoutError,
    state FAILED; the next sync_weights() retries."""

    class PeerDiesOnce(WeightSynchronizer):
        attempts = 0

        def _transfer_weights(self, version):
            self.attempts += 1
            if self.attempts == 1:
                raise TimeoutError("the engine stopped answering")

        def _wake_engine(self, version):
            pass

    sync = PeerDiesOnce(sync_timeout_s=5, wake_timeout_s=5)
    sync.mark_stale()
    with pytest.raises(WeightSyncTimeoutError, match="timed out: the engine stopped answering"):
        sync.sync_weights()
    assert sync.state is SyncState.FAILED and sync.is_stale
    assert sync.sync_weights() == 1 and sync.state is SyncState.SYNCED
