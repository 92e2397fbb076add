"""End to end of the task synthesizer on a local toy sdist: real git, real executor (HTTP on
127.0.0.1, pytest under bubblewrap), real libcst mutations.

Checks the written tasks as a consumer would: SWE-bench rows that load, held-out tests absent from
the base commit and restored by the test_patch, a gold patch that only touches library code, and
problem statements that name the failing tests but not the bug's location. A fresh executor (new
mirrors, new work dir) then scores every task independently: gold resolves, the empty patch does
not. Also: reruns resume per package and the search is deterministic for a seed.
"""

import io
import json
import pathlib
import subprocess
import tarfile
import types

import pytest
import unidiff

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.data.synthesis import (
    bundled_sdists,
    holdout,
    mutations,
    synthesize_swe_tasks,
    validate_swe_tasks,
)

NUM_TASKS = 4
_COMPARED = (
    "instance_id",
    "base_commit",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "problem_statement",
    "test_command",
)


def _args(archive, out, num_tasks):
    return [
        "--packages",
        str(archive),
        "--out",
        str(out),
        "--max-tasks-per-package",
        str(num_tasks),
        "--workers",
        "2",
        "--seed",
        "3",
        "--log-level",
        "WARNING",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthesis")
    archive = bundled_sdists.make_toy_sdist(root / "downloads")
    out = root / "out"
    code = synthesize_swe_tasks.main(_args(archive, out, NUM_TASKS))
    return types.SimpleNamespace(root=root, archive=archive, out=out, code=code)


def _git(repo, *args):
    return subprocess.run(
        ["git", "--git-dir", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


def _rows(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def test_tasks_are_valid_held_out_swe_instances(run):
    assert run.code == 0
    instances = load_jsonl(run.out / "tasks.jsonl")
    rows = _rows(run.out / "tasks.jsonl")
    assert len(instances) == NUM_TASKS
    assert len({i.instance_id for i in instances}) == NUM_TASKS
    repo = run.out / "repos" / "toystats-1.0.git"
    pristine = _git(repo, "rev-parse", "refs/heads/main").strip()
    for instance, row in zip(instances, rows):
        assert instance.repo == str(repo) and instance.version == "1.0"
        assert instance.environment_setup_commit == pristine
        assert instance.FAIL_TO_PASS and instance.PASS_TO_PASS
        assert not set(instance.FAIL_TO_PASS) & set(instance.PASS_TO_PASS)
        assert (
            _git(repo, "rev-parse", f"refs/tasks/{instance.instance_id}").strip()
            == instance.base_commit
        )
        gold_files = {f.path for f in unidiff.PatchSet(instance.patch)}
        test_files = {f.path for f in unidiff.PatchSet(instance.test_patch)}
        assert gold_files == {row["synthesis"]["file"]}
        assert all(path.startswith("toystats/") for path in gold_files)
        assert test_files and all(path.startswith("tests/test_") for path in test_files)
        # The held-out tests are not in the agent's checkout, and test_patch restores them.
        for node_id in instance.FAIL_TO_PASS:
            path, _, name = holdout.split_node_id(node_id)
            assert f"def {name}(" not in _git(repo, "show", f"{instance.base_commit}:{path}")
            assert f"def {name}(" in _git(repo, "show", f"{pristine}:{path}")
        assert (
            _git(repo, "diff", instance.base_commit, pristine, "--", *sorted(test_files))
            == instance.test_patch
        )
        # The gold patch is the exact reverse of the mutation.
        assert (
            _git(repo, "diff", instance.base_commit, pristine, "--", *sorted(gold_files))
            == instance.patch
        )
        statement = instance.problem_statement
        for node_id in instance.FAIL_TO_PASS[:5]:
            assert f"`{node_id}`" in statement
        assert row["synthesis"]["file"] not in statement and "toystats/" not in statement
        assert row["synthesis"]["mutation_kind"] in mutations.MUTATION_KINDS
        assert "python -m pytest" in instance.test_command and "tests" in instance.test_command
    report = json.loads((run.out / "report.json").read_text())
    (package,) = report["packages"]
    assert package["package"] == "toystats" and package["num_tasks"] == NUM_TASKS
    assert package["num_collected_tests"] == 17 and package["num_baseline_passing"] == 17
    assert package["num_screened"] >= NUM_TASKS and package["seconds"] > 0
    assert package["fail_to_pass"]["count"] == NUM_TASKS
    assert report["num_tasks"] == NUM_TASKS
    assert sum(package["tasks_per_kind"].values()) == NUM_TASKS
    assert _rows(run.out / "tasks" / "toystats-1.0.jsonl") == rows


def test_validator_confirms_every_task_and_catches_broken_ones(run, tmp_path, capsys):
    # A fresh executor (new mirrors, new work dir) scores gold and empty patches again.
    report = tmp_path / "validation.json"
    assert (
        validate_swe_tasks.main(
            [
                "--tasks",
                str(run.out / "tasks.jsonl"),
                "--gold-runs",
                "1",
                "--workers",
                "2",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    summary = json.loads(report.read_text())
    assert summary["num_valid"] == summary["num_tasks"] == NUM_TASKS
    assert "total: 4 of 4 valid" in capsys.readouterr().out
    # Broken copies: a gold patch that fixes nothing (another task's: it reverts a mutation this
    # base commit does not have), and a task whose only FAIL_TO_PASS test passes unfixed.
    rows = _rows(run.out / "tasks.jsonl")[:2]
    rows[0]["patch"] = rows[1]["patch"]
    rows[1]["FAIL_TO_PASS"] = rows[1]["PASS_TO_PASS"][:1]
    rows[1]["PASS_TO_PASS"] = rows[1]["PASS_TO_PASS"][1:]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert validate_swe_tasks.main(["--tasks", str(broken), "--report", str(report)]) == 1
    problems = json.loads(report.read_text())["problems"]
    assert "gold patch did not resolve" in problems[rows[0]["instance_id"]]
    assert "empty patch resolves it" in problems[rows[1]["instance_id"]]
    assert validate_swe_tasks.main(["--tasks", str(tmp_path / "missing.jsonl")]) == 2


def test_rerun_resumes_and_the_search_is_deterministic(run, caplog):
    before = (run.out / "tasks.jsonl").read_bytes()
    assert synthesize_swe_tasks.main(_args(run.archive, run.out, NUM_TASKS)) == 0
    assert (run.out / "tasks.jsonl").read_bytes() == before  # reused, not redone
    # A new directory and a smaller quota: the same seed finds the same first tasks.
    smaller = run.root / "smaller"
    assert synthesize_swe_tasks.main(_args(run.archive, smaller, 2)) == 0
    first = [{k: r[k] for k in _COMPARED} for r in _rows(run.out / "tasks.jsonl")[:2]]
    again = [{k: r[k] for k in _COMPARED} for r in _rows(smaller / "tasks.jsonl")]
    assert again == first


def test_src_layout_package(tmp_path):
    archive = bundled_sdists.make_toy_sdist(tmp_path / "downloads", src_layout=True)
    out = tmp_path / "out"
    assert synthesize_swe_tasks.main(_args(archive, out, 1)) == 0
    (instance,) = load_jsonl(out / "tasks.jsonl")
    assert "pythonpath=../src" in instance.test_command
    assert {f.path for f in unidiff.PatchSet(instance.patch)} <= {
        "src/toystats/__init__.py",
        "src/toystats/core.py",
        "src/toystats/window.py",
    }


def test_bad_settings_exit_2_naming_the_key(tmp_path, capsys):
    archive = bundled_sdists.make_toy_sdist(tmp_path)
    assert (
        synthesize_swe_tasks.main(
            [
                "--packages",
                str(archive),
                "--out",
                str(tmp_path / "o"),
                "--kinds",
                "flip_comparison,nope",
            ]
        )
        == 2
    )
    assert "mutation_kinds" in capsys.readouterr().err
    assert (
        synthesize_swe_tasks.main(
            [
                "--packages",
                str(archive),
                "--out",
                str(tmp_path / "o"),
                "--max-tasks-per-package",
                "0",
            ]
        )
        == 2
    )
    assert "max_tasks_per_package" in capsys.readouterr().err
    assert (
        synthesize_swe_tasks.main(
            ["--packages", str(archive), "--out", str(tmp_path / "o"), "--num-baseline-runs", "1"]
        )
        == 2
    )
    assert "num_baseline_runs" in capsys.readouterr().err
    assert synthesize_swe_tasks.main(["--packages", " , ", "--out", str(tmp_path / "o")]) == 2
    assert "--packages" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert (
        synthesize_swe_tasks.main(["--packages", str(archive), "--out", str(tmp_path / "a_file")])
        == 2
    )
    assert "not a directory" in capsys.readouterr().err


def _tar(path, files):
    with tarfile.open(path, "w:gz") as tarred:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tarred.addfile(info, io.BytesIO(text.encode()))
    return path


def test_unusable_packages_are_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    no_tests = _tar(
        tmp_path / "notests-1.0.tar.gz",
        {
            "notests-1.0/PKG-INFO": "Name: notests\nVersion: 1.0\n",
            "notests-1.0/notests.py": "def f():\n    return 1\n",
        },
    )
    corrupt = tmp_path / "corrupt-1.0.tar.gz"
    corrupt.write_bytes(b"\x1f\x8b not really gzip")
    toy = bundled_sdists.make_toy_sdist(tmp_path / "a")
    same_toy = bundled_sdists.make_toy_sdist(tmp_path / "b")  # same name and version
    monkeypatch.chdir(tmp_path)
    relative_toy = str(toy.relative_to(tmp_path))  # the same archive, named twice
    out = tmp_path / "out"
    packages = ",".join([str(no_tests), str(corrupt), relative_toy, str(toy), str(same_toy)])
    assert synthesize_swe_tasks.requirements_of(packages) == [
        str(no_tests),
        str(corrupt),
        str(toy),
        str(same_toy),
    ]
    assert (
        synthesize_swe_tasks.main(
            ["--packages", packages, "--out", str(out), "--max-tasks-per-package", "1"]
        )
        == 1
    )
    report = json.loads((out / "report.json").read_text())
    errors = {p["requirement"]: p.get("error", "") for p in report["packages"]}
    assert "ships no test modules" in errors[str(no_tests)]
    assert "cannot be unpacked" in errors[str(corrupt)]
    assert errors[str(toy)] == ""
    assert "already synthesized" in errors[str(same_toy)]
    assert len(load_jsonl(out / "tasks.jsonl")) == 1
