#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cc/advantages.h"
#include "cc/cuda/advantages_cuda.h"

namespace dockyard::kernels {
namespace {

// Threads per block: enough for the usual GRPO groups (4-64 samples) in one
// strided pass; larger groups loop. A multiple of the warp size, so that every
// warp is full and the shuffles' full mask is right.
constexpr int kMaxThreads = 256;
constexpr int kWarpSize = 32;
// No error seen yet (the flag holds the smallest flat index of a bad reward).
constexpr unsigned long long kNoBadReward = ~0ull;

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("group_advantages_cuda: ") + what +
                             ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

__device__ double WarpSum(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sum of `v` over the block, returned to every thread. `smem` holds one double
// per warp. Starts with a barrier, so consecutive calls may reuse `smem`.
__device__ double BlockSum(double v, double* smem) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = WarpSum(v);
  __syncthreads();  // Every thread has read the previous call's smem[0].
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < num_warps ? smem[lane] : 0.0;
    v = WarpSum(v);
    if (lane == 0) smem[0] = v;
  }
  __syncthreads();
  return smem[0];
}

// One block per group (grid-stride over groups when there are more groups
// than blocks). The formulas mirror GroupAdvantagesOne in cc/advantages.cc.
__global__ void GroupAdvantagesKernel(const float* __restrict__ rewards,
                                      int64_t num_groups, int64_t n,
                                      bool leave_one_out, bool normalize_std,
                                      double epsilon, float* out,
                                      unsigned long long* first_bad) {
  __shared__ double smem[kMaxThreads / kWarpSize];
  // Not __restrict__: out may alias rewards (in place). That is safe because
  // each thread reads r[i] before writing out[i] for the same i, and every
  // read of other elements happens before the barriers in BlockSum.
  for (int64_t g = blockIdx.x; g < num_groups; g += gridDim.x) {
    const float* r = rewards + g * n;
    float* o = out + g * n;
    const float first = r[0];

    // Pass 1: sum in double; flag non-finite rewards and reward differences.
    double sum = 0.0;
    int bad = 0, differs = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = r[i];
      if (!isfinite(v)) {
        bad = 1;
        // The host reports the smallest flat index: the first bad reward in
        // row-major order, as the CPU path does.
        atomicMin(first_bad, static_cast<unsigned long long>(g * n + i));
      }
      differs |= (v != first);
      sum += v;
    }
    // Block-uniform flags, so that every thread takes the same branch below
    // and all reach the same barriers.
    bad = __syncthreads_or(bad);
    differs = __syncthreads_or(differs);
    const double total = BlockSum(sum, smem);
    if (bad) continue;  // The host throws; the group's output is unspecified.
    if (n == 1 || !differs) {
      // No other samples, or no reward difference: exactly 0, no 0/0.
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = 0.0f;
      continue;
    }

    const double mean = total / static_cast<double>(n);
    // leave-one-out: r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean).
    double scale = leave_one_out
                       ? static_cast<double>(n) / static_cast<double>(n - 1)
                       : 1.0;
    if (normalize_std) {
      // Two-pass variance: no E[x^2] - E[x]^2 cancellation.
      double sum_sq = 0.0;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const double d = static_cast<double>(r[i]) - mean;
        sum_sq += d * d;
      }
      sum_sq = BlockSum(sum_sq, smem);
      const double std_dev = sqrt(sum_sq / static_cast<double>(n - 1));
      scale /= (std_dev + epsilon);
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      o[i] = static_cast<float>((static_cast<double>(r[i]) - mean) * scale);
    }
    // The next group's first BlockSum starts with a barrier, so smem reuse
    // across iterations is safe.
  }
}

// Switches to `device` for this scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) {
      CheckCuda(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }  // Best effort: no throw here.
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// The device that holds `ptr`; throws std::invalid_argument for host memory.
int DeviceOf(const void* ptr, const char* name) {
  cudaPointerAttributes attr{};
  CheckCuda(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    throw std::invalid_argument(std::string("group_advantages_cuda: ") + name +
                                " is not device memory");
  }
  return attr.device;
}

// 8 bytes of device memory for the error flag, freed in stream order. Stream-
// ordered allocation (cudaMallocAsync) avoids cudaFree's device-wide
// synchronization, which would also wait for other streams' work (e.g. NCCL).
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream) : stream_(stream) {
    CheckCuda(cudaMallocAsync(&ptr_, bytes, stream), "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(ptr_, stream_); }  // Best effort.
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

void group_advantages_cuda(const float* d_rewards, int64_t num_groups,
                           int64_t group_size, Baseline baseline,
                           bool normalize_std, float epsilon, float* d_out,
                           cudaStream_t stream) {
  internal::validate_group_advantages_args(d_rewards, num_groups, group_size,
                                           baseline, epsilon, d_out);
  if (num_groups == 0 || group_size == 0) return;  // Nothing to read or write.

  const int device = DeviceOf(d_rewards, "d_rewards");
  if (DeviceOf(d_out, "d_out") != device) {
    throw std::invalid_argument(
        "group_advantages_cuda: d_rewards and d_out are on different GPUs");
  }
  DeviceGuard device_guard(device);

  // Small groups get one warp; a block never has idle warps beyond the group.
  const int64_t rounded = (group_size + kWarpSize - 1) / kWarpSize * kWarpSize;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, rounded));
  const int blocks = static_cast<int>(std::min<int64_t>(num_groups, INT_MAX));

  unsigned long long first_bad = kNoBadReward;
  {
    StreamBuffer flag(sizeof(unsigned long long), stream);
    auto* d_flag = static_cast<unsigned long long*>(flag.get());
    // All bytes 0xFF = kNoBadReward.
    CheckCuda(cudaMemsetAsync(d_flag, 0xFF, sizeof(*d_flag), stream),
              "cudaMemsetAsync");
    GroupAdvantagesKernel<<<blocks, threads, 0, stream>>>(
        d_rewards, num_groups, group_size, baseline == Baseline::kLeaveOneOut,
        normalize_std, static_cast<double>(epsilon), d_out, d_flag);
    CheckCuda(cudaGetLastError(), "kernel launch");
    CheckCuda(cudaMemcpyAsync(&first_bad, d_flag, sizeof(first_bad),
                              cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync");
  }  // cudaFreeAsync is queued here, in stream order after the copy.
  // Errors of the kernel itself (e.g. an illegal address) surface here.
  CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  if (first_bad != kNoBadReward) {
    // Fetch the bad value for the message. The kernel does not write a group
    // that holds a bad reward, so this reads the input even when in place.
    float value = 0.0f;
    CheckCuda(cudaMemcpy(&value, d_rewards + first_bad, sizeof(value),
                         cudaMemcpyDeviceToHost),
              "cudaMemcpy");
    const auto flat = static_cast<int64_t>(first_bad);
    internal::throw_non_finite_reward(flat / group_size, flat % group_size,
                                      value);
  }
}

}  // namespace dockyard::kernels
