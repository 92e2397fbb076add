"""The held-out partners of the bundled task packages, pocketmath (pocketcalc's) and toyseries
(toystats'): each shares no function with its partner, and synthesizes into a task set of the same
kind: every function mutated, each task's gold patch resolves it and the unfixed (mutated) code
fails, checked again by validate_swe_tasks with a fresh executor (real git, pytest under
bubblewrap)."""

import ast
import io
import json
import tarfile

import pytest

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.data.synthesis import bundled_sdists, synthesize_swe_tasks, validate_swe_tasks

# (held-out package, the package it is held out from, its least number of functions)
PARTNERS = [("pocketmath", "pocketcalc", 15), ("toyseries", "toystats", 8)]


def _functions(name: str, tmp_path) -> dict[str, str]:
    """Function name -> the dump of its body (names of the arguments included), of every
    function in the package's library code."""
    archive = bundled_sdists.BUNDLED[name](tmp_path / name)
    functions = {}
    with tarfile.open(archive) as tarred:
        for member in tarred.getmembers():
            path = member.name.split("/", 1)[1]
            if path.startswith(f"{name}/") and path.endswith(".py"):
                text = io.TextIOWrapper(tarred.extractfile(member)).read()
                for node in ast.walk(ast.parse(text)):
                    if isinstance(node, ast.FunctionDef):
                        functions[node.name] = ast.dump(ast.Module(node.body, []))
    return functions


@pytest.mark.parametrize("held_out, trained, min_functions", PARTNERS)
def test_held_out_package_shares_no_function_with_its_partner(
    tmp_path, held_out, trained, min_functions
):
    held, seen = _functions(held_out, tmp_path), _functions(trained, tmp_path)
    assert len(held) >= min_functions
    assert not {n for n in set(held) & set(seen) if not n.startswith("__")}  # no shared name
    assert not set(held.values()) & set(seen.values())  # no shared body under another name


# The same kind and size as the partner's task set (pocketcalc: 28 tasks, toystats: 15).
@pytest.mark.parametrize("name, min_tasks", [("pocketmath", 25), ("toyseries", 12)])
def test_held_out_package_synthesizes_into_tasks_gold_resolves_and_the_bug_fails(
    tmp_path, name, min_tasks
):
    out = tmp_path / "out"
    args = ["--packages", f"bundled:{name}", "--out", str(out), "--workers", "2"]
    args += ["--max-tasks-per-package", "40", "--log-level", "WARNING"]
    assert synthesize_swe_tasks.main(args) == 0
    instances = load_jsonl(out / "tasks.jsonl")
    rows = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    # Every function (method: "Class.method") mutated, at most 2 tasks each.
    functions = [row["synthesis"]["function"].split(".")[-1] for row in rows]
    assert set(functions) == set(_functions(name, tmp_path))
    assert max(functions.count(f) for f in functions) <= 2
    assert min_tasks <= len(instances) <= 40
    # A fresh executor: the gold patch resolves every task, the empty patch (the mutated code
    # left as it is) resolves none.
    report = tmp_path / "validation.json"
    args = ["--tasks", str(out / "tasks.jsonl"), "--gold-runs", "1", "--workers", "2"]
    assert validate_swe_tasks.main([*args, "--report", str(report)]) == 0
    summary = json.loads(report.read_text())
    assert summary["num_valid"] == summary["num_tasks"] == len(instances)
    assert not summary["problems"]
