"""The push transports' two halves against each other, without an engine.

Real gloo process groups, ZMQ sockets, /dev/shm segments and an aiohttp server, all on
127.0.0.1; receivers run in spawned processes (as the engine's workers do). Every delivered
bucket must equal the refit packer's bytes; a peer killed mid-transfer must make the other side
raise TimeoutError within the peer timeout, and a new session afterwards must work.
The engine-level tests (real vLLM, real trainer) are in tests/weight_sync_test.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import uuid

import pytest
import requests
import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.utils import shared_memory
from dockyard_rl.weight_sync import (
    collective,
    http_transport,
    ipc_zmq,
    sender_sessions,
    testing_receivers,
)
from dockyard_rl.weight_sync.manifest_buckets import iter_manifest_buckets

PEER_TIMEOUT_S = 5.0
SPAWN = testing_receivers.SPAWN


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "embed.weight": (64, 32),
        "layers.0.q.weight": (32, 32),
        "layers.0.norm": (32,),
        "layers.1.q.weight": (32, 32),
        "head.weight": (64, 32),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _manifest() -> refit_packer.Manifest:
    # 8 KiB buckets: 5 tensors -> several buckets, so double buffering really rotates.
    return refit_packer.plan_buckets(refit_packer.describe_tensors(_weights()), 8192)


def _expected_buckets() -> list[bytes]:
    return [bytes(b.numpy()) for b in refit_packer.pack(_weights(), _manifest())]


def _send(session: str, version: int = 1, device: str = "cpu") -> dict:
    manifest = _manifest()
    weights = {name: tensor.to(device) for name, tensor in _weights().items()}
    return sender_sessions.send_weights(
        session, manifest, version, iter_manifest_buckets(manifest, weights.items())
    )


def _dying_receiver(spec: dict, die_after: int) -> None:
    """Spawned engine worker that joins the group, receives `die_after` buckets and dies."""
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(
        spec["master_addr"],
        spec["master_port"],
        spec["world_size"],
        is_master=False,
        timeout=datetime.timedelta(seconds=10),
    )
    group = collective._make_group(
        PrefixStore(spec["session"], store),
        spec["rank_offset"],
        spec["world_size"],
        10.0,
        torch.device("cpu"),
    )
    for size in _manifest().bucket_sizes[:die_after]:
        collective._broadcast(group, torch.empty(size, dtype=torch.uint8)).wait()
    os._exit(3)


def _start_receivers(transport: str, specs: list[dict], num_syncs: int = 1):
    return testing_receivers.start_receivers(transport, _manifest(), specs, num_syncs=num_syncs)


def _sender_process(transport: str, session: str, options: dict, endpoint_queue, die_after: int):
    """Spawned trainer stand-in that dies after sending `die_after` buckets."""
    manifest = _manifest()
    endpoint_queue.put(
        sender_sessions.open_session(session, transport, manifest.to_dict(), options)
    )
    session_sender = sender_sessions._SESSIONS[session].sender
    session_sender.begin(manifest, 1)
    plan = refit_packer.PackPlan(manifest)
    for b, named in iter_manifest_buckets(manifest, _weights().items()):
        if b == die_after:
            os._exit(3)
        out = session_sender.buffer(b)
        session_sender.send(b, plan.pack_bucket(named, b, out=out))
        time.sleep(0.2)  # let the bucket leave before dying
    os._exit(0)


# ------------------------------------------------------------------------------------ collective


def _collective_session(num_engines: int) -> tuple[str, list[dict]]:
    session = f"test-{uuid.uuid4().hex[:8]}"
    endpoint = sender_sessions.open_session(
        session,
        "collective",
        _manifest().to_dict(),
        {"world_size": 1 + num_engines, "timeout_s": PEER_TIMEOUT_S, "address": "127.0.0.1"},
    )
    specs = [
        {
            "transport": "collective",
            "session": session,
            **endpoint,
            "world_size": 1 + num_engines,
            "rank_offset": 1 + i,
            "timeout_s": PEER_TIMEOUT_S,
            "version": 1,
        }
        for i in range(num_engines)
    ]
    return session, specs


def test_collective_broadcasts_every_bucket_to_every_engine_and_reuses_the_group():
    session, specs = _collective_session(num_engines=2)
    try:
        processes, results = _start_receivers("collective", specs, num_syncs=2)
        stats = [_send(session, version) for version in (1, 2)]  # one group, two syncs
        outcomes = [results.get(timeout=60) for _ in range(2 * len(processes))]
        for process in processes:
            process.join(30)
        assert [status for status, *_ in outcomes] == ["ok"] * 4, outcomes
        assert all(buckets == _expected_buckets() for _, buckets, _ in outcomes)
        assert stats[0]["num_bytes"] == _manifest().total_bytes
    finally:
        sender_sessions.close_session(session)


def test_collective_engine_killed_mid_transfer_raises_then_a_new_session_works():
    session, specs = _collective_session(num_engines=1)
    dying = SPAWN.Process(target=_dying_receiver, args=(specs[0], 1))
    dying.start()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="collective transport"):
        _send(session)
    assert time.monotonic() - start < PEER_TIMEOUT_S + 10
    sender_sessions.close_session(session)
    dying.join(30)

    session, specs = _collective_session(num_engines=1)  # the retry: a new group
    try:
        processes, results = _start_receivers("collective", specs)
        _send(session)
        status, buckets, _ = results.get(timeout=60)
        assert status == "ok" and buckets == _expected_buckets()
    finally:
        sender_sessions.close_session(session)


def test_collective_trainer_killed_mid_transfer_makes_the_engine_raise():
    session = f"test-{uuid.uuid4().hex[:8]}"
    endpoints = SPAWN.Queue()
    trainer = SPAWN.Process(
        target=_sender_process,
        args=(
            "collective",
            session,
            {"world_size": 2, "timeout_s": PEER_TIMEOUT_S, "address": "127.0.0.1"},
            endpoints,
            1,
        ),
    )
    trainer.start()
    endpoint = endpoints.get(timeout=60)
    spec = {
        "transport": "collective",
        "session": session,
        **endpoint,
        "world_size": 2,
        "rank_offset": 1,
        "timeout_s": PEER_TIMEOUT_S,
        "version": 1,
    }
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="receiving the buckets"):
        collective.receive_buckets(_manifest(), spec, 0, torch.device("cpu"))
    assert time.monotonic() - start < PEER_TIMEOUT_S + 10
    trainer.join(30)


# --------------------------------------------------------------------------------------- ipc_zmq


def _ipc_session(num_engines: int) -> tuple[str, list[dict]]:
    session = f"test-{uuid.uuid4().hex[:8]}"
    endpoint = sender_sessions.open_session(
        session,
        "ipc_zmq",
        _manifest().to_dict(),
        {"num_receivers": num_engines, "timeout_s": PEER_TIMEOUT_S},
    )
    return session, [
        {
            "transport": "ipc_zmq",
            "session": session,
            **endpoint,
            "timeout_s": PEER_TIMEOUT_S,
            "version": 1,
        }
        for _ in range(num_engines)
    ]


def test_ipc_zmq_engines_map_the_trainers_segments_and_close_unlinks_them():
    session, specs = _ipc_session(num_engines=2)
    try:
        processes, results = _start_receivers("ipc_zmq", specs)
        _send(session)
        outcomes = [results.get(timeout=60) for _ in processes]
        assert all(
            status == "ok" and buckets == _expected_buckets() for status, buckets, _ in outcomes
        ), outcomes
        segments = [p for p in os.listdir(ipc_zmq.SHM_DIR) if session in p]
        assert len(segments) == _manifest().num_buckets
    finally:
        sender_sessions.close_session(session)
    assert not [p for p in os.listdir(ipc_zmq.SHM_DIR) if session in p]


def test_ipc_zmq_engine_that_dies_makes_the_sender_raise_then_a_new_session_works():
    session, specs = _ipc_session(num_engines=1)
    # Hello, then gone: the sender waits for an acknowledgement that never comes.
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(specs[0]["endpoint"])
    socket.send(ipc_zmq._dumps({"hello": session, "version": 1}))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="acknowledgement"):
        _send(session)
    assert time.monotonic() - start < PEER_TIMEOUT_S + 10
    socket.close(linger=0)
    sender_sessions.close_session(session)

    session, specs = _ipc_session(num_engines=1)
    try:
        processes, results = _start_receivers("ipc_zmq", specs)
        _send(session)
        assert results.get(timeout=60)[:2] == ("ok", _expected_buckets())
    finally:
        sender_sessions.close_session(session)


def test_ipc_zmq_trainer_killed_mid_transfer_makes_the_engine_raise():
    session = f"test-{uuid.uuid4().hex[:8]}"
    endpoints = SPAWN.Queue()
    trainer = SPAWN.Process(
        target=_sender_process,
        args=("ipc_zmq", session, {"num_receivers": 1, "timeout_s": PEER_TIMEOUT_S}, endpoints, 1),
    )
    trainer.start()
    spec = {
        "transport": "ipc_zmq",
        "session": session,
        **endpoints.get(timeout=60),
        "timeout_s": PEER_TIMEOUT_S,
        "version": 1,
    }
    with pytest.raises(TimeoutError, match="trainer sent nothing"):
        ipc_zmq.receive_buckets(_manifest(), spec, 0, torch.device("cpu"))
    trainer.join(30)
    # The dead trainer's segments: what a restart's sender (or the launcher) reclaims.
    assert [name for name in os.listdir(ipc_zmq.SHM_DIR) if session in name]
    shared_memory.reclaim_stale_segments(prefixes=(ipc_zmq.SEGMENT_PREFIX,))
    assert not [name for name in os.listdir(ipc_zmq.SHM_DIR) if session in name]


def test_ipc_zmq_receiver_refuses_a_segment_outside_dev_shm():
    with pytest.raises(ValueError, match="not a dockyard refit segment"):
        ipc_zmq._map_bucket({"path": "/etc/passwd"}, 16, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ http


class _EngineEndpoint:
    """An HttpBucketReceiver on its own event loop thread, storing what it is delivered."""

    def __init__(self):
        self.delivered: dict[int, bytes] = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def deliver(index: int, data: bytes) -> None:
            self.delivered[index] = data

        self.receiver = http_transport.HttpBucketReceiver(deliver)
        self.run(self.receiver.start("127.0.0.1", _manifest().max_bucket_size))

    def run(self, coroutine, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def expect(self, version: int) -> None:
        self.loop.call_soon_threadsafe(self.receiver.expect, _manifest(), version)
        time.sleep(0.1)

    def close(self):
        self.run(self.receiver.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def endpoint():
    engine = _EngineEndpoint()
    yield engine
    engine.close()


def _http_session(engines: list[_EngineEndpoint]) -> str:
    session = f"test-{uuid.uuid4().hex[:8]}"
    sender_sessions.open_session(
        session,
        "http",
        _manifest().to_dict(),
        {
            "engines": [{"url": e.receiver.url, "token": e.receiver.token} for e in engines],
            "timeout_s": PEER_TIMEOUT_S,
        },
    )
    return session


def test_http_pushes_every_bucket_with_its_checksum(endpoint):
    endpoint.expect(version=1)
    session = _http_session([endpoint])
    try:
        waiting = asyncio.run_coroutine_threadsafe(
            endpoint.receiver.wait_complete(PEER_TIMEOUT_S), endpoint.loop
        )
        _send(session, version=1)
        waiting.result(30)
    finally:
        sender_sessions.close_session(session)
    assert [endpoint.delivered[b] for b in range(_manifest().num_buckets)] == _expected_buckets()


def test_http_refuses_bad_requests_with_a_reason(endpoint):
    endpoint.expect(version=1)
    url = f"{endpoint.receiver.url}/v1/weights/1/buckets/0"
    data = _expected_buckets()[0]
    good = {
        "Authorization": f"Bearer {endpoint.receiver.token}",
        http_transport.CHECKSUM_HEADER: hashlib.sha256(data).hexdigest(),
    }
    cases = [
        ({**good, "Authorization": "Bearer wrong"}, url, data, 401, "token"),
        ({**good, http_transport.CHECKSUM_HEADER: "0" * 64}, url, data, 400, "sha256 mismatch"),
        (good, url, data[:-1], 400, "must be"),
        (good, url.replace("/1/", "/7/"), data, 409, "no update of weight version 7"),
        (good, url.replace("buckets/0", "buckets/99"), data, 400, "not in"),
    ]
    for headers, target, body, status, reason in cases:
        response = requests.put(target, data=body, headers=headers, timeout=30)
        assert response.status_code == status and reason in response.text, (target, response.text)
    assert endpoint.delivered == {}
    assert requests.put(url, data=data, headers=good, timeout=30).status_code == 200


def test_http_engine_gone_makes_the_sender_raise_and_a_silent_trainer_the_engine(endpoint):
    endpoint.expect(version=1)
    with pytest.raises(TimeoutError, match="no bucket arrived"):
        endpoint.run(endpoint.receiver.wait_complete(1.0))
    session = f"test-{uuid.uuid4().hex[:8]}"
    sender_sessions.open_session(
        session,
        "http",
        _manifest().to_dict(),
        {"engines": [{"url": "http://127.0.0.1:9", "token": "x"}], "timeout_s": PEER_TIMEOUT_S},
    )
    try:
        with pytest.raises(TimeoutError, match="http transport"):
            _send(session)
    finally:
        sender_sessions.close_session(session)


def test_open_session_rejects_an_unknown_transport_and_send_an_unknown_session():
    with pytest.raises(ValueError, match="unknown transport 'pigeon'"):
        sender_sessions.open_session("s", "pigeon", _manifest().to_dict(), {})
    with pytest.raises(KeyError, match="not open"):
        _send("never-opened")


# ---------------------------------------------------------------------------------------- on GPU

NO_GPU = "needs a CUDA GPU (NCCL group, CUDA IPC handles); this machine has none"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("transport", ["collective", "ipc_zmq"])
def test_cuda_buckets_reach_the_engine_bit_for_bit(transport):
    session = f"test-{uuid.uuid4().hex[:8]}"
    options = {"timeout_s": 60.0, "device": "cuda"}
    options.update(
        {"world_size": 2, "address": "127.0.0.1"}
        if transport == "collective"
        else {"num_receivers": 1}
    )
    endpoint = sender_sessions.open_session(session, transport, _manifest().to_dict(), options)
    spec = {
        "transport": transport,
        "session": session,
        **endpoint,
        "world_size": 2,
        "rank_offset": 1,
        "timeout_s": 60.0,
    }
    try:
        processes, results = testing_receivers.start_receivers(
            transport, _manifest(), [spec], device="cuda"
        )
        _send(session, device="cuda")
        status, buckets, _ = results.get(timeout=120)
        assert status == "ok" and buckets == _expected_buckets()
    finally:
        sender_sessions.close_session(session)
