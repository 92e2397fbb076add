"""Tests of dockyard_rl.kernels.refit_copy: the plans, the functional API, both copy paths.

Round trips are compared BYTE for byte (``_assert_bit_equal``), so NaN payloads, -0.0 and
infinities must survive exactly. The extension is REQUIRED: the build always provides it, so a
missing one fails these tests rather than skipping them. CUDA tests skip with a reason when there
is no GPU. ``rc._ext`` is what refit_copy calls; tests replace it with spies or None.
"""

from __future__ import annotations

import pytest
import torch

from dockyard_rl.kernels import _extension, testing_extension
from dockyard_rl.kernels import refit_copy as rc
from dockyard_rl.kernels.refit_manifest import Manifest
from dockyard_rl.kernels.refit_planning import describe_tensors, plan_buckets

# The shared fixture: the compiled extension, failing (not skipping) when it is missing.
ext = testing_extension.ext

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
    assert _extension.HAS_EXTENSION
    assert isinstance(ext.with_cuda, bool)


# --- Round trips ---------------------------------------------------------------------------------


@both_paths
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bit_exact(ext, use_extension, dtype):
    gen = torch.Generator().manual_seed(hash(str(dtype)) % 2**31)
    named = _layouts(dtype, gen)
    before = {k: v.clone() for k, v in named.items()}
    manifest = plan_buckets(describe_tensors(named), bucket_size_bytes=256, alignment=16)
    buckets = rc.pack(named, manifest, use_extension=use_extension)
    assert [b.numel() for b in buckets] == list(manifest.bucket_sizes)
    out = rc.unpack(buckets, manifest, use_extension=use_extension)
    assert list(out) == list(named)
    for name, t in named.items():
        _assert_bit_equal(out[name], t, name)
        assert out[name].is_contiguous()
        _assert_bit_equal(t, before[name], name)  # Sources untouched.
    # Zero-copy views read the same bytes.
    views = rc.unpack(buckets, manifest, copy=False)
    for name, t in named.items():
        _assert_bit_equal(views[name], t, name)


@both_paths
def test_buckets_are_deterministic_and_padding_is_zero(ext, use_extension):
    named = {"a": torch.arange(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float16)}
    manifest = plan_buckets(describe_tensors(named), 1024, 256)
    out = torch.full((2048,), 0xAB, dtype=torch.uint8)
    bucket = rc.pack_bucket(named, manifest, 0, out=out, use_extension=use_extension)
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
    manifest = plan_buckets(describe_tensors(named), 1 << 16, 256)
    ext_buckets = rc.pack(named, manifest, use_extension=True, num_threads=num_threads)
    torch_buckets = rc.pack(named, manifest, use_extension=False)
    for a, b in zip(ext_buckets, torch_buckets, strict=True):
        assert torch.equal(a, b)
    ext_out = rc.unpack(ext_buckets, manifest, use_extension=True, num_threads=num_threads)
    torch_out = rc.unpack(torch_buckets, manifest, use_extension=False)
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

    monkeypatch.setattr(rc, "_ext", Spy())
    named = {"w": torch.ones(3)}
    manifest = plan_buckets(describe_tensors(named), 256, 256)
    rc.unpack(rc.pack(named, manifest), manifest)
    assert calls == ["pack", "unpack"]
    rc.unpack(rc.pack(named, manifest, use_extension=False), manifest, use_extension=False)
    assert calls == ["pack", "unpack"]


def test_use_extension_true_without_extension_raises(monkeypatch):
    monkeypatch.setattr(rc, "_ext", None)
    named = {"w": torch.ones(3)}
    manifest = plan_buckets(describe_tensors(named), 256)
    with pytest.raises(RuntimeError, match="use_extension=None to fall back"):
        rc.pack(named, manifest, use_extension=True)
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        rc.PackPlan(named, manifest, use_extension=True)
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        rc.PackPlan.from_manifest(manifest, use_extension=True)
    # The default falls back to torch.
    out = rc.unpack(rc.pack(named, manifest), manifest)
    _assert_bit_equal(out["w"], named["w"])


@both_paths
def test_iter_pack_double_buffers(ext, use_extension):
    gen = torch.Generator().manual_seed(3)
    named = {f"t{i}": _random_tensor((50 + i,), torch.float32, gen) for i in range(7)}
    manifest = plan_buckets(describe_tensors(named), 256, 256)  # One tensor per bucket.
    assert manifest.num_buckets == 7
    expected = rc.pack(named, manifest, use_extension=use_extension)
    buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
    seen = []
    for b, bucket in enumerate(rc.iter_pack(named, manifest, buffers, use_extension=use_extension)):
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
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    buckets = rc.pack(named, manifest, use_extension=use_extension)
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
    rc.unpack_into(buckets, manifest, dests, use_extension=use_extension)
    for name, t in named.items():
        _assert_bit_equal(dests[name], t, name)
        assert dests[name].data_ptr() == ptrs[name]
    assert torch.equal(storage[1::2], torch.zeros(8)), "bytes between strided elements"
    assert torch.equal(dests["not_synced"], torch.full((2,), 3.0))
    assert dests["embed"].requires_grad


