// Bucketed refit packer for weight sync (core library: no Python, no CUDA).
//
// Weight sync sends a model's named tensors from the trainer to the inference
// engine. Sending one tensor at a time costs one collective (or request) per
// tensor; instead the sender packs tensors into a few large flat byte buckets
// and the receiver views each tensor's bytes in them. This library holds the
// sender's two byte-level parts:
//
// 1. Planning (`plan_buckets`): given each tensor's byte size, in order, place
//    every tensor at an aligned byte offset in a bucket of at most
//    `bucket_size_bytes` bytes. Rules, in order of the tensors:
//    - a tensor goes at the first offset >= the current bucket's end that is a
//      multiple of `alignment`;
//    - if it does not fit there (offset + nbytes > bucket_size_bytes) and the
//      current bucket already holds bytes, a new bucket starts (offset 0);
//    - so a tensor larger than a bucket gets a bucket of its own (it starts a
//      new bucket, and the next non-empty tensor cannot fit after it);
//    - a zero-byte tensor never starts a bucket: it sits at the aligned end of
//      the current one (bucket 0 when it comes first);
//    - each bucket's size is its end rounded up to `alignment`, so every
//      bucket is a multiple of it: at most `bucket_size_bytes` (itself a
//      multiple of the alignment), except a bucket whose only non-empty tensor
//      is larger than that.
//    Alignment is a power of two >= kMinAlignment (16): every offset is then a
//    multiple of every element size, so the receiver can view a byte range of
//    a bucket as a typed tensor, and CUDA can use 16-byte vector loads.
//
// 2. The copy (`pack_bucket`): multi-threaded byte copies of many tensors
//    into one bucket. Tensors are N-d strided views (shape and strides in
//    elements, element size in bytes), so non-contiguous sources
//    (transposes, slices with steps) are copied directly, without a
//    contiguous temporary. Each tensor's bytes in the bucket are its elements
//    in row-major (C) order, exactly what `tensor.contiguous()` would hold.
//    Work is split across std::thread workers by bytes (a large tensor is
//    split between workers), so the result does not depend on the thread
//    count.
//
// Errors are standard exceptions with the function's name and the span index:
// std::invalid_argument for bad arguments, std::out_of_range for a span that
// does not lie inside its bucket.
//
// Not covered here: dtypes (the caller maps them to element sizes), names and
// the manifest (python/dockyard_rl/kernels/refit_packer.py), device memory
// (cc/cuda/refit_packer_cuda.h), copying buckets back into tensors (the
// receiver reads typed views of a bucket: refit_copy.py's bucket_views).

#ifndef DOCKYARD_CC_REFIT_PACKER_H_
#define DOCKYARD_CC_REFIT_PACKER_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace dockyard::kernels {

// The smallest allowed alignment: the widest element size (complex128) and
// the widest vector load (16 bytes).
constexpr int64_t kMinAlignment = 16;
// The largest allowed alignment (1 GiB); larger values only waste memory.
constexpr int64_t kMaxAlignment = int64_t{1} << 30;

struct BucketPlan {
  std::vector<int64_t> bucket_of;     // Per tensor: its bucket index.
  std::vector<int64_t> offset_of;     // Per tensor: its byte offset there.
  std::vector<int64_t> bucket_sizes;  // Per bucket: its size in bytes.
};

// Places tensors of `tensor_nbytes` bytes (in order) into buckets, as
// described at the top of this file. No tensors give no buckets.
//
// Throws std::invalid_argument when: alignment is not a power of two in
// [kMinAlignment, kMaxAlignment]; bucket_size_bytes is not a positive multiple
// of alignment; a size is negative (the message names its index); or a bucket
// end would overflow int64.
BucketPlan plan_buckets(const std::vector<int64_t>& tensor_nbytes,
                        int64_t bucket_size_bytes, int64_t alignment);

// A tensor's memory: element [i0, ..., ik] of `element_size` bytes starts at
// data + (i0 * strides[0] + ... + ik * strides[k]) * element_size. An empty
// shape is a 0-d tensor (one element). Strides are >= 0 (torch never makes
// negative ones).
struct StridedTensor {
  void* data = nullptr;
  int64_t element_size = 0;  // 1, 2, 4, 8 or 16.
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

// One tensor's place in a bucket: its row-major bytes occupy
// [offset, offset + numel * element_size).
struct BucketSpan {
  StridedTensor tensor;
  int64_t offset = 0;
};

// num_threads: 0 = automatic (one thread per ~kMinBytesPerThread bytes, at
// most std::thread::hardware_concurrency()); n > 0 = exactly n workers
// (capped by the number of bytes), for tests and benchmarks.
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;
constexpr int kMaxThreads = 1024;

// Copies every span's tensor into `bucket` (bucket_nbytes bytes) at its
// offset, and writes zeros to every byte no span covers (alignment padding),
// so that the bucket's contents are fully determined by the tensors.
//
// Throws (before writing anything) std::invalid_argument when: bucket_nbytes
// is negative; bucket is null while bucket_nbytes > 0; num_threads is outside
// [0, kMaxThreads]; a span has an element size not in {1, 2, 4, 8, 16}, shape
// and strides of different lengths, a negative size or stride, a byte size
// that overflows int64, a null pointer with elements, or a negative offset;
// two spans overlap in the bucket; or a tensor's memory overlaps the bucket.
// Throws std::out_of_range when a span ends past bucket_nbytes.
void pack_bucket(const std::vector<BucketSpan>& spans, void* bucket,
                 int64_t bucket_nbytes, int num_threads = 0);

// Shared with the CUDA implementation (cc/cuda/refit_packer_cuda.h) so that
// both validate and word their errors alike; not for other callers.
namespace internal {

// A validated span with its dims collapsed: size-1 dims dropped and adjacent
// dims merged where the outer stride is the inner stride times the inner
// size. Strides are in bytes. A contiguous tensor becomes one dim whose
// stride is the element size (or zero dims for a single element).
struct CollapsedSpan {
  char* data = nullptr;
  int64_t element_size = 0;
  int64_t numel = 0;
  int64_t nbytes = 0;
  int64_t offset = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> byte_strides;
  // The tensor's memory is [data, data + extent) (0 for empty tensors).
  int64_t extent = 0;
};

// Validates `spans` against a bucket of `bucket_nbytes` bytes at `bucket`
// (throws as pack_bucket describes; `function` starts each message) and
// returns them collapsed, in the caller's order. Zero-element spans are
// validated and returned too (numel 0).
std::vector<CollapsedSpan> validate_spans(const char* function,
                                          const std::vector<BucketSpan>& spans,
                                          const void* bucket,
                                          int64_t bucket_nbytes);

// Throws std::invalid_argument unless 0 <= num_threads <= kMaxThreads.
void validate_num_threads(const char* function, int num_threads);

// The byte ranges [begin, end) of the bucket that no span covers, in order.
std::vector<std::pair<int64_t, int64_t>> uncovered_ranges(
    const std::vector<CollapsedSpan>& spans, int64_t bucket_nbytes);

}  // namespace internal

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_REFIT_PACKER_H_
