"""Loading SWE datasets into `SweInstance` lists: JSONL files, Hugging Face `datasets` on local
files, seeded shuffling, a train/validation split by repository, and the name registries.

    instances = load_jsonl("tasks.jsonl")
    instances = load_hf_local("swe-gym/data/train-*.parquet")      # parquet / json / arrow
    train, val = split_by_repo(instances, validation_fraction=0.1, seed=0)

The Hugging Face loader never touches the network: it sets HF_DATASETS_OFFLINE=1 and passes
`data_files` to one of the packaged builders (parquet, json, arrow), chosen from the file suffix
or given explicitly. Validation errors name the file and row (`DatasetError`).

Registries: `register_dataset(name, loader)` / `get_dataset(name)` map a name to a callable
`(path) -> list[SweInstance]`; `register_processor` / `get_processor` map a name to a prompt
processor factory. Unknown names raise ValueError listing the valid ones. The built-in dataset
names are "jsonl" and "hf_local"; processors register themselves in processors.py.

Not covered: downloading datasets from the Hub, streaming datasets larger than memory, and
deduplicating instances across files.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import random
from collections.abc import Callable, Sequence
from typing import Any

from dockyard_rl.data.schema import DatasetError, SweInstance

DatasetLoader = Callable[[str], list[SweInstance]]

# Suffix -> the packaged `datasets` builder that reads it.
_HF_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}


def _check_unique(instances: Sequence[SweInstance], source: str) -> None:
    seen: dict[str, int] = {}
    for index, instance in enumerate(instances):
        if instance.instance_id in seen:
            raise DatasetError(
                source,
                index,
                "instance_id",
                f"duplicate of row {seen[instance.instance_id]} "
                f"({instance.instance_id!r}); instance ids must be unique",
            )
        seen[instance.instance_id] = index


def load_jsonl(path: str | os.PathLike) -> list[SweInstance]:
    """One JSON object per line; blank lines are skipped (row indices count them, so an index
    is the 0-based line number). Raises DatasetError for unreadable JSON or a bad row, and
    ValueError when the file does not exist or holds no rows."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"dataset path {str(path)!r} is not a file; point it at a .jsonl file")
    instances = []
    with path.open(encoding="utf-8") as handle:
        for line_index, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(
                    str(path), line_index, "<row>", f"is not valid JSON: {error}"
                ) from None
            instances.append(SweInstance.from_row(row, line_index, str(path)))
    if not instances:
        raise ValueError(f"dataset {str(path)!r} holds no rows")
    _check_unique(instances, str(path))
    return instances


def _resolve_data_files(path: str) -> list[str]:
    candidate = pathlib.Path(path)
    if candidate.is_dir():
        files = sorted(
            str(p) for p in candidate.rglob("*") if p.is_file() and p.suffix in _HF_BUILDERS
        )
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise ValueError(
            f"dataset path {path!r} matches no data files; give a file, a glob or a "
            f"directory holding {', '.join(sorted(_HF_BUILDERS))} files"
        )
    return files


def _import_datasets() -> Any:
    # Offline: the packaged builders read local files; nothing may reach for the Hub. (The
    # variable is read when `datasets` is first imported; a process that imported it earlier
    # keeps its first value, and local files need no network either way.)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets  # heavy import (pyarrow, fsspec): only when an HF loader is used

    return datasets


def load_hf_local(
    path: str | os.PathLike, *, builder: str | None = None, split: str = "train"
) -> list[SweInstance]:
    """Reads local parquet/json/arrow files (a file, a glob or a directory) with the Hugging
    Face `datasets` library, offline. `builder` ("parquet" | "json" | "arrow") defaults to the
    one matching the files' suffix; mixing suffixes needs it set explicitly. A directory written
    by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (it holds state.json or
    dataset_dict.json) is read with `datasets.load_from_disk`, taking `split` from a DatasetDict."""
    source = str(path)
    if any((pathlib.Path(path) / name).is_file() for name in ("state.json", "dataset_dict.json")):
        # A `save_to_disk` directory: arrow files plus metadata JSON, read as a whole.
        datasets = _import_datasets()
        if builder is not None:
            raise ValueError(
                f"dataset path {source!r} is a save_to_disk directory; do not pass builder= for it"
            )
        table = datasets.load_from_disk(source)
        if isinstance(table, datasets.DatasetDict):
            if split not in table:
                raise ValueError(
                    f"dataset {source!r} has splits {sorted(table)}, not {split!r}; "
                    f"pass split= one of them"
                )
            table = table[split]
        return _instances_from_table(table, source)
    files = _resolve_data_files(source)
    if builder is None:
        builders = {_HF_BUILDERS.get(pathlib.Path(f).suffix) for f in files}
        if len(builders) != 1 or None in builders:
            raise ValueError(
                f"dataset path {source!r}: cannot pick a builder from suffixes of "
                f"{files[:5]}; pass builder= one of "
                f"{sorted(set(_HF_BUILDERS.values()))}"
            )
        builder = builders.pop()
    elif builder not in set(_HF_BUILDERS.values()):
        raise ValueError(
            f"builder {builder!r} is not supported; valid: {sorted(set(_HF_BUILDERS.values()))}"
        )
    datasets = _import_datasets()
    table = datasets.load_dataset(builder, data_files={split: files}, split=split)
    return _instances_from_table(table, source)


