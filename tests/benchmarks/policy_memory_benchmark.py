"""Benchmark: per-rank peak memory of the DTensor policy's model load and checkpoint save, at
several dp sizes, against the earlier full-load / full-gather code measured in the same run.

    tools/bazel run //tests/benchmarks:policy_memory_benchmark [-- --dp-sizes 1 2 4]

A random float32 Llama (~150 MB with the defaults; `--hidden-size`, `--num-layers`) is written
to a temporary directory as a HF checkpoint sharded into files of 60 MB. For each dp size,
`memory_probe.probe` (python/dockyard_rl/models/policy/memory_probe.py) starts that many
spawned gloo ranks and reports each rank's resident-set peak growth (VmHWM) over one operation,
printed as a fraction of the model's float32 weights (a rank holding its 1/dp shard reads ~1/dp):

- load: meta device + `fully_shard` + each rank reading its own rows (the worker's code);
  full load: `from_pretrained` in float32 on every rank, then `fully_shard` (the earlier code);
- save: the sharded DCP resume state (weights + AdamW state); export: the streamed HF export;
  full save: full weights and optimizer state gathered to rank 0's CPU and written there (the
  earlier code).

The max over ranks is printed (for the full save that is rank 0, which receives the gathers).
This is a script that prints a table, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

from dockyard_rl.models.policy import memory_probe

COLUMNS = ("load", "load_full", "save", "export", "save_full")
HEADERS = ("load", "full load", "save (DCP)", "HF export", "full save")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="policy_memory_") as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        full_bytes = memory_probe.build_random_llama(
            model_dir,
            hidden_size=args.hidden_size,
            intermediate_size=args.hidden_size * 11 // 4,
            num_layers=args.num_layers,
            max_shard_size="60MB",
        )
        print(f"model: {full_bytes / 2**20:.0f} MiB of float32 weights")
        print("per-rank peak resident growth / model weights (max over ranks)")
        print(f"{'dp':>3} {'1/dp':>6} " + " ".join(f"{h:>11}" for h in HEADERS))
        for dp in args.dp_sizes:
            row = []
            for operation in COLUMNS:
                out_dir = pathlib.Path(tmp) / f"{operation}_{dp}"
                growth = memory_probe.probe(model_dir, out_dir, dp, operation)
                row.append(max(growth) / full_bytes)
            print(f"{dp:>3} {1 / dp:>6.3f} " + " ".join(f"{r:>11.3f}" for r in row), flush=True)


if __name__ == "__main__":
    main()
