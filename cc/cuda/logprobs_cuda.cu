#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cc/cuda/logprobs_cuda.h"
#include "cc/logprobs.h"

namespace dockyard::kernels {
namespace {

// Threads per block. A row gets either one warp (rows of at most
// kWarpRowMaxBytes: 8 rows per block) or the whole block: 256 threads give
// each thread ~48 vectors of a 49k float32 row, and four 16-byte loads in
// flight per thread keep 64 KB or more in flight per multiprocessor (at least
// four resident blocks at these kernels' 47-80 registers a thread), enough to
// cover the memory latency at HBM3e bandwidth.
constexpr int kBlockThreads = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// 16-byte vectors loaded per thread before their values are used.
constexpr int kUnroll = 4;
constexpr int kVecBytes = 16;
// Up to 16 KiB (4096 float32 / 8192 bfloat16 logits) one warp reads a row in
// at most 8 steps of kUnroll vectors; past that a block's 8 warps share it,
// so that a few long rows still spread over the GPU.
constexpr int64_t kWarpRowMaxBytes = 16 * 1024;
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;
constexpr float kLn2F = 0.6931471805599453f;
// A base-2 exponent below every normal float result of 2^x (2^-126 is the
// smallest; ex2.approx.ftz flushes the rest to 0). Exponents are clamped here
// where they multiply the exp, so that a masked logit (exponent -inf, exp 0)
// contributes 0 * -256 = 0 and not 0 * -inf = NaN.
constexpr float kMinExponent = -256.0f;

void CheckCuda(cudaError_t err, const char* fn, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(fn) + ": " + what + ": " +
                             cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// 2^x in one hardware instruction (relative error ~2 ulp); results below
// 2^-126 are 0, as the CPU's exp gives 0 below e^-87.34 = 2^-126; 2^-inf = 0;
// NaN stays NaN. Exponents come pre-multiplied by log2(e), so this is the
// exp of the natural exponent at the cost of one rounding of the product
// (the CPU rounds (x - m) / T once too).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// max(x, kMinExponent) that keeps NaN (fmaxf would drop it).
__device__ __forceinline__ float ClampExponent(float x) {
  return x < kMinExponent ? kMinExponent : x;
}

// Round to nearest even in hardware (sm_80+), as the CPU path and torch. NaN
// becomes the canonical quiet NaN 0x7FFF (the CPU path writes 0x7FC0).
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  unsigned short bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f));
  return bits;
}

// Two floats as a bfloat16 pair: `lo` in the low half (the lower address).
__device__ __forceinline__ uint32_t FloatsToBf16x2(float lo, float hi) {
  uint32_t bits;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(hi), "f"(lo));
  return bits;
}

// Element access: scalar, and kWidth elements (one 16-byte Vec) at a 16-byte
// aligned address, widened to float (LoadRaw then Unpack, so that a caller
// can issue several loads before widening) and narrowed from float.
template <LogitsDtype D>
struct Logits;

template <>
struct Logits<LogitsDtype::kFloat32> {
  using T = float;
  using Vec = float4;
  static constexpr int kWidth = 4;
  static __device__ __forceinline__ float Load(const T* p) { return __ldg(p); }
  static __device__ __forceinline__ Vec LoadRaw(const T* p) {
    return __ldg(reinterpret_cast<const Vec*>(p));
  }
  static __device__ __forceinline__ void Unpack(const Vec& v, float* x) {
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  }
  static __device__ __forceinline__ void LoadVec(const T* p, float* x) {
    Unpack(LoadRaw(p), x);
  }
  static __device__ __forceinline__ void Store(T* p, float v) { *p = v; }
  static __device__ __forceinline__ void StoreVec(T* p, const float* x) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  }
};

