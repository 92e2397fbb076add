#include "cc/cuda/logprobs_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cc/logprobs.h"

namespace dockyard::kernels {
namespace {

// Threads per block (one block per row): 256 threads give each thread ~600
// logits of a 152k vocabulary, enough to hide memory latency with the 4-wide
// unrolled loads below. A multiple of the warp size, so that every warp is
// full and the shuffles' full mask is right.
constexpr int kMaxThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kUnroll = 4;
constexpr unsigned kFullMask = 0xffffffffu;
// No bad target seen yet (the flag holds the smallest bad row).
constexpr unsigned long long kNoBadRow = ~0ull;

void CheckCuda(cudaError_t err, const char* fn, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(fn) + ": " + what + ": " +
                             cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

__device__ __forceinline__ float Bf16ToFloat(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Round to nearest even, as the CPU path and torch; NaN stays a quiet NaN.
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  if (isnan(f)) return 0x7FC0;
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <LogitsDtype D>
struct Logits;

template <>
struct Logits<LogitsDtype::kFloat32> {
  using T = float;
  static __device__ __forceinline__ float Load(const T* p) { return __ldg(p); }
  static __device__ __forceinline__ void Store(T* p, float v) { *p = v; }
};

template <>
struct Logits<LogitsDtype::kBFloat16> {
  using T = uint16_t;
  static __device__ __forceinline__ float Load(const T* p) {
    return Bf16ToFloat(__ldg(p));
  }
  static __device__ __forceinline__ void Store(T* p, float v) {
    *p = FloatToBf16(v);
  }
};

// Online softmax statistics of a set of logits x, relative to their max m:
//   s = sum exp((x - m) / T),  t = sum exp((x - m) / T) * (x - m) / T.
// m == -inf means "no unmasked logit yet" (s = t = 0).
struct Stats {
  float m;
  double s;
  double t;
  int nan;  // A NaN was seen (it loses every max comparison).
};

// Re-expresses (s, t) relative to a new max `new_m` >= st.m:
//   s' = e^delta s,  t' = e^delta (t + delta s),  delta = (m - new_m) / T.
__device__ __forceinline__ void Rescale(const Stats& st, float new_m,
                                        double inv_t, double* s, double* t) {
  if (st.m == -INFINITY || st.s == 0.0) {
    *s = 0.0;
    *t = 0.0;
    return;
  }
  const double delta = (static_cast<double>(st.m) - new_m) * inv_t;
  const double scale = exp(delta);
  *s = scale * st.s;
  *t = scale * (st.t + delta * st.s);
}

__device__ __forceinline__ Stats Merge(const Stats& a, const Stats& b,
                                       double inv_t) {
  Stats out;
  out.m = fmaxf(a.m, b.m);
  out.nan = a.nan | b.nan;
  double sa, ta, sb, tb;
  Rescale(a, out.m, inv_t, &sa, &ta);
  Rescale(b, out.m, inv_t, &sb, &tb);
  out.s = sa + sb;
  out.t = ta + tb;
  return out;
}

__device__ __forceinline__ Stats ShuffleXor(const Stats& st, int lane_mask) {
  Stats o;
  o.m = __shfl_xor_sync(kFullMask, st.m, lane_mask);
  o.s = __shfl_xor_sync(kFullMask, st.s, lane_mask);
  o.t = __shfl_xor_sync(kFullMask, st.t, lane_mask);
  o.nan = __shfl_xor_sync(kFullMask, st.nan, lane_mask);
  return o;
}

// Merges every thread's stats; the result is returned to every thread.
// Starts with a barrier, so consecutive calls may reuse `smem`.
__device__ Stats BlockMerge(Stats st, double inv_t, Stats* smem) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    st = Merge(st, ShuffleXor(st, mask), inv_t);
  }
  __syncthreads();  // Every thread has read the previous call's smem[0].
  if (lane == 0) smem[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < num_warps ? smem[lane] : Stats{-INFINITY, 0.0, 0.0, 0};
    for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
      st = Merge(st, ShuffleXor(st, mask), inv_t);
    }
    if (lane == 0) smem[0] = st;
  }
  __syncthreads();
  return smem[0];
}

// One thread per row: records the smallest row whose target is out of range.
__global__ void ValidateTargetsKernel(const int64_t* __restrict__ targets,
                                      int64_t num_rows, int64_t vocab_size,
                                      unsigned long long* first_bad) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       r < num_rows; r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = targets[r];
    if (id < 0 || id >= vocab_size) {
      atomicMin(first_bad, static_cast<unsigned long long>(r));
    }
  }
}

