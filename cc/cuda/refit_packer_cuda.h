// CUDA implementation of the refit packer's copy (cc/refit_packer.h) on
// device memory: pack_bucket_cuda validates one bucket's spans, uploads the
// job descriptors (stream-ordered), then makes ONE kernel launch whatever the
// number of tensors.
//
// Same contract, validation and error messages as pack_bucket (the function
// name in messages is "pack_bucket_cuda"), and the same bytes: each tensor's
// row-major elements at its offset, zeros in the padding.
//
// How it copies: every tensor (and every padding range) becomes a job; each
// job is cut into chunks of bucket bytes (a power of two between 8 KiB and
// 64 KiB, smaller for small buckets so that they still spread over every SM)
// and a grid of as many blocks as the GPU holds resident strides over the
// chunks; a per-chunk table names each chunk's job. A dense job (the tensor's
// dims collapse to one with unit element stride) is copied with 16-byte
// vector loads and stores, four in flight per thread, when both addresses are
// 16-byte aligned (bucket offsets always are; tensors usually are), else with
// the widest word both addresses allow. A strided job (transposes, stepped
// slices) computes each element's address from its row-major index; at most
// kCudaMaxDims dims may remain after collapsing.
//
// This header is plain C++: a .cc compiled by g++ can include it without the
// CUDA headers. cudaStream_t is declared here exactly as cuda_runtime.h
// declares it (a pointer to the opaque CUstream_st); C++ allows the same alias
// twice, so including both headers is fine.

#ifndef DOCKYARD_CC_CUDA_REFIT_PACKER_CUDA_H_
#define DOCKYARD_CC_CUDA_REFIT_PACKER_CUDA_H_

#include <cstdint>
#include <vector>

#include "cc/refit_packer.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace dockyard::kernels {

// The most dims a strided tensor may have after collapsing (size-1 dims
// dropped, mergeable dims merged); e.g. any transpose or slice of a weight
// matrix has at most 2. More raise std::invalid_argument: make such a tensor
// contiguous first.
constexpr int kCudaMaxDims = 8;

// d_bucket and every tensor's data: device (or managed) memory of one GPU.
// The copy is queued on `stream` (nullptr = the legacy default stream) on the
// GPU that holds the bucket, whatever the current device (restored after),
// and is NOT waited for: order later work on `stream` or synchronize it.
// The job descriptors are uploaded from pageable host memory, so the host may
// wait for work already queued on `stream` before the launch.
//
// Throws (before queuing anything) what pack_bucket throws, plus
// std::invalid_argument for memory that is not on the bucket's GPU or a
// tensor with more than kCudaMaxDims dims after collapsing, and
// std::runtime_error with CUDA's error string when a CUDA call fails.
void pack_bucket_cuda(const std::vector<BucketSpan>& spans, void* d_bucket,
                      int64_t bucket_nbytes, cudaStream_t stream);

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_CUDA_REFIT_PACKER_CUDA_H_
