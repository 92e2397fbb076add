"""Per-sample generation seeds that a resumed run derives again: `sample_seed`.

    seed = sample_seed(run_seed, "train", prompt_key, instance_id, sample_index, turn=0)

The GRPO loops give every sample its own vLLM seed (`SamplingParams.seed`), derived from what a
resumed run reproduces exactly:

- `run_seed`: `grpo.seed`.
- `purpose`: "train" or "val" (a validation sample never shares a training sample's seed).
- `prompt_key`: training: the prompt's draw index, its position in the prompt sampler's stream
  (`PromptSampler.num_consumed` before it was handed out: epoch * num_prompts + position), the
  same in sync and async mode and restored by a checkpoint's sampler state; async GRPO carries it
  with a prompt that is generated again (in flight at a checkpoint, or dropped as stale).
  Validation: the task's index in the validation list (the same tasks every validation).
- `instance_id`: the task (guards against a different data set behind the same indices).
- `sample_index`: 0 .. num_generations_per_prompt - 1. `turn`: the episode's turn (0 for a
  single-shot sample; algorithms/agent_rollouts.py seeds turn t of an episode with t).

The hash is BLAKE2b over a canonical JSON encoding of the parts, not Python's `hash()` (salted per
process for strings), so every process and every Python version derives the same seed. The seed
is < 2**63 (vLLM passes it to `torch.Generator.manual_seed`, and it travels as an int64).
"""

from __future__ import annotations

import hashlib
import json

from dockyard_rl.utils.config import is_int

PURPOSES = ("train", "val")
_DOMAIN = "dockyard_rl.sample_seed/v1"


def sample_seed(
    run_seed: int,
    purpose: str,
    prompt_key: int,
    instance_id: str,
    sample_index: int,
    turn: int = 0,
) -> int:
    """The generation seed of one sample (module docstring); an int in [0, 2**63).

    Raises:
        ValueError: an integer part that is not an int >= 0, or an unknown `purpose`.
    """
    for name, value in (
        ("run_seed", run_seed),
        ("prompt_key", prompt_key),
        ("sample_index", sample_index),
        ("turn", turn),
    ):
        if not is_int(value) or value < 0:
            raise ValueError(f"sample_seed: {name} must be an int >= 0, got {value!r}")
    if purpose not in PURPOSES:
        raise ValueError(f"sample_seed: purpose must be one of {PURPOSES}, got {purpose!r}")
    if not isinstance(instance_id, str):
        raise ValueError(f"sample_seed: instance_id must be a str, got {instance_id!r}")
    # A JSON list: unambiguous (no part can run into the next one) and stable.
    text = json.dumps(
        [
            _DOMAIN,
            int(run_seed),
            purpose,
            int(prompt_key),
            instance_id,
            int(sample_index),
            int(turn),
        ]
    )
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def prompt_seeds(
    run_seed: int,
    purpose: str,
    prompt_keys: list[int],
    instance_ids: list[str],
    num_samples: int,
    turn: int = 0,
) -> list[list[int]]:
    """`sample_seed` of every sample of every prompt: [prompt][sample index]."""
    if len(prompt_keys) != len(instance_ids):
        raise ValueError(
            f"prompt_seeds: {len(prompt_keys)} prompt keys for {len(instance_ids)} prompts"
        )
    return [
        [sample_seed(run_seed, purpose, key, instance_id, i, turn) for i in range(num_samples)]
        for key, instance_id in zip(prompt_keys, instance_ids)
    ]
