"""Benchmark: refit packer bandwidth on a SmolLM2-135M-size parameter set, against memcpy.

    tools/bazel run //tests/benchmarks:refit_packer_benchmark [-- --device cuda --bucket-mb 64]
    tools/bazel run //tests/benchmarks:refit_packer_benchmark -- --shrink 64   # per-call overhead

The parameter set has SmolLM2-135M's real shapes (hidden 576, 30 layers, 9 query heads and 3 KV
heads of dim 64, MLP intermediate 1536, vocabulary 49152, tied embeddings: no lm_head), as
separate tensors like a model's, ~134.5M parameters; measured in float32 and bfloat16.
``--shrink N`` divides every dim by N (rounded up): the same 272 tensors, a few hundred KB in all,
so that the rows measure per-call host overhead (validation, conversions, native calls) rather
than bandwidth.

Rows, each the median over the repeats (after one warm-up), in GB/s of parameter bytes moved:

- ``memcpy (1 buffer)``: ``dst.copy_(src)`` of ONE buffer of the same total bytes into a
  preallocated one: the physical limit on this machine, measured in the same run.
- ``torch.cat baseline``: the per-tensor flatten + ``torch.cat(..., out=)`` of every tensor's
  bytes into one preallocated buffer (what a packer without buckets would do).
- ``pack plan``: ``PackPlan.pack(out=...)`` into preallocated buckets: every bucket in one native
  call (ONE kernel launch on CUDA); the plan is built once, outside the timing, as a sender does.
- ``iter_pack plan``: ``PackPlan.iter_pack`` into two reused bucket buffers (double buffering):
  one native call per bucket.
- ``iter_pack ext`` / ``iter_pack torch``: the functional ``iter_pack`` (validates and converts
  every tensor on every call), with the C++/CUDA extension or the plain-torch path.
- ``pack_bucket ext``: the functional ``pack_bucket`` once per bucket, each call given only that
  bucket's tensors, into two reused buffers (what a sender that gathers one bucket at a time does).
- ``pack_bucket_from plan``: the same with ``PackPlan.from_manifest(manifest)`` built once and
  ``plan.pack_bucket_from(bucket_tensors, b, out)`` per bucket (every bucket's tensors validated
  per call, one native call per bucket).
- ``unpack_into plan``: ``UnpackPlan.unpack_into`` of every bucket into preallocated destinations
  (one native call).
- ``unpack_into ext`` / ``unpack_into torch``: the functional ``unpack_into``.
- ``unpack (new) ext``: every bucket into new tensors (includes their allocation).

``call ms`` is the host time until the call returns (on CUDA the copies are asynchronous, so this
is the per-call overhead: validation, launches); ``ms`` includes waiting for the device.
``vs memcpy`` is the row's bandwidth over the memcpy row's (the target for pack is >= 50%).
Every run checks the round trips (functional and plan) byte for byte once. This is a script that
prints a table, not a test: nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dockyard_rl.kernels import _extension
from dockyard_rl.kernels import refit_packer as rp

# SmolLM2-135M (HF LlamaForCausalLM config).
HIDDEN = 576
NUM_LAYERS = 30
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = HIDDEN // NUM_HEADS  # 64
INTERMEDIATE = 1536
VOCAB = 49152


def smollm2_135m_shapes(shrink: int = 1) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of SmolLM2-135M (tied embeddings: no lm_head.weight).

    ``shrink``: every dim divided by it, rounded up (1 = the real shapes).
    """
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    kv = NUM_KV_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (NUM_HEADS * HEAD_DIM, HIDDEN)
        shapes[p + "self_attn.k_proj.weight"] = (kv, HIDDEN)
        shapes[p + "self_attn.v_proj.weight"] = (kv, HIDDEN)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, NUM_HEADS * HEAD_DIM)
        shapes[p + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    return {name: tuple(-(-d // shrink) for d in shape) for name, shape in shapes.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median (host seconds until fn returns, seconds until the device is done)."""
    fn()  # Warm-up (first-touch page faults, CUDA context, allocator caches).
    _sync(device)
    call_times, times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        call_times.append(time.perf_counter() - start)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(call_times), statistics.median(times)


def run(
    dtype: torch.dtype, device: torch.device, bucket_bytes: int, repeats: int, shrink: int
) -> tuple:
    gen = torch.Generator().manual_seed(0)
    named = {
        name: torch.randn(shape, generator=gen).to(dtype).to(device)
        for name, shape in smollm2_135m_shapes(shrink).items()
    }
    manifest = rp.plan_buckets(rp.describe_tensors(named), bucket_bytes)
    total = sum(t.numel() * t.element_size() for t in named.values())
    tensors = list(named.values())

    src = torch.empty(total, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    cat_out = torch.empty(total, dtype=torch.uint8, device=device)

    def new_bucket(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=device)

    buffers = [new_bucket(manifest.max_bucket_size) for _ in range(2)]
    bucket_outs = [new_bucket(size) for size in manifest.bucket_sizes]
    packed = rp.pack(named, manifest)
    dests = {k: torch.empty_like(v) for k, v in named.items()}

    def drain(iterator) -> None:
        for _ in iterator:
            pass

    ops = {
        "memcpy (1 buffer)": lambda: dst.copy_(src),
        "torch.cat baseline": lambda: torch.cat(
            [t.reshape(-1).view(torch.uint8) for t in tensors], out=cat_out
        ),
    }
    ext_supports_device = _extension.supports_device(_extension.EXTENSION, device)
    plan_kind = "ext" if ext_supports_device else "torch"
    # Built once, as a sender / receiver does; falls back to torch without the extension.
    pack_plan = rp.PackPlan(named, manifest)
    unpack_plan = rp.UnpackPlan(manifest, dests)
    ops[f"pack plan {plan_kind}"] = lambda: pack_plan.pack(out=bucket_outs)
    ops[f"iter_pack plan {plan_kind}"] = lambda: drain(pack_plan.iter_pack(buffers))
    if ext_supports_device:
        ops["iter_pack ext"] = lambda: drain(
            rp.iter_pack(named, manifest, buffers, use_extension=True)
        )
    ops["iter_pack torch"] = lambda: drain(
        rp.iter_pack(named, manifest, buffers, use_extension=False)
    )
    per_bucket = [
        {e.name: named[e.name] for e in manifest.bucket_entries(b)}
        for b in range(manifest.num_buckets)
    ]
    if ext_supports_device:
        ops["pack_bucket ext"] = lambda: [
            rp.pack_bucket(per_bucket[b], manifest, b, out=buffers[b % 2], use_extension=True)
            for b in range(manifest.num_buckets)
        ]
    lazy_plan = rp.PackPlan.from_manifest(manifest, device=device)
    ops[f"pack_bucket_from plan {plan_kind}"] = lambda: [
        lazy_plan.pack_bucket_from(per_bucket[b], b, out=buffers[b % 2])
        for b in range(manifest.num_buckets)
    ]
    ops[f"unpack_into plan {plan_kind}"] = lambda: unpack_plan.unpack_into(packed)
    if ext_supports_device:
        ops["unpack_into ext"] = lambda: rp.unpack_into(packed, manifest, dests, use_extension=True)
    ops["unpack_into torch"] = lambda: rp.unpack_into(packed, manifest, dests, use_extension=False)
    if ext_supports_device:
        ops["unpack (new) ext"] = lambda: rp.unpack(packed, manifest, use_extension=True)
    seconds = {name: _median_seconds(fn, device, repeats) for name, fn in ops.items()}

    # Correctness once: the functional extension path and the plans both round-trip exactly.
    def exact() -> bool:
        _sync(device)
        return all(
            torch.equal(dests[k].view(torch.uint8), v.view(torch.uint8)) for k, v in named.items()
        )

    rp.unpack_into(rp.pack(named, manifest), manifest, dests)
    functional_exact = exact()
    for d in dests.values():
        d.zero_()
    unpack_plan.unpack_into(pack_plan.pack())
    plan_exact = exact()
    assert pack_plan.num_rebuilds == 0 and unpack_plan.num_rebuilds == 0
    memcpy_gbps = total / seconds["memcpy (1 buffer)"][1] / 1e9
    rows = []
    for name, (call_s, s) in seconds.items():
        gbps = total / s / 1e9
        dtype_name = str(dtype).removeprefix("torch.")
        rows.append((dtype_name, name, call_s * 1e3, s * 1e3, gbps, gbps / memcpy_gbps))
    return rows, total, manifest.num_buckets, functional_exact and plan_exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--shrink", type=int, default=1, help="divide every dim by this (per-call overhead)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"device={device} extension={rp.HAS_EXTENSION} "
        f"cpu_threads={torch.get_num_threads()} bucket={args.bucket_mb} MiB repeats={args.repeats} "
        f"shrink={args.shrink}"
    )
    header = (
        f"{'dtype':<9} {'operation':<26} {'call ms':>8} {'ms':>8} {'GB/s':>8} {'vs memcpy':>10}"
    )
    for dtype_name in args.dtypes:
        dtype = rp.DTYPES[dtype_name]
        rows, total, num_buckets, exact = run(
            dtype, device, args.bucket_mb << 20, args.repeats, args.shrink
        )
        print(
            f"\n{dtype_name}: {total / 1e6:.3f} MB in {len(smollm2_135m_shapes())} tensors, "
            f"{num_buckets} buckets; round trip bit-exact: {exact}"
        )
        print(header)
        print("-" * len(header))
        for dt, name, call_ms, ms, gbps, ratio in rows:
            print(f"{dt:<9} {name:<26} {call_ms:>8.3f} {ms:>8.3f} {gbps:>8.2f} {ratio:>9.0%}")


if __name__ == "__main__":
    main()
