"""Tests of dockyard_rl.kernels.refit_packer: manifest, planning, and both copy paths.

Round trips are compared BYTE for byte (``_assert_bit_equal``), so NaN payloads, -0.0 and
infinities must survive exactly. The extension is REQUIRED: the build always provides it, so a
missing one fails these tests rather than skipping them. CUDA tests skip with a reason when there
is no GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockyard_rl.kernels import refit_packer as rp
from dockyard_rl.kernels import testing

# The shared fixture: the compiled extension, failing (not skipping) when it is missing.
ext = testing.ext

both_paths = pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "torch"])

MODEL_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.float64,
    torch.int16,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]

# Bit patterns that a value-based comparison would get wrong: NaNs with payloads (quiet and
# signalling, both signs), -0.0, +-inf, a subnormal.
_SPECIAL_BITS = {
    8: [0x7FF8000000000001, -0x0007FFFFFFFFFFFF, -0x8000000000000000, 0x7FF0000000000000, 1],
    4: [0x7FC00001, 0x7F800001, -0x003EDCBB, -0x80000000, 0x7F800000, 1],
    2: [0x7E01, 0x7C01, -0x0001, -0x8000, 0x7C00, 1],
    1: [0x7F, 0xFF, 0x80, 0x01],
}


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def _assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert actual.dtype == expected.dtype, name
    assert actual.shape == expected.shape, name
    assert torch.equal(_raw_bytes(actual).cpu(), _raw_bytes(expected).cpu()), name


def _random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random BITS of `dtype` (NaNs and all), plus the special patterns at the front."""
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.int64).to(torch.uint8)
    special = torch.tensor(_SPECIAL_BITS[size], dtype=_INT_OF_SIZE[size])
    special_bytes = special.view(torch.uint8)[: raw.numel()]
    raw[: special_bytes.numel()] = special_bytes
    return raw.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layouts(dtype, gen) -> dict[str, torch.Tensor]:
    """Named tensors of one dtype in every layout the packer must handle."""
    base = _random_tensor((6, 10, 7), dtype, gen)
    return {
        "contiguous": _random_tensor((4, 9), dtype, gen),
        "transposed": _random_tensor((9, 5), dtype, gen).t(),
        "sliced_steps": base[1:, ::2, ::3],
        "column": _random_tensor((8, 6), dtype, gen)[:, 3],
        "scalar": _random_tensor((), dtype, gen),
        "empty": _random_tensor((0, 4), dtype, gen),
        "larger_than_bucket": _random_tensor((40, 33), dtype, gen),
        "expanded_source": _random_tensor((1, 5), dtype, gen).expand(3, 5),
    }


def test_extension_is_built(ext):
    assert rp.HAS_EXTENSION
    assert isinstance(ext.with_cuda, bool)


# --- Round trips ---------------------------------------------------------------------------------


@both_paths
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bit_exact(ext, use_extension, dtype):
    gen = torch.Generator().manual_seed(hash(str(dtype)) % 2**31)
    named = _layouts(dtype, gen)
    before = {k: v.clone() for k, v in named.items()}
    manifest = rp.plan_buckets(rp.describe_tensors(named), bucket_size_bytes=256, alignment=16)
    buckets = rp.pack(named, manifest, use_extension=use_extension)
    assert [b.numel() for b in buckets] == list(manifest.bucket_sizes)
    out = rp.unpack(buckets, manifest, use_extension=use_extension)
    assert list(out) == list(named)
    for name, t in named.items():
        _assert_bit_equal(out[name], t, name)
        assert out[name].is_contiguous()
        _assert_bit_equal(t, before[name], name)  # Sources untouched.
    # Zero-copy views read the same bytes.
    views = rp.unpack(buckets, manifest, copy=False)
    for name, t in named.items():
        _assert_bit_equal(views[name], t, name)


def test_oversize_tensor_gets_its_own_bucket():
    named = {"a": torch.zeros(10), "big": torch.zeros(1000), "b": torch.zeros(10)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 1024, 256)
    assert [e.bucket for e in manifest.tensors] == [0, 1, 2]
    assert manifest.bucket_sizes == (256, 4096, 256)
    assert manifest.max_bucket_size == 4096
    assert manifest.total_bytes == 256 + 4096 + 256


@both_paths
def test_buckets_are_deterministic_and_padding_is_zero(ext, use_extension):
    named = {"a": torch.arange(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float16)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 1024, 256)
    out = torch.full((2048,), 0xAB, dtype=torch.uint8)
    bucket = rp.pack_bucket(named, manifest, 0, out=out, use_extension=use_extension)
    assert bucket.data_ptr() == out.data_ptr() and bucket.numel() == 512
    expected = torch.zeros(512, dtype=torch.uint8)
    expected[:3] = torch.tensor([0, 1, 2], dtype=torch.uint8)
    expected[256:266] = torch.ones(5, dtype=torch.float16).view(torch.uint8)
    assert torch.equal(bucket, expected)
    assert bool((out[512:] == 0xAB).all()), "bytes past the bucket must be left alone"


