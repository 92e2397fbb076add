"""Benchmark: policy train-step throughput and peak memory on SmolLM2-135M, per backend.

    tools/bazel run //tests/benchmarks:policy_benchmark [-- --backends dtensor jax --steps 3]

For each backend (dtensor always; jax when `dockyard_rl.models.policy.jax_policy` exists) a fresh
subprocess builds the policy on `smollm2-135m-instruct` and runs `--warmup-steps` untimed then
`--steps` timed `train` calls on one fixed batch of `--batch-size` random sequences of
`--seq-len` tokens (every token after the first 8 is a response token; GRPO's clipped loss with
random advantages). Reported per backend:

- tokens/s: the median over timed steps of the tokens in the batch / the wall time of `train`
  (driver side: for dtensor it includes the Ray round trip and the batch transfer);
- peak memory over the timed steps, after setup: on CPU the resident set high-water mark
  (VmHWM, reset through /proc/self/clear_refs after the warm-up), summed over the dtensor ranks'
  processes, the process's own for jax (which runs in the driver); on GPU the peak device bytes
  (torch's max allocated for dtensor, summed over ranks; jax's peak_bytes_in_use).

The dtensor backend runs `--dtensor-dp-size` ranks (default 2, one per core of the 2-core CI
machine), jax `--jax-dp-size` devices (default 1: jax on CPU exposes one device, using every core).
This is a script that prints a table, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

BACKENDS = ("dtensor", "jax")


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(args: argparse.Namespace) -> dict:
    import torch

    from dockyard_rl.algorithms.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
    from dockyard_rl.models import zoo
    from dockyard_rl.models.policy.config import OptimizerConfig, PolicyConfig
    from dockyard_rl.models.policy.factory import create_policy

    backend = args.worker
    dp_size = args.dtensor_dp_size if backend == "dtensor" else args.jax_dp_size
    zoo.resolve_model(zoo.SMOLLM2_NAME)  # build outside the timed region
    cfg = PolicyConfig(backend=backend, model=zoo.SMOLLM2_NAME, dtype=args.dtype,
                       dp_size=dp_size, micro_batch_size=args.micro_batch_size,
                       optimizer=OptimizerConfig(learning_rate=1e-6))
    gen = torch.Generator().manual_seed(0)
    num_samples, width = args.batch_size, args.seq_len
    ids_BS = torch.randint(0, 49152, (num_samples, width), generator=gen)
    batch = BatchedDataDict(
        input_ids=ids_BS,
        input_lengths=torch.full((num_samples,), width),
        token_mask=(torch.arange(width)[None, :] >= 8).float().expand(num_samples, width).clone(),
        sample_mask=torch.ones(num_samples),
        advantages=torch.randn(num_samples, 1, generator=gen).expand(num_samples, width).clone(),
    )
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    if backend == "dtensor":
        from dockyard_rl.cluster.local_ray import init_local_ray

        init_local_ray(log_to_driver=False)
    start = time.perf_counter()
    policy = create_policy(cfg)
    setup_s = time.perf_counter() - start
    try:
        batch["prev_logprobs"] = policy.get_logprobs(batch)
        for _ in range(args.warmup_steps):
            policy.train(batch, loss_fn)
        if backend == "dtensor":
            policy.memory_stats(reset=True)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        step_seconds, losses = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            metrics = policy.train(batch, loss_fn)
            step_seconds.append(time.perf_counter() - start)
            losses.append(metrics["loss"])
        if backend == "dtensor":
            stats = policy.memory_stats()
            peak_bytes = sum(s.get("peak_device_bytes", s["peak_rss_bytes"]) for s in stats)
            memory_kind = "device" if "peak_device_bytes" in stats[0] else "RSS"
        else:
            import jax

            device = jax.devices()[0]
            if device.platform == "cpu":
                peak_bytes, memory_kind = _rss_bytes("VmHWM"), "RSS"
            else:
                peak_bytes = int(device.memory_stats().get("peak_bytes_in_use", 0))
                memory_kind = "device"
    finally:
        policy.shutdown()
    num_tokens = num_samples * width
    return {
        "backend": backend, "dp_size": dp_size, "setup_s": setup_s,
        "step_s": statistics.median(step_seconds),
        "tokens_per_s": num_tokens / statistics.median(step_seconds),
        "peak_gib": peak_bytes / 2**30, "memory_kind": memory_kind, "last_loss": losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                        help="default: dtensor, plus jax when its module exists")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtensor-dp-size", type=int, default=2)
    parser.add_argument("--jax-dp-size", type=int, default=1)
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return
    backends = args.backends or [
        b for b in BACKENDS
        if b == "dtensor" or importlib.util.find_spec(f"dockyard_rl.models.policy.{b}_policy")]
    passthrough = [a for a in sys.argv[1:]]
    print(f"SmolLM2-135M train step, batch {args.batch_size} x {args.seq_len} tokens, "
          f"microbatch {args.micro_batch_size}, {args.dtype}, {args.steps} timed steps "
          f"after {args.warmup_steps} warm-up")
    print(f"{'backend':<9} {'dp':>3} {'setup s':>8} {'step s':>8} {'tokens/s':>10} "
          f"{'peak GiB':>9} {'memory':>7}")
    for backend in backends:
        cmd = [sys.executable, __file__, *passthrough, "--worker", backend]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{backend:<9} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"{backend:<9} {r['dp_size']:>3} {r['setup_s']:>8.1f} {r['step_s']:>8.2f} "
              f"{r['tokens_per_s']:>10.1f} {r['peak_gib']:>9.2f} {r['memory_kind']:>7}")


if __name__ == "__main__":
    main()