@both_paths
def test_unpack_bucket_into_needs_only_its_names(ext, use_extension):
    named = {"a": torch.arange(64, dtype=torch.float32), "b": torch.arange(64, dtype=torch.int32)}
    manifest = plan_buckets(describe_tensors(named), 256, 256)
    assert manifest.num_buckets == 2
    buckets = rc.pack(named, manifest, use_extension=use_extension)
    dest = {"b": torch.zeros(64, dtype=torch.int32)}
    rc.unpack_bucket_into(buckets[1], manifest, 1, dest, use_extension=use_extension)
    _assert_bit_equal(dest["b"], named["b"])
    with pytest.raises(ValueError, match="destination 'a' of the manifest is missing"):
        rc.unpack_bucket_into(buckets[0], manifest, 0, dest, use_extension=use_extension)


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
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    buckets = rc.pack(named, manifest)
    override, pattern = _mismatch_cases()[case]
    dests = {"a": torch.zeros(5), "b": torch.zeros(2, 2)}
    if override is not None:
        dests["z"] = override
    before = {k: v.clone() for k, v in dests.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=pattern):
        rc.unpack_into(buckets, manifest, dests, use_extension=use_extension)
    for k, v in before.items():
        assert torch.equal(dests[k], v), f"{k} was written before the mismatch was reported"


