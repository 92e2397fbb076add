"""The one import of the C++/CUDA extension ``_dockyard_kernels`` for the kernel modules.

The build puts the extension on ``sys.path`` as a top-level module (the ``//cc:_dockyard_kernels``
target). Outside the build (a plain checkout on PYTHONPATH) it may be missing; the kernel modules
then fall back to torch, and this module keeps the import error so that their messages can say
why the extension is absent.

- ``EXTENSION``: the module, or None when it is not importable.
- ``HAS_EXTENSION``: ``EXTENSION is not None``.
- ``IMPORT_ERROR``: the ImportError of the failed import, or None.
- ``require_extension(what, extension)``: the extension, or the RuntimeError the kernel modules
  raise for ``use_extension=True`` without it.
- ``supports_device(extension, device)``: whether the extension runs tensors on ``device`` (CPU
  always; CUDA only in a ``--config=cuda`` build).
- ``resolve_use_extension(use_extension, device, what, extension)``: the kernel modules'
  ``use_extension`` argument (None / True / False) turned into the path to take.

The kernel modules pass their own ``_ext`` binding to these helpers rather than reading
``EXTENSION`` here, so that tests can replace a module's extension (with None or a spy).

Not covered: re-importing after a failed import (the result is fixed at first import).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

try:
    import _dockyard_kernels as _imported
except ImportError as _error:  # Only when running outside the build.
    EXTENSION: types.ModuleType | None = None
    IMPORT_ERROR: ImportError | None = _error
else:
    EXTENSION = _imported
    IMPORT_ERROR = None

HAS_EXTENSION: bool = EXTENSION is not None

__all__ = [
    "EXTENSION",
    "HAS_EXTENSION",
    "IMPORT_ERROR",
    "missing_reason",
    "require_extension",
    "resolve_use_extension",
    "supports_device",
]


def missing_reason() -> str:
    """Says why the extension is absent, for error messages (e.g. ``... ({reason})``)."""
    return f"the C++ extension _dockyard_kernels is not importable ({IMPORT_ERROR})"


def require_extension(
    what: str, extension: types.ModuleType | None = EXTENSION
) -> types.ModuleType:
    """Returns ``extension``, or raises RuntimeError saying that ``what`` needs it.

    Args:
        what: the call that needs the extension, e.g.
            ``"group_advantages(use_extension=True)"``; it starts the message.
        extension: the module the caller would use. The kernel modules pass their own
            ``_ext`` binding (tests replace it), so the check sees what the call would run.

    Raises:
        RuntimeError: ``extension`` is None; the message names the import error and the fix.
    """
    if extension is None:
        raise RuntimeError(
            f"{what}: {missing_reason()}; build it with Bazel (it is a dependency of this "
            "module's target) or pass use_extension=None to fall back to torch"
        )
    return extension


def supports_device(extension: types.ModuleType | None, device: torch.device) -> bool:
    """Whether ``extension`` (None = absent) runs tensors on ``device``."""
    if extension is None:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and bool(extension.with_cuda)


def resolve_use_extension(
    use_extension: bool | None,
    device: torch.device,
    what: str,
    extension: types.ModuleType | None,
) -> bool:
    """Whether to call the extension, for a kernel module's ``use_extension`` argument.

    None picks the extension when it supports ``device``, else torch; False is torch; True is
    the extension, raising RuntimeError (``require_extension(what, extension)``) when it is
    absent. With True and a device the extension does not support, the extension's own call
    raises (e.g. a CUDA tensor on a build without CUDA).
    """
    if use_extension is None:
        return supports_device(extension, device)
    if use_extension:
        require_extension(what, extension)
    return bool(use_extension)