template <>
struct Logits<LogitsDtype::kBFloat16> {
  using T = uint16_t;
  using Vec = uint4;
  static constexpr int kWidth = 8;
  static __device__ __forceinline__ float Load(const T* p) {
    return __uint_as_float(static_cast<uint32_t>(__ldg(p)) << 16);
  }
  static __device__ __forceinline__ Vec LoadRaw(const T* p) {
    return __ldg(reinterpret_cast<const Vec*>(p));
  }
  static __device__ __forceinline__ void Unpack(const Vec& v, float* x) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Little-endian: the element at the lower address is the low half.
      x[2 * i] = __uint_as_float(words[i] << 16);
      x[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
  }
  static __device__ __forceinline__ void LoadVec(const T* p, float* x) {
    Unpack(LoadRaw(p), x);
  }
  static __device__ __forceinline__ void Store(T* p, float v) {
    *p = FloatToBf16(v);
  }
  static __device__ __forceinline__ void StoreVec(T* p, const float* x) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(FloatsToBf16x2(x[0], x[1]), FloatsToBf16x2(x[2], x[3]),
                   FloatsToBf16x2(x[4], x[5]), FloatsToBf16x2(x[6], x[7]));
  }
};

// A row of `vocab_size` elements starting at `row`, cut at 16-byte
// boundaries: `head` scalar elements up to the first boundary, `num_vecs`
// whole vectors of kWidth, then scalar elements from `tail` to the end (fewer
// than kWidth each side).
struct RowSplit {
  int64_t head;
  int64_t num_vecs;
  int64_t tail;
};

template <typename T, int kWidth>
__device__ __forceinline__ RowSplit SplitRow(const T* row, int64_t vocab_size) {
  const auto misalign =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % kVecBytes);
  int64_t head =
      ((kVecBytes - misalign) % kVecBytes) / static_cast<int64_t>(sizeof(T));
  if (head > vocab_size) head = vocab_size;
  const int64_t num_vecs = (vocab_size - head) / kWidth;
  return {head, num_vecs, head + num_vecs * kWidth};
}

// Sum of v[0..kN) by halves (pairwise): rounding error ~log2(kN) ulp rather
// than the kN ulp of a running sum. kN is a power of two.
template <int kN>
__device__ __forceinline__ float TreeSum(const float* v) {
  static_assert(kN > 0 && (kN & (kN - 1)) == 0, "kN must be a power of two");
  if constexpr (kN == 1) {
    return v[0];
  } else {
    return TreeSum<kN / 2>(v) + TreeSum<kN / 2>(v + kN / 2);
  }
}

// One thread's online softmax statistics over the logits it has seen,
// relative to their max m, in base-2 exponents d2 = (x - m) / T * log2(e):
//   s = sum 2^d2 (= sum exp((x - m) / T)),  t2 = sum 2^d2 * d2.
// m == -inf: no unmasked logit yet (s = t2 = 0). A NaN logit reaches s
// through its exp, except while m is -inf (nothing is summed then): `nan`
// records those.
struct ThreadStats {
  float m = -INFINITY;
  double s = 0.0;
  double t2 = 0.0;
  bool nan = false;
};

// Adds kN logits: one max update (rescaling the sums when the max grows),
// then their exps, summed in float by a tree and added to the double sums.
template <bool kEntropy, int kN>
__device__ __forceinline__ void Accumulate(const float (&x)[kN], float k_log2,
                                           double inv_t_log2, ThreadStats* st) {
  float batch_max = x[0];
#pragma unroll
  for (int j = 1; j < kN; ++j) batch_max = fmaxf(batch_max, x[j]);  // No NaN.
  if (batch_max > st->m) {
    if (st->s != 0.0) {  // Also true for a NaN sum, which stays NaN.
      //   s' = 2^delta2 s,  t2' = 2^delta2 (t2 + delta2 s).
      const double delta2 =
          (static_cast<double>(st->m) - batch_max) * inv_t_log2;
      const double scale = exp2(delta2);
      if (kEntropy) st->t2 = scale * (st->t2 + delta2 * st->s);
      st->s *= scale;
    }
    st->m = batch_max;
  }
  if (st->m == -INFINITY) {  // All masked so far: nothing to add.
#pragma unroll
    for (int j = 0; j < kN; ++j) st->nan |= isnan(x[j]);
    return;
  }
  float e[kN];
  float te[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    float d2 = (x[j] - st->m) * k_log2;  // Shift first: exact for huge logits.
    if (kEntropy) d2 = ClampExponent(d2);
    e[j] = Exp2(d2);  // 0 for masked (-inf) logits.
    if (kEntropy) te[j] = e[j] * d2;
  }
  st->s += TreeSum<kN>(e);
  if (kEntropy) st->t2 += TreeSum<kN>(te);
}

