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
- ``pack_bucket ext`` / ``pack_bucket torch``: what every sender does (weight_sync's
  sender_sessions): ``PackPlan(manifest)`` built once, outside the timing, then
  ``plan.pack_bucket(bucket_tensors, b, out)`` per bucket into two reused buffers (double
  buffering; every bucket's tensors validated per call, one copy per bucket), with the C++/CUDA
  extension or the plain-torch path.
- ``pack (new) ext``: the one-off ``pack`` of every bucket into new tensors (includes their
  allocation).

``call ms`` is the host time until the call returns (on CUDA the copies are asynchronous, so this
is the per-call overhead: validation, launches); ``ms`` includes waiting for the device.
``vs memcpy`` is the row's bandwidth over the memcpy row's (the target for pack is >= 50%).
Every run checks the round trip (packed buckets read back through ``bucket_views``) byte for byte
once. This is a script that prints a table, not a test: nothing is asserted about speed.
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
    per_bucket = [
        {e.name: named[e.name] for e in manifest.bucket_entries(b)}
        for b in range(manifest.num_buckets)
    ]

    def pack_buckets(plan: rp.PackPlan) -> list[torch.Tensor]:
        return [
            plan.pack_bucket(per_bucket[b], b, out=buffers[b % 2])
            for b in range(manifest.num_buckets)
        ]

    ops = {
        "memcpy (1 buffer)": lambda: dst.copy_(src),
        "torch.cat baseline": lambda: torch.cat(
            [t.reshape(-1).view(torch.uint8) for t in tensors], out=cat_out
        ),
    }
    ext_supports_device = _extension.supports_device(_extension.EXTENSION, device)
    # Built once, as a sender does.
    if ext_supports_device:
        ext_plan = rp.PackPlan(manifest, use_extension=True)
        ops["pack_bucket ext"] = lambda: pack_buckets(ext_plan)
    torch_plan = rp.PackPlan(manifest, use_extension=False)
    ops["pack_bucket torch"] = lambda: pack_buckets(torch_plan)
    if ext_supports_device:
        ops["pack (new) ext"] = lambda: rp.pack(named, manifest, use_extension=True)
    seconds = {name: _median_seconds(fn, device, repeats) for name, fn in ops.items()}

    # Correctness once: both paths' buckets read back bit for bit (pack_bucket writes into the
    # two shared buffers, so each bucket is read before the next call reuses its buffer).
    def exact(plan: rp.PackPlan) -> bool:
        same = True
        for b in range(manifest.num_buckets):
            bucket = plan.pack_bucket(per_bucket[b], b, out=buffers[b % 2])
            _sync(device)
            for name, view in rp.bucket_views(bucket, manifest, b).items():
                same &= torch.equal(view.view(torch.uint8), named[name].view(torch.uint8))
        return same

    plans = [torch_plan] + ([ext_plan] if ext_supports_device else [])
    round_trip_exact = all(exact(plan) for plan in plans)
    memcpy_gbps = total / seconds["memcpy (1 buffer)"][1] / 1e9
    rows = []
    for name, (call_s, s) in seconds.items():
        gbps = total / s / 1e9
        dtype_name = str(dtype).removeprefix("torch.")
        rows.append((dtype_name, name, call_s * 1e3, s * 1e3, gbps, gbps / memcpy_gbps))
    return rows, total, manifest.num_buckets, round_trip_exact


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
