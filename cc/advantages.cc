#include "cc/advantages.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace dockyard::kernels {
namespace {

// Below this many groups one thread is faster: starting a thread costs tens of
// microseconds, while a typical GRPO batch (a few hundred groups of 4-64
// samples) is done in a few microseconds.
constexpr int64_t kMaxGroupsSerial = 4096;
// Each extra thread gets at least this many groups, so that its start-up cost
// stays small against its share of the work.
constexpr int64_t kMinGroupsPerThread = 2048;

// "%g"-style text: std::to_string(float) prints fixed 6 decimals, which turns
// an epsilon of -1e-9 into "-0.000000".
std::string FormatFloat(float v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  return buf;
}

[[noreturn]] void ThrowInvalid(const std::string& what) {
  throw std::invalid_argument("group_advantages: " + what);
}

// Computes the advantages of one group of `n` > 0 rewards `r` into `out`.
// `group` is only used to name the group in error messages.
void GroupAdvantagesOne(const float* r, int64_t n, int64_t group,
                        Baseline baseline, bool normalize_std, double epsilon,
                        float* out) {
  // Pass 1: validate, sum in double, and detect a constant group.
  const float first = r[0];
  bool all_equal = true;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = r[i];
    if (!std::isfinite(v)) internal::throw_non_finite_reward(group, i, v);
    sum += v;
    // Exact comparison on purpose: "all rewards equal" means bit-equal values
    // (the usual case is all-pass or all-fail), not "close".
    all_equal = all_equal && (v == first);
  }
  // One sample (no others to compare with) or no reward difference: no signal.
  // Written explicitly so that the result is exactly 0 whatever the rounding,
  // and normalisation never divides 0 by a zero std.
  if (n == 1 || all_equal) {
    std::fill(out, out + n, 0.0f);
    return;
  }

  const double mean = sum / static_cast<double>(n);
  // Both baselines are a multiple of (r_i - mean):
  //   leave-one-out: r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean)
  // The closed form subtracts the mean first, avoiding the cancellation of
  // (sum - r_i) when rewards are large and close together.
  double scale = 1.0;
  if (baseline == Baseline::kLeaveOneOut) {
    scale = static_cast<double>(n) / static_cast<double>(n - 1);
  }
  if (normalize_std) {
    // Two-pass variance (sum of squared deviations from the mean): exact
    // enough for 1e7 + small deltas, where E[x^2] - E[x]^2 would cancel. In
    // double, squares of any float (up to ~1e77) cannot overflow.
    double sum_sq = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(r[i]) - mean;
      sum_sq += d * d;
    }
    // Not all equal, so sum_sq > 0: the smallest nonzero float deviation
    // (~1e-45) squares to ~1e-90, far above double's underflow.
    const double std_dev = std::sqrt(sum_sq / static_cast<double>(n - 1));
    scale /= (std_dev + epsilon);
  }
  // Read r[i] before writing out[i]: this is what makes out == r safe.
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>((static_cast<double>(r[i]) - mean) * scale);
  }
}

void GroupAdvantagesRange(const float* rewards, int64_t group_begin,
                          int64_t group_end, int64_t group_size,
                          Baseline baseline, bool normalize_std, double epsilon,
                          float* out) {
  for (int64_t g = group_begin; g < group_end; ++g) {
    GroupAdvantagesOne(rewards + g * group_size, group_size, g, baseline,
                       normalize_std, epsilon, out + g * group_size);
  }
}

}  // namespace

namespace internal {

void validate_group_advantages_args(const float* rewards, int64_t num_groups,
                                    int64_t group_size, Baseline baseline,
                                    float epsilon, const float* out) {
  if (num_groups < 0) {
    ThrowInvalid("num_groups must be >= 0, got " + std::to_string(num_groups));
  }
  if (group_size < 0) {
    ThrowInvalid("group_size must be >= 0, got " + std::to_string(group_size));
  }
  if (group_size > 0 &&
      num_groups > std::numeric_limits<int64_t>::max() / group_size) {
    ThrowInvalid("num_groups * group_size overflows int64 (" +
                 std::to_string(num_groups) + " * " +
                 std::to_string(group_size) + ")");
  }
  // `!(epsilon >= 0)` also rejects NaN.
  if (!(epsilon >= 0.0f) || !std::isfinite(epsilon)) {
    ThrowInvalid("epsilon must be finite and >= 0, got " +
                 FormatFloat(epsilon));
  }
  if (baseline != Baseline::kLeaveOneOut && baseline != Baseline::kGroupMean) {
    ThrowInvalid("unknown baseline enumerator " +
                 std::to_string(static_cast<int>(baseline)));
  }
  if (num_groups == 0 || group_size == 0) return;  // Pointers are not used.
  if (rewards == nullptr) ThrowInvalid("rewards is null but the size is not 0");
  if (out == nullptr) ThrowInvalid("out is null but the size is not 0");
}

void throw_non_finite_reward(int64_t group, int64_t index, float value) {
  ThrowInvalid("reward at group " + std::to_string(group) + ", index " +
               std::to_string(index) + " is not finite (" + FormatFloat(value) +
               ")");
}

}  // namespace internal

void group_advantages(const float* rewards, int64_t num_groups,
                      int64_t group_size, Baseline baseline, bool normalize_std,
                      float epsilon, float* out) {
  internal::validate_group_advantages_args(rewards, num_groups, group_size,
                                           baseline, epsilon, out);
  if (num_groups == 0 || group_size == 0) return;  // Nothing to read or write.

  const double eps = static_cast<double>(epsilon);
  int64_t num_threads = 1;
  if (num_groups > kMaxGroupsSerial) {
    const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
    num_threads = std::min(
        hw, (num_groups + kMinGroupsPerThread - 1) / kMinGroupsPerThread);
  }
  if (num_threads <= 1) {
    GroupAdvantagesRange(rewards, 0, num_groups, group_size, baseline,
                         normalize_std, eps, out);
    return;
  }

  // Contiguous chunks of groups, one per thread. Each chunk stops at its first
  // bad reward and keeps the exception; rethrowing the error of the lowest
  // failing chunk reports the first bad reward in row-major order, exactly as
  // the serial path does.
  const int64_t chunk = (num_groups + num_threads - 1) / num_threads;
  std::vector<std::exception_ptr> errors(num_threads);
  auto run_chunk = [&](int64_t t) {
    const int64_t begin = t * chunk;
    const int64_t end = std::min(num_groups, begin + chunk);
    try {
      GroupAdvantagesRange(rewards, begin, end, group_size, baseline,
                           normalize_std, eps, out);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  int64_t next = 1;
  try {
    for (; next < num_threads; ++next) threads.emplace_back(run_chunk, next);
  } catch (const std::system_error&) {
    // The system refused another thread: do the remaining chunks here rather
    // than fail (threads already started must be joined either way).
  }
  run_chunk(0);
  for (; next < num_threads; ++next) run_chunk(next);
  for (std::thread& th : threads) th.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace dockyard::kernels
