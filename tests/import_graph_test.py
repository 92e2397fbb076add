"""The import graph of python/dockyard_rl: no package imports one above it, and no circles.

The top-level packages are layered (`LAYERS`, lowest first); a module may import its own package
and the packages below it, never one above. Every module's imports are read with `ast`, not by
importing it: each `import` and `from ... import` statement anywhere in the file counts, inside
functions and `if TYPE_CHECKING:` blocks too (a lazy import is still a dependency, and lazy
imports are how import circles stayed out of sight); relative imports are resolved.

Checked, each failure naming the file, the import and the rule broken:
- upward imports between top-level packages, except the `KNOWN_VIOLATIONS` still being removed;
- a `KNOWN_VIOLATIONS` entry that is no longer violated (the list only shrinks: delete it);
- a top-level package (or module) missing from `LAYERS`, and the root `dockyard_rl/__init__.py`
  importing any package (importing one package would then load them all);
- circles among top-level packages and among modules. Without upward imports a package circle
  cannot form; the check stays for a clear message should one be allowed in `KNOWN_VIOLATIONS`.

Exempt: tests (`*_test.py`, `conftest.py`) and the sources of `testonly = True` targets in the
packages' BUILD files (read with `ast`: Starlark is Python syntax); they may import anything.
Not covered: modules imported by a computed name (`importlib.import_module(name)`, as the
transport registries do), the implicit import of a package's `__init__` by its submodules, and
code outside python/dockyard_rl (python/launch, tests/ and tools/ sit above every package).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
from collections.abc import Iterable, Mapping

from tools.lint import workspace_files

# Lowest first: a package may import the ones before it. `losses` sits below `models` because the
# policies call the loss the loops build; `weight_sync` below `models` (the comment in the tuple
# says why).
LAYERS = (
    "utils",
    "cluster",
    "distributed",
    "kernels",
    "losses",
    "sandbox",
    "rewards",
    "data",
    "data_plane",
    # Below models: most of it runs inside the model processes (the trainer rank's sender
    # sessions, the receivers inside vLLM), as vLLM's transfer engines sit below its workers.
    # It types the policies and engines against its own Protocols (WeightSource, WeightSink) and
    # imports nothing from models/.
    "weight_sync",
    "models",
    "environments",
    "algorithms",
)

# (importing module, the package above it that it imports) pairs still being removed. The test
# fails once an entry is no longer violated: delete it then. Empty: add none without a plan to
# remove it.
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()

ROOT_PACKAGE = "dockyard_rl"


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of a dockyard_rl module by a product module."""

    path: str  # the importing file, relative to the workspace root
    line: int
    importer: str  # dotted module name, e.g. dockyard_rl.models.policy.jax_policy
    imported: str  # the dotted module it names (the longest existing prefix)

    @property
    def importer_package(self) -> str:
        return _package(self.importer)

    @property
    def imported_package(self) -> str:
        return _package(self.imported)


def _package(module: str) -> str:
    """The top-level package of a dockyard_rl module ("" for the root package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: pathlib.Path, source_root: pathlib.Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_test(path: pathlib.Path) -> bool:
    return path.name.endswith("_test.py") or path.name == "conftest.py"


def sources_of_testonly_targets(build_files: Iterable[pathlib.Path]) -> set[pathlib.Path]:
    """The files in `srcs` of every `testonly = True` target of these BUILD files."""
    found = set()
    for build in build_files:
        try:
            tree = ast.parse(build.read_text(), filename=str(build))
        except SyntaxError as error:
            raise ValueError(
                f"{build}: cannot parse as Starlark/Python ({error}); this test reads BUILD "
                "files to find testonly helpers, so keep them in the common syntax"
            ) from error
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            keywords = {k.arg: k.value for k in call.keywords if k.arg}
            testonly = keywords.get("testonly")
            if not (isinstance(testonly, ast.Constant) and testonly.value is True):
                continue
            srcs = keywords.get("srcs")
            for element in srcs.elts if isinstance(srcs, ast.List) else []:
                if isinstance(element, ast.Constant) and isinstance(element.value, str):
                    found.add((build.parent / element.value).resolve())
    return found


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every dockyard_rl name the module imports, relative ones resolved;
    `from X import a` gives X.a (`collect` falls back to X when a is not a module)."""
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.extend((node.lineno, f"{source}.{alias.name}") for alias in node.names)
    return [
        (line, name)
        for line, name in names
        if name == ROOT_PACKAGE or name.startswith(ROOT_PACKAGE + ".")
    ]


