// CUDA implementation of group_advantages (cc/advantages.h) on device memory.
//
// Same contract, same numerics (double accumulation, exact zeros for
// degenerate groups) and same error messages as the CPU function; results
// agree with it to float rounding (sums are added in another order).
//
// This header is plain C++: a .cc compiled by g++ can include it without the
// CUDA headers. cudaStream_t is declared here exactly as cuda_runtime.h
// declares it (a pointer to the opaque CUstream_st); C++ allows the same alias
// twice, so including both headers is fine.

#ifndef DOCKYARD_CC_CUDA_ADVANTAGES_CUDA_H_
#define DOCKYARD_CC_CUDA_ADVANTAGES_CUDA_H_

#include <cstdint>

#include "cc/advantages.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace dockyard::kernels {

// d_rewards and d_out: device (or managed) memory of one GPU, row-major
// (num_groups, group_size); d_out may equal d_rewards. The work runs on
// `stream` (nullptr = the legacy default stream) on the GPU that holds the
// data, whatever the current device; the current device is restored after.
//
// Synchronizes `stream` before returning, so that a non-finite reward is
// reported as std::invalid_argument like on the CPU (naming the first bad
// group and index in row-major order).
//
// Throws std::invalid_argument for bad arguments (see group_advantages, plus
// pointers that are not device memory or not on the same GPU), and
// std::runtime_error with CUDA's error string when a CUDA call fails.
void group_advantages_cuda(const float* d_rewards, int64_t num_groups,
                           int64_t group_size, Baseline baseline,
                           bool normalize_std, float epsilon, float* d_out,
                           cudaStream_t stream);

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_CUDA_ADVANTAGES_CUDA_H_