// Max of `v` over the row's threads, returned to all of them. kRowThreads is
// a warp or the whole block; `smem` holds a float per warp of the block.
template <int kRowThreads>
__device__ __forceinline__ float RowMax(float v, float* smem) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, mask));
  }
  if constexpr (kRowThreads > kWarpSize) {
    if (threadIdx.x % kWarpSize == 0) smem[threadIdx.x / kWarpSize] = v;
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int w = 1; w < kRowThreads / kWarpSize; ++w) v = fmaxf(v, smem[w]);
  }
  return v;
}

// Sums `s` (and `t` when kBoth) over the row's threads; the totals are right
// in the row's first thread. Called after RowMax, whose readers of its smem
// have all passed this function's barrier before the next RowMax writes, and
// the first thread reads this function's smem before it reaches the next
// barrier: consecutive rows may reuse both buffers.
template <int kRowThreads, bool kBoth>
__device__ __forceinline__ void RowSum(double* s, double* t, double* smem_s,
                                       double* smem_t) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    *s += __shfl_xor_sync(kFullMask, *s, mask);
    if (kBoth) *t += __shfl_xor_sync(kFullMask, *t, mask);
  }
  if constexpr (kRowThreads > kWarpSize) {
    if (threadIdx.x % kWarpSize == 0) {
      smem_s[threadIdx.x / kWarpSize] = *s;
      if (kBoth) smem_t[threadIdx.x / kWarpSize] = *t;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      *s = smem_s[0];
      if (kBoth) *t = smem_t[0];
#pragma unroll
      for (int w = 1; w < kRowThreads / kWarpSize; ++w) {
        *s += smem_s[w];
        if (kBoth) *t += smem_t[w];
      }
    }
  }
}