def collect(
    workspace: pathlib.Path, files: Iterable[pathlib.Path]
) -> tuple[list[Import], set[str]]:
    """The imports of dockyard_rl modules by the product modules among `files` (the .py and
    BUILD files under `workspace`/python/dockyard_rl), and every module's name."""
    files = list(files)
    source_root = workspace / "python"
    sources = [f for f in files if f.suffix == ".py"]
    exempt = sources_of_testonly_targets(f for f in files if f.name in ("BUILD", "BUILD.bazel"))
    modules = {_module_name(f, source_root): f for f in sources}
    imports = []
    for module, path in sorted(modules.items()):
        if _is_test(path) or path.resolve() in exempt:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported_names(tree, module, path.name == "__init__.py"):
            target = name
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != module:
                imports.append(Import(str(path.relative_to(workspace)), line, module, target))
    # `from X import a, b` is one import per name; the same module twice on a line is one.
    return list(dict.fromkeys(imports)), set(modules)


def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components)


def problems(
    imports: list[Import],
    modules: set[str],
    known: frozenset[tuple[str, str]] = KNOWN_VIOLATIONS,
    layers: tuple[str, ...] = LAYERS,
) -> list[str]:
    """Every broken rule (module docstring), one message each; empty when the graph is clean."""
    found = []
    rank = {package: i for i, package in enumerate(layers)}
    order = " < ".join(layers)
    for package in sorted({_package(m) for m in modules} - set(layers) - {""}):
        found.append(
            f"python/dockyard_rl/{package}: a top-level package (or module) missing from LAYERS "
            f"in tests/import_graph_test.py: add it where it belongs in {order}"
        )
    violated = set()
    package_edges: dict[str, set[str]] = {}
    module_edges: dict[str, set[str]] = {}
    for imp in imports:
        module_edges.setdefault(imp.importer, set()).add(imp.imported)
        source, target = imp.importer_package, imp.imported_package
        if source == target:
            continue
        if source == "":
            found.append(
                f"{imp.path}:{imp.line}: imports {imp.imported}: the root package "
                f"{ROOT_PACKAGE}/__init__.py imports none of its packages (importing any one "
                "would load them all)"
            )
            continue
        if source in rank and target in rank and rank[target] > rank[source]:
            if (imp.importer, target) in known:
                violated.add((imp.importer, target))
                continue
            found.append(
                f"{imp.path}:{imp.line}: imports {imp.imported}: {source} may not import "
                f"{target}, which sits above it ({order}). Move what both need into a package "
                f"at or below {source}, or let {source} define a Protocol that {target}'s "
                "objects satisfy"
            )
        # Known violations stay out of the package graph (they would close circles with the
        # legitimate imports in the other direction); a new upward import that closes one is
        # named twice, as an upward import and as the circle it makes.
        package_edges.setdefault(source, set()).add(target)
    for importer, target in sorted(known - violated):
        found.append(
            f"KNOWN_VIOLATIONS lists ({importer!r}, {target!r}), but {importer} no longer imports "
            f"{target} upward: delete the entry from tests/import_graph_test.py (the list only "
            "shrinks)"
        )
    for cycle in _cycles(package_edges):
        found.append(
            f"top-level packages import each other in a circle: {', '.join(cycle)}; break it "
            f"so they follow {order}"
        )
    for cycle in _cycles(module_edges):
        lines = [
            f"  {imp.path}:{imp.line}: {imp.importer} imports {imp.imported}"
            for imp in imports
            if imp.importer in cycle and imp.imported in cycle
        ]
        found.append(
            "modules import each other in a circle (lazy imports count): "
            + ", ".join(cycle)
            + "; move what they share into a module both import\n"
            + "\n".join(lines)
        )
    return found


# The workspace: this file's real location (under Bazel the runfile is a symlink into the
# source tree, like the anchors of //tools/lint's tests), so the test reads the working tree.
WORKSPACE = pathlib.Path(__file__).resolve().parents[1]


@functools.cache
def _workspace_graph() -> tuple[list[Import], set[str]]:
    files = workspace_files.source_files(
        WORKSPACE, ["python/dockyard_rl/*.py", "python/dockyard_rl/*BUILD*"]
    )
    return collect(WORKSPACE, files)


def test_no_upward_imports_and_no_circles():
    imports, modules = _workspace_graph()
    assert len(modules) > 100, f"found only {len(modules)} modules under {WORKSPACE}"
    report = problems(imports, modules)
    assert not report, "\n".join(report)


# --- the checker on small fake trees ------------------------------------------------------------


def _tree(tmp_path: pathlib.Path, files: Mapping[str, str]) -> tuple[list[Import], set[str]]:
    for name, text in files.items():
        path = tmp_path / "python" / "dockyard_rl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in {pathlib.PurePath(name).parts[0] for name in files}:
        init = tmp_path / "python" / "dockyard_rl" / package / "__init__.py"
        if not init.exists() and init.parent.is_dir():
            init.write_text("")
    return collect(tmp_path, sorted((tmp_path / "python").rglob("*")))


