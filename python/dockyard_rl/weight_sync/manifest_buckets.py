"""Grouping a policy's exported weights into the manifest's buckets (the in-process path)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dockyard_rl.kernels import refit_packer


def iter_manifest_buckets(
    manifest: refit_packer.Manifest, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[int, dict[str, torch.Tensor]]]:
    """Groups a stream of (name, tensor) in manifest order into (bucket index, bucket's tensors):
    the in-process path for policies that export through `iter_refit_weights`."""
    entries = iter(named_tensors)
    for b in range(manifest.num_buckets):
        named = {}
        for entry in manifest.bucket_entries(b):
            name, tensor = next(entries, (None, None))
            if name != entry.name:
                raise ValueError(
                    f"the policy yielded {name!r} where the manifest expects "
                    f"{entry.name!r}; iter_refit_weights must follow "
                    "prepare_refit_info's order"
                )
            named[name] = tensor
        yield b, named
