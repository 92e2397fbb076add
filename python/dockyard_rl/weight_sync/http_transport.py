"""`transport: http` — the trainer pushes each bucket to an HTTP endpoint served beside each
engine: for layouts where no process group can be formed (e.g. trainer and engines in different
clusters, only HTTP between them).

Engine side: `HttpBucketReceiver` is an aiohttp server in the engine actor's event loop, started
by `open_weight_receiver("http")` on `weight_sync.http_host` and a free port, with a random
bearer token per engine (handed to the trainer through the driver; nothing else can push
weights). One route:

    PUT /v1/weights/{version}/buckets/{index}
        Authorization: Bearer <token>
        X-Dockyard-Sha256: <hex sha256 of the body>
        body: the packed bucket's bytes

    200 {"received": index}
    400 bad index, a size other than the manifest's, or a checksum mismatch (the bucket is
        dropped; the sender may resend it)
    401 missing or wrong token
    409 no update of that version is pending (not begun, already finished, or another version)

The receiver checks the size from Content-Length before reading the body, verifies the
checksum, and hands the bytes to the engine's workers (`deliver`, i.e. the extension's
`dockyard_receive_bucket`). A bucket sent twice is accepted twice (idempotent resend).
`wait_complete` returns when every bucket arrived and raises TimeoutError when no bucket arrived
for `peer_timeout_s` (the trainer died).

Trainer side: `HttpBucketSender` uploads each packed bucket to every engine on a thread pool
(requests), so packing bucket b+1 overlaps the upload of bucket b (two pack buffers). A
connection failure or a timeout of `peer_timeout_s` is a TimeoutError (peer died); a 4xx is a
ValueError with the server's reason.

Everything here is ours: vLLM's HTTP weight-transfer routes carry CUDA IPC handles or NCCL
rendezvous data, not the weights themselves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync.interfaces import BucketSender
from dockyard_rl.weight_sync.push_synchronizer import PushWeightSynchronizer

TRANSPORT = "http"
CHECKSUM_HEADER = "X-Dockyard-Sha256"


class HttpWeightSynchronizer(PushWeightSynchronizer):
    """Weight sync by HTTP PUT of every bucket to every engine's endpoint."""

    transport = TRANSPORT

    def _open_session(self, session: str) -> list[dict[str, Any]]:
        engines = self.generation.open_weight_receiver(TRANSPORT, host=self.config.http_host)
        self.policy.open_weight_sender(
            session,
            TRANSPORT,
            self.manifest.to_dict(),
            {
                "engines": [{"url": e["url"], "token": e["token"]} for e in engines],
                "timeout_s": self.config.peer_timeout_s,
            },
        )
        return [
            {"transport": TRANSPORT, "session": session, "timeout_s": self.config.peer_timeout_s}
            for _ in engines
        ]


class HttpBucketSender(BucketSender):
    """Uploads buckets to every engine endpoint; two pack buffers in flight."""

    def __init__(self, manifest: refit_packer.Manifest, options: dict[str, Any]):
        import requests

        super().__init__(manifest)
        self._engines = list(options["engines"])
        self._timeout_s = float(options["timeout_s"])
        self._http = requests.Session()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.num_buffers * len(self._engines), thread_name_prefix="refit-http"
        )
        self._buffers = [
            torch.empty(manifest.max_bucket_size, dtype=torch.uint8)
            for _ in range(self.num_buffers)
        ]
        self._in_flight: list[list[concurrent.futures.Future]] = [[] for _ in self._buffers]

    def buffer(self, bucket_index: int) -> torch.Tensor:
        slot = bucket_index % self.num_buffers
        self._wait(slot)
        return self._buffers[slot]

    def send(self, bucket_index: int, bucket: torch.Tensor) -> None:
        data = memoryview(bucket.numpy()).cast("B")
        digest = hashlib.sha256(data).hexdigest()
        self._in_flight[bucket_index % self.num_buffers] = [
            self._pool.submit(self._put, engine, bucket_index, data, digest)
            for engine in self._engines
        ]

    def finish(self) -> None:
        for slot in range(self.num_buffers):
            self._wait(slot)

    def _put(
        self, engine: dict[str, str], bucket_index: int, data: memoryview, digest: str
    ) -> None:
        import requests

        url = f"{engine['url']}/v1/weights/{self.version}/buckets/{bucket_index}"
        try:
            response = self._http.put(
                url,
                data=data,
                timeout=self._timeout_s,
                headers={
                    "Authorization": f"Bearer {engine['token']}",
                    CHECKSUM_HEADER: digest,
                    "Content-Type": "application/octet-stream",
                },
            )
        except requests.RequestException as error:
            raise TimeoutError(
                f"http transport: PUT {url} failed ({type(error).__name__}: "
                f"{error}); the engine died or stopped answering"
            ) from error
        if 400 <= response.status_code < 500:
            raise ValueError(
                f"http transport: the engine refused bucket {bucket_index} "
                f"({response.status_code}): {response.text}"
            )
        if response.status_code != 200:
            raise RuntimeError(
                f"http transport: PUT {url} answered {response.status_code}: {response.text}"
            )

    def _wait(self, slot: int) -> None:
        futures, self._in_flight[slot] = self._in_flight[slot], []
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def create_sender(manifest: refit_packer.Manifest, options: dict[str, Any]) -> BucketSender:
    return HttpBucketSender(manifest, options)


