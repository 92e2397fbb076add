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

Weight refit moves the SAME tensors after every optimizer step, so the hot path is a plan built
once: ``PackPlan`` (sender) and ``UnpackPlan`` (receiver) validate every tensor and prepare the
copies once (on CUDA: job descriptors uploaded to the GPU once); each call then only checks that
no tensor was re-allocated (one pass over ``data_ptr()``, re-planning when one was) and makes one
native call: ONE kernel launch on CUDA for all buckets. Sender::

    manifest = plan_buckets(describe_tensors(params), bucket_size_bytes=256 << 20)
    send(manifest.to_dict())
    plan = PackPlan(params, manifest)  # once; params: e.g. dict(model.named_parameters())
    buffers = [torch.empty(manifest.max_bucket_size, dtype=torch.uint8) for _ in range(2)]
    for bucket in plan.iter_pack(buffers):  # every step; double buffering: pack b while b - 1
        send(bucket)                        # is in flight

Receiver: ``manifest = Manifest.from_dict(received)``, ``plan = UnpackPlan(manifest,
model_params)`` once, then per step ``plan.unpack_into(buckets)`` (or per bucket
``plan.unpack_bucket_into(bucket, b)``).

A sender whose tensors exist one bucket at a time (a trainer that all-gathers sharded weights
bucket by bucket) builds ``plan = PackPlan.from_manifest(manifest)`` once and, per step and bucket,
calls ``plan.pack_bucket_from(named_tensors_of_bucket_b, b, out=buffer)``: the bucket's tensors
are validated against the manifest (names, shapes, dtypes, device) and packed in one native call.
``UnpackPlan.from_manifest(manifest).unpack_bucket_to(bucket, b, destinations)`` is the
receiver's counterpart.

The functional API (``pack``, ``iter_pack``, ``pack_bucket``, ``unpack``, ``unpack_bucket``,
``unpack_into``, ``unpack_bucket_into``) builds a plan for one call and runs it: the same checks
and copies, with every check on every call (about a millisecond of host work for a few hundred
tensors, whatever their size); use it for one-off copies.

Modules (this one re-exports their API): refit_manifest.py (``TensorEntry``, ``Manifest``,
``DTYPES``), refit_planning.py (``describe_tensors``, ``plan_buckets``), refit_copy.py (the plans,
the functional API, the one copy path).

Implementations: the C++/CUDA extension ``_dockyard_kernels`` (cc/refit_packer.cc: multi-threaded
strided byte copies, no contiguous temporaries; cc/cuda/refit_packer_cuda.cu: batched kernel
launches with 16-byte vector copies, asynchronous on torch's current stream) when importable and
built for the tensors' device, else plain torch (``copy_`` through typed views of the bucket).
Both give identical bytes.

Covered dtypes: ``DTYPES`` (floating point incl. bfloat16 and float8, signed ints, uint8, bool).
Non-contiguous sources and destinations are supported (transposes, slices with steps);
destinations whose elements share memory (``expand``-ed tensors) are rejected with ValueError.
Not covered: sparse, quantized or complex tensors; moving tensors between devices (all tensors of
a bucket live on the bucket's device); destinations that share memory with each other (e.g. tied
weights listed under two names) are not detected and receive the bytes of one of them; the
transport itself (python/dockyard_rl/weight_sync/).
"""

from dockyard_rl.kernels._extension import HAS_EXTENSION
from dockyard_rl.kernels.refit_copy import (
    MAX_THREADS,
    ON_REALLOCATION,
    PackPlan,
    UnpackPlan,
    iter_pack,
    pack,
    pack_bucket,
    unpack,
    unpack_bucket,
    unpack_bucket_into,
    unpack_into,
)
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
    "MAX_THREADS",
    "MIN_ALIGNMENT",
    "ON_REALLOCATION",
    "Manifest",
    "PackPlan",
    "TensorEntry",
    "UnpackPlan",
    "describe_tensors",
    "iter_pack",
    "pack",
    "pack_bucket",
    "plan_buckets",
    "unpack",
    "unpack_bucket",
    "unpack_bucket_into",
    "unpack_into",
]
