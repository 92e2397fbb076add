"""Bucketed refit packer: named tensors <-> flat byte buckets, for weight sync.

Weight sync sends the trainer's weights (HF names, shapes, dtypes) to the inference engine. One
transfer per tensor is slow (hundreds of small collectives); instead the sender packs the tensors
into a few flat ``uint8`` buckets of a configurable size, sends each bucket, and the receiver
unpacks it. The :class:`Manifest` is the only thing the receiver needs for that: per tensor its
name, dtype (a string), shape, bucket index, byte offset and byte size, plus every bucket's size.
It is plain data (``to_dict`` / ``from_dict``, JSON-serialisable) and is validated whenever one is
built, so a corrupt or mismatched manifest fails before any byte is copied.

Layout (see cc/refit_packer.h for the full rules):

- Tensors are placed in manifest order; a new bucket starts when the next tensor does not fit in
  the current one; a tensor larger than a bucket gets a bucket of its own.
- Every offset is a multiple of ``alignment`` (a power of two >= 16, default 256), so a byte range
  of a bucket can be viewed as a typed tensor (``bucket[o:o + n].view(dtype).view(shape)``) and
  CUDA copies use 16-byte vector loads. Bucket sizes are multiples of the alignment too.
- A tensor's bytes are its elements in row-major order (what ``.contiguous()`` holds), whatever its
  strides; bytes between tensors are zeros.

Every sender's tensors exist one bucket at a time (the DTensor policy all-gathers each bucket's
shards; the jax policy and the driver stream the weights in manifest order), so the packer works
bucket by bucket: ``PackPlan(manifest)`` once, then per step and bucket one ``pack_bucket`` call,
which validates that bucket's tensors against the manifest (names, shapes, dtypes, one device)
and packs them in one native call. Sender::

    manifest = plan_buckets(describe_tensors(params), bucket_size_bytes=256 << 20)
    send(manifest.to_dict())
    plan = PackPlan(manifest)  # once
    buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
    for b in range(manifest.num_buckets):  # every step; bucket b packs while b - 1 is sent
        named_b = {e.name: params[e.name] for e in manifest.bucket_entries(b)}
        send(plan.pack_bucket(named_b, b, out=buffers[b % 2]))

Receiver: ``manifest = Manifest.from_dict(received)``, then per bucket
``bucket_views(bucket, manifest, b)``: the bucket's tensors as views into it, no copy (vLLM's
loader copies them into its own layout). ``pack(named, manifest)`` packs every bucket of one
mapping in one call (one-off copies: benchmarks, tests).

Modules (this one re-exports their API): refit_manifest.py (``TensorEntry``, ``Manifest``,
``DTYPES``), refit_planning.py (``describe_tensors``, ``plan_buckets``), refit_copy.py
(``PackPlan``, ``pack``, ``bucket_views``).

Implementations: the C++/CUDA extension ``_dockyard_kernels`` (cc/refit_packer.cc: multi-threaded
strided byte copies, no contiguous temporaries; cc/cuda/refit_packer_cuda.cu: batched kernel
launches with 16-byte vector copies, asynchronous on torch's current stream) when importable and
built for the tensors' device, else plain torch (``copy_`` through typed views of the bucket).
Both give identical bytes.

Covered dtypes: ``DTYPES`` (floating point incl. bfloat16 and float8, signed ints, uint8, bool).
Non-contiguous sources are supported (transposes, slices with steps, ``expand``-ed views).
Not covered: sparse, quantized or complex tensors; moving tensors between devices (all tensors of
a bucket live on the bucket's device); the transport itself (python/dockyard_rl/weight_sync/).
"""

from dockyard_rl.kernels._extension import HAS_EXTENSION
from dockyard_rl.kernels.refit_copy import PackPlan, bucket_views, pack
from dockyard_rl.kernels.refit_manifest import (
    DEFAULT_ALIGNMENT,
    DTYPES,
    MANIFEST_FORMAT_VERSION,
    MAX_ALIGNMENT,
    MIN_ALIGNMENT,
    Manifest,
    TensorEntry,
)
from dockyard_rl.kernels.refit_planning import describe_tensors, plan_buckets

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DTYPES",
    "HAS_EXTENSION",
    "MANIFEST_FORMAT_VERSION",
    "MAX_ALIGNMENT",
    "MIN_ALIGNMENT",
    "Manifest",
    "PackPlan",
    "TensorEntry",
    "bucket_views",
    "describe_tensors",
    "pack",
    "plan_buckets",
]
