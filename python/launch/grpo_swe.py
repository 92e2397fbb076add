"""grpo_swe: trains a policy with GRPO on SWE tasks from one YAML recipe.

    tools/bazel run //python/launch:grpo_swe -- --config configs/smoke_cpu.yaml [a.b.c=value ...]
    tools/bazel run //python/launch:grpo_swe -- --config configs/X.yaml --dry-run
    tools/bazel run //python/launch:grpo_swe -- --help          # every section and key, defaults

`--config` is resolved against the directory the command was typed in (`bazel run` starts the
binary elsewhere; utils/paths.caller_path); relative paths inside the recipe against the
workspace root (algorithms/grpo_config.py). `a.b.c=value` overrides one key (value: YAML).
`--dry-run` validates the recipe and prints the resolved config as YAML, starting nothing: no Ray,
no model, no engine, no file written. Otherwise `dockyard_rl.algorithms.grpo.run(config)` trains.

Exit status: 0 on success; 2 for a bad command line or config (one line on stderr naming the file
and the key); otherwise what the training run returns or raises.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from dockyard_rl.algorithms.grpo_config import config_to_yaml, describe_config, load_config
from dockyard_rl.utils.config_loading import ConfigError
from dockyard_rl.utils.paths import caller_path

PROG = "grpo_swe"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog=describe_config(),
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="RECIPE.yaml",
        help="the recipe, e.g. configs/smoke_cpu.yaml",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe and print the resolved config; start nothing",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a key of the recipe, e.g. grpo.max_num_steps=10",
    )
    return parser


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(caller_path(args.config), args.overrides)
    except ConfigError as error:
        print(f"{PROG}: config error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(
            f"# {PROG}: resolved config of {args.config}"
            + (f" with {' '.join(args.overrides)}" if args.overrides else "")
        )
        print(config_to_yaml(config), end="")
        print(f"{PROG}: config OK (dry run: nothing started)", file=sys.stderr)
        return 0
    # Progress, per-step prompts, checkpoints and warnings of the run go to stderr.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("aiohttp.access", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Shared memory that killed runs left in /dev/shm (utils/shared_memory.py: only dead owners').
    from dockyard_rl.utils import shared_memory

    shared_memory.reclaim_stale_segments()
    # Imported here: the loop pulls in Ray, torch and vLLM, which --help and --dry-run never need.
    from dockyard_rl.algorithms import grpo

    # SIGTERM (kill, a scheduler's preemption) unwinds like Ctrl-C, so `finally` blocks and exit
    # handlers run: from the start, where set-up (task synthesis with its executor, the model
    # build) runs before Ray; `ray.init` then installs a handler of its own that does the same
    # (sys.exit) for as long as Ray is up. Python's default would end the process at once.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = grpo.run(config)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    sys.exit(main())
