"""Benchmark: fused log-prob gather vs torch eager, forward + backward.

    tools/bazel run //tests/benchmarks:logprobs_benchmark \\
        [-- --device cuda --dtypes float32 bfloat16]

For N tokens and a vocabulary V, both variants compute ``sum(log_softmax(logits)[target])``
and its gradient w.r.t. the logits:

- torch eager: ``torch.log_softmax(logits.float(), -1).gather(-1, targets)`` then
  ``.backward()`` (torch keeps the (N, V) log-softmax for backward and creates more (N, V)
  temporaries in it);
- fused: ``dockyard_rl.kernels.logprobs.gather_logprobs`` (the C++/CUDA extension).

Each (variant, V, dtype) runs in a fresh subprocess, so that one variant's allocations do
not hide the other's peak. Reported per variant: the median time of a forward + backward
over the repeats (after warm-ups), and the peak extra memory during them,
over what was allocated before (the logits and targets): on CPU the process's resident
set high-water mark (VmHWM, reset through /proc/self/clear_refs before each run; torch's
CPU allocations are invisible to tracemalloc), on CUDA ``torch.cuda.max_memory_allocated``.
Both include the (N, V) gradient that autograd returns. The last column checks that the
two variants agree (relative difference of the summed logprobs).

Timing: on CPU, wall time of each step. On CUDA, CUDA events recorded on the current
stream around each step (GPU time from the step's first queued work to its last,
including any gap where the GPU waits for Python), with 20 repeats by default: one step
takes about a millisecond there, so single host-timed runs would be noise. The column
"fused GB/s" is the fused step's minimum traffic (the logits read by the forward and by
the backward, the gradient written once) over its time, to compare with the device's
memory bandwidth.

This is a script that prints a table, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dockyard_rl.utils import process_memory

VARIANTS = ("torch", "fused")


def _rss_bytes(field: str) -> int:
    value = process_memory.status_bytes(field)
    if value is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return value


def _worker(
    variant: str, num_tokens: int, vocab_size: int, dtype_name: str, device: str, repeats: int
) -> dict:
    import torch

    from dockyard_rl.kernels.logprobs import gather_logprobs

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(0)
    logits_NV = (
        torch.randn(num_tokens, vocab_size, generator=gen, device=device, dtype=torch.float32)
        .mul_(3)
        .to(dtype)
        .requires_grad_()
    )
    targets_N = torch.randint(0, vocab_size, (num_tokens,), generator=gen, device=device)

    def step():
        logits_NV.grad = None
        if variant == "torch":
            logp_NV = torch.log_softmax(logits_NV.float(), dim=-1)
            lp_N = logp_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
        else:
            lp_N = gather_logprobs(logits_NV, targets_N, use_extension=True)
        total = lp_N.sum()
        total.backward()
        return total.detach()  # Read after the timing: float() here would synchronize.

    cuda = device == "cuda"
    for _ in range(3 if cuda else 1):  # Warm-up (page faults, CUDA context, kernel loads).
        step()
    logits_NV.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        if not process_memory.reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS through /proc/self/clear_refs")
        before = _rss_bytes("VmRSS")
    times, total = [], None
    if cuda:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            start.record()
            total = step()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1000 for start, end in events]
    else:
        for _ in range(repeats):
            start = time.perf_counter()
            total = step()
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM")
    # Minimum traffic of the fused step: the logits read twice, the gradient written once.
    step_bytes = 3 * logits_NV.numel() * logits_NV.element_size()
    seconds = statistics.median(times)
    return {
        "seconds": seconds,
        "peak_extra_bytes": peak - before,
        "logprob_sum": float(total),
        "gbps": step_bytes / seconds / 1e9,
    }


def _run_variant(args, variant: str, vocab_size: int, dtype: str) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--num-tokens",
        str(args.num_tokens),
        "--vocab-sizes",
        str(vocab_size),
        "--dtypes",
        dtype,
        "--device",
        args.device,
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} V={vocab_size} {dtype} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument(
        "--vocab-sizes",
        type=int,
        nargs="+",
        default=[49152, 151936],
        help="SmolLM2's and Qwen2.5's vocabularies by default",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16"))
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per variant (default: 2 on CPU, 20 on CUDA)",
    )
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.repeats is None:
        args.repeats = 20 if args.device == "cuda" else 2
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.worker:
        result = _worker(
            args.worker,
            args.num_tokens,
            args.vocab_sizes[0],
            args.dtypes[0],
            args.device,
            args.repeats,
        )
        print(json.dumps(result))
        return

    print(
        f"fused log-prob gather vs torch eager, forward + backward, N = {args.num_tokens} "
        f"tokens, device {args.device}, median of {args.repeats}"
        + (" (CUDA events)" if args.device == "cuda" else "")
    )
    header = (
        f"{'V':>7} {'dtype':>8} | {'torch ms':>8} {'fused ms':>8} {'speedup':>7} "
        f"{'fused GB/s':>10} | {'torch MiB':>9} {'fused MiB':>9} {'mem ratio':>9} | "
        f"{'rel diff':>8}"
    )
    print(header)
    print("-" * len(header))
    for dtype in args.dtypes:
        for vocab_size in args.vocab_sizes:
            res = {v: _run_variant(args, v, vocab_size, dtype) for v in VARIANTS}
            t, f = res["torch"], res["fused"]
            mib = 1024 * 1024
            rel = abs(t["logprob_sum"] - f["logprob_sum"]) / max(1.0, abs(t["logprob_sum"]))
            print(
                f"{vocab_size:>7} {dtype:>8} | {t['seconds'] * 1e3:>8.3f} "
                f"{f['seconds'] * 1e3:>8.3f} {t['seconds'] / f['seconds']:>6.2f}x "
                f"{f['gbps']:>10.1f} | "
                f"{t['peak_extra_bytes'] / mib:>9.0f} {f['peak_extra_bytes'] / mib:>9.0f} "
                f"{t['peak_extra_bytes'] / max(1, f['peak_extra_bytes']):>8.2f}x | "
                f"{rel:>8.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
