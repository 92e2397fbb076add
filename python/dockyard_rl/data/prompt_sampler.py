"""The order in which a run hands out its training prompts: `PromptSampler`, seeded per-epoch
permutations of the prompt indices read as one stream, resumable from its `state_dict()`.

    sampler = PromptSampler(num_prompts=len(tasks), batch_size=8, seed=grpo.seed)
    batch = sampler.next_batch()            # 8 indices into tasks
    state = sampler.state_dict()            # saved in the checkpoint's trainer state
    resumed = PromptSampler(len(tasks), 8, seed=grpo.seed)
    resumed.load_state_dict(state)          # continues with the very next prompt

A run resumed from the state consumes exactly the prompts an uninterrupted run would; the
position in the stream (`num_consumed`) is the prompt's draw index, from which
`utils/seeding.sample_seed` derives its generation seeds. `datasets.py` has only the one-shot
`shuffled`, which cannot resume, hence this sampler.

Not covered: weighting or filtering prompts (every prompt is handed out once per epoch) and
changing the data set or the seed within a run (`load_state_dict` refuses it).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping

from dockyard_rl.utils.config import is_int

# The version of `state_dict()`'s layout, stored in it (trainer state of a checkpoint).
FORMAT_VERSION = 1


class PromptSampler:
    """Batches of prompt indices from seeded per-epoch permutations of range(num_prompts).

    The permutations are read as one continuous stream: a batch may end one epoch and start the
    next, so every epoch hands out each prompt exactly once and none is dropped (a batch that
    crosses a boundary can hold a prompt twice, once per epoch, when num_prompts is small).
    Epoch e's order depends only on (seed, e): the seed is hashed with the epoch and the shuffle
    draws from `random.Random.random()`, whose sequence Python keeps stable across versions.

    `state_dict()` is (seed, num_prompts, epoch, position); a sampler that loads it continues
    with the very next prompt. The batch size may differ after a resume; the seed and the number
    of prompts may not (it would not be the same order).
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int):
        for name, value, low in (
            ("num_prompts", num_prompts, 1),
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
        ):
            if not is_int(value) or value < low:
                raise ValueError(f"PromptSampler {name} must be an integer >= {low}, got {value!r}")
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._position = 0  # index into the current epoch's permutation, < num_prompts
        self._order: list[int] | None = None

    @property
    def num_consumed(self) -> int:
        """Prompts handed out so far: the draw index of the next one."""
        return self._epoch * self.num_prompts + self._position

    def permutation(self, epoch: int) -> list[int]:
        digest = hashlib.sha256(f"dockyard_rl.PromptSampler/{self.seed}/{epoch}".encode())
        rng = random.Random(int.from_bytes(digest.digest()[:8], "big"))
        order = list(range(self.num_prompts))
        for i in range(len(order) - 1, 0, -1):  # Fisher-Yates
            j = int(rng.random() * (i + 1))
            order[i], order[j] = order[j], order[i]
        return order

    def next_batch(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if self._order is None:
                self._order = self.permutation(self._epoch)
            take = min(self.batch_size - len(batch), self.num_prompts - self._position)
            batch.extend(self._order[self._position : self._position + take])
            self._position += take
            if self._position == self.num_prompts:
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict[str, int]:
        return {
            "format_version": FORMAT_VERSION,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continues where the sampler that wrote `state` stopped.

        Raises:
            ValueError: the state was written for another seed or number of prompts (the data
                or its seed changed: the order would differ), or it is malformed.
        """
        missing = sorted({"seed", "num_prompts", "epoch", "position"} - set(state))
        if missing:
            raise ValueError(f"sampler state lacks {missing}; not a PromptSampler.state_dict()")
        if state["seed"] != self.seed or state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"sampler state was written for seed {state['seed']} over "
                f"{state['num_prompts']} prompts, this run has seed {self.seed} over "
                f"{self.num_prompts}: resuming would change the prompt order; keep "
                f"the dataset and its seed, or start a new run"
            )
        epoch, position = state["epoch"], state["position"]
        if not (
            is_int(epoch) and epoch >= 0 and is_int(position) and 0 <= position < self.num_prompts
        ):
            raise ValueError(
                f"sampler state has epoch {epoch!r}, position {position!r}; expected "
                f"integers with epoch >= 0 and 0 <= position < {self.num_prompts}"
            )
        self._epoch, self._position, self._order = epoch, position, None