@both_paths
def test_unpack_into_rejects_bad_buckets_before_writing(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.full((100,), 2.0)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    buckets = rc.pack(named, manifest)
    dests = {"a": torch.zeros(5), "b": torch.zeros(100)}
    with pytest.raises(ValueError, match="got 1 buckets but the manifest has 2"):
        rc.unpack_into(buckets[:1], manifest, dests, use_extension=use_extension)
    with pytest.raises(ValueError, match="bucket 1: expected 400 bytes"):
        rc.unpack_into([buckets[0], buckets[1][:-16]], manifest, dests, use_extension=use_extension)
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        rc.unpack_into(
            [buckets[0], buckets[1].view(torch.float32)],
            manifest,
            dests,
            use_extension=use_extension,
        )
    with pytest.raises(ValueError, match="destination 'b' shares memory with bucket 1"):
        alias = {"a": torch.zeros(5), "b": buckets[1].view(torch.float32)}
        rc.unpack_into(buckets, manifest, alias, use_extension=use_extension)
    assert torch.equal(dests["a"], torch.zeros(5)) and torch.equal(dests["b"], torch.zeros(100))


# --- Pack errors ---------------------------------------------------------------------------------


@both_paths
def test_pack_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    with pytest.raises(ValueError, match="tensor 'b' of the manifest is missing"):
        rc.pack({"a": named["a"]}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match="tensor 'c' is not in the manifest"):
        rc.pack({**named, "c": torch.ones(1)}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(2, 2\), got \(4,\)"):
        rc.pack({"a": named["a"], "b": torch.ones(4)}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match="tensor 'a': expected dtype float32, got bfloat16"):
        rc.pack(
            {"a": named["a"].bfloat16(), "b": named["b"]}, manifest, use_extension=use_extension
        )
    with pytest.raises(ValueError, match="out has 16 bytes but bucket 0 needs 48"):
        rc.pack_bucket(named, manifest, 0, out=torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned address"):
        rc.pack_bucket(named, manifest, 0, out=torch.empty(200, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 1\), got 1"):
        rc.pack_bucket(named, manifest, 1)
    with pytest.raises(ValueError, match="num_threads must be in"):
        rc.pack(named, manifest, num_threads=-1)
    shared = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tensor 'a' shares memory with bucket 0"):
        rc.pack_bucket(
            {"a": shared[:20].view(torch.float32), "b": named["b"]}, manifest, 0, out=shared
        )


def test_gradients_and_parameters_pack(ext):
    p = torch.nn.Parameter(torch.randn(3, 4))
    manifest = plan_buckets(describe_tensors({"p": p}), 256)
    for use_extension in (True, False):
        (bucket,) = rc.pack({"p": p}, manifest, use_extension=use_extension)
        assert not bucket.requires_grad
        _assert_bit_equal(rc.unpack([bucket], manifest)["p"], p.detach())


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
    for i, dtype in enumerate(
        [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
    ):
        for layout, t in _layouts(dtype, gen).items():
            named[f"{i}.{layout}"] = t
    return named


@both_paths
def test_pack_plan_matches_functional_pack_across_calls(ext, use_extension):
    gen = torch.Generator().manual_seed(21)
    named = _plan_named(gen)
    manifest = plan_buckets(describe_tensors(named), 512, 16)
    assert manifest.num_buckets > 3
    plan = rc.PackPlan(named, manifest, use_extension=use_extension)
    assert plan.uses_extension is use_extension
    for step in range(3):
        expected = rc.pack(named, manifest, use_extension=False)
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
    manifest = plan_buckets(describe_tensors(params), 256, 16)
    plan = rc.PackPlan(params, manifest, use_extension=use_extension)
    plan.pack()
    # Re-allocated, and with other strides: the plan must follow, not read the old memory.
    params["w"].data = _random_tensor((5, 6), torch.float32, gen).t()
    (bucket,) = plan.pack()
    assert plan.num_rebuilds == 1
    assert torch.equal(bucket, rc.pack(params, manifest, use_extension=False)[0])
    (bucket,) = plan.pack()  # Stable again: no second rebuild.
    assert plan.num_rebuilds == 1
    # A re-allocation with a different shape is a mismatch with the manifest.
    params["b"].data = torch.zeros(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(5,\), got \(7,\)"):
        plan.pack()


@both_paths
def test_pack_plan_on_reallocation_error(ext, use_extension):
    named = {"a": torch.ones(4), "b": torch.full((3,), 2.0)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    plan = rc.PackPlan(named, manifest, use_extension=use_extension, on_reallocation="error")
    named["b"].data = torch.full((3,), 5.0)
    out = torch.full((manifest.bucket_sizes[0],), 0xEE, dtype=torch.uint8)
    pattern = r"PackPlan: 'b' \(1 such\) was re-allocated .* plan.rebuild\(\)"
    with pytest.raises(ValueError, match=pattern):
        plan.pack(out=[out])
    assert bool((out == 0xEE).all()), "nothing may be written when the check fails"
    plan.rebuild()
    assert plan.num_rebuilds == 1
    (bucket,) = plan.pack(out=[out])
    assert torch.equal(bucket, rc.pack(named, manifest, use_extension=False)[0])


@both_paths
def test_pack_plan_with_per_call_named_tensors(ext, use_extension):
    model = torch.nn.Linear(4, 3)
    manifest = plan_buckets(describe_tensors(model.state_dict()), 256, 16)
    plan = rc.PackPlan(model.state_dict(), manifest, use_extension=use_extension)
    with torch.no_grad():
        model.weight.mul_(2)
    # A fresh state_dict(): other objects over the same memory, so no rebuild.
    (bucket,) = plan.pack(named_tensors=model.state_dict())
    assert plan.num_rebuilds == 0
    assert torch.equal(bucket, rc.pack(model.state_dict(), manifest, use_extension=False)[0])
    model.weight = torch.nn.Parameter(torch.randn(3, 4))  # Replaced: state_dict() differs.
    (bucket,) = plan.pack(named_tensors=model.state_dict())
    assert plan.num_rebuilds == 1
    assert torch.equal(bucket, rc.pack(model.state_dict(), manifest, use_extension=False)[0])
    with pytest.raises(ValueError, match="PackPlan: tensor 'bias' of the manifest is missing"):
        plan.pack(named_tensors={"weight": model.weight})


@both_paths
def test_pack_plan_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    kwargs = {"use_extension": use_extension}
    with pytest.raises(ValueError, match="PackPlan: tensor 'b' of the manifest is missing"):
        rc.PackPlan({"a": named["a"]}, manifest, **kwargs)
    with pytest.raises(ValueError, match="PackPlan: tensor 'c' is not in the manifest"):
        rc.PackPlan({**named, "c": torch.ones(1)}, manifest, **kwargs)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(2, 2\), got \(4,\)"):
        rc.PackPlan({"a": named["a"], "b": torch.ones(4)}, manifest, **kwargs)
    with pytest.raises(ValueError, match="tensor 'a': expected dtype float32, got float16"):
        rc.PackPlan({"a": named["a"].half(), "b": named["b"]}, manifest, **kwargs)
    with pytest.raises(ValueError, match="on_reallocation must be one of"):
        rc.PackPlan(named, manifest, on_reallocation="ignore", **kwargs)
    with pytest.raises(ValueError, match="num_threads must be in"):
        rc.PackPlan(named, manifest, num_threads=-1, **kwargs)
    with pytest.raises(ValueError, match="manifest must be a Manifest"):
        rc.PackPlan(named, manifest.to_dict(), **kwargs)
    plan = rc.PackPlan(named, manifest, **kwargs)
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
    plan = rc.PackPlan(aliased, manifest, **kwargs)
    with pytest.raises(ValueError, match="overlaps bucket 0|shares memory with bucket 0"):
        plan.pack(out=[shared])
    assert bool((shared[20:] == 7).all())


@both_paths
def test_unpack_plan_writes_in_place_across_calls(ext, use_extension):
    gen = torch.Generator().manual_seed(23)
    named = _plan_named(gen)
    named = {k: v for k, v in named.items() if "expanded" not in k}  # Not valid destinations.
    manifest = plan_buckets(describe_tensors(named), 512, 16)
    storage = torch.zeros(2 * 36, dtype=torch.float32)
    dests = {k: torch.zeros_like(v) for k, v in named.items()}
    dests["0.contiguous"] = storage[1::2].view(4, 9)  # Stepped writes.
    dests["0.transposed"] = torch.zeros(9, 5).t()  # Strided writes.
    dests["1.contiguous"] = torch.nn.Parameter(torch.zeros(4, 9, dtype=torch.bfloat16))
    dests["not_synced"] = torch.full((2,), 3.0)
    ptrs = {k: v.data_ptr() for k, v in dests.items()}
    plan = rc.UnpackPlan(manifest, dests, use_extension=use_extension)
    for step in range(2):
        with torch.no_grad():
            for t in named.values():
                if t.numel() and t.dtype.is_floating_point:
                    t.add_(step)
        buckets = rc.pack(named, manifest, use_extension=False)
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
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    override, pattern = _mismatch_cases()[case]
    dests = {"a": torch.zeros(5), "b": torch.zeros(2, 2)}
    if override is not None:
        dests["z"] = override
    with pytest.raises(ValueError, match=pattern.replace("destination", "UnpackPlan: destination")):
        rc.UnpackPlan(manifest, dests, use_extension=use_extension)


@both_paths
def test_unpack_plan_bucket_errors_write_nothing(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.full((100,), 2.0)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    buckets = rc.pack(named, manifest)
    dests = {"a": torch.zeros(5), "b": torch.zeros(100)}
    plan = rc.UnpackPlan(manifest, dests, use_extension=use_extension)
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
    plan = rc.UnpackPlan(manifest, alias, use_extension=use_extension)
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

    monkeypatch.setattr(rc, "_ext", Spy())
    named = {f"t{i}": torch.full((50,), float(i)) for i in range(6)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    assert manifest.num_buckets == 6
    plan = rc.PackPlan(named, manifest)
    buckets = plan.pack()
    assert runs == [(6, 0)]
    list(plan.iter_pack())
    assert runs[1:] == [(1, b) for b in range(6)]
    runs.clear()
    dests = {k: torch.zeros_like(v) for k, v in named.items()}
    rc.UnpackPlan(manifest, dests).unpack_into(buckets)
    assert runs == [(6, 0)]
    for k, v in named.items():
        _assert_bit_equal(dests[k], v, k)


def test_plan_empty_manifests(ext):
    for named in ({}, {"e": torch.empty(0, 3)}):
        manifest = plan_buckets(describe_tensors(named), 256, 16)
        plan = rc.PackPlan(named, manifest, device="cpu")
        buckets = plan.pack()
        assert [b.numel() for b in buckets] == list(manifest.bucket_sizes)
        rc.UnpackPlan(manifest, {k: torch.empty_like(v) for k, v in named.items()}).unpack_into(
            buckets
        )


def test_raw_plan_binding_errors(ext):
    t = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="got 1 tensors, 2 bucket indices and 1 offsets"):
        ext.RefitCopyPlan([t], [0, 0], [0], [64], False)
    with pytest.raises(ValueError, match=r"span 0: bucket 1 is not in \[0, 1\)"):
        ext.RefitCopyPlan([t], [1], [0], [64], False)
    with pytest.raises(
        IndexError, match=r"span 1 covers bytes \[64, 64 \+ 16\) but bucket 1 has 64"
    ):
        ext.RefitCopyPlan([t, t], [0, 1], [0, 64], [64, 64], False)
    with pytest.raises(ValueError, match="span 0 and span 1 overlap in bucket 0"):
        ext.RefitCopyPlan([t, t], [0, 0], [0, 8], [64, 64], False)
    with pytest.raises(ValueError, match="span 0: the destination overlaps itself"):
        ext.RefitCopyPlan([torch.zeros(1, 4, dtype=torch.int32).expand(3, 4)], [0], [0], [64], True)
    plan = ext.RefitCopyPlan([t, t], [0, 1], [0, 16], [64, 64], False)
    assert plan.num_buckets == 2 and plan.cuda_device == -1
    a, b = torch.full((64,), 9, dtype=torch.uint8), torch.full((64,), 9, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"buckets \[1, 1 \+ 2\) are not all in the plan's 2 buckets"
    ):
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


# --- Per-bucket tensors: from_manifest, pack_bucket_from, unpack_bucket_to -----------------------


def _gathered(
    named: dict[str, torch.Tensor], manifest: Manifest, b: int
) -> dict[str, torch.Tensor]:
    """Bucket b's tensors as NEW objects in new memory, as an all-gather produces them."""
    return {e.name: named[e.name].clone() for e in manifest.bucket_entries(b)}


@both_paths
def test_pack_bucket_from_matches_pack(ext, use_extension):
    gen = torch.Generator().manual_seed(31)
    named = _plan_named(gen)
    manifest = plan_buckets(describe_tensors(named), 512, 16)
    assert manifest.num_buckets > 3
    plan = rc.PackPlan.from_manifest(manifest, device="cpu", use_extension=use_extension)
    assert plan.uses_extension is use_extension and plan.device == torch.device("cpu")
    buffers = [
        torch.full((manifest.max_bucket_size + 32,), 0xCD, dtype=torch.uint8) for _ in range(2)
    ]
    for step in range(2):
        expected = rc.pack(named, manifest, use_extension=False)
        for b in range(manifest.num_buckets):
            # Strided sources too: the transposed / sliced layouts of _layouts, kept as views.
            bucket_named = {e.name: named[e.name] for e in manifest.bucket_entries(b)}
            if step:
                bucket_named = _gathered(named, manifest, b)
            out = buffers[b % 2].fill_(0xCD)
            got = plan.pack_bucket_from(bucket_named, b, out=out)
            assert got.data_ptr() == out.data_ptr() and torch.equal(got, expected[b]), (step, b)
            assert bool((out[got.numel() :] == 0xCD).all()), "bytes past the bucket are left alone"
            assert torch.equal(plan.pack_bucket_from(bucket_named, b), expected[b])  # New bucket.
        with torch.no_grad():
            for t in named.values():
                if t.dtype.is_floating_point and t.numel() and t.stride() != (0, 1):
                    t.add_(1)


def test_pack_bucket_from_makes_one_native_call_per_bucket(ext, monkeypatch):
    calls = []

    class Spy:
        with_cuda = ext.with_cuda

        def refit_pack_bucket(self, bucket, tensors, offsets, num_threads, stream):
            calls.append((len(tensors), offsets, num_threads))
            return ext.refit_pack_bucket(bucket, tensors, offsets, num_threads, stream)

        def RefitCopyPlan(self, *args):  # noqa: N802 - the extension's name.
            raise AssertionError("a per-bucket call must not prepare a native plan")

    monkeypatch.setattr(rc, "_ext", Spy())
    named = {"a": torch.ones(5), "b": torch.full((3,), 2.0), "c": torch.full((70,), 3.0)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    assert [e.bucket for e in manifest.tensors] == [0, 0, 1]
    plan = rc.PackPlan.from_manifest(manifest, num_threads=2)
    assert plan.device is None and plan.uses_extension is None  # Decided per call.
    got = [plan.pack_bucket_from(_gathered(named, manifest, b), b) for b in range(2)]
    assert calls == [(2, [0, 32], 2), (1, [0], 2)]
    for g, want in zip(got, rc.pack(named, manifest, use_extension=False), strict=True):
        assert torch.equal(g, want)
    # The functional pack_bucket is the same path: one native call, only the bucket's tensors.
    calls.clear()
    assert torch.equal(rc.pack_bucket(named, manifest, 1), got[1])
    assert calls == [(1, [0], 0)]


def _bucket_mismatch_cases():
    # Each: (change to bucket 0's tensors {"a", "z"}, message pattern). "z" is the LAST tensor of
    # the bucket, so a check made while copying would already have written "a".
    meta = torch.empty(3, 4, device="meta")
    return {
        "missing": (lambda d: d.pop("z"), r"PackPlan: tensor 'z' of the manifest is missing"),
        "other_bucket": (
            lambda d: d.update(big=torch.zeros(80)),
            r"PackPlan: tensor 'big' belongs to bucket 1, not bucket 0",
        ),
        "unknown": (
            lambda d: d.update(extra=torch.zeros(1)),
            r"PackPlan: tensor 'extra' is not in the manifest",
        ),
        "shape": (
            lambda d: d.update(z=torch.zeros(4, 3)),
            r"PackPlan: tensor 'z': expected shape \(3, 4\), got \(4, 3\)",
        ),
        "dtype": (
            lambda d: d.update(z=torch.zeros(3, 4, dtype=torch.bfloat16)),
            r"PackPlan: tensor 'z': expected dtype float32, got bfloat16",
        ),
        "not_a_tensor": (lambda d: d.update(z=[0.0] * 12), r"PackPlan: tensor 'z' is a list"),
        "device": (
            lambda d: d.update(z=meta),
            r"PackPlan: tensor 'z': expected device cpu \(the plan's\), got meta",
        ),
    }


@both_paths
@pytest.mark.parametrize("case", list(_bucket_mismatch_cases()))
def test_pack_bucket_from_mismatch_names_the_tensor(ext, use_extension, case):
    named = {"a": torch.ones(5), "z": torch.full((3, 4), 9.0), "big": torch.ones(80)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    assert [e.bucket for e in manifest.tensors] == [0, 0, 1]
    plan = rc.PackPlan.from_manifest(manifest, device="cpu", use_extension=use_extension)
    change, pattern = _bucket_mismatch_cases()[case]
    bucket_named = {"a": named["a"], "z": named["z"]}
    change(bucket_named)
    out = torch.full((256,), 0xEE, dtype=torch.uint8)
    with pytest.raises(ValueError, match=pattern):
        plan.pack_bucket_from(bucket_named, 0, out=out)
    assert bool((out == 0xEE).all()), "nothing may be written when a check fails"


@both_paths
def test_pack_bucket_from_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    plan = rc.PackPlan.from_manifest(manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 1\), got 1"):
        plan.pack_bucket_from(named, 1)
    with pytest.raises(ValueError, match="expected a mapping name -> tensor, got list"):
        plan.pack_bucket_from([named["a"], named["b"]], 0)
    pattern = r"PackPlan.pack_bucket_from: out has 16 bytes but bucket 0 needs 48"
    with pytest.raises(ValueError, match=pattern):
        plan.pack_bucket_from(named, 0, out=torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned address"):
        plan.pack_bucket_from(named, 0, out=torch.empty(200, dtype=torch.uint8)[1:])
    shared = torch.full((64,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="PackPlan: tensor 'a' shares memory with bucket 0"):
        plan.pack_bucket_from(
            {"a": shared[:20].view(torch.float32), "b": named["b"]}, 0, out=shared
        )
    assert bool((shared[20:] == 7).all())
    # Memory of the same storage outside the bucket's bytes is fine (exact byte ranges).
    storage = torch.zeros(256, dtype=torch.uint8)
    beside = {"a": storage[192:212].view(torch.float32).fill_(4.0), "b": named["b"]}
    bucket = plan.pack_bucket_from(beside, 0, out=storage[:128])
    assert torch.equal(bucket, rc.pack({"a": torch.full((5,), 4.0), "b": named["b"]}, manifest)[0])
    # A plan without tensors has nothing to pack by itself.
    for call in (
        plan.pack,
        lambda: plan.pack_bucket(0),
        lambda: list(plan.iter_pack()),
        plan.rebuild,
    ):
        with pytest.raises(
            ValueError, match=r"from_manifest and holds no tensors.*pack_bucket_from"
        ):
            call()
    with pytest.raises(ValueError, match="manifest must be a Manifest"):
        rc.PackPlan.from_manifest(manifest.to_dict())
    with pytest.raises(ValueError, match="num_threads must be in"):
        rc.PackPlan.from_manifest(manifest, num_threads=MAX_THREADS_PLUS_ONE)


MAX_THREADS_PLUS_ONE = rc.MAX_THREADS + 1


@both_paths
def test_pack_bucket_from_leaves_held_tensors_alone(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.full((2, 2), 2.0)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    plan = rc.PackPlan(named, manifest, use_extension=use_extension)
    other = {"a": torch.full((5,), 8.0), "b": torch.full((2, 2), 9.0)}
    (held,) = plan.pack()
    assert torch.equal(plan.pack_bucket_from(other, 0), rc.pack(other, manifest)[0])
    assert torch.equal(plan.pack()[0], held) and plan.num_rebuilds == 0
    # rebuild(named) makes a from_manifest plan hold tensors.
    lazy = rc.PackPlan.from_manifest(manifest, use_extension=use_extension)
    lazy.rebuild(named)
    assert lazy.device == torch.device("cpu") and lazy.uses_extension is use_extension
    assert torch.equal(lazy.pack()[0], held)


@both_paths
def test_unpack_bucket_to(ext, use_extension):
    gen = torch.Generator().manual_seed(32)
    named = {k: v for k, v in _plan_named(gen).items() if "expanded" not in k}
    manifest = plan_buckets(describe_tensors(named), 512, 16)
    buckets = rc.pack(named, manifest, use_extension=False)
    plan = rc.UnpackPlan.from_manifest(manifest, use_extension=use_extension)
    dests = {k: torch.zeros_like(v) for k, v in named.items()}
    dests["0.transposed"] = torch.zeros(9, 5).t()  # Strided writes.
    dests["not_synced"] = torch.full((2,), 3.0)  # Extra names are left alone.
    for b, bucket in enumerate(buckets):
        plan.unpack_bucket_to(bucket, b, dests)
    for name, t in named.items():
        _assert_bit_equal(dests[name], t, name)
    assert torch.equal(dests["not_synced"], torch.full((2,), 3.0))
    with pytest.raises(
        ValueError, match=r"UnpackPlan: destination '0.contiguous' of the manifest is"
    ):
        plan.unpack_bucket_to(buckets[0], 0, {})
    first = manifest.bucket_entries(0)[0]
    expanded = torch.zeros(1, *first.shape[1:], dtype=first.torch_dtype).expand(*first.shape)
    with pytest.raises(ValueError, match=f"destination '{first.name}' has elements that share"):
        plan.unpack_bucket_to(buckets[0], 0, {**dests, first.name: expanded})
    with pytest.raises(ValueError, match="UnpackPlan.unpack_bucket_to: bucket 0: expected"):
        plan.unpack_bucket_to(buckets[0][:-16], 0, dests)
    with pytest.raises(ValueError, match="holds no destinations.*unpack_bucket_to"):
        plan.unpack_into(buckets)


def test_messages_name_the_call(ext):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    with pytest.raises(ValueError, match=r"^pack: tensor 'b' of the manifest is missing"):
        rc.pack({"a": named["a"]}, manifest)
    with pytest.raises(ValueError, match=r"^pack_bucket: tensor 'b': expected shape"):
        rc.pack_bucket({"a": named["a"], "b": torch.ones(4)}, manifest, 0)
    with pytest.raises(ValueError, match=r"^pack_bucket: out has 16 bytes"):
        rc.pack_bucket(named, manifest, 0, out=torch.empty(16, dtype=torch.uint8))
    (bucket,) = rc.pack(named, manifest)
    with pytest.raises(
        ValueError, match=r"^unpack_into: destination 'a' of the manifest is missing"
    ):
        rc.unpack_into([bucket], manifest, {"b": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"^unpack: got 2 buckets but the manifest has 1"):
        rc.unpack([bucket, bucket], manifest)
    with pytest.raises(
        ValueError, match=r"PackPlan.pack: out\[0\] is on meta but the tensors on cpu"
    ):
        rc.PackPlan(named, manifest).pack(out=[torch.empty(64, dtype=torch.uint8, device="meta")])
    with pytest.raises(ValueError, match=r"^unpack_bucket: bucket 0: expected 48 bytes"):
        rc.unpack_bucket(bucket[:32], manifest, 0, copy=False)
    with pytest.raises(ValueError, match=r"expected device meta \(the buckets'\), got cpu"):
        meta_bucket = torch.empty(48, dtype=torch.uint8, device="meta")
        rc.unpack_bucket_into(
            meta_bucket, manifest, 0, {"a": torch.zeros(5), "b": torch.zeros(2, 2)}
        )


# --- CUDA ----------------------------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine"
)


@requires_gpu
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
)
def test_cuda_parity(ext, dtype):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    gen = torch.Generator().manual_seed(11)
    named_cpu = _layouts(dtype, gen)
    named_cpu["big"] = _random_tensor((1000, 333), dtype, gen)  # Many 64 KiB chunks.
    named_cpu["big_t"] = _random_tensor((333, 700), dtype, gen).t()
    named = {k: v.cuda() for k, v in named_cpu.items()}
    manifest = plan_buckets(describe_tensors(named), 1 << 16, 256)
    cpu_buckets = rc.pack(named_cpu, manifest, use_extension=True)
    cuda_buckets = rc.pack(named, manifest, use_extension=True)
    torch_buckets = rc.pack(named, manifest, use_extension=False)
    for c, g, t in zip(cpu_buckets, cuda_buckets, torch_buckets, strict=True):
        assert g.is_cuda
        assert torch.equal(g.cpu(), c) and torch.equal(t.cpu(), c)
    out = rc.unpack(cuda_buckets, manifest, use_extension=True)
    dests = {k: torch.zeros_like(v) for k, v in named.items() if k != "expanded_source"}
    dests["expanded_source"] = torch.zeros(3, 5, dtype=dtype, device="cuda")
    dests["big_t"] = torch.zeros(333, 700, dtype=dtype, device="cuda").t()  # Strided writes.
    rc.unpack_into(cuda_buckets, manifest, dests, use_extension=True)
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
        named = {
            "w": torch.arange(1 << 20, device="cuda", dtype=torch.float32).view(1024, 1024).t()
        }
        manifest = plan_buckets(describe_tensors(named), 1 << 22, 256)
        (bucket,) = rc.pack(named, manifest)
        out = rc.unpack([bucket], manifest)
    torch.cuda.synchronize()
    _assert_bit_equal(out["w"], named["w"].contiguous())


@requires_gpu
def test_cuda_without_cuda_build_falls_back(ext):
    if ext.with_cuda:
        pytest.skip("this build has CUDA; the fallback applies to CPU-only builds")
    named = {"w": torch.ones(3, device="cuda")}
    manifest = plan_buckets(describe_tensors(named), 256)
    with pytest.raises(RuntimeError, match="does not support cuda tensors"):
        rc.pack(named, manifest, use_extension=True)
    out = rc.unpack(rc.pack(named, manifest), manifest)  # Default: torch.
    _assert_bit_equal(out["w"], named["w"])


@requires_gpu
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
)
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
    manifest = plan_buckets(describe_tensors(named), 256, 256)
    assert manifest.num_buckets > 40
    plan = rc.PackPlan(named, manifest)
    assert plan.uses_extension
    dests = {k: torch.zeros_like(v) for k, v in named.items() if k != "expanded_source"}
    dests["expanded_source"] = torch.zeros(3, 5, dtype=dtype, device="cuda")
    dests["big_t"] = torch.zeros(333, 700, dtype=dtype, device="cuda").t()  # Strided writes.
    unpack_plan = rc.UnpackPlan(manifest, dests)
    for step in range(2):
        cpu_buckets = rc.pack(named_cpu, manifest, use_extension=True)
        buckets = plan.pack()
        for c, g in zip(cpu_buckets, buckets, strict=True):
            assert g.is_cuda and torch.equal(g.cpu(), c)
        buffers = [
            torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device="cuda")
            for _ in range(2)
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
    for c, g in zip(rc.pack(named_cpu, manifest, use_extension=True), buckets, strict=True):
        assert torch.equal(g.cpu(), c)


@requires_gpu
def test_cuda_plan_side_stream_and_errors(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        named = {
            "w": torch.arange(1 << 20, device="cuda", dtype=torch.float32).view(1024, 1024).t()
        }
        manifest = plan_buckets(describe_tensors(named), 1 << 22, 256)
        plan = rc.PackPlan(named, manifest)
        # Produced on the side stream right before the pack: the pack must run after it there.
        named["w"].mul_(3)
        (bucket,) = plan.pack()
        dest = {"w": torch.empty(1024, 1024, device="cuda")}
        rc.UnpackPlan(manifest, dest).unpack_into([bucket])
    torch.cuda.synchronize()
    _assert_bit_equal(dest["w"], named["w"])
    with pytest.raises(ValueError, match="out\\[0\\] is on cpu but the tensors on cuda"):
        plan.pack(out=[torch.empty(manifest.bucket_sizes[0], dtype=torch.uint8)])
    with pytest.raises(ValueError, match="expected device cuda:0 \\(the plan's\\), got cpu"):
        rc.PackPlan({"w": torch.zeros(1024, 1024)}, manifest, device="cuda")
    assert rc.PackPlan(named, manifest, device="cuda").device == named["w"].device


@requires_gpu
@both_paths
def test_cuda_pack_bucket_from(ext, use_extension):
    if use_extension and not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    gen = torch.Generator().manual_seed(13)
    named_cpu = _layouts(torch.bfloat16, gen)
    manifest = plan_buckets(describe_tensors(named_cpu), 1 << 12, 256)
    expected = rc.pack(named_cpu, manifest, use_extension=False)
    plan = rc.PackPlan.from_manifest(manifest, device="cuda", use_extension=use_extension)
    buffers = [
        torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device="cuda") for _ in range(2)
    ]
    for b in range(manifest.num_buckets):
        # "Gathered" on the current stream right before the pack, then dropped.
        bucket_named = {e.name: named_cpu[e.name].cuda() for e in manifest.bucket_entries(b)}
        bucket = plan.pack_bucket_from(bucket_named, b, out=buffers[b % 2])
        assert bucket.is_cuda and torch.equal(bucket.cpu(), expected[b]), b
    with pytest.raises(ValueError, match=r"expected device cuda:0 \(the plan's\), got cpu"):
        plan.pack_bucket_from({e.name: named_cpu[e.name] for e in manifest.bucket_entries(0)}, 0)