// Forward: kRowThreads threads (a warp or the block) per row, grid-stride over
// rows. Each thread accumulates its share of the row (scalar head, vectors,
// scalar tail), then the row's threads rescale their sums to the row max and
// add them up; the row's first thread writes the results.
template <LogitsDtype D, bool kEntropy, int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    ForwardKernel(const void* __restrict__ logits, int64_t num_rows,
                  int64_t vocab_size, int64_t row_stride,
                  const int64_t* __restrict__ targets, double inv_t_d,
                  float k_log2, float* __restrict__ logprobs,
                  float* __restrict__ entropy, float* __restrict__ row_max,
                  double* __restrict__ row_log_sum, int* bad_target) {
  using L = Logits<D>;
  using T = typename L::T;
  constexpr int kWidth = L::kWidth;
  constexpr int kRowsPerBlock = kBlockThreads / kRowThreads;
  constexpr int kWarpsPerRow = kRowThreads / kWarpSize;
  static_assert(kRowThreads == kWarpSize || kRowThreads == kBlockThreads,
                "a row is one warp or the whole block");
  __shared__ float smem_max[kWarpsPerRow];
  __shared__ double smem_s[kWarpsPerRow];
  __shared__ double smem_t[kWarpsPerRow];
  const int lane = static_cast<int>(threadIdx.x) % kRowThreads;
  const double inv_t_log2 = inv_t_d * kLog2e;
  // With a block per row every thread of the block runs the same iterations
  // (the barriers in RowMax / RowSum need that); with a warp per row there is
  // no block barrier, and a warp past the last row just stops.
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock +
                   threadIdx.x / kRowThreads;
       r < num_rows; r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const T* row = static_cast<const T*>(logits) + r * row_stride;
    const RowSplit split = SplitRow<T, kWidth>(row, vocab_size);
    ThreadStats st;
    if (lane < split.head) {
      const float x[1] = {L::Load(row + lane)};
      Accumulate<kEntropy>(x, k_log2, inv_t_log2, &st);
    }
    const T* vecs = row + split.head;  // 16-byte aligned.
    int64_t v = lane;
    for (; v + (kUnroll - 1) * kRowThreads < split.num_vecs;
         v += kUnroll * kRowThreads) {
      // All kUnroll loads are issued before the first value is used.
      float x[kUnroll * kWidth];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        L::LoadVec(vecs + (v + u * kRowThreads) * kWidth, x + u * kWidth);
      }
      Accumulate<kEntropy>(x, k_log2, inv_t_log2, &st);
    }
    for (; v < split.num_vecs; v += kRowThreads) {
      float x[kWidth];
      L::LoadVec(vecs + v * kWidth, x);
      Accumulate<kEntropy>(x, k_log2, inv_t_log2, &st);
    }
    if (split.tail + lane < vocab_size) {
      const float x[1] = {L::Load(row + split.tail + lane)};
      Accumulate<kEntropy>(x, k_log2, inv_t_log2, &st);
    }

    const float m = RowMax<kRowThreads>(st.m, smem_max);
    double s = 0.0;
    double t2 = 0.0;
    if (st.m != -INFINITY) {
      const double delta2 = (static_cast<double>(st.m) - m) * inv_t_log2;
      const double scale = exp2(delta2);  // 1 for the thread holding m.
      s = scale * st.s;
      if (kEntropy) t2 = scale * (st.t2 + delta2 * st.s);
    }
    if (st.nan) s = static_cast<double>(NAN);
    RowSum<kRowThreads, kEntropy>(&s, &t2, smem_s, smem_t);
    if (lane == 0) {
      const int64_t target = targets[r];
      const bool bad = target < 0 || target >= vocab_size;
      if (bad && bad_target != nullptr) *bad_target = 1;
      // A bad id; all -inf; or NaN / +inf somewhere (s is NaN then): NaN, as
      // the CPU path and torch.
      if (bad || !isfinite(m) || !isfinite(s)) {
        logprobs[r] = NAN;
        if (kEntropy) entropy[r] = NAN;
        if (row_max != nullptr) row_max[r] = NAN;
        if (row_log_sum != nullptr) row_log_sum[r] = static_cast<double>(NAN);
      } else {
        const double log_s = log(s);  // s >= 1: the max contributes 2^0.
        const double x_t = L::Load(row + target);
        logprobs[r] = static_cast<float>(
            (x_t - static_cast<double>(m)) * inv_t_d - log_s);
        if (kEntropy) entropy[r] = static_cast<float>(log_s - t2 * kLn2 / s);
        if (row_max != nullptr) row_max[r] = m;
        if (row_log_sum != nullptr) row_log_sum[r] = log_s;
      }
    }
  }
}

// One row's gradient (cc/logprobs.cc's BackwardRow):
//   grad_k = p_k * (-g / T - gH / T * (log p_k + H)) + [k == t] g / T
// with p_k = 2^d2_k / S, d2_k = (x_k - M) / T * log2(e), log p_k = d2_k ln 2 -
// log S. `m` is NaN for a row whose forward gave NaN (or whose target id is
// bad): every element is NaN then. Only floats are kept for the loop; the
// target's element, once a row, rereads its row's doubles.
template <bool kEntropyGrad>
struct RowGrad {
  float m, k_log2, inv_s, coef_g, coef_h, h_minus_log_s;

