"""Tests of dockyard_rl.kernels.refit_manifest: TensorEntry, Manifest and its validation.

Manifests are written out literally here (refit_planning_test checks that plan_buckets produces
this very layout), so these tests need neither the planner nor the extension.
"""

from __future__ import annotations

import json

import pytest
import torch

from dockyard_rl.kernels import refit_manifest as rm


def _manifest_dict() -> dict:
    # plan_buckets({"w": ((4, 8), bfloat16), "b": ((8,), float32), "step": ((), int64),
    #               "big": ((100,), float32)}, 256, 64).to_dict()
    return {
        "format_version": 1,
        "alignment": 64,
        "bucket_sizes": [192, 448],
        "tensors": [
            {
                "name": "w",
                "dtype": "bfloat16",
                "shape": [4, 8],
                "bucket": 0,
                "offset": 0,
                "nbytes": 64,
            },
            {
                "name": "b",
                "dtype": "float32",
                "shape": [8],
                "bucket": 0,
                "offset": 64,
                "nbytes": 32,
            },
            {
                "name": "step",
                "dtype": "int64",
                "shape": [],
                "bucket": 0,
                "offset": 128,
                "nbytes": 8,
            },
            {
                "name": "big",
                "dtype": "float32",
                "shape": [100],
                "bucket": 1,
                "offset": 0,
                "nbytes": 400,
            },
        ],
    }


def test_manifest_json_round_trip():
    data = _manifest_dict()
    assert data["tensors"][0] == {
        "name": "w",
        "dtype": "bfloat16",
        "shape": [4, 8],
        "bucket": 0,
        "offset": 0,
        "nbytes": 64,
    }
    text = json.dumps(data)
    manifest = rm.Manifest.from_dict(json.loads(text))
    assert manifest.to_dict() == data
    assert json.dumps(manifest.to_dict()) == text
    assert manifest.bucket_entries(1)[0].name == "big"


def _mutate(path, value):
    def apply(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return data

    return apply


_DELETE = object()

_BAD_MANIFESTS = {
    "unknown_dtype": (_mutate(["tensors", 1, "dtype"], "float128"), "unknown dtype 'float128'"),
    "overlap": (_mutate(["tensors", 1, "offset"], 0), "tensors 'w' and 'b' overlap in bucket 0"),
    "out_of_bucket": (
        _mutate(["tensors", 3, "offset"], 64),
        r"tensor 'big': bytes \[64, 464\) lie outside bucket 1 of 448 bytes",
    ),
    "bucket_out_of_range": (
        _mutate(["tensors", 3, "bucket"], 2),
        r"tensor 'big': bucket 2 out of range \(2 buckets\)",
    ),
    "duplicate_name": (_mutate(["tensors", 1, "name"], "w"), "duplicate tensor name 'w'"),
    "misaligned": (
        _mutate(["tensors", 1, "offset"], 72),
        "offset 72 is not a multiple of the alignment 64",
    ),
    "nbytes": (_mutate(["tensors", 0, "nbytes"], 32), "nbytes is 32 but shape"),
    "negative_shape": (_mutate(["tensors", 0, "shape"], [-4, 8]), "shape must be a list of ints"),
    "bool_offset": (_mutate(["tensors", 2, "offset"], True), "offset must be an int >= 0"),
    "float_size": (_mutate(["bucket_sizes", 0], 256.0), r"bucket_sizes\[0\] must be an int"),
    "alignment": (_mutate(["alignment"], 100), "alignment must be a power of two"),
    "version": (_mutate(["format_version"], 2), "format_version is 2"),
    "missing_key": (_mutate(["tensors", 0, "shape"], _DELETE), r"missing keys \['shape'\]"),
    "unknown_key": (_mutate(["tensors", 0, "stride"], [8, 1]), r"unknown keys \['stride'\]"),
    "top_missing": (_mutate(["bucket_sizes"], _DELETE), r"manifest is missing keys"),
    "tensors_not_list": (_mutate(["tensors"], {}), "manifest.tensors must be a list"),
}


@pytest.mark.parametrize("case", list(_BAD_MANIFESTS))
def test_manifest_validation_errors(case):
    mutate, pattern = _BAD_MANIFESTS[case]
    data = mutate(_manifest_dict())
    with pytest.raises(ValueError, match=pattern):
        rm.Manifest.from_dict(json.loads(json.dumps(data)))


def test_manifest_accessors():
    manifest = rm.Manifest.from_dict(_manifest_dict())
    assert manifest.num_buckets == 2
    assert manifest.max_bucket_size == 448 and manifest.total_bytes == 192 + 448
    assert manifest.names == ("w", "b", "step", "big")
    assert manifest.bucket_members == ((0, 1, 2), (3,))
    assert [e.name for e in manifest.bucket_entries(0)] == ["w", "b", "step"]
    assert manifest.tensors[0].torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 2\), got 2"):
        manifest.bucket_entries(2)
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 2\), got True"):
        manifest.bucket_entries(True)


def test_tensor_entry_validation():
    entry = rm.TensorEntry("w", "float32", [2, 3], 0, 0, 24)
    assert entry.shape == (2, 3)  # Lists become tuples (hashable, comparable).
    with pytest.raises(ValueError, match="tensor name must be a non-empty string"):
        rm.TensorEntry("", "float32", (1,), 0, 0, 4)
    with pytest.raises(ValueError, match="unknown dtype 'complex64'"):
        rm.TensorEntry("w", "complex64", (1,), 0, 0, 8)
    with pytest.raises(ValueError, match=r"nbytes is 5 but shape \(2,\) of float16 holds 4 bytes"):
        rm.TensorEntry("w", "float16", (2,), 0, 0, 5)
    with pytest.raises(ValueError, match="bucket must be an int >= 0, got -1"):
        rm.TensorEntry("w", "float32", (1,), -1, 0, 4)


def test_dtypes_and_helpers():
    for name, dtype in rm.DTYPES.items():
        assert str(dtype) == f"torch.{name}"
        assert rm._dtype_name(dtype) == name
        assert rm._itemsize(dtype) == torch.empty((), dtype=dtype).element_size()
    assert rm._dtype_name(torch.complex64) == "torch.complex64"
    assert rm._numel(()) == 1 and rm._numel((2, 0, 3)) == 0


def test_alignment_bounds():
    rm._check_alignment(rm.MIN_ALIGNMENT, "x")
    rm._check_alignment(rm.MAX_ALIGNMENT, "x")
    for bad in (rm.MIN_ALIGNMENT // 2, rm.MAX_ALIGNMENT * 2, 48, 64.0, True):
        with pytest.raises(ValueError, match="x: alignment must be a power of two"):
            rm._check_alignment(bad, "x")