class HttpBucketReceiver:
    """The endpoint beside one engine (module docstring). Runs in the engine actor's loop.

    Call order: `await start(host)` once -> per update `expect(manifest, version)` ->
    `await wait_complete(timeout_s)` (or `cancel()`) -> `await stop()` at shutdown.
    """

    def __init__(self, deliver: Callable[[int, bytes], Awaitable[None]]):
        self._deliver = deliver
        self.token = secrets.token_urlsafe(32)
        self.url: str | None = None
        self._runner = None
        self._manifest: refit_packer.Manifest | None = None
        self._version: int | None = None
        self._received: set[int] = set()
        self._progress = asyncio.Event()
        self._last_arrival = 0.0

    async def start(self, host: str, max_bucket_bytes: int) -> str:
        from aiohttp import web

        app = web.Application(client_max_size=max_bucket_bytes + 1)
        app.router.add_put("/v1/weights/{version}/buckets/{index}", self._handle_bucket)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        return self.url

    def expect(self, manifest: refit_packer.Manifest, version: int) -> None:
        self._manifest, self._version = manifest, version
        self._received = set()
        self._last_arrival = time.monotonic()

    def cancel(self) -> None:
        self._manifest, self._version = None, None

    async def wait_complete(self, timeout_s: float) -> None:
        """Returns once every bucket arrived; TimeoutError after `timeout_s` without one."""
        manifest = self._manifest
        assert manifest is not None, "expect() first"
        while len(self._received) < manifest.num_buckets:
            self._progress.clear()
            remaining = self._last_arrival + timeout_s - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"http transport: no bucket arrived for {timeout_s:g}s "
                    f"({len(self._received)} of {manifest.num_buckets} received); "
                    "the trainer died or stopped sending"
                )
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                pass
        self.cancel()

    async def _handle_bucket(self, request):
        from aiohttp import web

        if request.headers.get("Authorization") != f"Bearer {self.token}":
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")
        manifest = self._manifest
        try:
            version, index = int(request.match_info["version"]), int(request.match_info["index"])
        except ValueError:
            raise web.HTTPBadRequest(text="version and bucket index must be integers") from None
        if manifest is None or version != self._version:
            raise web.HTTPConflict(
                text=f"no update of weight version {version} is pending (pending: {self._version})"
            )
        if not 0 <= index < manifest.num_buckets:
            raise web.HTTPBadRequest(
                text=f"bucket index {index} is not in [0, {manifest.num_buckets})"
            )
        size = manifest.bucket_sizes[index]
        if request.content_length != size:
            raise web.HTTPBadRequest(
                text=f"bucket {index} must be {size} bytes, got "
                f"Content-Length {request.content_length}"
            )
        data = await request.read()
        expected = request.headers.get(CHECKSUM_HEADER, "")
        if hashlib.sha256(data).hexdigest() != expected:
            raise web.HTTPBadRequest(
                text=f"bucket {index}: sha256 mismatch (header "
                f"{CHECKSUM_HEADER}={expected!r}); resend it"
            )
        await self._deliver(index, data)
        if self._manifest is manifest:  # not cancelled meanwhile
            self._received.add(index)
            self._last_arrival = time.monotonic()
            self._progress.set()
        return web.json_response({"received": index})

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


def receive_buckets(*_args, **_kwargs):
    raise RuntimeError(
        "http transport: buckets arrive at the engine's HTTP endpoint, not "
        "through the worker (HttpBucketReceiver)"
    )
