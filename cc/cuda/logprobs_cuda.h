// CUDA implementation of gather_logprobs / gather_logprobs_backward
// (cc/logprobs.h) on device memory.
//
// Same layout, maths and special values as the CPU functions (see
// cc/logprobs.h); results agree with them to float rounding (~1e-7 relative:
// the GPU takes exp as the hardware's 2^x of a base-2 exponent where the CPU
// uses its own polynomial, and sums in another order).
//
// Layout of the work: each row is read with 16-byte loads (4 float32 or 8
// bfloat16 logits) from its first 16-byte boundary on, with a few scalar
// loads for the elements before it and after the last whole vector, so any
// vocab size and row stride works (pointers need only their element's
// alignment). Rows of up to 16 KiB go one per warp (8 rows per block), longer
// ones one per 256-thread block. The forward keeps an online (max, sum,
// entropy-sum) per thread and merges the threads of a row with warp shuffles
// and shared memory; the backward writes the gradient with 16-byte stores
// where the gradient row and the logits row share their offset from a
// 16-byte boundary (always for contiguous logits), with scalar stores
// otherwise.
//
// Target ids are checked inside the kernels, not in a pass of their own. With
// `check_targets`, the call then waits for its stream once (reading a flag the
// kernel sets) and throws std::out_of_range naming the first bad row and id,
// as the CPU functions; unlike them, the outputs have been written by then
// (NaN in the bad rows). Without `check_targets` nothing waits: the call only
// queues the kernel, and a bad id gives NaN in its row's outputs (logprob,
// entropy, statistics; gradient row) instead of an error. Either way no
// memory outside the arrays is read.
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
// current device is restored after. With check_targets, the call returns once
// the kernel has finished; without, as soon as it is queued (see above).
//
// Throws as gather_logprobs (std::invalid_argument for bad arguments, plus
// logits that are not device memory; std::out_of_range for a bad target id
// when check_targets), and std::runtime_error with CUDA's error string when a
// CUDA call fails.
void gather_logprobs_cuda(const void* d_logits, LogitsDtype dtype,
                          int64_t num_rows, int64_t vocab_size,
                          int64_t row_stride, const int64_t* d_targets,
                          double temperature, float* d_logprobs,
                          float* d_entropy, float* d_row_max,
                          double* d_row_log_sum, cudaStream_t stream,
                          bool check_targets);

// As gather_logprobs_backward, on device memory; same stream, target and
// error rules as gather_logprobs_cuda. A caller that has just run the forward
// on the same (unchanged) targets may pass check_targets = false to skip the
// wait: the ids were checked there.
void gather_logprobs_backward_cuda(
    const void* d_logits, LogitsDtype dtype, int64_t num_rows,
    int64_t vocab_size, int64_t row_stride, const int64_t* d_targets,
    double temperature, const float* d_row_max, const double* d_row_log_sum,
    const float* d_entropy, const float* d_grad_logprobs,
    const float* d_grad_entropy, void* d_grad_logits, cudaStream_t stream,
    bool check_targets);

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_CUDA_LOGPROBS_CUDA_H_
