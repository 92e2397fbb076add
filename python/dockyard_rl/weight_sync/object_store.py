"""`transport: object_store` — the baseline: the driver gathers the weights, packs the buckets
and hands them to the engines through Ray's object store.

The trainer's weights travel trainer -> driver (`policy.iter_refit_weights`, through Ray) ->
object store -> every engine actor -> its workers (`generation.update_weights_from_buckets`).
Two extra hops and a full copy in the driver, but no connection between the fleets: it works
wherever Ray does. The benchmark measures the other transports against it.
"""

from __future__ import annotations

import time
from typing import Any

from dockyard_rl.kernels import refit_packer
from dockyard_rl.weight_sync.manifest_buckets import iter_manifest_buckets
from dockyard_rl.weight_sync.push_synchronizer import PushWeightSynchronizer

TRANSPORT = "object_store"


class ObjectStoreWeightSynchronizer(PushWeightSynchronizer):
    """Weight sync through the driver and Ray's object store (module docstring)."""

    transport = TRANSPORT

    def _open_session(self, session: str) -> list[dict[str, Any]]:
        return []  # nothing to connect

    def _close_session(self) -> None:
        self._session = None

    async def _push(self, version: int) -> None:
        start = time.monotonic()
        manifest = self.manifest
        pack_plan = refit_packer.PackPlan(manifest)
        buckets, pack_seconds = [], 0.0
        for b, named in iter_manifest_buckets(manifest, self.policy.iter_refit_weights()):
            packing = time.monotonic()
            buckets.append(pack_plan.pack_bucket(named, b))
            pack_seconds += time.monotonic() - packing
        await self.generation.update_weights_from_buckets(manifest.to_dict(), buckets, version)
        seconds = time.monotonic() - start
        self._last = {
            "last_sync_bytes": manifest.total_bytes,
            "last_transfer_seconds": seconds,
            "last_transfer_gb_per_s": manifest.total_bytes / seconds / 1e9,
            "last_pack_seconds": pack_seconds,
            "last_engine_load_seconds": max(
                s["load_seconds"] for s in self.generation.last_update_stats
            ),
        }