  __device__ __forceinline__ float Other(float x) const {
    float d2 = (x - m) * k_log2;
    if (kEntropyGrad) d2 = ClampExponent(d2);
    const float p = Exp2(d2) * inv_s;  // 0 for a masked logit.
    float grad = p * coef_g;
    // p == 0 (masked: d2 clamped) contributes exactly 0, not 0 * -inf.
    if (kEntropyGrad) {
      grad = fmaf(p * coef_h, fmaf(d2, kLn2F, h_minus_log_s), grad);
    }
    return grad;
  }
};

// The target's element, in double: g (1 - p_t) cancels when p_t ~ 1.
template <bool kEntropyGrad>
__device__ __noinline__ float TargetGrad(float x, float m, double inv_t_d,
                                         double log_s, double g, double g_h,
                                         double h) {
  const double log_p = (static_cast<double>(x) - m) * inv_t_d - log_s;
  const double p = exp(log_p);  // 0 for a masked target.
  double grad = g * (1.0 - p);
  if (kEntropyGrad && p > 0.0) grad -= g_h * p * (log_p + h);
  return static_cast<float>(grad * inv_t_d);
}

// Backward: kRowThreads threads per row as in the forward; no shared state.
template <LogitsDtype D, bool kEntropyGrad, int kRowThreads>
__global__ void __launch_bounds__(kBlockThreads)
    BackwardKernel(const void* __restrict__ logits, int64_t num_rows,
                   int64_t vocab_size, int64_t row_stride,
                   const int64_t* __restrict__ targets, double inv_t_d,
                   float k_log2, const float* __restrict__ row_max,
                   const double* __restrict__ row_log_sum,
                   const float* __restrict__ entropy,
                   const float* __restrict__ grad_logprobs,
                   const float* __restrict__ grad_entropy,
                   void* __restrict__ grad_logits, int* bad_target) {
  using L = Logits<D>;
  using T = typename L::T;
  using Vec = typename L::Vec;
  constexpr int kWidth = L::kWidth;
  constexpr int kRowsPerBlock = kBlockThreads / kRowThreads;
  static_assert(kRowThreads == kWarpSize || kRowThreads == kBlockThreads,
                "a row is one warp or the whole block");
  const int lane = static_cast<int>(threadIdx.x) % kRowThreads;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock +
                   threadIdx.x / kRowThreads;
       r < num_rows; r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const T* row = static_cast<const T*>(logits) + r * row_stride;
    T* out = static_cast<T*>(grad_logits) + r * vocab_size;
    int64_t target = targets[r];
    const bool bad = target < 0 || target >= vocab_size;
    if (bad) {
      if (lane == 0 && bad_target != nullptr) *bad_target = 1;
      target = -1;  // Matches no element.
    }
    const double log_s = row_log_sum[r];
    const double g = grad_logprobs != nullptr ? grad_logprobs[r] : 0.0;
    const double g_h = kEntropyGrad ? grad_entropy[r] : 0.0;
    const double h = kEntropyGrad ? entropy[r] : 0.0;
    RowGrad<kEntropyGrad> f;
    f.m = row_max[r];
    if (bad || !isfinite(f.m) || !isfinite(log_s) || !isfinite(h)) {
      f.m = NAN;  // The forward gave NaN for this row: so does its gradient.
    }
    f.k_log2 = k_log2;
    f.inv_s = static_cast<float>(exp(-log_s));
    f.coef_g = static_cast<float>(-g * inv_t_d);
    f.coef_h = static_cast<float>(-g_h * inv_t_d);
    f.h_minus_log_s = static_cast<float>(h - log_s);
    // The gradient at element k of logit x.
    auto grad_at = [&](float x, int64_t k) {
      if (k != target) return f.Other(x);
      return TargetGrad<kEntropyGrad>(
          x, f.m, inv_t_d, row_log_sum[r],
          grad_logprobs != nullptr ? grad_logprobs[r] : 0.0,
          kEntropyGrad ? grad_entropy[r] : 0.0,
          kEntropyGrad ? entropy[r] : 0.0);
    };

    const auto in_phase = reinterpret_cast<uintptr_t>(row) % kVecBytes;
    const auto out_phase = reinterpret_cast<uintptr_t>(out) % kVecBytes;
    if (in_phase != out_phase) {
      // No common 16-byte boundaries (an odd row stride): scalar, coalesced.
      for (int64_t k = lane; k < vocab_size; k += kRowThreads) {
        L::Store(out + k, grad_at(L::Load(row + k), k));
      }
      continue;
    }
    const RowSplit split = SplitRow<T, kWidth>(row, vocab_size);
    if (lane < split.head) {
      L::Store(out + lane, grad_at(L::Load(row + lane), lane));
    }
    const T* vecs = row + split.head;  // Both 16-byte aligned.
    T* out_vecs = out + split.head;
    // Widens, differentiates and stores vector `vec` of the row.
    auto grad_vec = [&](const Vec& raw, int64_t vec) {
      float x[kWidth];
      L::Unpack(raw, x);
      const int64_t k0 = split.head + vec * kWidth;
      float grad[kWidth];
      if (static_cast<uint64_t>(target - k0) < kWidth) {  // Rare: once a row.
#pragma unroll
        for (int j = 0; j < kWidth; ++j) grad[j] = grad_at(x[j], k0 + j);
      } else {
#pragma unroll
        for (int j = 0; j < kWidth; ++j) grad[j] = f.Other(x[j]);
      }
      L::StoreVec(out_vecs + vec * kWidth, grad);
    };
    int64_t v = lane;
    for (; v + (kUnroll - 1) * kRowThreads < split.num_vecs;
         v += kUnroll * kRowThreads) {
      // All kUnroll loads are issued before the first value is used.
      Vec raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        raw[u] = L::LoadRaw(vecs + (v + u * kRowThreads) * kWidth);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) grad_vec(raw[u], v + u * kRowThreads);
    }
    for (; v < split.num_vecs; v += kRowThreads) {
      grad_vec(L::LoadRaw(vecs + v * kWidth), v);
    }
    const int64_t k = split.tail + lane;
    if (k < vocab_size) L::Store(out + k, grad_at(L::Load(row + k), k));
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

