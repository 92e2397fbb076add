"""Torch-facing API of the C++/CUDA extension `_dockyard_kernels` (built from cc/).

One module per kernel, each with a plain-torch path used when the extension is absent:

- `advantages`: group-relative (leave-one-out / group-mean) advantages.
- `logprobs`: fused log-prob gather (forward + backward, optional entropy).
- `refit_packer`: packing named tensors into flat byte buckets for weight sync (the facade of
  `refit_manifest`, `refit_planning` and `refit_copy`).

The extension is a top-level module the build puts on sys.path; `HAS_EXTENSION` says whether it
imported.
"""

from dockyard_rl.kernels.advantages import (
    BASELINES,
    HAS_EXTENSION,
    group_advantages,
    group_advantages_reference,
)
from dockyard_rl.kernels.logprobs import gather_logprobs, gather_logprobs_reference
from dockyard_rl.kernels.refit_packer import (
    Manifest,
    TensorEntry,
    bucket_views,
    pack,
    plan_buckets,
)

__all__ = [
    "BASELINES",
    "HAS_EXTENSION",
    "Manifest",
    "TensorEntry",
    "bucket_views",
    "gather_logprobs",
    "gather_logprobs_reference",
    "group_advantages",
    "group_advantages_reference",
    "pack",
    "plan_buckets",
]