template <LogitsDtype D, bool kEntropy>
__global__ void ForwardKernel(const void* __restrict__ logits,
                              int64_t num_rows, int64_t vocab_size,
                              int64_t row_stride,
                              const int64_t* __restrict__ targets,
                              double inv_t_d, float* __restrict__ logprobs,
                              float* __restrict__ entropy,
                              float* __restrict__ row_max,
                              double* __restrict__ row_log_sum) {
  using L = Logits<D>;
  using T = typename L::T;
  __shared__ Stats smem[kMaxThreads / kWarpSize];
  const float inv_t = static_cast<float>(inv_t_d);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const T* row = static_cast<const T*>(logits) + r * row_stride;
    Stats st{-INFINITY, 0.0, 0.0, 0};
    for (int64_t base = threadIdx.x; base < vocab_size; base += step) {
      // kUnroll coalesced loads in flight, then one max update per batch.
      float x[kUnroll];
      float batch_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = base + static_cast<int64_t>(u) * blockDim.x;
        x[u] = k < vocab_size ? L::Load(row + k) : -INFINITY;
        st.nan |= isnan(x[u]);
        batch_max = fmaxf(batch_max, x[u]);  // fmaxf ignores NaN.
      }
      if (batch_max > st.m) {
        double s, t;
        Rescale(st, batch_max, inv_t_d, &s, &t);
        st.s = s;
        st.t = t;
        st.m = batch_max;
      }
      if (st.m == -INFINITY) continue;  // All masked so far.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float d = (x[u] - st.m) * inv_t;
        const float e = expf(d);  // 0 for masked (-inf) logits.
        st.s += e;
        // e * d with e == 0 (d = -inf) would be NaN: it is 0.
        if (kEntropy && e > 0.0f) st.t += static_cast<double>(e) * d;
      }
    }
    st = BlockMerge(st, inv_t_d, smem);
    if (threadIdx.x == 0) {
      // All -inf, or NaN / +inf somewhere: NaN, as the CPU path and torch.
      if (st.nan || !(st.m > -INFINITY) || !isfinite(st.s)) {
        logprobs[r] = NAN;
        if (kEntropy) entropy[r] = NAN;
        if (row_max != nullptr) row_max[r] = NAN;
        if (row_log_sum != nullptr) row_log_sum[r] = NAN;
      } else {
        const double log_s = log(st.s);
        const double x_t = L::Load(row + targets[r]);
        logprobs[r] = static_cast<float>(
            (x_t - static_cast<double>(st.m)) * inv_t_d - log_s);
        if (kEntropy) entropy[r] = static_cast<float>(log_s - st.t / st.s);
        if (row_max != nullptr) row_max[r] = st.m;
        if (row_log_sum != nullptr) row_log_sum[r] = log_s;
      }
    }
  }
}

