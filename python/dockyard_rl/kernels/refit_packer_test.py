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


@pytest.fixture(scope="module")
def ext():
    """The compiled extension; fails (does not skip) when it is missing."""
    try:
        import _dockyard_kernels
    except ImportError as e:
        pytest.fail(
            f"_dockyard_kernels is not importable ({e}); the build provides it: run this "
            "test through Bazel, or put the built extension's folder on PYTHONPATH"
        )
    return _dockyard_kernels


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
