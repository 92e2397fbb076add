"""Tests of dockyard_rl.kernels.refit_packer, the facade: what it re-exports and the usage of it
elsewhere in the repository (the vLLM backend, vllm_worker_extension, weight_sync, the benchmark).

The parts are tested beside their modules (refit_manifest_test, refit_planning_test,
refit_copy_test); here only that the facade's API is theirs and that the documented sender /
receiver flows work end to end through it.
"""

from __future__ import annotations

import json

import torch

from dockyard_rl import kernels
from dockyard_rl.kernels import (
    _extension,
    refit_copy,
    refit_manifest,
    refit_packer,
    refit_planning,
    testing_extension,
)

# The shared fixture: the compiled extension, failing (not skipping) when it is missing.
ext = testing_extension.ext


def test_extension_is_built(ext):
    assert refit_packer.HAS_EXTENSION
    assert isinstance(ext.with_cuda, bool)


def test_facade_re_exports_the_parts():
    modules = (refit_manifest, refit_planning, refit_copy, _extension)
    for name in refit_packer.__all__:
        owners = [m for m in modules if name in vars(m)]
        assert owners, f"{name} is defined by none of the parts"
        assert getattr(refit_packer, name) is getattr(owners[0], name), name
    # Everything the parts export is on the facade.
    for module in (refit_manifest, refit_planning, refit_copy):
        assert set(module.__all__) <= set(refit_packer.__all__), module.__name__
    assert refit_packer.DTYPES["bfloat16"] is torch.bfloat16
    for name in ("Manifest", "TensorEntry", "bucket_views", "pack", "plan_buckets"):
        assert getattr(kernels, name) is getattr(refit_packer, name)


def _model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(41)
    return {
        "embed.weight": torch.randn(50, 8, generator=gen).bfloat16(),
        "layers.0.proj.weight": torch.randn(8, 12, generator=gen).t(),  # Non-contiguous.
        "layers.0.norm.weight": torch.randn(8, generator=gen),
        "step": torch.tensor(3),
    }


def test_vllm_backend_usage(ext):
    # vllm_generation_test / vllm_multi_engine_test: pack of ALL the tensors;
    # vllm_worker_extension: Manifest.from_dict, then bucket_views.
    named = _model()
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(named), 256)
    assert manifest.num_buckets > 1
    buckets = refit_packer.pack(named, manifest)
    received = refit_packer.Manifest.from_dict(json.loads(json.dumps(manifest.to_dict())))
    assert isinstance(received, refit_packer.Manifest) and received == manifest
    views = {}
    for b, bucket in enumerate(buckets):
        views.update(refit_packer.bucket_views(bucket, received, b))
    assert set(views) == set(named)
    for e in received.tensors:
        assert torch.equal(views[e.name], named[e.name]), e.name
        # Views into the received bucket: no copy.
        bucket_storage = buckets[e.bucket].untyped_storage().data_ptr()
        assert views[e.name].untyped_storage().data_ptr() == bucket_storage, e.name
    # vllm_generation: a manifest dtype name is checked against DTYPES.
    assert refit_packer.DTYPES[received.tensors[0].dtype].is_floating_point


def test_documented_flow(ext):
    named = _model()
    manifest = refit_packer.plan_buckets(refit_packer.describe_tensors(named), 256, 16)
    expected = refit_packer.pack(named, manifest)
    # Sender (weight_sync.sender_sessions): one plan, then each bucket's tensors as they come
    # (new objects, as an all-gather makes them), double-buffered.
    buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
    plan = refit_packer.PackPlan(manifest)
    received = refit_packer.Manifest.from_dict(manifest.to_dict())
    for b in range(manifest.num_buckets):
        bucket_named = {e.name: named[e.name].clone() for e in manifest.bucket_entries(b)}
        bucket = plan.pack_bucket(bucket_named, b, out=buffers[b % 2])
        assert torch.equal(bucket, expected[b])
        # Receiver: views of the bucket, read before the buffer comes round again.
        for name, view in refit_packer.bucket_views(bucket, received, b).items():
            assert torch.equal(view, named[name]), name