// The flag a kernel sets (to 1) when it meets a bad target id: one int of
// device memory per host thread and device, allocated (zeroed) on the first
// checked call and kept, so that a call costs only a 4-byte copy back and one
// wait; the separate check kernel, stream-ordered allocation and memset this
// replaced cost tens of microseconds a call. Per thread because a checked
// call waits for its kernel before returning: a thread has at most one in
// flight, and it clears the flag again before reporting an error. (Pinned host
// memory written by the kernel would save the copy, a few microseconds, but
// depends on host-mapped memory working wherever this runs.)
class TargetFlags {
 public:
  // The flag of the current device for the calling thread; zero.
  static int* ForCurrentDevice(const char* fn) {
    thread_local TargetFlags flags;
    int device = 0;
    CheckCuda(cudaGetDevice(&device), fn, "cudaGetDevice");
    if (static_cast<size_t>(device) >= flags.by_device_.size()) {
      flags.by_device_.resize(device + 1, nullptr);
    }
    int*& flag = flags.by_device_[device];
    if (flag == nullptr) {
      void* ptr = nullptr;
      CheckCuda(cudaMalloc(&ptr, sizeof(int)), fn, "cudaMalloc");
      // Synchronous (the legacy stream, from pageable memory): zero before any
      // kernel of any stream can see it.
      const int zero = 0;
      const cudaError_t err =
          cudaMemcpy(ptr, &zero, sizeof(int), cudaMemcpyHostToDevice);
      if (err != cudaSuccess) cudaFree(ptr);
      CheckCuda(err, fn, "cudaMemcpy");
      CheckCuda(cudaDeviceSynchronize(), fn, "cudaDeviceSynchronize");
      flag = static_cast<int*>(ptr);
    }
    return flag;
  }