// grad_k = p_k * (-g / T - gH / T * (log p_k + H)) + [k == t] g / T, with
// p_k = exp((x_k - M) / T) / S (cc/logprobs.cc's BackwardRow, one element per
// thread per step). No shared state: rows are independent.
template <LogitsDtype D, bool kEntropyGrad>
__global__ void BackwardKernel(const void* __restrict__ logits,
                               int64_t num_rows, int64_t vocab_size,
                               int64_t row_stride,
                               const int64_t* __restrict__ targets,
                               double inv_t_d, const float* __restrict__ row_max,
                               const double* __restrict__ row_log_sum,
                               const float* __restrict__ entropy,
                               const float* __restrict__ grad_logprobs,
                               const float* __restrict__ grad_entropy,
                               void* __restrict__ grad_logits) {
  using L = Logits<D>;
  using T = typename L::T;
  const float inv_t = static_cast<float>(inv_t_d);
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const T* row = static_cast<const T*>(logits) + r * row_stride;
    T* out = static_cast<T*>(grad_logits) + r * vocab_size;
    const float m = row_max[r];
    const double log_s = row_log_sum[r];
    const double g = grad_logprobs != nullptr ? grad_logprobs[r] : 0.0;
    const double g_h = kEntropyGrad ? grad_entropy[r] : 0.0;
    const double h = kEntropyGrad ? entropy[r] : 0.0;
    if (!isfinite(m) || !isfinite(log_s) || !isfinite(h)) {
      // The forward gave NaN for this row: so does its gradient.
      for (int64_t k = threadIdx.x; k < vocab_size; k += blockDim.x) {
        L::Store(out + k, NAN);
      }
      continue;
    }
    const int64_t target = targets[r];
    const float inv_s = static_cast<float>(exp(-log_s));
    const float coef_g = static_cast<float>(-g * inv_t_d);
    const float coef_h = static_cast<float>(-g_h * inv_t_d);
    const float h_minus_log_s = static_cast<float>(h - log_s);
    for (int64_t k = threadIdx.x; k < vocab_size; k += blockDim.x) {
      const float x = L::Load(row + k);
      float grad;
      if (k == target) {
        // In double: g (1 - p_t) cancels when p_t ~ 1.
        const double log_p = (static_cast<double>(x) - m) * inv_t_d - log_s;
        const double p = exp(log_p);  // 0 for a masked target.
        double gd = g * (1.0 - p);
        if (kEntropyGrad && p > 0.0) gd -= g_h * p * (log_p + h);
        grad = static_cast<float>(gd * inv_t_d);
      } else {
        const float d = (x - m) * inv_t;
        const float p = expf(d) * inv_s;
        grad = p * coef_g;
        // p == 0 (masked: d = -inf) contributes exactly 0, not 0 * -inf.
        if (kEntropyGrad && p > 0.0f) grad += p * coef_h * (d + h_minus_log_s);
      }
      L::Store(out + k, grad);
    }
  }
}

// Switches to `device` for this scope and restores the caller's device after.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* fn) {
    CheckCuda(cudaGetDevice(&previous_), fn, "cudaGetDevice");
    if (device != previous_) {
      CheckCuda(cudaSetDevice(device), fn, "cudaSetDevice");
    }
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }  // Best effort: no throw here.
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// The device that holds `ptr`; throws std::invalid_argument for host memory.
int DeviceOf(const void* ptr, const char* fn, const char* name) {
  cudaPointerAttributes attr{};
  CheckCuda(cudaPointerGetAttributes(&attr, ptr), fn,
            "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    throw std::invalid_argument(std::string(fn) + ": " + name +
                                " is not device memory");
  }
  return attr.device;
}

