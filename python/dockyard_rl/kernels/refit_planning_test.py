"""Tests of dockyard_rl.kernels.refit_planning: describe_tensors and plan_buckets.

Both planners (C++ through the extension, and Python) must give identical manifests; the
property test checks the layout rules on random inputs. The extension is REQUIRED (the build
provides it): a missing one fails these tests rather than skipping them.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockyard_rl.kernels import _extension, testing_extension
from dockyard_rl.kernels import refit_planning as rpl
from dockyard_rl.kernels.refit_manifest import DTYPES, Manifest

# The shared fixture: the compiled extension, failing (not skipping) when it is missing.
ext = testing_extension.ext


def test_describe_tensors_keeps_order_shapes_and_dtypes():
    named = {
        "b": torch.zeros(2, 3, dtype=torch.bfloat16),
        "a": torch.zeros(()),
        "c": torch.zeros(4, 5).t(),
    }
    assert rpl.describe_tensors(named) == {
        "b": ((2, 3), torch.bfloat16),
        "a": ((), torch.float32),
        "c": ((5, 4), torch.float32),
    }
    assert list(rpl.describe_tensors(named)) == ["b", "a", "c"]


def test_oversize_tensor_gets_its_own_bucket():
    named = {"a": torch.zeros(10), "big": torch.zeros(1000), "b": torch.zeros(10)}
    manifest = rpl.plan_buckets(rpl.describe_tensors(named), 1024, 256)
    assert [e.bucket for e in manifest.tensors] == [0, 1, 2]
    assert manifest.bucket_sizes == (256, 4096, 256)
    assert manifest.max_bucket_size == 4096
    assert manifest.total_bytes == 256 + 4096 + 256


_DTYPE_NAMES = list(DTYPES)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 40), max_size=3),
            st.sampled_from(_DTYPE_NAMES),
        ),
        max_size=30,
    ),
    alignment_log2=st.integers(4, 9),
    bucket_multiple=st.integers(1, 40),
)
def test_plan_properties(specs, alignment_log2, bucket_multiple):
    alignment = 1 << alignment_log2
    bucket_size = alignment * bucket_multiple
    named = {f"t{i}": (shape, dtype) for i, (shape, dtype) in enumerate(specs)}
    manifest = rpl.plan_buckets(named, bucket_size, alignment, use_extension=False)
    if _extension.HAS_EXTENSION:  # Required elsewhere; here both planners must agree.
        assert rpl.plan_buckets(named, bucket_size, alignment, use_extension=True) == manifest
    entries = manifest.tensors
    # Every tensor exactly once, in order, with its size.
    assert [e.name for e in entries] == list(named)
    for e, (shape, dtype) in zip(entries, named.values()):
        size = torch.empty((), dtype=DTYPES[dtype]).element_size()
        n = 1
        for s in shape:
            n *= s
        assert e.nbytes == n * size and e.shape == tuple(shape) and e.dtype == dtype
    # In order: buckets never go back, offsets increase within a bucket; aligned; no overlap.
    prev_bucket, prev_end = 0, 0
    for e in entries:
        assert e.offset % alignment == 0
        assert e.bucket in (prev_bucket, prev_bucket + 1)
        if e.bucket == prev_bucket:
            assert e.offset >= prev_end
        prev_bucket, prev_end = e.bucket, e.offset + e.nbytes
        assert e.offset + e.nbytes <= manifest.bucket_sizes[e.bucket]
    # Bucket sizes: aligned, within the limit unless holding one oversize tensor, never empty
    # when they hold bytes, and a new bucket starts only when the next tensor did not fit.
    for b, size in enumerate(manifest.bucket_sizes):
        assert size % alignment == 0
        members = [e for e in entries if e.bucket == b]
        nonempty = [e for e in members if e.nbytes > 0]
        if size > bucket_size:
            assert len(nonempty) == 1 and nonempty[0].nbytes > bucket_size
        if b > 0:
            first = nonempty[0]  # A bucket only starts for a tensor with bytes.
            prev = [e for e in entries if e.bucket == b - 1 and e.nbytes > 0]
            prev_end = max(e.offset + e.nbytes for e in prev)
            aligned_end = (prev_end + alignment - 1) // alignment * alignment
            assert aligned_end + first.nbytes > bucket_size
    assert manifest.num_buckets == (0 if not specs else max(e.bucket for e in entries) + 1)
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


@pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "python"])
def test_plan_errors(ext, use_extension):
    named = {"a": ((2,), torch.float32)}
    with pytest.raises(
        ValueError, match=r"alignment must be a power of two in \[16, 1073741824\], got 8"
    ):
        rpl.plan_buckets(named, 256, 8, use_extension=use_extension)
    with pytest.raises(ValueError, match="positive multiple of the alignment \\(256\\), got 1000"):
        rpl.plan_buckets(named, 1000, use_extension=use_extension)
    with pytest.raises(ValueError, match="unsupported dtype torch.complex64"):
        rpl.plan_buckets({"c": ((2,), torch.complex64)}, 256, use_extension=use_extension)
    with pytest.raises(ValueError, match="shape must be a sequence of ints >= 0"):
        rpl.plan_buckets({"c": ((-1,), torch.float32)}, 256, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"expected \(shape, dtype\)"):
        rpl.plan_buckets({"c": torch.ones(2)}, 256, use_extension=use_extension)


def test_core_plan_errors_surface_as_value_error(ext):
    with pytest.raises(ValueError, match="plan_buckets: tensor 1 has a negative size"):
        ext.refit_plan_buckets([4, -1], 256, 16)
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        ext.refit_plan_buckets([4], 256, 48)


def test_manifest_base_layout():
    # The layout refit_manifest_test's mutations rely on (alignment 64, buckets of 256 bytes).
    named = {
        "w": ((4, 8), torch.bfloat16),
        "b": ((8,), torch.float32),
        "step": ((), torch.int64),
        "big": ((100,), torch.float32),
    }
    data = rpl.plan_buckets(named, 256, 64).to_dict()
    assert data["bucket_sizes"] == [192, 448]
    assert [(t["bucket"], t["offset"]) for t in data["tensors"]] == [
        (0, 0),
        (0, 64),
        (0, 128),
        (1, 0),
    ]
    assert Manifest.from_dict(data).alignment == 64


def test_use_extension_true_without_extension_raises(monkeypatch):
    monkeypatch.setattr(rpl, "_ext", None)
    named = {"w": ((3,), torch.float32)}
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        rpl.plan_buckets(named, 256, use_extension=True)
    # The default falls back to the Python planner, with the same layout.
    assert rpl.plan_buckets(named, 256) == rpl.plan_buckets(named, 256, use_extension=False)


def test_default_uses_the_cpp_planner(ext, monkeypatch):
    calls = []

    class Spy:
        def refit_plan_buckets(self, *args):
            calls.append(args)
            return ext.refit_plan_buckets(*args)

    monkeypatch.setattr(rpl, "_ext", Spy())
    rpl.plan_buckets({"w": ((3,), torch.float32)}, 256, 16)
    assert calls == [([12], 256, 16)]
