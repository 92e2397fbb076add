"""Tests of dockyard_rl.kernels.refit_copy: PackPlan, pack, bucket_views, both copy paths.

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


def _views(buckets: list[torch.Tensor], manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest, as views into ``buckets`` (the receiver's reading)."""
    views = {}
    for b, bucket in enumerate(buckets):
        views.update(rc.bucket_views(bucket, manifest, b))
    return views


def _gathered(
    named: dict[str, torch.Tensor], manifest: Manifest, b: int
) -> dict[str, torch.Tensor]:
    """Bucket b's tensors as NEW objects in new memory, as an all-gather produces them."""
    return {e.name: named[e.name].clone() for e in manifest.bucket_entries(b)}


def _plan_named(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Several dtypes and layouts, spread over several buckets (one larger than a bucket)."""
    named = {}
    for i, dtype in enumerate(
        [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
    ):
        for layout, t in _layouts(dtype, gen).items():
            named[f"{i}.{layout}"] = t
    return named


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
    views = _views(buckets, manifest)
    assert list(views) == list(named)
    for name, t in named.items():
        _assert_bit_equal(views[name], t, name)
        _assert_bit_equal(t, before[name], name)  # Sources untouched.


@both_paths
def test_buckets_are_deterministic_and_padding_is_zero(ext, use_extension):
    named = {"a": torch.arange(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float16)}
    manifest = plan_buckets(describe_tensors(named), 1024, 256)
    out = torch.full((2048,), 0xAB, dtype=torch.uint8)
    bucket = rc.PackPlan(manifest, use_extension=use_extension).pack_bucket(named, 0, out=out)
    assert bucket.data_ptr() == out.data_ptr() and bucket.numel() == 512
    expected = torch.zeros(512, dtype=torch.uint8)
    expected[:3] = torch.tensor([0, 1, 2], dtype=torch.uint8)
    expected[256:266] = torch.ones(5, dtype=torch.float16).view(torch.uint8)
    assert torch.equal(bucket, expected)
    assert bool((out[512:] == 0xAB).all()), "bytes past the bucket must be left alone"


def test_extension_matches_torch(ext):
    gen = torch.Generator().manual_seed(3)
    named = {}
    for i, dtype in enumerate(MODEL_DTYPES):
        for layout, t in _layouts(dtype, gen).items():
            named[f"{i}.{layout}"] = t
    named["big.transposed"] = _random_tensor((700, 300), torch.float32, gen).t()  # Threaded.
    manifest = plan_buckets(describe_tensors(named), 1 << 16, 256)
    ext_buckets = rc.pack(named, manifest, use_extension=True)
    torch_buckets = rc.pack(named, manifest, use_extension=False)
    for a, b in zip(ext_buckets, torch_buckets, strict=True):
        assert torch.equal(a, b)
    views = _views(ext_buckets, manifest)
    for name, t in named.items():
        _assert_bit_equal(views[name], t, name)


def test_default_uses_extension_on_cpu(ext, monkeypatch):
    calls = []

    class Spy:
        with_cuda = ext.with_cuda

        def refit_pack_bucket(self, *args):
            calls.append("pack")
            return ext.refit_pack_bucket(*args)

    monkeypatch.setattr(rc, "_ext", Spy())
    named = {"w": torch.ones(3)}
    manifest = plan_buckets(describe_tensors(named), 256, 256)
    rc.pack(named, manifest)
    assert calls == ["pack"]
    rc.pack(named, manifest, use_extension=False)
    rc.PackPlan(manifest, use_extension=False).pack_bucket(named, 0)
    assert calls == ["pack"]


def test_use_extension_true_without_extension_raises(monkeypatch):
    monkeypatch.setattr(rc, "_ext", None)
    named = {"w": torch.ones(3)}
    manifest = plan_buckets(describe_tensors(named), 256)
    with pytest.raises(RuntimeError, match=r"^pack\(use_extension=True\).*use_extension=None"):
        rc.pack(named, manifest, use_extension=True)
    with pytest.raises(RuntimeError, match="_dockyard_kernels is not importable"):
        rc.PackPlan(manifest, use_extension=True)
    # The default falls back to torch.
    (bucket,) = rc.pack(named, manifest)
    _assert_bit_equal(rc.bucket_views(bucket, manifest, 0)["w"], named["w"])


def test_gradients_and_parameters_pack(ext):
    p = torch.nn.Parameter(torch.randn(3, 4))
    manifest = plan_buckets(describe_tensors({"p": p}), 256)
    for use_extension in (True, False):
        (bucket,) = rc.pack({"p": p}, manifest, use_extension=use_extension)
        assert not bucket.requires_grad
        _assert_bit_equal(rc.bucket_views(bucket, manifest, 0)["p"], p.detach())


@both_paths
def test_pack_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    with pytest.raises(ValueError, match="^pack: tensor 'b' of the manifest is missing"):
        rc.pack({"a": named["a"]}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match="^pack: tensor 'c' is not in the manifest"):
        rc.pack({**named, "c": torch.ones(1)}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"tensor 'b': expected shape \(2, 2\), got \(4,\)"):
        rc.pack({"a": named["a"], "b": torch.ones(4)}, manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match="tensor 'a': expected dtype float32, got bfloat16"):
        rc.pack(
            {"a": named["a"].bfloat16(), "b": named["b"]}, manifest, use_extension=use_extension
        )
    with pytest.raises(ValueError, match=r"expected device meta \(tensor 'a''s\), got cpu"):
        rc.pack({"a": torch.ones(5, device="meta"), "b": named["b"]}, manifest)
    with pytest.raises(ValueError, match="^pack: expected a mapping name -> tensor, got list"):
        rc.pack([named["a"], named["b"]], manifest)
    with pytest.raises(ValueError, match="^pack: manifest must be a Manifest"):
        rc.pack(named, manifest.to_dict())


def test_empty_manifests(ext):
    for named in ({}, {"e": torch.empty(0, 3)}):
        manifest = plan_buckets(describe_tensors(named), 256, 16)
        buckets = rc.pack(named, manifest)
        assert [b.numel() for b in buckets] == list(manifest.bucket_sizes)
        assert list(_views(buckets, manifest)) == list(named)


# --- PackPlan: one bucket per call ---------------------------------------------------------------


@both_paths
def test_pack_bucket_matches_pack(ext, use_extension):
    gen = torch.Generator().manual_seed(31)
    named = _plan_named(gen)
    manifest = plan_buckets(describe_tensors(named), 512, 16)
    assert manifest.num_buckets > 3
    plan = rc.PackPlan(manifest, use_extension=use_extension)
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
            got = plan.pack_bucket(bucket_named, b, out=out)
            assert got.data_ptr() == out.data_ptr() and torch.equal(got, expected[b]), (step, b)
            assert bool((out[got.numel() :] == 0xCD).all()), "bytes past the bucket are left alone"
            assert torch.equal(plan.pack_bucket(bucket_named, b), expected[b])  # New bucket.
        # An optimizer-like in-place update: the next step packs the new values.
        with torch.no_grad():
            for t in named.values():
                if t.dtype.is_floating_point and t.numel() and t.stride() != (0, 1):
                    t.add_(1)


def test_pack_bucket_makes_one_native_call_per_bucket(ext, monkeypatch):
    calls = []

    class Spy:
        with_cuda = ext.with_cuda

        def refit_pack_bucket(self, bucket, tensors, offsets, num_threads, stream):
            calls.append((len(tensors), offsets, num_threads))
            return ext.refit_pack_bucket(bucket, tensors, offsets, num_threads, stream)

    monkeypatch.setattr(rc, "_ext", Spy())
    named = {"a": torch.ones(5), "b": torch.full((3,), 2.0), "c": torch.full((70,), 3.0)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    assert [e.bucket for e in manifest.tensors] == [0, 0, 1]
    plan = rc.PackPlan(manifest)
    got = [plan.pack_bucket(_gathered(named, manifest, b), b) for b in range(2)]
    assert calls == [(2, [0, 32], 0), (1, [0], 0)]
    for g, want in zip(got, rc.pack(named, manifest, use_extension=False), strict=True):
        assert torch.equal(g, want)


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
            r"PackPlan: tensor 'z': expected device cpu \(out's\), got meta",
        ),
    }


@both_paths
@pytest.mark.parametrize("case", list(_bucket_mismatch_cases()))
def test_pack_bucket_mismatch_names_the_tensor(ext, use_extension, case):
    named = {"a": torch.ones(5), "z": torch.full((3, 4), 9.0), "big": torch.ones(80)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    assert [e.bucket for e in manifest.tensors] == [0, 0, 1]
    plan = rc.PackPlan(manifest, use_extension=use_extension)
    change, pattern = _bucket_mismatch_cases()[case]
    bucket_named = {"a": named["a"], "z": named["z"]}
    change(bucket_named)
    out = torch.full((256,), 0xEE, dtype=torch.uint8)
    with pytest.raises(ValueError, match=pattern):
        plan.pack_bucket(bucket_named, 0, out=out)
    assert bool((out == 0xEE).all()), "nothing may be written when a check fails"


@both_paths
def test_pack_bucket_errors(ext, use_extension):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    plan = rc.PackPlan(manifest, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 1\), got 1"):
        plan.pack_bucket(named, 1)
    with pytest.raises(ValueError, match="expected a mapping name -> tensor, got list"):
        plan.pack_bucket([named["a"], named["b"]], 0)
    with pytest.raises(ValueError, match=r"expected device cpu \(tensor 'a''s\), got meta"):
        plan.pack_bucket({"a": named["a"], "b": torch.ones(2, 2, device="meta")}, 0)
    pattern = r"PackPlan.pack_bucket: out has 16 bytes but bucket 0 needs 48"
    with pytest.raises(ValueError, match=pattern):
        plan.pack_bucket(named, 0, out=torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned address"):
        plan.pack_bucket(named, 0, out=torch.empty(200, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        plan.pack_bucket(named, 0, out=torch.empty(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be a torch.Tensor, got list"):
        plan.pack_bucket(named, 0, out=[0] * 64)
    shared = torch.full((64,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="PackPlan: tensor 'a' shares memory with bucket 0"):
        plan.pack_bucket({"a": shared[:20].view(torch.float32), "b": named["b"]}, 0, out=shared)
    assert bool((shared[20:] == 7).all())
    # A strided tensor inside out (its bytes counted from its strides, not its element count).
    with pytest.raises(ValueError, match="PackPlan: tensor 'b' shares memory with bucket 0"):
        plan.pack_bucket(
            {"a": named["a"], "b": shared[16:32].view(torch.float32).view(2, 2).t()}, 0, out=shared
        )
    # Memory of the same storage outside the bucket's bytes is fine (exact byte ranges).
    storage = torch.zeros(256, dtype=torch.uint8)
    beside = {"a": storage[192:212].view(torch.float32).fill_(4.0), "b": named["b"]}
    bucket = plan.pack_bucket(beside, 0, out=storage[:128])
    assert torch.equal(bucket, rc.pack({"a": torch.full((5,), 4.0), "b": named["b"]}, manifest)[0])
    with pytest.raises(ValueError, match="PackPlan: manifest must be a Manifest"):
        rc.PackPlan(manifest.to_dict())


# --- bucket_views: the receiver ------------------------------------------------------------------


def test_bucket_views_are_views_into_the_bucket(ext):
    named = {"a": torch.arange(5, dtype=torch.float32), "b": torch.ones(2, 2, dtype=torch.int64)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    (bucket,) = rc.pack(named, manifest)
    views = rc.bucket_views(bucket, manifest, 0)
    assert list(views) == ["a", "b"]
    for name, entry in zip(views, manifest.tensors, strict=True):
        assert views[name].data_ptr() == bucket.data_ptr() + entry.offset
        assert views[name].dtype == entry.torch_dtype and tuple(views[name].shape) == entry.shape
    bucket.zero_()  # Views: they see the bucket's bytes change.
    assert torch.equal(views["a"], torch.zeros(5))


def test_bucket_views_errors(ext):
    named = {"a": torch.ones(5), "b": torch.ones(2, 2)}
    manifest = plan_buckets(describe_tensors(named), 256, 16)
    (bucket,) = rc.pack(named, manifest)
    with pytest.raises(ValueError, match=r"^bucket_views: bucket 0: expected 48 bytes"):
        rc.bucket_views(bucket[:32], manifest, 0)
    with pytest.raises(ValueError, match=r"^bucket_views: bucket 0: expected 48 bytes"):
        rc.bucket_views(torch.zeros(64, dtype=torch.uint8), manifest, 0)
    with pytest.raises(ValueError, match="1-D contiguous uint8 tensor, got float32"):
        rc.bucket_views(bucket.view(torch.float32), manifest, 0)
    with pytest.raises(ValueError, match="aligned address"):
        rc.bucket_views(torch.zeros(49, dtype=torch.uint8)[1:], manifest, 0)
    with pytest.raises(ValueError, match=r"bucket_index must be an int in \[0, 1\), got 1"):
        rc.bucket_views(bucket, manifest, 1)
    with pytest.raises(ValueError, match="^bucket_views: manifest must be a Manifest"):
        rc.bucket_views(bucket, manifest.to_dict(), 0)


# --- Raw binding ---------------------------------------------------------------------------------
# refit_pack_bucket's own checks, called directly (refit_copy validates before calling it).


def test_raw_binding_errors(ext):
    bucket = torch.zeros(64, dtype=torch.uint8)
    t = torch.ones(4, dtype=torch.int32)
    with pytest.raises(IndexError, match=r"span 0 covers bytes \[56, 56 \+ 16\)"):
        ext.refit_pack_bucket(bucket, [t], [56])
    with pytest.raises(ValueError, match="span 0 and span 1 overlap in the bucket"):
        ext.refit_pack_bucket(bucket, [t, t], [0, 8])
    with pytest.raises(ValueError, match="got 1 tensors but 2 offsets"):
        ext.refit_pack_bucket(bucket, [t], [0, 16])
    with pytest.raises(ValueError, match="overlaps the bucket"):
        ext.refit_pack_bucket(bucket, [bucket[8:24].view(torch.int32)], [32])
    with pytest.raises(TypeError):  # noconvert: a bucket is never silently copied.
        ext.refit_pack_bucket(torch.zeros(16, dtype=torch.int32), [t], [0])


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
    views = _views(cuda_buckets, manifest)
    for name, t in named_cpu.items():
        _assert_bit_equal(views[name].cpu(), t, name)


@requires_gpu
def test_cuda_side_stream(ext):
    if not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produced on the side stream right before the pack: the pack must run after it there.
        named = {
            "w": torch.arange(1 << 20, device="cuda", dtype=torch.float32).view(1024, 1024).t()
        }
        named["w"].mul_(3)
        manifest = plan_buckets(describe_tensors(named), 1 << 22, 256)
        (bucket,) = rc.pack(named, manifest)
        view = rc.bucket_views(bucket, manifest, 0)["w"].clone()
    torch.cuda.synchronize()
    _assert_bit_equal(view, named["w"].contiguous())


@requires_gpu
def test_cuda_without_cuda_build_falls_back(ext):
    if ext.with_cuda:
        pytest.skip("this build has CUDA; the fallback applies to CPU-only builds")
    named = {"w": torch.ones(3, device="cuda")}
    manifest = plan_buckets(describe_tensors(named), 256)
    with pytest.raises(RuntimeError, match="does not support cuda tensors"):
        rc.pack(named, manifest, use_extension=True)
    (bucket,) = rc.pack(named, manifest)  # Default: torch.
    _assert_bit_equal(rc.bucket_views(bucket, manifest, 0)["w"], named["w"])


@requires_gpu
@both_paths
def test_cuda_pack_bucket(ext, use_extension):
    if use_extension and not ext.with_cuda:
        pytest.skip("_dockyard_kernels was built without CUDA (build with --config=cuda)")
    gen = torch.Generator().manual_seed(13)
    named_cpu = _layouts(torch.bfloat16, gen)
    manifest = plan_buckets(describe_tensors(named_cpu), 1 << 12, 256)
    expected = rc.pack(named_cpu, manifest, use_extension=False)
    plan = rc.PackPlan(manifest, use_extension=use_extension)
    buffers = [
        torch.empty(manifest.max_bucket_size, dtype=torch.uint8, device="cuda") for _ in range(2)
    ]
    for b in range(manifest.num_buckets):
        # "Gathered" on the current stream right before the pack, then dropped.
        bucket_named = {e.name: named_cpu[e.name].cuda() for e in manifest.bucket_entries(b)}
        bucket = plan.pack_bucket(bucket_named, b, out=buffers[b % 2])
        assert bucket.is_cuda and torch.equal(bucket.cpu(), expected[b]), b
    cpu_named = {e.name: named_cpu[e.name] for e in manifest.bucket_entries(0)}
    with pytest.raises(ValueError, match=r"expected device cuda:0 \(out's\), got cpu"):
        plan.pack_bucket(cpu_named, 0, out=buffers[0])
