"""Benchmark: policy train-step throughput and peak memory on SmolLM2-135M, per backend.

    tools/bazel run //tests/benchmarks:policy_benchmark [-- --backends dtensor jax --steps 3]

For each backend (dtensor always; jax when `dockyard_rl.models.policy.jax_policy` exists) a fresh
subprocess builds the policy on `smollm2-135m-instruct` and runs `--warmup-steps` untimed then
`--steps` timed `train` calls on one fixed batch of `--batch-size` random sequences of
`--seq-len` tokens (every token after the first 8 is a response token; GRPO's clipped loss with
random advantages). Reported per backend:

- tokens/s: the median over timed steps of the tokens in the batch / the wall time of `train`
  (driver side: it includes the Ray round trip and the batch transfer to the trainer actors);
- peak memory over the timed steps, after setup: on CPU the resident set high-water mark
  (VmHWM, reset through /proc/self/clear_refs after the warm-up), summed over the dtensor ranks'
  processes, the jax actor's for jax (models/policy/jax_fleet.py); on GPU the peak device bytes
  (torch's max allocated for dtensor, summed over ranks; jax's peak_bytes_in_use);
- x eager: the backend's step time over a plain eager torch step on the same batch (the median
  over timed steps of the ratio). The baseline is one process of transformers + torch, no Ray,
  no FSDP: `log_softmax` + `gather` log-probs, the same loss, microbatches, gradient clipping and
  AdamW, on every core (`torch.set_num_threads(os.cpu_count())`), in float32 (autocast to
  bfloat16 with `--dtype bfloat16`). It runs in its own process, started before the backend, and
  takes one step right before or after each of the backend's (alternating), so that both see the
  same load on a shared machine: compare this column, not absolute times, across runs.
  `--no-eager-baseline` skips it.

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


def _make_batch(args: argparse.Namespace):
    """The benchmark's fixed batch (without prev_logprobs) and its loss function."""
    import torch

    from dockyard_rl.distributed.batched_data_dict import BatchedDataDict
    from dockyard_rl.losses.loss_functions import ClippedPGLossConfig, ClippedPGLossFn

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
    return batch, ClippedPGLossFn(ClippedPGLossConfig())


