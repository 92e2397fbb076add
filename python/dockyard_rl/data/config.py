"""Config section `data`: which dataset to train on, how to split and order it, how to prompt.

    data:
      dataset: jsonl                 # registry name (datasets.py): jsonl | hf_local | yours
      train_path: /data/swe/tasks.jsonl
      validation_fraction: 0.1       # split by repository (or validation_path: a separate file)
      seed: 0
      # optional: the held-out split made once by the task synthesizer when validation_path
      # (then <folder>/tasks.jsonl) is missing; same keys as the recipe's `synthesis` section
      validation_synthesis: {packages: [bundled:pocketmath]}
      prompt: {patch_format: search_replace, max_context_tokens: 6000}

`load_train_validation(cfg)` returns (train, validation) instance lists: the training file is
loaded with the named loader; validation comes from `validation_path` when set, else from a
split by repository of the training file (no repository on both sides) when
`validation_fraction` > 0, else it is empty. With `shuffle` the training list is permuted with
`seed` (the same on every machine); `max_train_instances` keeps a prefix of the result. A
validation repository that also appears in a separate training file is an error, not a warning:
it would leak the validation tasks into training.

`validation_synthesis` (a TaskSynthesisConfig, data/synthesis/task_synthesis.py) makes the
validation file when it is missing, as the recipe's `synthesis` section does for `train_path`
(algorithms/grpo_setup.ensure_task_data): a held-out task set from other packages than the
training ones, e.g. `bundled:pocketmath` beside `bundled:pocketcalc` (docs/learning_run.md).
"""

from __future__ import annotations

import dataclasses

from dockyard_rl.data import datasets
from dockyard_rl.data.processors import PromptConfig
from dockyard_rl.data.schema import SweInstance
from dockyard_rl.data.synthesis.task_synthesis import TaskSynthesisConfig
from dockyard_rl.utils.config import is_int, require, require_bool


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Config section `data` (module docstring)."""

    dataset: str = "jsonl"  # loader registry name (datasets.dataset_names())
    train_path: str | None = None  # required: file, glob or directory for the loader
    validation_path: str | None = None  # a separate validation set (same loader)...
    validation_fraction: float = 0.0  # ...or this share split off by repository (0 = none)
    min_validation_repos: int = 1
    # Makes validation_path when it is missing (module docstring); null = validation_path must
    # exist (or no validation_path).
    validation_synthesis: TaskSynthesisConfig | None = None
    shuffle: bool = True
    seed: int = 0
    max_train_instances: int | None = None  # null = all
    processor: str = "swe_single_shot"  # prompt processor registry name
    prompt: PromptConfig = dataclasses.field(default_factory=PromptConfig)

    def __post_init__(self) -> None:
        require(
            self.dataset in datasets.dataset_names(),
            "dataset",
            f"unknown dataset loader {self.dataset!r}; valid: "
            f"{', '.join(datasets.dataset_names())} (register others with "
            f"datasets.register_dataset)",
        )
        require(
            isinstance(self.train_path, str) and bool(self.train_path.strip()),
            "train_path",
            "is required: the file, glob or directory of the training instances (e.g. the "
            "tasks.jsonl written by synthesize_swe_tasks)",
        )
        require(
            self.validation_path is None
            or (isinstance(self.validation_path, str) and bool(self.validation_path.strip())),
            "validation_path",
            f"must be a path or null, got {self.validation_path!r}",
        )
        require(
            isinstance(self.validation_fraction, (int, float))
            and not isinstance(self.validation_fraction, bool)
            and 0.0 <= self.validation_fraction < 1.0,
            "validation_fraction",
            f"must be in [0, 1), got {self.validation_fraction!r}",
        )
        require(
            self.validation_path is None or self.validation_fraction == 0.0,
            "validation_fraction",
            "must be 0 when validation_path is set (use one source of validation instances)",
        )
        require(
            self.validation_synthesis is None or self.validation_path is not None,
            "validation_synthesis",
            "is set but data.validation_path is not: name the file it makes "
            "(<folder>/tasks.jsonl), or remove validation_synthesis",
        )
        for name in ("min_validation_repos", "seed"):
            value = getattr(self, name)
            require(
                is_int(value) and value >= (1 if name == "min_validation_repos" else 0),
                name,
                f"must be an integer >= {1 if name == 'min_validation_repos' else 0}, "
                f"got {value!r}",
            )
        require_bool(self, "shuffle")
        require(
            self.max_train_instances is None
            or (
                isinstance(self.max_train_instances, int)
                and not isinstance(self.max_train_instances, bool)
                and self.max_train_instances >= 1
            ),
            "max_train_instances",
            f"must be an integer >= 1 or null (= all), got {self.max_train_instances!r}",
        )
        require(
            self.processor in datasets.processor_names(),
            "processor",
            f"unknown prompt processor {self.processor!r}; valid: "
            f"{', '.join(datasets.processor_names())}",
        )


def load_train_validation(cfg: DataConfig) -> tuple[list[SweInstance], list[SweInstance]]:
    """(train, validation) as the module docstring says. Raises DatasetError for a bad row and
    ValueError for missing files, an impossible split, or repositories on both sides."""
    assert cfg.train_path is not None, "DataConfig.__post_init__ requires train_path"
    loader = datasets.get_dataset(cfg.dataset)
    train = loader(cfg.train_path)
    if not train:
        raise ValueError(f"data.train_path: {cfg.train_path!r} holds no instances")
    if cfg.validation_path is not None:
        validation = loader(cfg.validation_path)
        shared = sorted({i.repo for i in train} & {i.repo for i in validation})
        if shared:
            raise ValueError(
                f"data.validation_path: repositories {shared[:5]} appear in both the "
                f"training and the validation set; validation must hold out whole "
                f"repositories"
            )
    elif cfg.validation_fraction > 0:
        train, validation = datasets.split_by_repo(
            train,
            validation_fraction=cfg.validation_fraction,
            seed=cfg.seed,
            min_validation_repos=cfg.min_validation_repos,
        )
    else:
        validation = []
    if cfg.shuffle:
        train = datasets.shuffled(train, cfg.seed)
    if cfg.max_train_instances is not None:
        train = train[: cfg.max_train_instances]
    return train, validation
