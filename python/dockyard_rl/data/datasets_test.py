import json

import hypothesis
import hypothesis.strategies as st
import pytest

from dockyard_rl.data import datasets
from dockyard_rl.data.schema import DatasetError, SweInstance


def _row(index, repo="octo/calc", **overrides):
    row = {
        "instance_id": f"{repo.replace('/', '__')}-{index}",
        "repo": repo,
        "base_commit": "abc",
        "patch": "p",
        "test_patch": "t",
        "FAIL_TO_PASS": json.dumps([f"tests/test_x.py::test_{index}"]),
        "PASS_TO_PASS": "[]",
        "problem_statement": f"problem {index}",
        "hints_text": "",
        "version": "1",
        "environment_setup_commit": "abc",
        "created_at": "2025",
    }
    row.update(overrides)
    return row


def _instance(index, repo):
    return SweInstance.from_row(_row(index, repo), index, "mem")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_load_jsonl_reads_rows_in_order_and_skips_blank_lines(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n\n" + json.dumps(_row(1)) + "\n")
    instances = datasets.load_jsonl(path)
    assert [i.instance_id for i in instances] == ["octo__calc-0", "octo__calc-1"]
    assert instances[1].FAIL_TO_PASS == ("tests/test_x.py::test_1",)


def test_load_jsonl_errors_name_the_line_and_field(tmp_path):
    bad = _row(1)
    del bad["base_commit"]
    path = _write_jsonl(tmp_path / "bad.jsonl", [_row(0), bad])
    with pytest.raises(DatasetError, match=r"bad.jsonl: row 1: field 'base_commit': is required"):
        datasets.load_jsonl(path)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(_row(0)) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"row 1: field '<row>': is not valid JSON"):
        datasets.load_jsonl(broken)


def test_load_jsonl_rejects_duplicates_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match=r"row 1: field 'instance_id': duplicate of row 0"):
        datasets.load_jsonl(_write_jsonl(tmp_path / "dup.jsonl", [_row(0), _row(0)]))
    with pytest.raises(ValueError, match="is not a file"):
        datasets.load_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        datasets.load_jsonl(tmp_path / "empty.jsonl")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    # Keep the datasets cache inside the test's directory (Bazel's HOME may be read-only).
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))


