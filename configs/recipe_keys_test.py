"""Every key of every recipe in configs/ takes effect: it is a field of the typed config, and
product code reads that field.

Two checks per recipe, so the test cannot pass vacuously:
1. The recipe loads (`load_config`, which also refuses keys set on a path of the loop that does
   not read them: grpo_config.UNREAD_UNLESS), and walking its YAML next to the loaded
   `MasterConfig` maps every key to a dataclass field (`recipe_fields`; a stage's `type` is the
   loader's discriminator). A recipe yields dozens of keys; the test requires that it does.
2. Each such field is read by product code: a static scan (`attribute_reads`) of every module
   under python/ except tests and test helpers collects the attribute names read as `x.name`,
   `getattr(x, "name")` or `d["name"]` (a section turned into a dict of its keys, as the engine's
   sampling parameters are) outside `__post_init__`, where config classes only validate. A field
   no product code reads is a key that does nothing.

The scan matches names, not types: a field shares its name's reads with any other attribute of
that name, so it proves "something reads a field of this name", not which dataclass. What it
does not see: a field consumed only as a whole dataclass (`dataclasses.asdict`), which then
counts as unread (the safe direction: the test fails and the reader is made explicit).
The self-tests show the detector failing for a key nothing reads, a key only validated, and a
key that is no field.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from dockyard_rl.algorithms.grpo_config import load_config

# configs/<this file> -> the workspace root (also in Bazel's runfiles tree).
WORKSPACE = pathlib.Path(__file__).absolute().parents[1]
RECIPES = sorted((WORKSPACE / "configs").glob("*.yaml"))
PRODUCT_ROOT = WORKSPACE / "python"
# Fewer keys than this from a recipe means the walk went wrong, not that the recipe is small.
MIN_KEYS_PER_RECIPE = 20


@dataclasses.dataclass(frozen=True)
class RecipeKey:
    key: str  # dotted, e.g. "cluster.fleets.trainer.strategy"
    owner: str  # the dataclass holding the field, e.g. "FleetConfig"
    field: str


def recipe_fields(raw: Any, config: Any, prefix: str = "") -> Iterator[RecipeKey]:
    """Every key of the YAML `raw` with the dataclass field it sets in `config` (the config
    loaded from it). ValueError for a key that is no field of its dataclass."""
    if dataclasses.is_dataclass(config) and isinstance(raw, Mapping):
        fields = {f.name for f in dataclasses.fields(config)}
        for name, value in raw.items():
            key = f"{prefix}{name}"
            if name == "type" and hasattr(type(config), "stage_type"):
                continue  # the loader picks the stage class by it
            if name not in fields:
                raise ValueError(f"{key}: no field {name!r} in {type(config).__name__}")
            yield RecipeKey(key, type(config).__name__, name)
            yield from recipe_fields(value, getattr(config, name), f"{key}.")
    elif isinstance(raw, list) and isinstance(config, (list, tuple)):
        for index, (item, loaded) in enumerate(zip(raw, config, strict=True)):
            yield from recipe_fields(item, loaded, f"{prefix[:-1]}[{index}].")
    # Anything else is a leaf: a scalar, or a mapping-valued field (resources, extra).


def _is_product_module(path: pathlib.Path) -> bool:
    name = path.name
    return not (name.endswith("_test.py") or name.startswith("testing_"))


class _Reads(ast.NodeVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name != "__post_init__":  # validation is not an effect
            self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            self.names.add(node.attr)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        if (
            isinstance(node.ctx, ast.Load)
            and isinstance(key, ast.Constant)
            and isinstance(key.value, str)
        ):
            self.names.add(key.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            self.names.add(node.args[1].value)
        self.generic_visit(node)


def attribute_reads(root: pathlib.Path) -> set[str]:
    """Attribute names product modules under `root` read (module docstring, check 2)."""
    visitor = _Reads()
    modules = [p for p in sorted(root.rglob("*.py")) if _is_product_module(p)]
    for path in modules:
        visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.names


def unread_keys(keys: list[RecipeKey], reads: set[str]) -> list[str]:
    return [f"{k.key} ({k.owner}.{k.field})" for k in keys if k.field not in reads]


@pytest.fixture(scope="module")
def reads() -> set[str]:
    names = attribute_reads(PRODUCT_ROOT)
    # The scan saw the product code (not an empty folder): the loop's own reads are there.
    assert {"placement_timeout_s", "nccl_env", "sample_timeout_s", "num_engines"} <= names
    return names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_key_is_a_field_that_product_code_reads(recipe, reads):
    config = load_config(recipe, base_dir=WORKSPACE)
    keys = list(recipe_fields(yaml.safe_load(recipe.read_text()), config))
    assert len(keys) >= MIN_KEYS_PER_RECIPE, [k.key for k in keys]
    assert unread_keys(keys, reads) == [], "keys that nothing reads: remove them or read them"


def test_the_recipes_are_found():
    assert len(RECIPES) >= 5, RECIPES


# -- the detector itself


@dataclasses.dataclass(frozen=True)
class _Inner:
    used: int = 1
    validated_only: int = 2

    def __post_init__(self) -> None:
        assert self.validated_only > 0


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    forgotten: str = "x"


_PRODUCT_SOURCE = """
def consume(config, sampling):
    return config.inner.used + getattr(config, "other") + sampling["temperature"]
"""


def test_the_detector_reports_a_key_nothing_reads_and_one_only_validated(tmp_path):
    (tmp_path / "module.py").write_text(_PRODUCT_SOURCE)
    (tmp_path / "module_test.py").write_text("def test(c):\n    return c.forgotten\n")
    reads = attribute_reads(tmp_path)
    raw = {"inner": {"used": 3, "validated_only": 4}, "forgotten": "y"}
    keys = list(recipe_fields(raw, _Outer(_Inner(3, 4), "y")))
    assert [k.key for k in keys] == ["inner", "inner.used", "inner.validated_only", "forgotten"]
    assert {"inner", "used", "other", "temperature"} <= reads
    # Read in product code: inner, used. Only in __post_init__ or in a test: reported.
    assert unread_keys(keys, reads) == [
        "inner.validated_only (_Inner.validated_only)",
        "forgotten (_Outer.forgotten)",
    ]


def test_the_detector_rejects_a_key_that_is_no_field():
    with pytest.raises(ValueError, match=r"inner\.typo: no field 'typo' in _Inner"):
        list(recipe_fields({"inner": {"typo": 1}}, _Outer()))