@pytest.mark.parametrize("num_threads", [0, 1, 2, 3, 8])
def test_extension_matches_torch(ext, num_threads):
    gen = torch.Generator().manual_seed(num_threads)
    named = {}
    for i, dtype in enumerate(MODEL_DTYPES):
        for layout, t in _layouts(dtype, gen).items():
            named[f"{i}.{layout}"] = t
    named["big.transposed"] = _random_tensor((700, 300), torch.float32, gen).t()  # Threaded.
    manifest = rp.plan_buckets(rp.describe_tensors(named), 1 << 16, 256)
    ext_buckets = rp.pack(named, manifest, use_extension=True, num_threads=num_threads)
    torch_buckets = rp.pack(named, manifest, use_extension=False)
    for a, b in zip(ext_buckets, torch_buckets, strict=True):
        assert torch.equal(a, b)
    ext_out = rp.unpack(ext_buckets, manifest, use_extension=True, num_threads=num_threads)
    torch_out = rp.unpack(torch_buckets, manifest, use_extension=False)
    for name in named:
        _assert_bit_equal(ext_out[name], torch_out[name], name)


def test_default_uses_extension_on_cpu(ext, monkeypatch):
    calls = []

    class Spy:
        with_cuda = ext.with_cuda
        refit_plan_buckets = staticmethod(ext.refit_plan_buckets)

        def refit_pack_bucket(self, *args):
            calls.append("pack")
            return ext.refit_pack_bucket(*args)

        def refit_unpack_bucket(self, *args):
            calls.append("unpack")
            return ext.refit_unpack_bucket(*args)

    monkeypatch.setattr(rp, "_ext", Spy())
    named = {"w": torch.ones(3)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 256)
    rp.unpack(rp.pack(named, manifest), manifest)
    assert calls == ["pack", "unpack"]
    rp.unpack(rp.pack(named, manifest, use_extension=False), manifest, use_extension=False)
    assert calls == ["pack", "unpack"]


def test_use_extension_true_without_extension_raises(monkeypatch):
    monkeypatch.setattr(rp, "_ext", None)
    named = {"w": torch.ones(3)}
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        rp.plan_buckets(rp.describe_tensors(named), 256, use_extension=True)
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256)  # Python planner.
    with pytest.raises(RuntimeError, match="use_extension=None to fall back"):
        rp.pack(named, manifest, use_extension=True)
    # The default falls back to torch.
    out = rp.unpack(rp.pack(named, manifest), manifest)
    _assert_bit_equal(out["w"], named["w"])


@both_paths
def test_iter_pack_double_buffers(ext, use_extension):
    gen = torch.Generator().manual_seed(3)
    named = {f"t{i}": _random_tensor((50 + i,), torch.float32, gen) for i in range(7)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 256)  # One tensor per bucket.
    assert manifest.num_buckets == 7
    expected = rp.pack(named, manifest, use_extension=use_extension)
    buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
    seen = []
    for b, bucket in enumerate(rp.iter_pack(named, manifest, buffers, use_extension=use_extension)):
        assert bucket.data_ptr() == buffers[b % 2].data_ptr()
        assert torch.equal(bucket, expected[b])
        seen.append(b)
    assert seen == list(range(7))


# --- In-place unpack -----------------------------------------------------------------------------


@both_paths
def test_unpack_into_writes_in_place(ext, use_extension):
    gen = torch.Generator().manual_seed(5)
    named = {
        "embed": _random_tensor((12, 8), torch.bfloat16, gen),
        "proj": _random_tensor((8, 6), torch.float32, gen).t(),  # Non-contiguous source.
        "norm": _random_tensor((8,), torch.float32, gen),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "none": torch.empty(0, 8),
    }
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    buckets = rp.pack(named, manifest, use_extension=use_extension)
    # Destinations: a parameter that requires grad, a transposed view (non-contiguous), a
    # stepped slice of a bigger buffer; plus a name the manifest does not know (left alone).
    storage = torch.zeros(16)
    dests = {
        "embed": torch.nn.Parameter(torch.zeros(12, 8, dtype=torch.bfloat16)),
        "proj": torch.zeros(8, 6).t(),
        "norm": storage[::2],
        "step": torch.tensor(0),
        "mask": torch.zeros(3, dtype=torch.bool),
        "none": torch.empty(0, 8),
        "not_synced": torch.full((2,), 3.0),
    }
    ptrs = {k: v.data_ptr() for k, v in dests.items()}
    rp.unpack_into(buckets, manifest, dests, use_extension=use_extension)
    for name, t in named.items():
        _assert_bit_equal(dests[name], t, name)
        assert dests[name].data_ptr() == ptrs[name]
    assert torch.equal(storage[1::2], torch.zeros(8)), "bytes between strided elements"
    assert torch.equal(dests["not_synced"], torch.full((2,), 3.0))
    assert dests["embed"].requires_grad


@both_paths
def test_unpack_bucket_into_needs_only_its_names(ext, use_extension):
    named = {"a": torch.arange(64, dtype=torch.float32), "b": torch.arange(64, dtype=torch.int32)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 256)
    assert manifest.num_buckets == 2
    buckets = rp.pack(named, manifest, use_extension=use_extension)
    dest = {"b": torch.zeros(64, dtype=torch.int32)}
    rp.unpack_bucket_into(buckets[1], manifest, 1, dest, use_extension=use_extension)
    _assert_bit_equal(dest["b"], named["b"])
    with pytest.raises(ValueError, match="destination 'a' of the manifest is missing"):
        rp.unpack_bucket_into(buckets[0], manifest, 0, dest, use_extension=use_extension)