def test_load_hf_local_parquet_matches_jsonl(tmp_path, hf_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(i, repo=f"octo/r{i % 2}") for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    from_parquet = datasets.load_hf_local(tmp_path / "train.parquet")
    from_jsonl = datasets.load_jsonl(_write_jsonl(tmp_path / "train.jsonl", rows))
    assert from_parquet == from_jsonl


def test_load_hf_local_reads_a_directory_of_json_files_with_list_columns(tmp_path, hf_cache):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rows = [_row(i, FAIL_TO_PASS=[f"t::{i}"], PASS_TO_PASS=["t::p"]) for i in range(4)]
    _write_jsonl(data_dir / "part-0.jsonl", rows[:2])
    _write_jsonl(data_dir / "part-1.jsonl", rows[2:])
    instances = datasets.load_hf_local(data_dir)
    assert [i.FAIL_TO_PASS for i in instances] == [(f"t::{i}",) for i in range(4)]
    assert all(i.PASS_TO_PASS == ("t::p",) for i in instances)


def test_load_hf_local_reads_save_to_disk_directories_and_arrow_files(tmp_path, hf_cache):
    import datasets as hf

    rows = [_row(i) for i in range(3)]
    hf.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    expected = [SweInstance.from_row(row, i, "mem") for i, row in enumerate(rows)]
    assert datasets.load_hf_local(tmp_path / "saved") == expected
    assert datasets.load_hf_local(str(tmp_path / "saved" / "*.arrow")) == expected
    hf.DatasetDict({"test": hf.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dd"))
    assert datasets.load_hf_local(tmp_path / "dd", split="test") == expected[:1]
    with pytest.raises(ValueError, match=r"has splits \['test'\], not 'train'"):
        datasets.load_hf_local(tmp_path / "dd")


def test_load_hf_local_errors(tmp_path, hf_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(0), _row(1, FAIL_TO_PASS="oops")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"row 1: field 'FAIL_TO_PASS': is a string but not"):
        datasets.load_hf_local(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="matches no data files"):
        datasets.load_hf_local(tmp_path / "nothing-*.parquet")
    with pytest.raises(ValueError, match="builder 'csv' is not supported"):
        datasets.load_hf_local(tmp_path / "bad.parquet", builder="csv")
    _write_jsonl(tmp_path / "more.jsonl", [_row(2)])
    with pytest.raises(ValueError, match="cannot pick a builder from suffixes"):
        datasets.load_hf_local(tmp_path)


def test_shuffled_is_a_seeded_permutation():
    instances = [_instance(i, "octo/calc") for i in range(50)]
    first = datasets.shuffled(instances, seed=7)
    assert first == datasets.shuffled(instances, seed=7)
    assert first != datasets.shuffled(instances, seed=8)
    assert first != instances
    assert sorted(i.instance_id for i in first) == sorted(i.instance_id for i in instances)
    assert [i.instance_id for i in instances] == [f"octo__calc-{i}" for i in range(50)]


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(
    repo_of=st.lists(st.integers(0, 9), min_size=2, max_size=60),
    fraction=st.floats(0.01, 0.99),
    seed=st.integers(0, 2**31),
)
def test_split_by_repo_never_shares_a_repository(repo_of, fraction, seed):
    instances = [_instance(i, f"org/repo{r}") for i, r in enumerate(repo_of)]
    if len(set(repo_of)) < 2:
        with pytest.raises(ValueError, match="at least 2 repositories"):
            datasets.split_by_repo(instances, validation_fraction=fraction, seed=seed)
        return
    train, validation = datasets.split_by_repo(instances, validation_fraction=fraction, seed=seed)
    assert train and validation
    assert not {i.repo for i in train} & {i.repo for i in validation}
    assert sorted(i.instance_id for i in train + validation) == sorted(
        i.instance_id for i in instances
    )
    # Validation reaches the fraction unless that would leave train empty.
    if len(validation) < fraction * len(instances):
        assert len({i.repo for i in train}) == 1
    # Deterministic for a given seed.
    assert (train, validation) == datasets.split_by_repo(
        instances, validation_fraction=fraction, seed=seed
    )
    # Order within each side follows the input.
    assert [i.instance_id for i in train] == [i.instance_id for i in instances if i in train]


def test_split_by_repo_depends_on_seed_and_validates_arguments():
    instances = [_instance(i, f"org/repo{i % 10}") for i in range(100)]
    splits = {
        tuple(
            sorted(
                {
                    i.repo
                    for i in datasets.split_by_repo(instances, validation_fraction=0.2, seed=seed)[
                        1
                    ]
                }
            )
        )
        for seed in range(10)
    }
    assert len(splits) > 1
    _, validation = datasets.split_by_repo(instances, validation_fraction=0.2, seed=0)
    assert len(validation) == 20  # 10 instances per repository: exactly two repositories
    with pytest.raises(ValueError, match=r"validation_fraction must be in \(0, 1\)"):
        datasets.split_by_repo(instances, validation_fraction=1.0, seed=0)
    with pytest.raises(ValueError, match="needs at least 4 repositories"):
        datasets.split_by_repo(
            instances[:3], validation_fraction=0.5, seed=0, min_validation_repos=3
        )


def test_registries_list_valid_names_on_unknown_or_duplicate_names(tmp_path):
    assert datasets.get_dataset("jsonl") is datasets.load_jsonl
    assert {"jsonl", "hf_local"} <= set(datasets.dataset_names())
    with pytest.raises(
        ValueError,
        match=r"unknown dataset 'swe-gymm'; valid names: .*hf_local, "
        r"jsonl",
    ):
        datasets.get_dataset("swe-gymm")
    with pytest.raises(ValueError, match="already registered"):
        datasets.register_dataset("jsonl", lambda path: [])
    with pytest.raises(ValueError, match="must be callable"):
        datasets.register_dataset("not-callable", "nope")
    with pytest.raises(ValueError, match="unknown prompt processor 'nope'"):
        datasets.get_processor("nope")

    def custom(path):
        return datasets.load_jsonl(path)[:1]

    datasets.register_dataset("first_only", custom)
    path = _write_jsonl(tmp_path / "t.jsonl", [_row(0), _row(1)])
    assert [i.instance_id for i in datasets.get_dataset("first_only")(str(path))] == [
        "octo__calc-0"
    ]