// 8 bytes of device memory for the error flag, freed in stream order (no
// device-wide synchronization, unlike cudaFree).
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream, const char* fn)
      : stream_(stream) {
    CheckCuda(cudaMallocAsync(&ptr_, bytes, stream), fn, "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(ptr_, stream_); }  // Best effort.
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// Checks every target id on the device; throws std::out_of_range for the
// first bad one (synchronizes `stream`).
void ValidateTargets(const char* fn, const int64_t* d_targets,
                     int64_t num_rows, int64_t vocab_size,
                     cudaStream_t stream) {
  unsigned long long first_bad = kNoBadRow;
  {
    StreamBuffer flag(sizeof(unsigned long long), stream, fn);
    auto* d_flag = static_cast<unsigned long long*>(flag.get());
    CheckCuda(cudaMemsetAsync(d_flag, 0xFF, sizeof(*d_flag), stream), fn,
              "cudaMemsetAsync");
    const int threads = 256;
    const int blocks = static_cast<int>(
        std::min<int64_t>((num_rows + threads - 1) / threads, 65535));
    ValidateTargetsKernel<<<blocks, threads, 0, stream>>>(
        d_targets, num_rows, vocab_size, d_flag);
    CheckCuda(cudaGetLastError(), fn, "target check launch");
    CheckCuda(cudaMemcpyAsync(&first_bad, d_flag, sizeof(first_bad),
                              cudaMemcpyDeviceToHost, stream),
              fn, "cudaMemcpyAsync");
  }  // cudaFreeAsync is queued here, in stream order after the copy.
  CheckCuda(cudaStreamSynchronize(stream), fn, "cudaStreamSynchronize");
  if (first_bad != kNoBadRow) {
    int64_t id = 0;
    CheckCuda(cudaMemcpy(&id, d_targets + first_bad, sizeof(id),
                         cudaMemcpyDeviceToHost),
              fn, "cudaMemcpy");
    internal::throw_target_out_of_range(fn, static_cast<int64_t>(first_bad),
                                        id, vocab_size);
  }
}

// Threads per row: the vocab rounded up to whole warps, at most kMaxThreads.
int ThreadsFor(int64_t vocab_size) {
  const int64_t rounded = (vocab_size + kWarpSize - 1) / kWarpSize * kWarpSize;
  return static_cast<int>(std::min<int64_t>(kMaxThreads, rounded));
}

int BlocksFor(int64_t num_rows) {
  return static_cast<int>(std::min<int64_t>(num_rows, INT_MAX));
}

}  // namespace

void gather_logprobs_cuda(const void* d_logits, LogitsDtype dtype,
                          int64_t num_rows, int64_t vocab_size,
                          int64_t row_stride, const int64_t* d_targets,
                          double temperature, float* d_logprobs,
                          float* d_entropy, float* d_row_max,
                          double* d_row_log_sum, cudaStream_t stream) {
  constexpr const char* kFn = "gather_logprobs_cuda";
  internal::validate_logprobs_args(kFn, d_logits, dtype, num_rows, vocab_size,
                                   row_stride, d_targets, temperature, false,
                                   d_logprobs, nullptr, nullptr, nullptr,
                                   nullptr);
  if (num_rows == 0) return;
  DeviceGuard guard(DeviceOf(d_logits, kFn, "d_logits"), kFn);
  ValidateTargets(kFn, d_targets, num_rows, vocab_size, stream);

  const double inv_t = 1.0 / temperature;
  const int threads = ThreadsFor(vocab_size);
  const int blocks = BlocksFor(num_rows);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(
        d_logits, num_rows, vocab_size, row_stride, d_targets, inv_t,
        d_logprobs, d_entropy, d_row_max, d_row_log_sum);
  };
  const bool with_entropy = d_entropy != nullptr;
  if (dtype == LogitsDtype::kFloat32) {
    with_entropy ? launch(ForwardKernel<LogitsDtype::kFloat32, true>)
                 : launch(ForwardKernel<LogitsDtype::kFloat32, false>);
  } else {
    with_entropy ? launch(ForwardKernel<LogitsDtype::kBFloat16, true>)
                 : launch(ForwardKernel<LogitsDtype::kBFloat16, false>);
  }
  CheckCuda(cudaGetLastError(), kFn, "kernel launch");
}

void gather_logprobs_backward_cuda(
    const void* d_logits, LogitsDtype dtype, int64_t num_rows,
    int64_t vocab_size, int64_t row_stride, const int64_t* d_targets,
    double temperature, const float* d_row_max, const double* d_row_log_sum,
    const float* d_entropy, const float* d_grad_logprobs,
    const float* d_grad_entropy, void* d_grad_logits, cudaStream_t stream) {
  constexpr const char* kFn = "gather_logprobs_backward_cuda";
  internal::validate_logprobs_args(kFn, d_logits, dtype, num_rows, vocab_size,
                                   row_stride, d_targets, temperature, true,
                                   d_grad_logits, d_row_max, d_row_log_sum,
                                   d_entropy, d_grad_entropy);
  if (num_rows == 0) return;
  DeviceGuard guard(DeviceOf(d_logits, kFn, "d_logits"), kFn);
  ValidateTargets(kFn, d_targets, num_rows, vocab_size, stream);

  const double inv_t = 1.0 / temperature;
  const int threads = ThreadsFor(vocab_size);
  const int blocks = BlocksFor(num_rows);
  auto launch = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(
        d_logits, num_rows, vocab_size, row_stride, d_targets, inv_t,
        d_row_max, d_row_log_sum, d_entropy, d_grad_logprobs, d_grad_entropy,
        d_grad_logits);
  };
  const bool with_entropy = d_grad_entropy != nullptr;
  if (dtype == LogitsDtype::kFloat32) {
    with_entropy ? launch(BackwardKernel<LogitsDtype::kFloat32, true>)
                 : launch(BackwardKernel<LogitsDtype::kFloat32, false>);
  } else {
    with_entropy ? launch(BackwardKernel<LogitsDtype::kBFloat16, true>)
                 : launch(BackwardKernel<LogitsDtype::kBFloat16, false>);
  }
  CheckCuda(cudaGetLastError(), kFn, "kernel launch");
}

}  // namespace dockyard::kernels
