#include "cc/logprobs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

// The inner loops are written with GCC/Clang vector extensions (8 floats, one
// AVX register) rather than left to the auto-vectorizer: the build uses -O2,
// whose cost model does not vectorize reductions, and float sums are not
// reassociated without -ffast-math. Every helper is always_inline, so the same
// source compiles once for the baseline ISA and once for AVX2 (below), and the
// 32-byte vectors never cross a function call (which would change the ABI).
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace dockyard::kernels {
namespace {

#define DY_INLINE inline __attribute__((always_inline))

using VF = float __attribute__((vector_size(32)));
using VI = int32_t __attribute__((vector_size(32)));
using VU = uint32_t __attribute__((vector_size(32)));
using VD = double __attribute__((vector_size(64)));
using VU16 = uint16_t __attribute__((vector_size(16)));
constexpr int kLanes = 8;

constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr uint16_t kBf16NegInf = 0xFF80;  // -inf as bfloat16 bits.

// Elements per chunk of the online logsumexp: the chunk is read from memory
// once (max pass) and again from L1 (sum pass). 2048 floats = 8 KiB.
constexpr int64_t kChunk = 2048;
// Below this many logits one thread is faster than starting others; each extra
// thread gets at least this much work.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 18;

DY_INLINE VF Splat(float v) { return VF{} + v; }

DY_INLINE VF Select(const VI& mask, const VF& a, const VF& b) {
  return reinterpret_cast<VF>((mask & reinterpret_cast<VI>(a)) |
                              (~mask & reinterpret_cast<VI>(b)));
}

DY_INLINE float HMax(const VF& v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

DY_INLINE double HSum(const VD& v) {
  // Fixed order, so results do not depend on the ISA.
  double s = 0.0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp(x) for x <= 0 (and NaN, which it returns): Cody-Waite reduction
// x = n ln2 + r with |r| <= ln2 / 2, then a degree-7 Taylor polynomial for
// e^r (truncation error < 6e-9; max relative error ~2e-7 with rounding).
// Returns exactly 0 below -87.33 (where e^x is below float's smallest normal,
// 1.2e-38): masked (-inf) logits get probability exactly 0.
DY_INLINE VF ExpNonPositive(const VF& x) {
  const VI underflow = x < -87.33654f;
  const VI is_nan = x != x;
  // Keep the integer conversion below in range for every lane.
  const VF xc = Select(underflow | is_nan, Splat(-1.0f), x);
  // Round to nearest integer: adding 1.5 * 2^23 pushes the fraction out.
  const VF shifted = xc * 1.44269504088896341f + 12582912.0f;
  const VF n = shifted - 12582912.0f;
  VF r = xc - n * 0.693359375f;  // ln2's high part: n * it is exact.
  r = r - n * -2.12194440e-4f;   // ln2's low part.
  VF p = Splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // n in [-126, 0]: 2^n is a normal float, built from its exponent bits.
  const VI exponent = (__builtin_convertvector(n, VI) + 127) << 23;
  const VF result = p * reinterpret_cast<VF>(exponent);
  return Select(underflow, VF{}, Select(is_nan, x, result));
}

DY_INLINE VD ToDouble(const VF& v) { return __builtin_convertvector(v, VD); }

// Loads of 8 logits as floats from element k of a row; the Partial versions
// read `count` < 8 elements and pad with -inf (neutral for max, exp = 0).
template <LogitsDtype D>
struct Logits;

template <>
struct Logits<LogitsDtype::kFloat32> {
  using T = float;
  static DY_INLINE VF Load(const T* row, int64_t k) {
    VF v;
    std::memcpy(&v, row + k, sizeof(v));
    return v;
  }
  static DY_INLINE VF LoadPartial(const T* row, int64_t k, int64_t count) {
    float buf[kLanes] = {-kInfF, -kInfF, -kInfF, -kInfF,
                         -kInfF, -kInfF, -kInfF, -kInfF};
    std::memcpy(buf, row + k, count * sizeof(T));
    VF v;
    std::memcpy(&v, buf, sizeof(v));
    return v;
  }
  static DY_INLINE float Scalar(const T* row, int64_t k) { return row[k]; }
  static DY_INLINE void Store(T* out, int64_t k, const VF& v, int64_t count) {
    std::memcpy(out + k, &v, count * sizeof(T));
  }
  static DY_INLINE void StoreScalar(T* out, int64_t k, float v) { out[k] = v; }
};

DY_INLINE float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as torch's float -> bfloat16; NaN stays a quiet NaN.
DY_INLINE uint16_t FloatToBf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <>
struct Logits<LogitsDtype::kBFloat16> {
  using T = uint16_t;
  static DY_INLINE VF Widen(const VU16& bits) {
    return reinterpret_cast<VF>(__builtin_convertvector(bits, VU) << 16);
  }
  static DY_INLINE VF Load(const T* row, int64_t k) {
    VU16 bits;
    std::memcpy(&bits, row + k, sizeof(bits));
    return Widen(bits);
  }
  static DY_INLINE VF LoadPartial(const T* row, int64_t k, int64_t count) {
    T buf[kLanes] = {kBf16NegInf, kBf16NegInf, kBf16NegInf, kBf16NegInf,
                     kBf16NegInf, kBf16NegInf, kBf16NegInf, kBf16NegInf};
    std::memcpy(buf, row + k, count * sizeof(T));
    VU16 bits;
    std::memcpy(&bits, buf, sizeof(bits));
    return Widen(bits);
  }
  static DY_INLINE float Scalar(const T* row, int64_t k) {
    return Bf16ToFloat(row[k]);
  }
  static DY_INLINE void Store(T* out, int64_t k, const VF& v, int64_t count) {
    const VU u = reinterpret_cast<VU>(v);
    VU rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const VI is_nan = v != v;
    rounded = (reinterpret_cast<VU>(is_nan) & 0x7FC0u) |
              (~reinterpret_cast<VU>(is_nan) & rounded);
    const VU16 bits = __builtin_convertvector(rounded, VU16);
    std::memcpy(out + k, &bits, count * sizeof(T));
  }
  static DY_INLINE void StoreScalar(T* out, int64_t k, float v) {
    out[k] = FloatToBf16(v);
  }
};

struct ForwardArgs {
  const void* logits;
  int64_t num_rows, vocab_size, row_stride;
  const int64_t* targets;
  double temperature;
  float* logprobs;
  float* entropy;
  float* row_max;
  double* row_log_sum;
};

struct BackwardArgs {
  const void* logits;
  int64_t num_rows, vocab_size, row_stride;
  const int64_t* targets;
  double temperature;
  const float* row_max;
  const double* row_log_sum;
  const float* entropy;
  const float* grad_logprobs;
  const float* grad_entropy;
  void* grad_logits;
};

// One row of the forward pass. See the header for the algorithm.
template <LogitsDtype D, bool kEntropy>
DY_INLINE void ForwardRow(const ForwardArgs& a, int64_t r) {
  using L = Logits<D>;
  using T = typename L::T;
  const int64_t V = a.vocab_size;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  const double inv_t_d = 1.0 / a.temperature;
  const float inv_t = static_cast<float>(inv_t_d);

  float m = -kInfF;  // Running max of the raw logits.
  double s = 0.0;    // sum exp((x - m) / T)
  double t = 0.0;    // sum exp((x - m) / T) * (x - m) / T  (entropy only)
  VI nan_seen = VI{};
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t end = std::min(V, c + kChunk);
    const int64_t full_end = c + (end - c) / kLanes * kLanes;
    // Pass 1: the chunk's max. NaNs lose every comparison; they are tracked
    // separately so that they reach the result.
    VF vmax = Splat(-kInfF);
    for (int64_t k = c; k < full_end; k += kLanes) {
      const VF v = L::Load(row, k);
      nan_seen |= v != v;
      vmax = Select(v > vmax, v, vmax);
    }
    if (full_end < end) {
      const VF v = L::LoadPartial(row, full_end, end - full_end);
      nan_seen |= v != v;
      vmax = Select(v > vmax, v, vmax);
    }
    const float chunk_max = HMax(vmax);
    if (chunk_max > m) {
      if (s > 0.0) {
        // Rescale the sums from the old max to the new one:
        //   s' = e^delta s,  t' = e^delta (t + delta s),  delta = (m - m') / T.
        const double delta =
            (static_cast<double>(m) - static_cast<double>(chunk_max)) * inv_t_d;
        const double scale = std::exp(delta);
        t = scale * (t + delta * s);
        s = scale * s;
      }
      m = chunk_max;
    }
    if (m == -kInfF) continue;  // All masked so far: nothing to add.

    // Pass 2 (from L1): the chunk's exps relative to the running max.
    VD vs = VD{}, vt = VD{};
    auto add = [&](const VF& v) __attribute__((always_inline)) {
      const VF d = (v - m) * inv_t;
      const VF e = ExpNonPositive(d);
      vs += ToDouble(e);
      if constexpr (kEntropy) {
        // e * d with e == 0 (masked, d = -inf) would be NaN: it is 0.
        vt += ToDouble(Select(e == 0.0f, VF{}, e * d));
      }
    };
    for (int64_t k = c; k < full_end; k += kLanes) add(L::Load(row, k));
    if (full_end < end) add(L::LoadPartial(row, full_end, end - full_end));
    s += HSum(vs);
    if constexpr (kEntropy) t += HSum(vt);
  }

  bool any_nan = false;
  for (int i = 0; i < kLanes; ++i) any_nan |= nan_seen[i] != 0;
  // All -inf (nothing to normalise), or NaN / +inf somewhere: NaN, as torch.
  if (any_nan || !(m > -kInfF) || !std::isfinite(s)) {
    a.logprobs[r] = static_cast<float>(kNaN);
    if (kEntropy) a.entropy[r] = static_cast<float>(kNaN);
    if (a.row_max != nullptr) a.row_max[r] = static_cast<float>(kNaN);
    if (a.row_log_sum != nullptr) a.row_log_sum[r] = kNaN;
    return;
  }
  const double log_s = std::log(s);  // s >= 1: the max contributes e^0.
  const double x_t = L::Scalar(row, a.targets[r]);
  // In double: exact shift, then scale; -inf stays -inf.
  a.logprobs[r] =
      static_cast<float>((x_t - static_cast<double>(m)) * inv_t_d - log_s);
  if (kEntropy) a.entropy[r] = static_cast<float>(log_s - t / s);
  if (a.row_max != nullptr) a.row_max[r] = m;
  if (a.row_log_sum != nullptr) a.row_log_sum[r] = log_s;
}

// One row of the backward pass:
//   grad_k = p_k * (-g / T - gH / T * (log p_k + H)) + [k == t] g / T
// with p_k = exp((x_k - M) / T) / S and log p_k = (x_k - M) / T - log S.
template <LogitsDtype D, bool kEntropyGrad>
DY_INLINE void BackwardRow(const BackwardArgs& a, int64_t r) {
  using L = Logits<D>;
  using T = typename L::T;
  const int64_t V = a.vocab_size;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  T* out = static_cast<T*>(a.grad_logits) + r * V;
  const double inv_t_d = 1.0 / a.temperature;
  const float inv_t = static_cast<float>(inv_t_d);

  const float m = a.row_max[r];
  const double log_s = a.row_log_sum[r];
  const double g = a.grad_logprobs != nullptr ? a.grad_logprobs[r] : 0.0;
  const double g_h = kEntropyGrad ? a.grad_entropy[r] : 0.0;
  const double h = kEntropyGrad ? a.entropy[r] : 0.0;
  if (!std::isfinite(m) || !std::isfinite(log_s) || !std::isfinite(h)) {
    // The forward gave NaN for this row (see the header): so does its grad.
    for (int64_t k = 0; k < V; ++k) {
      L::StoreScalar(out, k, static_cast<float>(kNaN));
    }
    return;
  }
  const float inv_s = static_cast<float>(std::exp(-log_s));
  const float coef_g = static_cast<float>(-g * inv_t_d);
  const float coef_h = static_cast<float>(-g_h * inv_t_d);
  const float h_minus_log_s = static_cast<float>(h - log_s);

  auto grad = [&](const VF& v) __attribute__((always_inline)) {
    const VF d = (v - m) * inv_t;
    const VF p = ExpNonPositive(d) * inv_s;
    VF out_v = p * coef_g;
    if constexpr (kEntropyGrad) {
      // p == 0 (masked: d = -inf) contributes exactly 0, not 0 * -inf.
      out_v += Select(p == 0.0f, VF{}, p * coef_h * (d + h_minus_log_s));
    }
    return out_v;
  };
  const int64_t full_end = V / kLanes * kLanes;
  for (int64_t k = 0; k < full_end; k += kLanes) {
    L::Store(out, k, grad(L::Load(row, k)), kLanes);
  }
  if (full_end < V) {
    L::Store(out, full_end, grad(L::LoadPartial(row, full_end, V - full_end)),
             V - full_end);
  }

  // The target's element again, in double: g (1 - p_t) cancels when p_t ~ 1.
  const int64_t tgt = a.targets[r];
  const double log_p_t =
      (static_cast<double>(L::Scalar(row, tgt)) - m) * inv_t_d - log_s;
  const double p_t = std::exp(log_p_t);  // 0 for a masked target.
  double grad_t = g * (1.0 - p_t);
  if (kEntropyGrad && p_t > 0.0) grad_t -= g_h * p_t * (log_p_t + h);
  L::StoreScalar(out, tgt, static_cast<float>(grad_t * inv_t_d));
}

template <LogitsDtype D, bool kEntropy>
DY_INLINE void ForwardRange(const ForwardArgs& a, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) ForwardRow<D, kEntropy>(a, r);
}

template <LogitsDtype D, bool kEntropyGrad>
DY_INLINE void BackwardRange(const BackwardArgs& a, int64_t begin,
                             int64_t end) {
  for (int64_t r = begin; r < end; ++r) BackwardRow<D, kEntropyGrad>(a, r);
}

// Entry points compiled twice: for the baseline ISA and, on x86-64, for AVX2
// (chosen at run time). Both do the same IEEE operations in the same order
// (no FMA contraction under -std=c++17), so their results are identical.
template <LogitsDtype D, bool kEntropy>
void ForwardRangeBase(const ForwardArgs& a, int64_t begin, int64_t end) {
  ForwardRange<D, kEntropy>(a, begin, end);
}
template <LogitsDtype D, bool kEntropyGrad>
void BackwardRangeBase(const BackwardArgs& a, int64_t begin, int64_t end) {
  BackwardRange<D, kEntropyGrad>(a, begin, end);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DOCKYARD_LOGPROBS_AVX2 1
template <LogitsDtype D, bool kEntropy>
__attribute__((target("avx2"))) void ForwardRangeAvx2(const ForwardArgs& a,
                                                      int64_t begin,
                                                      int64_t end) {
  ForwardRange<D, kEntropy>(a, begin, end);
}
template <LogitsDtype D, bool kEntropyGrad>
__attribute__((target("avx2"))) void BackwardRangeAvx2(const BackwardArgs& a,
                                                       int64_t begin,
                                                       int64_t end) {
  BackwardRange<D, kEntropyGrad>(a, begin, end);
}

bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

using ForwardFn = void (*)(const ForwardArgs&, int64_t, int64_t);
using BackwardFn = void (*)(const BackwardArgs&, int64_t, int64_t);

template <LogitsDtype D, bool kFlag>
ForwardFn PickForward() {
#ifdef DOCKYARD_LOGPROBS_AVX2
  if (CpuHasAvx2()) return &ForwardRangeAvx2<D, kFlag>;
#endif
  return &ForwardRangeBase<D, kFlag>;
}

template <LogitsDtype D, bool kFlag>
BackwardFn PickBackward() {
#ifdef DOCKYARD_LOGPROBS_AVX2
  if (CpuHasAvx2()) return &BackwardRangeAvx2<D, kFlag>;
#endif
  return &BackwardRangeBase<D, kFlag>;
}

// Runs fn(begin, end) over contiguous ranges of rows, in parallel when there is
// enough work. Each row is written by exactly one thread, and a row's result
// does not depend on which.
template <typename Fn>
void ParallelRows(int64_t num_rows, int64_t vocab_size, const Fn& fn) {
  const int64_t work = num_rows * std::max<int64_t>(vocab_size, 1);
  int64_t num_threads = 1;
  if (work >= 2 * kMinElementsPerThread && num_rows > 1) {
    const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
    num_threads = std::min({hw, work / kMinElementsPerThread, num_rows});
  }
  if (num_threads <= 1) {
    fn(0, num_rows);
    return;
  }
  const int64_t chunk = (num_rows + num_threads - 1) / num_threads;
  // No exceptions are thrown inside fn (validation happens before); the
  // vector keeps threads joinable if starting one fails.
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  int64_t next = 1;
  try {
    for (; next < num_threads; ++next) {
      const int64_t begin = next * chunk;
      const int64_t end = std::min(num_rows, begin + chunk);
      if (begin >= end) break;
      threads.emplace_back([&fn, begin, end] { fn(begin, end); });
    }
  } catch (const std::system_error&) {
    // The system refused another thread: do the remaining rows here.
  }
  fn(0, std::min(num_rows, chunk));
  for (; next < num_threads; ++next) {
    const int64_t begin = next * chunk;
    const int64_t end = std::min(num_rows, begin + chunk);
    if (begin < end) fn(begin, end);
  }
  for (std::thread& th : threads) th.join();
}

void ValidateTargets(const char* fn, const int64_t* targets, int64_t num_rows,
                     int64_t vocab_size) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t id = targets[r];
    if (id < 0 || id >= vocab_size) {
      internal::throw_target_out_of_range(fn, r, id, vocab_size);
    }
  }
}

[[noreturn]] void ThrowInvalid(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

}  // namespace

namespace internal {

void validate_logprobs_args(const char* fn, const void* logits,
                            LogitsDtype dtype, int64_t num_rows,
                            int64_t vocab_size, int64_t row_stride,
                            const int64_t* targets, double temperature,
                            bool backward, const void* out,
                            const float* row_max, const double* row_log_sum,
                            const float* entropy, const float* grad_entropy) {
  if (num_rows < 0) {
    ThrowInvalid(fn, "num_rows must be >= 0, got " + std::to_string(num_rows));
  }
  if (vocab_size < 0) {
    ThrowInvalid(fn,
                 "vocab_size must be >= 0, got " + std::to_string(vocab_size));
  }
  if (vocab_size == 0 && num_rows > 0) {
    ThrowInvalid(fn, "vocab_size is 0: no target id can be valid");
  }
  if (row_stride < 0) {
    ThrowInvalid(fn,
                 "row_stride must be >= 0, got " + std::to_string(row_stride));
  }
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (vocab_size > 0 && num_rows > kMax / vocab_size) {
    ThrowInvalid(fn, "num_rows * vocab_size overflows int64 (" +
                         std::to_string(num_rows) + " * " +
                         std::to_string(vocab_size) + ")");
  }
  if (num_rows > 1 && row_stride > (kMax - vocab_size) / (num_rows - 1)) {
    ThrowInvalid(fn, "the last row's offset overflows int64 (row_stride " +
                         std::to_string(row_stride) + ")");
  }
  // `!(t > 0)` also rejects NaN.
  if (!(temperature > 0.0) || !std::isfinite(temperature)) {
    ThrowInvalid(fn, "temperature must be finite and > 0, got " +
                         std::to_string(temperature));
  }
  if (dtype != LogitsDtype::kFloat32 && dtype != LogitsDtype::kBFloat16) {
    ThrowInvalid(fn, "unknown dtype enumerator " +
                         std::to_string(static_cast<int>(dtype)));
  }
  if (backward && grad_entropy != nullptr && entropy == nullptr) {
    ThrowInvalid(fn, "grad_entropy is given but entropy is null");
  }
  if (num_rows == 0) return;  // Pointers are not used.
  if (logits == nullptr) ThrowInvalid(fn, "logits is null");
  if (targets == nullptr) ThrowInvalid(fn, "targets is null");
  if (out == nullptr) {
    ThrowInvalid(fn, backward ? "grad_logits is null" : "logprobs is null");
  }
  if (backward) {
    if (row_max == nullptr) ThrowInvalid(fn, "row_max is null");
    if (row_log_sum == nullptr) ThrowInvalid(fn, "row_log_sum is null");
  }
}

void throw_target_out_of_range(const char* fn, int64_t row, int64_t id,
                               int64_t vocab_size) {
  throw std::out_of_range(std::string(fn) + ": target id " +
                          std::to_string(id) + " at row " +
                          std::to_string(row) + " is out of range [0, " +
                          std::to_string(vocab_size) + ")");
}

}  // namespace internal

void gather_logprobs(const void* logits, LogitsDtype dtype, int64_t num_rows,
                     int64_t vocab_size, int64_t row_stride,
                     const int64_t* targets, double temperature,
                     float* logprobs, float* entropy, float* row_max,
                     double* row_log_sum) {
  constexpr const char* kFn = "gather_logprobs";
  internal::validate_logprobs_args(
      kFn, logits, dtype, num_rows, vocab_size, row_stride, targets,
      temperature, false, logprobs, nullptr, nullptr, nullptr, nullptr);
  if (num_rows == 0) return;
  ValidateTargets(kFn, targets, num_rows, vocab_size);

  const ForwardArgs args{logits,  num_rows,    vocab_size, row_stride,
                         targets, temperature, logprobs,   entropy,
                         row_max, row_log_sum};
  const bool with_entropy = entropy != nullptr;
  ForwardFn fn;
  if (dtype == LogitsDtype::kFloat32) {
    fn = with_entropy ? PickForward<LogitsDtype::kFloat32, true>()
                      : PickForward<LogitsDtype::kFloat32, false>();
  } else {
    fn = with_entropy ? PickForward<LogitsDtype::kBFloat16, true>()
                      : PickForward<LogitsDtype::kBFloat16, false>();
  }
  ParallelRows(num_rows, vocab_size,
               [&](int64_t begin, int64_t end) { fn(args, begin, end); });
}

void gather_logprobs_backward(const void* logits, LogitsDtype dtype,
                              int64_t num_rows, int64_t vocab_size,
                              int64_t row_stride, const int64_t* targets,
                              double temperature, const float* row_max,
                              const double* row_log_sum, const float* entropy,
                              const float* grad_logprobs,
                              const float* grad_entropy, void* grad_logits) {
  constexpr const char* kFn = "gather_logprobs_backward";
  internal::validate_logprobs_args(kFn, logits, dtype, num_rows, vocab_size,
                                   row_stride, targets, temperature, true,
                                   grad_logits, row_max, row_log_sum, entropy,
                                   grad_entropy);
  if (num_rows == 0) return;
  ValidateTargets(kFn, targets, num_rows, vocab_size);

  const BackwardArgs args{logits,  num_rows,      vocab_size,   row_stride,
                          targets, temperature,   row_max,      row_log_sum,
                          entropy, grad_logprobs, grad_entropy, grad_logits};
  const bool with_entropy = grad_entropy != nullptr;
  BackwardFn fn;
  if (dtype == LogitsDtype::kFloat32) {
    fn = with_entropy ? PickBackward<LogitsDtype::kFloat32, true>()
                      : PickBackward<LogitsDtype::kFloat32, false>();
  } else {
    fn = with_entropy ? PickBackward<LogitsDtype::kBFloat16, true>()
                      : PickBackward<LogitsDtype::kBFloat16, false>();
  }
  ParallelRows(num_rows, vocab_size,
               [&](int64_t begin, int64_t end) { fn(args, begin, end); });
}

}  // namespace dockyard::kernels