LAYERS_ABC = ("low", "mid", "high")


def test_an_upward_import_is_reported_with_file_line_and_rule(tmp_path):
    imports, modules = _tree(
        tmp_path,
        {
            "low/base.py": "import os\n",
            "mid/loss.py": "\nfrom dockyard_rl.high.loop import train\n",
            "high/loop.py": "from dockyard_rl.low import base\ndef train(): ...\n",
        },
    )
    (report,) = problems(imports, modules, frozenset(), LAYERS_ABC)
    assert report.startswith("python/dockyard_rl/mid/loss.py:2: imports dockyard_rl.high.loop: ")
    assert "mid may not import high, which sits above it (low < mid < high)" in report


def test_a_circle_of_packages_is_named(tmp_path):
    imports, modules = _tree(
        tmp_path,
        {
            "mid/loss.py": "from dockyard_rl.high.loop import train\n",
            "high/loop.py": "from dockyard_rl.mid.metrics import mean\ndef train(): ...\n",
            "mid/metrics.py": "def mean(): ...\n",
        },
    )
    upward, circle = problems(imports, modules, frozenset(), LAYERS_ABC)
    assert upward.startswith("python/dockyard_rl/mid/loss.py:1: imports dockyard_rl.high.loop")
    assert circle.startswith("top-level packages import each other in a circle: high, mid;")


def test_lazy_type_checking_and_relative_imports_count(tmp_path):
    imports, modules = _tree(
        tmp_path,
        {
            "low/a.py": "def f():\n    from dockyard_rl.mid import b\n",
            "low/c.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    import dockyard_rl.high\n",
            "low/d.py": "from ..mid.b import g\n",
            "mid/b.py": "def g(): ...\n",
            "high/h.py": "",
        },
    )
    report = problems(imports, modules, frozenset(), LAYERS_ABC)
    assert [r.split(": ")[0] for r in report] == [
        "python/dockyard_rl/low/a.py:2",
        "python/dockyard_rl/low/c.py:3",
        "python/dockyard_rl/low/d.py:1",
    ], report


def test_known_violations_are_allowed_and_a_stale_one_fails(tmp_path):
    imports, modules = _tree(
        tmp_path,
        {"low/a.py": "from dockyard_rl.mid import b\n", "mid/b.py": "", "low/z.py": ""},
    )
    known = frozenset({("dockyard_rl.low.a", "mid")})
    assert problems(imports, modules, known, LAYERS_ABC) == []
    stale = known | {("dockyard_rl.low.z", "high")}
    (report,) = problems(imports, modules, stale, LAYERS_ABC)
    assert "KNOWN_VIOLATIONS lists ('dockyard_rl.low.z', 'high')" in report
    assert "delete the entry" in report


def test_module_circles_and_unknown_packages_are_reported(tmp_path):
    imports, modules = _tree(
        tmp_path,
        {
            "mid/loop_a.py": "def f():\n    from dockyard_rl.mid.loop_b import g\n",
            "mid/loop_b.py": "from dockyard_rl.mid import loop_a\ndef g(): ...\n",
            "extra/x.py": "",
        },
    )
    circle, unknown = sorted(problems(imports, modules, frozenset(), LAYERS_ABC))
    assert circle.startswith(
        "modules import each other in a circle (lazy imports count): "
        "dockyard_rl.mid.loop_a, dockyard_rl.mid.loop_b;"
    )
    assert "python/dockyard_rl/mid/loop_a.py:2: dockyard_rl.mid.loop_a imports" in circle
    assert unknown.startswith("python/dockyard_rl/extra: a top-level package (or module) missing")


def test_tests_and_testonly_helpers_may_import_anything(tmp_path):
    imports, modules = _tree(
        tmp_path,
        {
            "low/a_test.py": "from dockyard_rl.high import h\n",
            "low/helpers.py": "from dockyard_rl.high import h\n",
            "low/BUILD": 'py_library(\n    name = "helpers",\n    testonly = True,\n'
            '    srcs = ["helpers.py"],\n)\n',
            "high/h.py": "",
        },
    )
    assert problems(imports, modules, frozenset(), LAYERS_ABC) == []


def test_the_real_tree_is_read():
    """The main test would pass vacuously on an empty listing; the checker must see the known
    layering of this repository (algorithms imports models, and models sits below it)."""
    imports, _ = _workspace_graph()
    pairs = {(imp.importer_package, imp.imported_package) for imp in imports}
    assert ("algorithms", "models") in pairs
    assert ("models", "losses") in pairs
