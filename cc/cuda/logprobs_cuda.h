// CUDA implementation of gather_logprobs / gather_logprobs_backward
// (cc/logprobs.h) on device memory.
//
// Same contract, layout and special values as the CPU functions (see
// cc/logprobs.h); results agree with them to float rounding: the GPU uses
// CUDA's expf where the CPU uses its own polynomial, and sums per thread in
// another order. One block per row: each thread keeps an online (max, sum,
// entropy-sum) over a strided slice of the row, then warp shuffles and shared
// memory merge the slices.
//
// This header is plain C++: a .cc compiled by g++ can include it without the
// CUDA headers. cudaStream_t is declared here exactly as cuda_runtime.h
// declares it (a pointer to the opaque CUstream_st); C++ allows the same alias
// twice, so including both headers is fine.

#ifndef DOCKYARD_CC_CUDA_LOGPROBS_CUDA_H_
#define DOCKYARD_CC_CUDA_LOGPROBS_CUDA_H_

#include <cstdint>

#include "cc/logprobs.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace dockyard::kernels {

// All pointers: device (or managed) memory of one GPU, laid out as for
// gather_logprobs. The work runs on `stream` (nullptr = the legacy default
// stream) on the GPU that holds the logits, whatever the current device; the
// current device is restored after.
//
// Target ids are validated on the device first, and the stream is
// synchronized once for that (so an out-of-range id is reported as
// std::out_of_range naming the first bad row and id, before anything is
// written); the main kernel is then queued and not waited for.
//
// Throws as gather_logprobs (std::invalid_argument for bad arguments, plus
// logits that are not device memory), and std::runtime_error with CUDA's
// error string when a CUDA call fails.
void gather_logprobs_cuda(const void* d_logits, LogitsDtype dtype,
                          int64_t num_rows, int64_t vocab_size,
                          int64_t row_stride, const int64_t* d_targets,
                          double temperature, float* d_logprobs,
                          float* d_entropy, float* d_row_max,
                          double* d_row_log_sum, cudaStream_t stream);

// As gather_logprobs_backward, on device memory; same stream and error rules
// as gather_logprobs_cuda.
void gather_logprobs_backward_cuda(
    const void* d_logits, LogitsDtype dtype, int64_t num_rows,
    int64_t vocab_size, int64_t row_stride, const int64_t* d_targets,
    double temperature, const float* d_row_max, const double* d_row_log_sum,
    const float* d_entropy, const float* d_grad_logprobs,
    const float* d_grad_entropy, void* d_grad_logits, cudaStream_t stream);

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_CUDA_LOGPROBS_CUDA_H_