def _mismatch_cases():
    # Each: (destination override for the LAST tensor in manifest order, message pattern).
    # The last tensor, so that a path that checked while copying would already have written the
    # earlier ones.
    return {
        "missing": (None, r"destination 'z' of the manifest is missing"),
        "shape": (torch.zeros(4, 3), r"destination 'z': expected shape \(3, 4\), got \(4, 3\)"),
        "dtype": (
            torch.zeros(3, 4, dtype=torch.float16),
            r"destination 'z': expected dtype float32, got float16",
        ),
        "not_a_tensor": ([[0.0] * 4] * 3, r"destination 'z' is a list, not a tensor"),
        "expanded": (torch.zeros(1, 4).expand(3, 4), r"destination 'z' has elements that share"),
        "overlapping_windows": (
            torch.zeros(20).as_strided((3, 4), (2, 1)),
            r"destination 'z' has elements that share",
        ),
    }


@both_paths
@pytest.mark.parametrize("case", list(_mismatch_cases()))
def test_unpack_into_mismatch_writes_nothing(ext, use_extension, case):
    named = {"a": torch.ones(5), "b": torch.full((2, 2), 2.0), "z": torch.full((3, 4), 9.0)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    buckets = rp.pack(named, manifest)
    override, pattern = _mismatch_cases()[case]
    dests = {"a": torch.zeros(5), "b": torch.zeros(2, 2)}
    if override is not None:
        dests["z"] = override
    before = {k: v.clone() for k, v in dests.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=pattern):
        rp.unpack_into(buckets, manifest, dests, use_extension=use_extension)
    for k, v in before.items():
        assert torch.equal(dests[k], v), f"{k} was written before the mismatch was reported"


@both_paths
def test_unpack_into_rejects_bad_buckets_before_writing(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.full((100,), 2.0)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    buckets = rp.pack(named, manifest)
    dests = {"a": torch.zeros(5), "b": torch.zeros(100)}
    with pytest.raises(ValueError, match="got 1 buckets but the manifest has 2"):
        rp.unpack_into(buckets[:1], manifest, dests, use_extension=use_extension)
    with pytest.raises(ValueError, match="bucket 1: expected 400 bytes"):
        rp.unpack_into([buckets[0], buckets[1][:-16]], manifest, dests, use_extension=use_extension)
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        rp.unpack_into(
            [buckets[0], buckets[1].view(torch.float32)], manifest, dests, use_extension=use_extension
        )
    with pytest.raises(ValueError, match="shares memory with its bucket"):
        alias = {"a": torch.zeros(5), "b": buckets[1].view(torch.float32)}
        rp.unpack_into(buckets, manifest, alias, use_extension=use_extension)
    assert torch.equal(dests["a"], torch.zeros(5)) and torch.equal(dests["b"], torch.zeros(100))


# --- Pack errors ---------------------------------------------------------------------------------


@both_paths
def test_pack_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    with pytest.raises(ValueError, match="tensor 'b' of the manifest is missing"):
        rp.pack({"a": named["a"]}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match="tensor 'c' is not in the manifest"):
        rp.pack({**named, "c": torch.ones(1)}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(2, 2\), got \(4,\)"):
        rp.pack({"a": named["a"], "b": torch.ones(4)}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match="tensor 'a': expected dtype float32, got bfloat16"):
        rp.pack(
            {"a": named["a"].bfloat16(), "b": named["b"]}, manifest, use_extension=use_extension
        )
    with pytest.raises(ValueError, match="out has 16 bytes but bucket 0 needs 48"):
        rp.pack_bucket(named, manifest, 0, out=torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned address"):
        rp.pack_bucket(named, manifest, 0, out=torch.empty(200, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 1\), got 1"):
        rp.pack_bucket(named, manifest, 1)
    with pytest.raises(ValueError, match="num_threads must be in"):
        rp.pack(named, manifest, num_threads=-1)
    shared = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tensor 'a' shares memory with out"):
        rp.pack_bucket(
            {"a": shared[:20].view(torch.float32), "b": named["b"]}, manifest, 0, out=shared
        )


def test_gradients_and_parameters_pack(ext):
    p = torch.nn.Parameter(torch.randn(3, 4))
    manifest = rp.plan_buckets(rp.describe_tensors({"p": p}), 256)
    for use_extension in (True, False):
        (bucket,) = rp.pack({"p": p}, manifest, use_extension=use_extension)
        assert not bucket.requires_grad
        _assert_bit_equal(rp.unpack([bucket], manifest)["p"], p.detach())


# --- Planning ------------------------------------------------------------------------------------

_DTYPE_NAMES = list(rp.DTYPES)


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
    manifest = rp.plan_buckets(named, bucket_size, alignment, use_extension=False)
    if rp.HAS_EXTENSION:  # Required elsewhere; here both planners must agree.
        assert rp.plan_buckets(named, bucket_size, alignment, use_extension=True) == manifest
    entries = manifest.tensors
    # Every tensor exactly once, in order, with its size.
    assert [e.name for e in entries] == list(named)
    for e, (shape, dtype) in zip(entries, named.values()):
        size = torch.empty((), dtype=rp.DTYPES[dtype]).element_size()
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
    assert rp.Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


@pytest.mark.parametrize("use_extension", [True, False], ids=["ext", "python"])
def test_plan_errors(ext, use_extension):
    named = {"a": ((2,), torch.float32)}
    with pytest.raises(ValueError, match=r"alignment must be a power of two in \[16, 1073741824\], got 8"):
        rp.plan_buckets(named, 256, 8, use_extension=use_extension)
    with pytest.raises(ValueError, match="positive multiple of the alignment \\(256\\), got 1000"):
        rp.plan_buckets(named, 1000, use_extension=use_extension)
    with pytest.raises(ValueError, match="unsupported dtype torch.complex64"):
        rp.plan_buckets({"c": ((2,), torch.complex64)}, 256, use_extension=use_extension)
    with pytest.raises(ValueError, match="shape must be a sequence of ints >= 0"):
        rp.plan_buckets({"c": ((-1,), torch.float32)}, 256, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"expected \(shape, dtype\)"):
        rp.plan_buckets({"c": torch.ones(2)}, 256, use_extension=use_extension)


def test_core_plan_errors_surface_as_value_error(ext):
    with pytest.raises(ValueError, match="plan_buckets: tensor 1 has a negative size"):
        ext.refit_plan_buckets([4, -1], 256, 16)
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        ext.refit_plan_buckets([4], 256, 48)


# --- Manifest ------------------------------------------------------------------------------------


def _manifest_dict() -> dict:
    named = {
        "w": ((4, 8), torch.bfloat16),
        "b": ((8,), torch.float32),
        "step": ((), torch.int64),
        "big": ((100,), torch.float32),
    }
    return rp.plan_buckets(named, 256, 64).to_dict()


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
    manifest = rp.Manifest.from_dict(json.loads(text))
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
        rp.Manifest.from_dict(json.loads(json.dumps(data)))


def test_manifest_base_layout():
    # The layout the mutations above rely on (alignment 64, buckets of 256 bytes).
    data = _manifest_dict()
    assert data["bucket_sizes"] == [192, 448]
    assert [(t["bucket"], t["offset"]) for t in data["tensors"]] == [(0, 0), (0, 64), (0, 128), (1, 0)]
    assert rp.Manifest.from_dict(data).alignment == 64


# --- Raw binding ---------------------------------------------------------------------------------


def test_raw_binding_errors(ext):
    bucket = torch.zeros(64, dtype=torch.uint8)
    t = torch.ones(4, dtype=torch.int32)
    with pytest.raises(IndexError, match=r"span 0 covers bytes \[56, 56 \+ 16\)"):
        ext.refit_pack_bucket(bucket, [t], [56])
    with pytest.raises(ValueError, match="span 0 and span 1 overlap in the bucket"):
        ext.refit_pack_bucket(bucket, [t, t], [0, 8])
    with pytest.raises(ValueError, match="got 1 tensors but 2 offsets"):
        ext.refit_pack_bucket(bucket, [t], [0, 16])
    with pytest.raises(ValueError, match="the destination overlaps itself"):
        ext.refit_unpack_bucket(bucket, [torch.zeros(1, 4, dtype=torch.int32).expand(3, 4)], [0])
    with pytest.raises(ValueError, match="overlaps the bucket"):
        ext.refit_unpack_bucket(bucket, [bucket[8:24].view(torch.int32)], [32])
    with pytest.raises(TypeError):  # noconvert: a bucket is never silently copied.
        ext.refit_pack_bucket(torch.zeros(16, dtype=torch.int32), [t], [0])


# --- Plans ---------------------------------------------------------------------------------------


def _plan_named(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Several dtypes and layouts, spread over several buckets (one larger than a bucket)."""
    named = {}
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]):
        for layout, t in _layouts(dtype, gen).items():
            named[f"{i}.{layout}"] = t
    return named


@both_paths
def test_pack_plan_matches_functional_pack_across_calls(ext, use_extension):
    gen = torch.Generator().manual_seed(21)
    named = _plan_named(gen)
    manifest = rp.plan_buckets(rp.describe_tensors(named), 512, 16)
    assert manifest.num_buckets > 3
    plan = rp.PackPlan(named, manifest, use_extension=use_extension)
    assert plan.uses_extension is use_extension
    for step in range(3):
        expected = rp.pack(named, manifest, use_extension=False)
        for got, want in zip(plan.pack(), expected, strict=True):
            assert torch.equal(got, want), f"step {step}"
        # Into reused buffers, larger than each bucket: only the bucket's bytes are written.
        outs = [torch.full((size + 64,), 0xCD, dtype=torch.uint8) for size in manifest.bucket_sizes]
        for got, o, want in zip(plan.pack(out=outs), outs, expected, strict=True):
            assert got.data_ptr() == o.data_ptr() and torch.equal(got, want)
            assert bool((o[want.numel() :] == 0xCD).all())
        buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
        for b, got in enumerate(plan.iter_pack(buffers)):
            assert got.data_ptr() == buffers[b % 2].data_ptr() and torch.equal(got, expected[b])
        assert torch.equal(plan.pack_bucket(1), expected[1])
        # An optimizer-like in-place update: the next call packs the new values, no rebuild.
        with torch.no_grad():
            for name, t in named.items():
                if "expanded" in name or not t.numel():
                    continue  # An expanded view cannot be written in place.
                if t.dtype.is_floating_point:
                    t.add_(1)
                elif t.dtype == torch.int64:
                    t.mul_(3)
    assert plan.num_rebuilds == 0


@both_paths
def test_pack_plan_rebuilds_after_reallocation(ext, use_extension):
    gen = torch.Generator().manual_seed(22)
    params = {
        "w": torch.nn.Parameter(_random_tensor((6, 5), torch.float32, gen)),
        "b": torch.nn.Parameter(_random_tensor((5,), torch.bfloat16, gen)),
    }
    manifest = rp.plan_buckets(rp.describe_tensors(params), 256, 16)
    plan = rp.PackPlan(params, manifest, use_extension=use_extension)
    plan.pack()
    # Re-allocated, and with other strides: the plan must follow, not read the old memory.
    params["w"].data = _random_tensor((5, 6), torch.float32, gen).t()
    (bucket,) = plan.pack()
    assert plan.num_rebuilds == 1
    assert torch.equal(bucket, rp.pack(params, manifest, use_extension=False)[0])
    (bucket,) = plan.pack()  # Stable again: no second rebuild.
    assert plan.num_rebuilds == 1
    # A re-allocation with a different shape is a mismatch with the manifest.
    params["b"].data = torch.zeros(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(5,\), got \(7,\)"):
        plan.pack()


@both_paths
def test_pack_plan_on_reallocation_error(ext, use_extension):
    named = {"a": torch.ones(4), "b": torch.full((3,), 2.0)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    plan = rp.PackPlan(named, manifest, use_extension=use_extension, on_reallocation="error")
    named["b"].data = torch.full((3,), 5.0)
    out = torch.full((manifest.bucket_sizes[0],), 0xEE, dtype=torch.uint8)
    pattern = r"PackPlan: 'b' \(1 such\) was re-allocated .* plan.rebuild\(\)"
    with pytest.raises(ValueError, match=pattern):
        plan.pack(out=[out])
    assert bool((out == 0xEE).all()), "nothing may be written when the check fails"
    plan.rebuild()
    assert plan.num_rebuilds == 1
    (bucket,) = plan.pack(out=[out])
    assert torch.equal(bucket, rp.pack(named, manifest, use_extension=False)[0])


@both_paths
def test_pack_plan_with_per_call_named_tensors(ext, use_extension):
    model = torch.nn.Linear(4, 3)
    manifest = rp.plan_buckets(rp.describe_tensors(model.state_dict()), 256, 16)
    plan = rp.PackPlan(model.state_dict(), manifest, use_extension=use_extension)
    with torch.no_grad():
        model.weight.mul_(2)
    # A fresh state_dict(): other objects over the same memory, so no rebuild.
    (bucket,) = plan.pack(named_tensors=model.state_dict())
    assert plan.num_rebuilds == 0
    assert torch.equal(bucket, rp.pack(model.state_dict(), manifest, use_extension=False)[0])
    model.weight = torch.nn.Parameter(torch.randn(3, 4))  # Replaced: state_dict() differs.
    (bucket,) = plan.pack(named_tensors=model.state_dict())
    assert plan.num_rebuilds == 1
    assert torch.equal(bucket, rp.pack(model.state_dict(), manifest, use_extension=False)[0])
    with pytest.raises(ValueError, match="PackPlan: tensor 'bias' of the manifest is missing"):
        plan.pack(named_tensors={"weight": model.weight})


@both_paths
def test_pack_plan_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    kwargs = {"use_extension": use_extension}
    with pytest.raises(ValueError, match="PackPlan: tensor 'b' of the manifest is missing"):
        rp.PackPlan({"a": named["a"]}, manifest, **kwargs)
    with pytest.raises(ValueError, match="PackPlan: tensor 'c' is not in the manifest"):
        rp.PackPlan({**named, "c": torch.ones(1)}, manifest, **kwargs)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(2, 2\), got \(4,\)"):
        rp.PackPlan({"a": named["a"], "b": torch.ones(4)}, manifest, **kwargs)
    with pytest.raises(ValueError, match="tensor 'a': expected dtype float32, got float16"):
        rp.PackPlan({"a": named["a"].half(), "b": named["b"]}, manifest, **kwargs)
    with pytest.raises(ValueError, match="on_reallocation must be one of"):
        rp.PackPlan(named, manifest, on_reallocation="ignore", **kwargs)
    with pytest.raises(ValueError, match="num_threads must be in"):
        rp.PackPlan(named, manifest, num_threads=-1, **kwargs)
    with pytest.raises(ValueError, match="manifest must be a Manifest"):
        rp.PackPlan(named, manifest.to_dict(), **kwargs)
    plan = rp.PackPlan(named, manifest, **kwargs)
    with pytest.raises(ValueError, match="out must be a sequence of 1 tensors"):
        plan.pack(out=[])
    with pytest.raises(ValueError, match=r"out\[0\] has 16 bytes but bucket 0 needs 48"):
        plan.pack(out=[torch.empty(16, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="aligned address"):
        plan.pack(out=[torch.empty(200, dtype=torch.uint8)[1:]])
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        plan.pack_bucket(0, out=torch.empty(64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 1\), got 1"):
        plan.pack_bucket(1)
    # A tensor living inside the output buffer.
    shared = torch.full((64,), 7, dtype=torch.uint8)
    aliased = {"a": shared[:20].view(torch.float32), "b": named["b"]}
    plan = rp.PackPlan(aliased, manifest, **kwargs)
    with pytest.raises(ValueError, match="overlaps bucket 0|shares memory with bucket 0"):
        plan.pack(out=[shared])
    assert bool((shared[20:] == 7).all())


@both_paths
def test_unpack_plan_writes_in_place_across_calls(ext, use_extension):
    gen = torch.Generator().manual_seed(23)
    named = _plan_named(gen)
    named = {k: v for k, v in named.items() if "expanded" not in k}  # Not valid destinations.
    manifest = rp.plan_buckets(rp.describe_tensors(named), 512, 16)
    storage = torch.zeros(2 * 36, dtype=torch.float32)
    dests = {k: torch.zeros_like(v) for k, v in named.items()}
    dests["0.contiguous"] = storage[1::2].view(4, 9)  # Stepped writes.
    dests["0.transposed"] = torch.zeros(9, 5).t()  # Strided writes.
    dests["1.contiguous"] = torch.nn.Parameter(torch.zeros(4, 9, dtype=torch.bfloat16))
    dests["not_synced"] = torch.full((2,), 3.0)
    ptrs = {k: v.data_ptr() for k, v in dests.items()}
    plan = rp.UnpackPlan(manifest, dests, use_extension=use_extension)
    for step in range(2):
        with torch.no_grad():
            for t in named.values():
                if t.numel() and t.dtype.is_floating_point:
                    t.add_(step)
        buckets = rp.pack(named, manifest, use_extension=False)
        plan.unpack_into(buckets)
        for name, t in named.items():
            _assert_bit_equal(dests[name], t, f"{name} step {step}")
            assert dests[name].data_ptr() == ptrs[name]
        assert torch.equal(storage[0::2], torch.zeros(36)), "bytes between strided elements"
        assert torch.equal(dests["not_synced"], torch.full((2,), 3.0))
        # One bucket at a time, as buckets arrive.
        with torch.no_grad():
            for name in named:
                dests[name].zero_()
        for b, bucket in enumerate(buckets):
            plan.unpack_bucket_into(bucket, b)
        for name, t in named.items():
            _assert_bit_equal(dests[name], t, f"{name} step {step} per bucket")
    assert dests["1.contiguous"].requires_grad and plan.num_rebuilds == 0


@both_paths
@pytest.mark.parametrize("case", list(_mismatch_cases()))
def test_unpack_plan_rejects_mismatched_destinations(ext, use_extension, case):
    named = {"a": torch.ones(5), "b": torch.full((2, 2), 2.0), "z": torch.full((3, 4), 9.0)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    override, pattern = _mismatch_cases()[case]
    dests = {"a": torch.zeros(5), "b": torch.zeros(2, 2)}
    if override is not None:
        dests["z"] = override
    with pytest.raises(ValueError, match=pattern.replace("destination", "UnpackPlan: destination")):
        rp.UnpackPlan(manifest, dests, use_extension=use_extension)


@both_paths
def test_unpack_plan_bucket_errors_write_nothing(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.full((100,), 2.0)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    buckets = rp.pack(named, manifest)
    dests = {"a": torch.zeros(5), "b": torch.zeros(100)}
    plan = rp.UnpackPlan(manifest, dests, use_extension=use_extension)
    with pytest.raises(ValueError, match="got 1 buckets but the manifest has 2"):
        plan.unpack_into(buckets[:1])
    with pytest.raises(ValueError, match="bucket 1: expected 400 bytes"):
        plan.unpack_into([buckets[0], buckets[1][:-16]])
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        plan.unpack_into([buckets[0], buckets[1].view(torch.float32)])
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 2\)"):
        plan.unpack_bucket_into(buckets[0], 2)
    assert torch.equal(dests["a"], torch.zeros(5)) and torch.equal(dests["b"], torch.zeros(100))
    # A destination inside a bucket.
    alias_bucket = buckets[1].clone()
    alias = {"a": torch.zeros(5), "b": alias_bucket.view(torch.float32)}
    plan = rp.UnpackPlan(manifest, alias, use_extension=use_extension)
    with pytest.raises(ValueError, match="overlaps bucket 1|shares memory with bucket 1"):
        plan.unpack_into([buckets[0], alias_bucket])
    assert torch.equal(alias["a"], torch.zeros(5))


def test_plans_make_one_native_call_per_pack(ext, monkeypatch):
    runs = []

    class SpyPlan:
        def __init__(self, *args):
            self._plan = ext.RefitCopyPlan(*args)

        def run(self, buckets, first_bucket, num_threads, stream):
            runs.append((len(buckets), first_bucket))
            return self._plan.run(buckets, first_bucket, num_threads, stream)

    class Spy:
        with_cuda = ext.with_cuda
        refit_plan_buckets = staticmethod(ext.refit_plan_buckets)
        RefitCopyPlan = SpyPlan

    monkeypatch.setattr(rp, "_ext", Spy())
    named = {f"t{i}": torch.full((50,), float(i)) for i in range(6)}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
    assert manifest.num_buckets == 6
    plan = rp.PackPlan(named, manifest)
    buckets = plan.pack()
    assert runs == [(6, 0)]
    list(plan.iter_pack())
    assert runs[1:] == [(1, b) for b in range(6)]
    runs.clear()
    dests = {k: torch.zeros_like(v) for k, v in named.items()}
    rp.UnpackPlan(manifest, dests).unpack_into(buckets)
    assert runs == [(6, 0)]
    for k, v in named.items():
        _assert_bit_equal(dests[k], v, k)


def test_plan_empty_manifests(ext):
    for named in ({}, {"e": torch.empty(0, 3)}):
        manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 16)
        plan = rp.PackPlan(named, manifest, device="cpu")
        buckets = plan.pack()
        assert [b.numel() for b in buckets] == list(manifest.bucket_sizes)
        rp.UnpackPlan(manifest, {k: torch.empty_like(v) for k, v in named.items()}).unpack_into(buckets)


def test_raw_plan_binding_errors(ext):
    t = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="got 1 tensors, 2 bucket indices and 1 offsets"):
        ext.RefitCopyPlan([t], [0, 0], [0], [64], False)
    with pytest.raises(ValueError, match=r"span 0: bucket 1 is not in \[0, 1\)"):
        ext.RefitCopyPlan([t], [1], [0], [64], False)
    with pytest.raises(IndexError, match=r"span 1 covers bytes \[64, 64 \+ 16\) but bucket 1 has 64"):
        ext.RefitCopyPlan([t, t], [0, 1], [0, 64], [64, 64], False)
    with pytest.raises(ValueError, match="span 0 and span 1 overlap in bucket 0"):
        ext.RefitCopyPlan([t, t], [0, 0], [0, 8], [64, 64], False)
    with pytest.raises(ValueError, match="span 0: the destination overlaps itself"):
        ext.RefitCopyPlan([torch.zeros(1, 4, dtype=torch.int32).expand(3, 4)], [0], [0], [64], True)
    plan = ext.RefitCopyPlan([t, t], [0, 1], [0, 16], [64, 64], False)
    assert plan.num_buckets == 2 and plan.cuda_device == -1
    a, b = torch.full((64,), 9, dtype=torch.uint8), torch.full((64,), 9, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"buckets \[1, 1 \+ 2\) are not all in the plan's 2 buckets"):
        plan.run([a.data_ptr(), b.data_ptr()], 1)
    with pytest.raises(ValueError, match="bucket 1 is null but has 64 bytes"):
        plan.run([a.data_ptr(), 0], 0)
    with pytest.raises(ValueError, match="span 0: the tensor's memory overlaps bucket 0"):
        plan.run([t.data_ptr() - 16], 0)
    with pytest.raises(ValueError, match="num_threads must be in"):
        plan.run([a.data_ptr()], 0, -1)
    assert bool((a == 9).all()) and bool((b == 9).all())
    plan.run([b.data_ptr()], 1, 3)  # Bucket 1 only; threads beyond the bytes are capped.
    expected = torch.zeros(64, dtype=torch.uint8)
    expected[16:32] = t.view(torch.uint8)
    assert torch.equal(b, expected) and bool((a == 9).all())
    if not ext.with_cuda:
        with pytest.raises(RuntimeError, match="built without CUDA"):
            ext.RefitCopyPlan([], [], [], [], False, 0)


# --- CUDA ----------------------------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_cuda_parity(ext, dtype):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    gen = torch.Generator().manual_seed(11)
    named_cpu = _layouts(dtype, gen)
    named_cpu["big"] = _random_tensor((1000, 333), dtype, gen)  # Many 64 KiB chunks.
    named_cpu["big_t"] = _random_tensor((333, 700), dtype, gen).t()
    named = {k: v.cuda() for k, v in named_cpu.items()}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 1 << 16, 256)
    cpu_buckets = rp.pack(named_cpu, manifest, use_extension=True)
    cuda_buckets = rp.pack(named, manifest, use_extension=True)
    torch_buckets = rp.pack(named, manifest, use_extension=False)
    for c, g, t in zip(cpu_buckets, cuda_buckets, torch_buckets, strict=True):
        assert g.is_cuda
        assert torch.equal(g.cpu(), c) and torch.equal(t.cpu(), c)
    out = rp.unpack(cuda_buckets, manifest, use_extension=True)
    dests = {k: torch.zeros_like(v) for k, v in named.items() if k != "expanded_source"}
    dests["expanded_source"] = torch.zeros(3, 5, dtype=dtype, device="cuda")
    dests["big_t"] = torch.zeros(333, 700, dtype=dtype, device="cuda").t()  # Strided writes.
    rp.unpack_into(cuda_buckets, manifest, dests, use_extension=True)
    torch.cuda.synchronize()
    for name, t in named_cpu.items():
        _assert_bit_equal(out[name].cpu(), t, name)
        _assert_bit_equal(dests[name].cpu(), t, name)


@requires_gpu
def test_cuda_side_stream(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produced on the side stream; the pack must run after it there.
        named = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32).view(1024, 1024).t()}
        manifest = rp.plan_buckets(rp.describe_tensors(named), 1 << 22, 256)
        (bucket,) = rp.pack(named, manifest)
        out = rp.unpack([bucket], manifest)
    torch.cuda.synchronize()
    _assert_bit_equal(out["w"], named["w"].contiguous())


@requires_gpu
def test_cuda_without_cuda_build_falls_back(ext):
    if ext.with_cuda:
        pytest.skip("this build has CUDA; the fallback applies to CPU-only builds")
    named = {"w": torch.ones(3, device="cuda")}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256)
    with pytest.raises(RuntimeError, match="does not support cuda tensors"):
        rp.pack(named, manifest, use_extension=True)
    out = rp.unpack(rp.pack(named, manifest), manifest)  # Default: torch.
    _assert_bit_equal(out["w"], named["w"])


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_cuda_plans_match_cpu(ext, dtype):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    gen = torch.Generator().manual_seed(12)
    named_cpu = _layouts(dtype, gen)
    named_cpu["big"] = _random_tensor((1000, 333), dtype, gen)  # Many chunks.
    named_cpu["big_t"] = _random_tensor((333, 700), dtype, gen).t()
    for i in range(40):  # One per 256-byte bucket: more buckets than one launch takes (32).
        named_cpu[f"small{i}"] = _random_tensor((7 + i, 3), dtype, gen)
    named = {k: v.cuda() for k, v in named_cpu.items()}
    manifest = rp.plan_buckets(rp.describe_tensors(named), 256, 256)
    assert manifest.num_buckets > 40
    plan = rp.PackPlan(named, manifest)
    assert plan.uses_extension
    dests = {k: torch.zeros_like(v) for k, v in named.items() if k != "expanded_source"}
    dests["expanded_source"] = torch.zeros(3, 5, dtype=dtype, device="cuda")
    dests["big_t"] = torch.zeros(333, 700, dtype=dtype, device="cuda").t()  # Strided writes.
    unpack_plan = rp.UnpackPlan(manifest, dests)
    for step in range(2):
        cpu_buckets = rp.pack(named_cpu, manifest, use_extension=True)
        buckets = plan.pack()
        for c, g in zip(cpu_buckets, buckets, strict=True):
            assert g.is_cuda and torch.equal(g.cpu(), c)
        buffers = [
            torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device="cuda") for _ in range(2)
        ]
        for b, g in enumerate(plan.iter_pack(buffers)):
            assert torch.equal(g.cpu(), cpu_buckets[b])
        unpack_plan.unpack_into(buckets)
        torch.cuda.synchronize()
        for name, t in named_cpu.items():
            _assert_bit_equal(dests[name].cpu(), t, f"{name} step {step}")
        # The same in-place change on both sides, then the plans are reused.
        for name in ("big", "contiguous", "small3"):
            for t in (named_cpu[name], named[name]):
                if dtype == torch.bool:
                    t.logical_not_()
                else:
                    t.view(torch.uint8).bitwise_not_()
    assert plan.num_rebuilds == 0 and unpack_plan.num_rebuilds == 0
    # A re-allocated source is followed.
    named["big"].data = named["big"].flip(0).contiguous()
    named_cpu["big"] = named_cpu["big"].flip(0).contiguous()
    buckets = plan.pack()
    assert plan.num_rebuilds == 1
    for c, g in zip(rp.pack(named_cpu, manifest, use_extension=True), buckets, strict=True):
        assert torch.equal(g.cpu(), c)


@requires_gpu
def test_cuda_plan_side_stream_and_errors(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        named = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32).view(1024, 1024).t()}
        manifest = rp.plan_buckets(rp.describe_tensors(named), 1 << 22, 256)
        plan = rp.PackPlan(named, manifest)
        # Produced on the side stream right before the pack: the pack must run after it there.
        named["w"].mul_(3)
        (bucket,) = plan.pack()
        dest = {"w": torch.empty(1024, 1024, device="cuda")}
        rp.UnpackPlan(manifest, dest).unpack_into([bucket])
    torch.cuda.synchronize()
    _assert_bit_equal(dest["w"], named["w"])
    with pytest.raises(ValueError, match="is on cpu but the plan's tensors on cuda"):
        plan.pack(out=[torch.empty(manifest.bucket_sizes[0], dtype=torch.uint8)])
    with pytest.raises(ValueError, match="expected device cuda:0 \\(the plan's\\), got cpu"):
        rp.PackPlan({"w": torch.zeros(1024, 1024)}, manifest, device="cuda")
    assert rp.PackPlan(named, manifest, device="cuda").device == named["w"].device
