"""The check every transport runs before the engine is touched: does the manifest the trainer
will send hold exactly the weights the engine expects (names, shapes, dtypes)?"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dockyard_rl.kernels import refit_packer


def dtype_name(dtype: torch.dtype | str) -> str:
    """ "float32" for torch.float32 or "float32"."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def check_manifest_against_refit_info(
    manifest: refit_packer.Manifest,
    expected: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
) -> None:
    """Raises ValueError naming the first difference between the manifest's tensors and
    `expected` (names, shapes, dtypes); the manifest must hold exactly the expected names."""
    expected_names = set(expected)
    for entry in manifest.tensors:
        if entry.name not in expected_names:
            raise ValueError(
                f"weight manifest: unexpected tensor {entry.name!r}: the engine's model has no "
                f"such weight (expected HF names like {sorted(expected_names)[0]!r}); send the "
                "names of prepare_refit_info()"
            )
        shape, dtype = expected[entry.name]
        if tuple(entry.shape) != tuple(shape):
            raise ValueError(
                f"weight manifest: tensor {entry.name!r} has shape {entry.shape} but "
                f"the engine expects {tuple(shape)}"
            )
        if entry.dtype != dtype_name(dtype):
            raise ValueError(
                f"weight manifest: tensor {entry.name!r} has dtype {entry.dtype} but "
                f"the engine expects {dtype_name(dtype)}"
            )
    missing = sorted(expected_names - set(manifest.names))
    if missing:
        raise ValueError(
            f"weight manifest: {len(missing)} expected tensor(s) missing, e.g. {missing[0]!r}; a "
            "partial update would leave the engine with mixed weights, send all of them"
        )
