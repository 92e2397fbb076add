// CUDA implementation of the refit packer's copies (cc/refit_packer.h) on
// device memory, in two forms:
//
// - pack_bucket_cuda / unpack_bucket_cuda: one bucket per call, everything
//   validated and the job descriptors uploaded per call (stream-ordered), then
//   ONE kernel launch whatever the number of tensors.
// - CudaCopyPlan: the refit path. The same tensors are copied every optimizer
//   step, so the plan validates them and uploads the job descriptors ONCE;
//   each run() is then one kernel launch for any range of buckets (up to
//   kCudaBucketsPerLaunch per launch) with no host-to-device transfer: the
//   buckets' base pointers travel as a kernel argument.
//
// Same contract, validation and error messages as the CPU functions (the
// function name in messages ends in "_cuda"), and the same bytes: each
// tensor's row-major elements at its offset, zeros in the padding.
//
// How it copies: every tensor (and, for pack, every padding range) becomes a
// job; each job is cut into chunks of bucket bytes (a power of two between
// 8 KiB and 64 KiB, smaller for small buckets so that they still spread over
// every SM) and a grid of as many blocks as the GPU holds resident strides
// over the chunks; a per-chunk table names each chunk's job. A dense job (the
// tensor's dims collapse to one with unit element stride) is copied with
// 16-byte vector loads and stores, four in flight per thread, when both
// addresses are 16-byte aligned (bucket offsets always are; tensors usually
// are), else with the widest word both addresses allow. A strided job
// (transposes, stepped slices) computes each element's address from its
// row-major index; at most kCudaMaxDims dims may remain after collapsing.
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

// The most buckets one kernel launch copies; CudaCopyPlan::run splits larger
// ranges into several launches.
constexpr int kCudaBucketsPerLaunch = 32;

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

// As unpack_bucket, on the device; same notes as pack_bucket_cuda.
void unpack_bucket_cuda(const void* d_bucket, int64_t bucket_nbytes,
                        const std::vector<BucketSpan>& spans,
                        cudaStream_t stream);

// A CopyPlan (cc/refit_packer.h) on one GPU: validated on the host and its
// job descriptors uploaded to that GPU once, at construction.
class CudaCopyPlan {
 public:
  // Validates `spans` as CopyPlan does (messages start with `function`) and
  // checks that every tensor with bytes is device (or managed) memory of GPU
  // `device`; then uploads the job descriptors (synchronously: construction
  // is not on the hot path). Throws what CopyPlan throws, plus
  // std::invalid_argument for memory not on `device` or a tensor with more
  // than kCudaMaxDims dims after collapsing, and std::runtime_error with
  // CUDA's error string when a CUDA call fails.
  CudaCopyPlan(const char* function, CopyDirection direction,
               const std::vector<PlanSpan>& spans,
               std::vector<int64_t> bucket_sizes, int device);
  // Waits for the plan's GPU to finish (a queued run may still read the
  // descriptors), then frees them.
  ~CudaCopyPlan();
  CudaCopyPlan(const CudaCopyPlan&) = delete;
  CudaCopyPlan& operator=(const CudaCopyPlan&) = delete;

  const CopyPlan& host_plan() const { return plan_; }
  int device() const { return device_; }
  int64_t num_chunks() const { return num_chunks_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }

  // Queues the copies of buckets [first_bucket, first_bucket +
  // buckets.size()) on `stream` (nullptr = the legacy default stream), on the
  // plan's GPU whatever the current device (restored after); buckets[i] is
  // the device address of bucket first_bucket + i. Not waited for: order
  // later work on `stream` or synchronize it. Host work per call: checks of
  // the bucket pointers (range, device, overlap with the tensors) and one
  // kernel launch per kCudaBucketsPerLaunch buckets.
  //
  // Throws (before queuing anything) what CopyPlan::check_buckets throws,
  // std::invalid_argument for a bucket that is not device memory of the
  // plan's GPU, and std::runtime_error when a CUDA call fails.
  void run(const std::vector<void*>& buckets, int64_t first_bucket,
           cudaStream_t stream) const;

 private:
  CopyPlan plan_;
  int device_ = 0;
  int64_t chunk_bytes_ = 0;
  int64_t num_chunks_ = 0;
  int num_blocks_cap_ = 0;  // Blocks resident at once on the plan's GPU.
  // Per bucket b: its chunks are [bucket_first_chunk_[b],
  // bucket_first_chunk_[b + 1]).
  std::vector<int64_t> bucket_first_chunk_;
  void* d_jobs_ = nullptr;       // Job[num_jobs]
  void* d_chunk_job_ = nullptr;  // int32_t[num_chunks_]: each chunk's job.
};

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_CUDA_REFIT_PACKER_CUDA_H_
