"""Pytest helpers shared by the kernels' tests (``<kernel>_test.py`` beside each module).

- ``load_extension()``: the compiled ``_dockyard_kernels`` module; when it is missing the calling
  test FAILS (never skips): a build that lost the extension must not pass by testing only the
  torch fallback.
- ``ext``: a module-scoped pytest fixture returning ``load_extension()``. Tests import it
  explicitly (``from dockyard_rl.kernels.testing_extension import ext``); there is no conftest.py.

Not covered: CUDA availability (tests mark CUDA cases with ``pytest.mark.skipif`` themselves).
"""

from __future__ import annotations

import types

import pytest

from dockyard_rl.kernels import _extension

__all__ = ["ext", "load_extension"]


def load_extension() -> types.ModuleType:
    """Returns the compiled extension; fails the calling test when it is missing."""
    if _extension.EXTENSION is None:
        pytest.fail(
            f"_dockyard_kernels is not importable ({_extension.IMPORT_ERROR}); the build provides "
            "it: run this test through Bazel, or put the built extension's folder on PYTHONPATH"
        )
    return _extension.EXTENSION


@pytest.fixture(scope="module")
def ext() -> types.ModuleType:
    """The compiled extension; fails (does not skip) when it is missing."""
    return load_extension()