def _eager_worker(args: argparse.Namespace) -> None:
    """The eager baseline's process: prints READY, then one step per "step" line on stdin,
    answering "STEP <seconds>". Every sequence of the batch is full length (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dockyard_rl.losses.loss_functions import count_valid
    from dockyard_rl.models import zoo
    from dockyard_rl.models.policy.config import OptimizerConfig

    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, loss_fn = _make_batch(args)
    model = AutoModelForCausalLM.from_pretrained(
        zoo.resolve_model(zoo.SMOLLM2_NAME), dtype=torch.float32
    ).to(device)
    opt = OptimizerConfig(learning_rate=1e-6)  # the benchmark's policy optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=opt.learning_rate,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def logprobs(ids_BS: torch.Tensor) -> torch.Tensor:
        # log p(ids[t] | ids[:t]) at column t (0 in column 0): the policies' alignment.
        with autocast:
            logits_BSV = model(input_ids=ids_BS, use_cache=False).logits
        next_BS = (
            torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
            .gather(-1, ids_BS[:, 1:, None])
            .squeeze(-1)
        )
        return torch.nn.functional.pad(next_BS, (1, 0))

    with torch.no_grad():
        batch["prev_logprobs"] = logprobs(batch["input_ids"].to(device)).cpu()
    counts = count_valid(batch)

    def step() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for mb in batch.make_microbatch_iterator(args.micro_batch_size, allow_partial=True):
            mb = mb.to(device) if device.type != "cpu" else mb
            loss, _ = loss_fn(logprobs(mb["input_ids"]), mb, *counts)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup_steps):
        step()
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        step()
        print(f"STEP {time.perf_counter() - start}", flush=True)


class _EagerBaseline:
    """The eager baseline's process, stepped on demand (see `_eager_worker`)."""

    def __init__(self, args: argparse.Namespace):
        # The backend worker's own arguments; the last --worker wins.
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--worker", "eager"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        self._expect("READY")

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(word):
                return line
        raise RuntimeError(f"the eager baseline exited (code {self.proc.wait()})")

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self._expect("STEP ").split()[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def _worker(args: argparse.Namespace) -> dict:

    from dockyard_rl.models import zoo
    from dockyard_rl.models.policy.config import OptimizerConfig, PolicyConfig
    from dockyard_rl.models.policy.factory import create_policy

    backend = args.worker
    dp_size = args.dtensor_dp_size if backend == "dtensor" else args.jax_dp_size
    zoo.resolve_model(zoo.SMOLLM2_NAME)  # build outside the timed region
    cfg = PolicyConfig(
        backend=backend,
        model=zoo.SMOLLM2_NAME,
        dtype=args.dtype,
        dp_size=dp_size,
        micro_batch_size=args.micro_batch_size,
        optimizer=OptimizerConfig(learning_rate=1e-6),
    )
    batch, loss_fn = _make_batch(args)
    num_samples, width = args.batch_size, args.seq_len
    # Started (and warmed up) first, so that it does not share the machine with the setup.
    eager = _EagerBaseline(args) if args.eager_baseline else None
    from dockyard_rl.cluster.local_ray import init_local_ray

    init_local_ray(log_to_driver=False)  # both backends run as trainer-fleet actors
    start = time.perf_counter()
    try:
        policy = create_policy(cfg)
    except BaseException:
        if eager is not None:
            eager.close()
        raise
    setup_s = time.perf_counter() - start
    eager_seconds = []
    try:
        batch["prev_logprobs"] = policy.get_logprobs(batch)
        for _ in range(args.warmup_steps):
            policy.train(batch, loss_fn)
        policy.memory_stats(reset=True)  # the actors' (dtensor ranks, the jax actor)
        step_seconds, losses = [], []
        for index in range(args.steps):
            if eager is not None and index % 2 == 0:
                eager_seconds.append(eager.step())
            start = time.perf_counter()
            metrics = policy.train(batch, loss_fn)
            step_seconds.append(time.perf_counter() - start)
            losses.append(metrics["loss"])
            if eager is not None and index % 2 == 1:
                eager_seconds.append(eager.step())
        stats = policy.memory_stats()
        peak_bytes = sum(s.get("peak_device_bytes", s["peak_rss_bytes"]) for s in stats)
        memory_kind = "device" if "peak_device_bytes" in stats[0] else "RSS"
    finally:
        policy.shutdown()
        if eager is not None:
            eager.close()
    num_tokens = num_samples * width
    return {
        "backend": backend,
        "dp_size": dp_size,
        "setup_s": setup_s,
        "step_s": statistics.median(step_seconds),
        "tokens_per_s": num_tokens / statistics.median(step_seconds),
        "peak_gib": peak_bytes / 2**30,
        "memory_kind": memory_kind,
        "last_loss": losses[-1],
        "eager_tokens_per_s": num_tokens / statistics.median(eager_seconds)
        if eager_seconds
        else None,
        # Each backend step against the eager step taken right next to it.
        "x_eager": statistics.median(s / e for s, e in zip(step_seconds, eager_seconds))
        if eager_seconds
        else None,
        "step_seconds": step_seconds,
        "eager_seconds": eager_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=None,
        help="default: dtensor, plus jax when its module exists",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtensor-dp-size", type=int, default=2)
    parser.add_argument("--jax-dp-size", type=int, default=1)
    parser.add_argument(
        "--eager-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="step a plain eager torch baseline beside each backend and print "
        "the backend's step time over it ('x eager')",
    )
    parser.add_argument("--verbose", action="store_true", help="print every step's time")
    parser.add_argument("--worker", choices=(*BACKENDS, "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "eager":
        _eager_worker(args)
        return
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return
    backends = args.backends or [
        b
        for b in BACKENDS
        if b == "dtensor" or importlib.util.find_spec(f"dockyard_rl.models.policy.{b}_policy")
    ]
    passthrough = [a for a in sys.argv[1:]]
    print(
        f"SmolLM2-135M train step, batch {args.batch_size} x {args.seq_len} tokens, "
        f"microbatch {args.micro_batch_size}, {args.dtype}, {args.steps} timed steps "
        f"after {args.warmup_steps} warm-up"
    )
    print(
        f"{'backend':<9} {'dp':>3} {'setup s':>8} {'step s':>8} {'tokens/s':>10} "
        f"{'peak GiB':>9} {'memory':>7} {'eager tok/s':>12} {'x eager':>8}"
    )
    for backend in backends:
        cmd = [sys.executable, __file__, *passthrough, "--worker", backend]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{backend:<9} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][len("RESULT ") :])
        baseline = (
            f" {r['eager_tokens_per_s']:>12.1f} {r['x_eager']:>8.2f}"
            if r["x_eager"] is not None
            else ""
        )
        print(
            f"{backend:<9} {r['dp_size']:>3} {r['setup_s']:>8.1f} {r['step_s']:>8.2f} "
            f"{r['tokens_per_s']:>10.1f} {r['peak_gib']:>9.2f} {r['memory_kind']:>7}"
            f"{baseline}"
        )
        if args.verbose:
            print(
                f"  step s: {[round(t, 2) for t in r['step_seconds']]}, eager step s: "
                f"{[round(t, 2) for t in r['eager_seconds']]}"
            )


if __name__ == "__main__":
    main()