  TargetFlags() = default;
  ~TargetFlags() {
    // Best effort at thread exit (the runtime may be shutting down).
    for (int* flag : by_device_) {
      if (flag != nullptr) cudaFree(flag);
    }
  }
  TargetFlags(const TargetFlags&) = delete;
  TargetFlags& operator=(const TargetFlags&) = delete;

 private:
  std::vector<int*> by_device_;
};

// After a checked launch: reads the flag back (waiting for `stream`); when
// the kernel set it, clears it, finds the first bad id on the host and throws
// std::out_of_range.
void ReportBadTargets(const char* fn, int* d_flag, const int64_t* d_targets,
                      int64_t num_rows, int64_t vocab_size,
                      cudaStream_t stream) {
  int flag = 0;
  CheckCuda(cudaMemcpyAsync(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost,
                            stream),
            fn, "cudaMemcpyAsync");
  CheckCuda(cudaStreamSynchronize(stream), fn, "cudaStreamSynchronize");
  if (flag == 0) return;
  CheckCuda(cudaMemsetAsync(d_flag, 0, sizeof(int), stream), fn,
            "cudaMemsetAsync");
  std::vector<int64_t> targets(num_rows);
  CheckCuda(
      cudaMemcpyAsync(targets.data(), d_targets, num_rows * sizeof(int64_t),
                      cudaMemcpyDeviceToHost, stream),
      fn, "cudaMemcpyAsync");
  CheckCuda(cudaStreamSynchronize(stream), fn, "cudaStreamSynchronize");
  for (int64_t r = 0; r < num_rows; ++r) {
    if (targets[r] < 0 || targets[r] >= vocab_size) {
      internal::throw_target_out_of_range(fn, r, targets[r], vocab_size);
    }
  }
  throw std::runtime_error(std::string(fn) +
                           ": the kernel saw a target id out of range that "
                           "is not there now: were the targets written while "
                           "the call ran?");
}

int ElementBytes(LogitsDtype dtype) {
  return dtype == LogitsDtype::kFloat32 ? 4 : 2;
}

// Threads per row (see kWarpRowMaxBytes) and the blocks for all rows (grid
// stride past INT_MAX blocks).
struct Shape {
  int row_threads;
  int blocks;
};

Shape ShapeFor(int64_t num_rows, int64_t vocab_size, LogitsDtype dtype) {
  const int row_threads = vocab_size * ElementBytes(dtype) <= kWarpRowMaxBytes
                              ? kWarpSize
                              : kBlockThreads;
  const int64_t rows_per_block = kBlockThreads / row_threads;
  const int64_t blocks = (num_rows + rows_per_block - 1) / rows_per_block;
  return {row_threads, static_cast<int>(blocks < INT_MAX ? blocks : INT_MAX)};
}

// Calls fn(kernel) with the kernel instantiation for these run-time choices.
template <template <LogitsDtype, bool, int> class Kernel, typename Fn>
void Dispatch(LogitsDtype dtype, bool flag, int row_threads, const Fn& fn) {
  auto by_threads = [&](auto dtype_tag, auto flag_tag) {
    constexpr LogitsDtype kD = decltype(dtype_tag)::value;
    constexpr bool kFlag = decltype(flag_tag)::value;
    if (row_threads == kWarpSize) {
      fn(Kernel<kD, kFlag, kWarpSize>::kFn);
    } else {
      fn(Kernel<kD, kFlag, kBlockThreads>::kFn);
    }
  };
  auto by_flag = [&](auto dtype_tag) {
    if (flag) {
      by_threads(dtype_tag, std::true_type{});
    } else {
      by_threads(dtype_tag, std::false_type{});
    }
  };
  if (dtype == LogitsDtype::kFloat32) {
    by_flag(std::integral_constant<LogitsDtype, LogitsDtype::kFloat32>{});
  } else {
    by_flag(std::integral_constant<LogitsDtype, LogitsDtype::kBFloat16>{});
  }
}