def _instances_from_table(table: Any, source: str) -> list[SweInstance]:
    instances = [SweInstance.from_row(row, index, source) for index, row in enumerate(table)]
    if not instances:
        raise ValueError(f"dataset {source!r} holds no rows")
    _check_unique(instances, source)
    return instances


def shuffled(instances: Sequence[SweInstance], seed: int) -> list[SweInstance]:
    """A seeded permutation: the same input order and seed give the same output on every run
    and machine (a private random.Random, never the global one)."""
    result = list(instances)
    random.Random(seed).shuffle(result)
    return result


def split_by_repo(
    instances: Sequence[SweInstance],
    *,
    validation_fraction: float,
    seed: int,
    min_validation_repos: int = 1,
) -> tuple[list[SweInstance], list[SweInstance]]:
    """Splits into (train, validation) so that no repository has instances on both sides.

    Repositories (sorted, then seeded-shuffled) go to validation until it holds at least
    `validation_fraction` of the instances, and at least `min_validation_repos` repositories;
    at least one repository always stays in train. Each side keeps the input's order.

    Raises:
        ValueError: the fraction is outside (0, 1), or there are too few repositories to leave
            one in train after giving validation its minimum.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    if min_validation_repos < 1:
        raise ValueError(f"min_validation_repos must be >= 1, got {min_validation_repos}")
    repos = sorted({instance.repo for instance in instances})
    if len(repos) < min_validation_repos + 1:
        raise ValueError(
            f"split by repository needs at least {min_validation_repos + 1} "
            f"repositories ({min_validation_repos} for validation, 1 for train); the "
            f"dataset has {len(repos)}: {repos[:10]}. Add repositories or disable "
            f"the validation split"
        )
    random.Random(seed).shuffle(repos)
    counts: dict[str, int] = {}
    for instance in instances:
        counts[instance.repo] = counts.get(instance.repo, 0) + 1
    target = validation_fraction * len(instances)
    validation_repos: set[str] = set()
    num_validation = 0
    for repo in repos[:-1]:  # the last one is kept for train
        if len(validation_repos) >= min_validation_repos and num_validation >= target:
            break
        validation_repos.add(repo)
        num_validation += counts[repo]
    train = [i for i in instances if i.repo not in validation_repos]
    validation = [i for i in instances if i.repo in validation_repos]
    assert train and validation
    return train, validation


# --- registries ---------------------------------------------------------------------------

_DATASETS: dict[str, DatasetLoader] = {}
_PROCESSORS: dict[str, Callable[..., Any]] = {}


def _register(table: dict, kind: str, name: str, value: Any, overwrite: bool) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
    if not callable(value):
        raise ValueError(f"{kind} {name!r}: must be callable, got {type(value).__name__}")
    if name in table and not overwrite and table[name] is not value:
        raise ValueError(
            f"{kind} {name!r} is already registered; pick another name or pass overwrite=True"
        )
    table[name] = value


def _get(table: dict, kind: str, name: str) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}")
    return table[name]


def register_dataset(name: str, loader: DatasetLoader, *, overwrite: bool = False) -> None:
    """Registers `loader(path) -> list[SweInstance]` under `name`."""
    _register(_DATASETS, "dataset", name, loader, overwrite)


def get_dataset(name: str) -> DatasetLoader:
    return _get(_DATASETS, "dataset", name)


def dataset_names() -> list[str]:
    return sorted(_DATASETS)


def register_processor(
    name: str, processor: Callable[..., Any], *, overwrite: bool = False
) -> None:
    """Registers a prompt processor (a callable building prompts; see processors.py)."""
    _register(_PROCESSORS, "prompt processor", name, processor, overwrite)


def get_processor(name: str) -> Callable[..., Any]:
    return _get(_PROCESSORS, "prompt processor", name)


def processor_names() -> list[str]:
    return sorted(_PROCESSORS)


register_dataset("jsonl", load_jsonl)
register_dataset("hf_local", load_hf_local)