template <LogitsDtype D, bool kEntropy, int kRowThreads>
struct Forward {
  static constexpr auto kFn = &ForwardKernel<D, kEntropy, kRowThreads>;
};

template <LogitsDtype D, bool kEntropyGrad, int kRowThreads>
struct Backward {
  static constexpr auto kFn = &BackwardKernel<D, kEntropyGrad, kRowThreads>;
};

}  // namespace

void gather_logprobs_cuda(const void* d_logits, LogitsDtype dtype,
                          int64_t num_rows, int64_t vocab_size,
                          int64_t row_stride, const int64_t* d_targets,
                          double temperature, float* d_logprobs,
                          float* d_entropy, float* d_row_max,
                          double* d_row_log_sum, cudaStream_t stream,
                          bool check_targets) {
  constexpr const char* kFn = "gather_logprobs_cuda";
  internal::validate_logprobs_args(
      kFn, d_logits, dtype, num_rows, vocab_size, row_stride, d_targets,
      temperature, false, d_logprobs, nullptr, nullptr, nullptr, nullptr);
  if (num_rows == 0) return;
  DeviceGuard guard(DeviceOf(d_logits, kFn, "d_logits"), kFn);
  int* d_flag = check_targets ? TargetFlags::ForCurrentDevice(kFn) : nullptr;

  const double inv_t = 1.0 / temperature;
  const auto k_log2 = static_cast<float>(inv_t * kLog2e);
  const Shape shape = ShapeFor(num_rows, vocab_size, dtype);
  Dispatch<Forward>(
      dtype, d_entropy != nullptr, shape.row_threads, [&](auto kernel) {
        kernel<<<shape.blocks, kBlockThreads, 0, stream>>>(
            d_logits, num_rows, vocab_size, row_stride, d_targets, inv_t,
            k_log2, d_logprobs, d_entropy, d_row_max, d_row_log_sum, d_flag);
      });
  CheckCuda(cudaGetLastError(), kFn, "kernel launch");
  if (check_targets) {
    ReportBadTargets(kFn, d_flag, d_targets, num_rows, vocab_size, stream);
  }
}

void gather_logprobs_backward_cuda(
    const void* d_logits, LogitsDtype dtype, int64_t num_rows,
    int64_t vocab_size, int64_t row_stride, const int64_t* d_targets,
    double temperature, const float* d_row_max, const double* d_row_log_sum,
    const float* d_entropy, const float* d_grad_logprobs,
    const float* d_grad_entropy, void* d_grad_logits, cudaStream_t stream,
    bool check_targets) {
  constexpr const char* kFn = "gather_logprobs_backward_cuda";
  internal::validate_logprobs_args(kFn, d_logits, dtype, num_rows, vocab_size,
                                   row_stride, d_targets, temperature, true,
                                   d_grad_logits, d_row_max, d_row_log_sum,
                                   d_entropy, d_grad_entropy);
  if (num_rows == 0) return;
  DeviceGuard guard(DeviceOf(d_logits, kFn, "d_logits"), kFn);
  int* d_flag = check_targets ? TargetFlags::ForCurrentDevice(kFn) : nullptr;

  const double inv_t = 1.0 / temperature;
  const auto k_log2 = static_cast<float>(inv_t * kLog2e);
  const Shape shape = ShapeFor(num_rows, vocab_size, dtype);
  Dispatch<Backward>(
      dtype, d_grad_entropy != nullptr, shape.row_threads, [&](auto kernel) {
        kernel<<<shape.blocks, kBlockThreads, 0, stream>>>(
            d_logits, num_rows, vocab_size, row_stride, d_targets, inv_t,
            k_log2, d_row_max, d_row_log_sum, d_entropy, d_grad_logprobs,
            d_grad_entropy, d_grad_logits, d_flag);
      });
  CheckCuda(cudaGetLastError(), kFn, "kernel launch");
  if (check_targets) {
    ReportBadTargets(kFn, d_flag, d_targets, num_rows, vocab_size, stream);
  }
}

}  // namespace dockyard::kernels
