// Tests of the core gather_logprobs / gather_logprobs_backward
// (cc/logprobs.h), on the harness of cc/testing.h: it prints each failure with
// its line, then "logprobs_test: N passed, M failed", and exits nonzero on any
// failure.
//
// Expected values come from hand-worked examples and from a naive double
// implementation of the definitions (two passes, no online rescaling); the
// gradients are also checked against central finite differences of it.

#include "cc/logprobs.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cc/testing.h"

namespace {

using dockyard::testing::FromBf16;
using dockyard::testing::ToBf16;

using dockyard::kernels::gather_logprobs;
using dockyard::kernels::gather_logprobs_backward;
using dockyard::kernels::LogitsDtype;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr float kNaNF = std::numeric_limits<float>::quiet_NaN();

struct Forward {
  std::vector<float> logprobs, entropy, row_max;
  std::vector<double> row_log_sum;
};

// Runs the forward on float logits (converted to bf16 bits when asked).
Forward RunForward(const std::vector<float>& logits, int64_t num_rows,
                   int64_t vocab_size, const std::vector<int64_t>& targets,
                   double temperature,
                   LogitsDtype dtype = LogitsDtype::kFloat32,
                   int64_t row_stride = -1) {
  if (row_stride < 0) row_stride = vocab_size;
  Forward f;
  f.logprobs.assign(num_rows, -999.0f);
  f.entropy.assign(num_rows, -999.0f);
  f.row_max.assign(num_rows, -999.0f);
  f.row_log_sum.assign(num_rows, -999.0);
  std::vector<uint16_t> bf16(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) bf16[i] = ToBf16(logits[i]);
  const void* data = dtype == LogitsDtype::kFloat32
                         ? static_cast<const void*>(logits.data())
                         : static_cast<const void*>(bf16.data());
  gather_logprobs(data, dtype, num_rows, vocab_size, row_stride, targets.data(),
                  temperature, f.logprobs.data(), f.entropy.data(),
                  f.row_max.data(), f.row_log_sum.data());
  return f;
}

// Naive double reference of one row: (logprob, entropy).
std::pair<double, double> NaiveRow(const float* row, int64_t V, int64_t target,
                                   double T) {
  double m = -kInf;
  for (int64_t k = 0; k < V; ++k) m = std::max(m, row[k] / T);
  double s = 0.0;
  for (int64_t k = 0; k < V; ++k) s += std::exp(row[k] / T - m);
  const double lse = m + std::log(s);
  double expected_z = 0.0;
  for (int64_t k = 0; k < V; ++k) {
    const double p = std::exp(row[k] / T - lse);
    if (p > 0) expected_z += p * (row[k] / T);
  }
  return {row[target] / T - lse, lse - expected_z};
}

// Deterministic pseudo-random logits in [-scale, scale] (no <random>
// distribution, whose output differs across standard libraries).
std::vector<float> PseudoRandom(size_t n, float scale, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t x = 0x9E3779B97F4A7C15ull ^ (seed * 0x2545F4914F6CDD1Dull);
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = scale * (static_cast<float>(x % 200001) / 100000.0f - 1.0f);
  }
  return v;
}

void TestHandExamples() {
  const double ln2 = std::log(2.0), ln3 = std::log(3.0);
  // Row 0: {0, 0} -> p = 1/2 each. Row 1: {0, ln 3} -> p = {1/4, 3/4}.
  const std::vector<float> logits = {0.0f, 0.0f, 0.0f, static_cast<float>(ln3)};
  const Forward f = RunForward(logits, 2, 2, {0, 1}, 1.0);
  EXPECT_NEAR(f.logprobs[0], -ln2, 1e-7);
  EXPECT_NEAR(f.entropy[0], ln2, 1e-7);
  EXPECT_NEAR(f.logprobs[1], std::log(0.75), 1e-7);
  EXPECT_NEAR(f.entropy[1], -(0.25 * std::log(0.25) + 0.75 * std::log(0.75)),
              1e-7);
  CHECK(f.row_max[0] == 0.0f);
  CHECK(f.row_max[1] == static_cast<float>(ln3));
  EXPECT_NEAR(f.row_log_sum[0], ln2, 1e-7);
  EXPECT_NEAR(f.row_log_sum[1], std::log(1.0 + 1.0 / 3.0), 1e-7);
}

void TestTemperature() {
  // {0, 2 ln 3} at T = 2 is {0, ln 3} at T = 1: p = {1/4, 3/4}.
  const std::vector<float> logits = {0.0f,
                                     static_cast<float>(2 * std::log(3.0))};
  const Forward f = RunForward(logits, 1, 2, {0}, 2.0);
  EXPECT_NEAR(f.logprobs[0], std::log(0.25), 1e-7);
  EXPECT_NEAR(f.entropy[0], -(0.25 * std::log(0.25) + 0.75 * std::log(0.75)),
              1e-7);
}

void TestVocabOne() {
  const Forward f = RunForward({3.5f, -1e30f, 0.0f}, 3, 1, {0, 0, 0}, 0.7);
  for (int r = 0; r < 3; ++r) {
    CHECK(f.logprobs[r] == 0.0f);
    CHECK(f.entropy[r] == 0.0f);
  }
}

void TestHugeLogits() {
  // exp(1e30) overflows anything: the shift by the max must come first.
  const std::vector<float> logits = {1e30f, 1e30f, -1e30f, 3e38f, -3e38f, 0.0f};
  const Forward f = RunForward(logits, 2, 3, {0, 2}, 1.0);
  EXPECT_NEAR(f.logprobs[0], -std::log(2.0), 1e-7);
  EXPECT_NEAR(f.entropy[0], std::log(2.0), 1e-7);
  // Row 1: p = one-hot on 3e38; target 2 (0.0) has logprob -3e38.
  EXPECT_NEAR(f.logprobs[1], -3e38, 1e31);
  CHECK(std::isfinite(f.logprobs[1]));
  CHECK(f.entropy[1] == 0.0f);
}

void TestMaskedLogits() {
  // {0, -inf, 0, -inf}: masked entries have probability 0.
  const std::vector<float> logits = {0.0f, -kInfF, 0.0f, -kInfF};
  const Forward f = RunForward(logits, 1, 4, {0}, 1.0);
  EXPECT_NEAR(f.logprobs[0], -std::log(2.0), 1e-7);
  EXPECT_NEAR(f.entropy[0], std::log(2.0), 1e-7);
  // A masked target: -inf log-prob, the rest stays finite.
  const Forward g = RunForward(logits, 1, 4, {1}, 1.0);
  CHECK(g.logprobs[0] == -kInfF);
  EXPECT_NEAR(g.entropy[0], std::log(2.0), 1e-7);
  // Masked head of a long row (several chunks entirely -inf before the max).
  std::vector<float> long_row(5000, -kInfF);
  long_row[4999] = 7.0f;
  long_row[4500] = 7.0f;
  const Forward h = RunForward(long_row, 1, 5000, {4500}, 1.0);
  EXPECT_NEAR(h.logprobs[0], -std::log(2.0), 1e-7);
  EXPECT_NEAR(h.entropy[0], std::log(2.0), 1e-7);
}

void TestNaNRows() {
  // All -inf, a NaN, a +inf: NaN everything for that row only.
  const std::vector<float> logits = {-kInfF, -kInfF, 1.0f, kNaNF,
                                     kInfF,  0.0f,   1.0f, 2.0f};
  const Forward f = RunForward(logits, 4, 2, {0, 0, 0, 1}, 1.0);
  for (int r = 0; r < 3; ++r) {
    CHECK(std::isnan(f.logprobs[r]));
    CHECK(std::isnan(f.entropy[r]));
    CHECK(std::isnan(f.row_log_sum[r]));
  }
  EXPECT_NEAR(f.logprobs[3], -std::log1p(std::exp(-1.0)), 1e-7);
}

void TestRandomParity() {
  // Vocab sizes around the 8-lane vectors and the 2048-element chunks.
  for (int64_t V : {2, 7, 8, 9, 100, 2047, 2048, 2049, 5000}) {
    for (double T : {1.0, 0.7, 1.9}) {
      for (LogitsDtype dtype :
           {LogitsDtype::kFloat32, LogitsDtype::kBFloat16}) {
        const int64_t N = 5, stride = V + 3;  // Rows with a gap between them.
        std::vector<float> logits =
            PseudoRandom(N * stride, 12.0f, static_cast<uint64_t>(V * 10 + T));
        if (dtype == LogitsDtype::kBFloat16) {
          for (float& x : logits) x = FromBf16(ToBf16(x));
        }
        logits[stride + V / 2] = -kInfF;  // A masked entry in row 1.
        std::vector<int64_t> targets(N);
        for (int64_t r = 0; r < N; ++r) targets[r] = (r * 7919) % V;
        const Forward f = RunForward(logits, N, V, targets, T, dtype, stride);
        for (int64_t r = 0; r < N; ++r) {
          const auto [lp, h] = NaiveRow(&logits[r * stride], V, targets[r], T);
          if (std::isinf(lp)) {  // The target is the masked entry.
            CHECK(f.logprobs[r] == -kInfF);
          } else {
            EXPECT_NEAR(f.logprobs[r], lp, 1e-6 * std::fabs(lp) + 1e-6);
          }
          EXPECT_NEAR(f.entropy[r], h, 1e-6 * std::fabs(h) + 1e-6);
        }
      }
    }
  }
}

// The naive (-logsumexp, entropy) of a row of doubles, for finite
// differences (logprob = z_target - logsumexp; the z_target part is added by
// the caller, as it is -inf for a masked target).
std::pair<double, double> NaiveRowDouble(const std::vector<double>& row,
                                         double T) {
  double m = -kInf;
  for (double x : row) m = std::max(m, x / T);
  double s = 0.0;
  for (double x : row) s += std::exp(x / T - m);
  const double lse = m + std::log(s);
  double expected_z = 0.0;
  for (double x : row) {
    const double p = std::exp(x / T - lse);
    if (p > 0) expected_z += p * (x / T);
  }
  return {-lse, lse - expected_z};
}

void TestBackwardFiniteDifferences() {
  const int64_t N = 3, V = 11;
  const double T = 0.8;
  std::vector<float> logits = PseudoRandom(N * V, 3.0f, 42);
  logits[V + 4] = -kInfF;  // Masked in row 1: gradient exactly 0 there.
  const std::vector<int64_t> targets = {2, 4, 10};  // Row 1's target masked.
  const std::vector<float> g = {1.0f, -0.5f, 2.5f};
  const std::vector<float> g_h = {0.3f, 1.0f, -2.0f};
  const Forward f = RunForward(logits, N, V, targets, T);
  std::vector<float> grad(N * V, -999.0f);
  gather_logprobs_backward(logits.data(), LogitsDtype::kFloat32, N, V, V,
                           targets.data(), T, f.row_max.data(),
                           f.row_log_sum.data(), f.entropy.data(), g.data(),
                           g_h.data(), grad.data());
  for (int64_t r = 0; r < N; ++r) {
    std::vector<double> row(logits.begin() + r * V,
                            logits.begin() + (r + 1) * V);
    for (int64_t k = 0; k < V; ++k) {
      if (std::isinf(row[k])) {
        // Masked logit: no gradient from either output, even at the target.
        const double expected = k == targets[r] ? g[r] / T : 0.0;
        EXPECT_NEAR(grad[r * V + k], expected, 1e-6);
        continue;
      }
      const double eps = 1e-5;
      std::vector<double> up = row, down = row;
      up[k] += eps;
      down[k] -= eps;
      // Objective g * logprob + g_h * entropy with logprob = z_t - lse.
      // Row 1's target is masked: z_t is -inf, a constant, and the gradient
      // is that of -lse, as torch defines it (g / T at the target itself is
      // checked above).
      const bool target_masked = std::isinf(row[targets[r]]);
      auto obj = [&](const std::vector<double>& x) {
        const auto [neg_lse, h] = NaiveRowDouble(x, T);
        const double z_t = target_masked ? 0.0 : x[targets[r]] / T;
        return g[r] * (z_t + neg_lse) + g_h[r] * h;
      };
      const double fd = (obj(up) - obj(down)) / (2 * eps);
      if (!(std::fabs(grad[r * V + k] - fd) <= 1e-5)) {
        std::fprintf(stderr, "  row %lld, k %lld\n", static_cast<long long>(r),
                     static_cast<long long>(k));
      }
      EXPECT_NEAR(grad[r * V + k], fd, 1e-5);
    }
  }
}

void TestBackwardNullGradsAndBf16() {
  const int64_t N = 4, V = 2051;
  const double T = 1.3;
  std::vector<float> logits = PseudoRandom(N * V, 8.0f, 7);
  for (float& x : logits) x = FromBf16(ToBf16(x));
  const std::vector<int64_t> targets = {0, 2050, 17, 1024};
  const std::vector<float> g = {1.0f, 0.25f, -3.0f, 0.0f};
  const Forward f = RunForward(logits, N, V, targets, T);
  std::vector<float> grad(N * V);
  gather_logprobs_backward(logits.data(), LogitsDtype::kFloat32, N, V, V,
                           targets.data(), T, f.row_max.data(),
                           f.row_log_sum.data(), nullptr, g.data(), nullptr,
                           grad.data());
  // grad = g (onehot - p) / T, checked against the naive softmax.
  for (int64_t r = 0; r < N; ++r) {
    const float* row = &logits[r * V];
    const auto [lp, h] = NaiveRow(row, V, targets[r], T);
    (void)h;
    const double lse = row[targets[r]] / T - lp;
    double max_err = 0.0;
    for (int64_t k = 0; k < V; ++k) {
      const double p = std::exp(row[k] / T - lse);
      const double expected = g[r] * ((k == targets[r]) - p) / T;
      max_err = std::max(max_err, std::fabs(grad[r * V + k] - expected) /
                                      (1e-6 + 1e-6 * std::fabs(expected)));
    }
    CHECK(max_err <= 1.0);
  }
  // The bf16 path computes the same floats and rounds them to nearest even.
  std::vector<uint16_t> logits_bf16(logits.size()), grad_bf16(N * V);
  for (size_t i = 0; i < logits.size(); ++i) logits_bf16[i] = ToBf16(logits[i]);
  gather_logprobs_backward(logits_bf16.data(), LogitsDtype::kBFloat16, N, V, V,
                           targets.data(), T, f.row_max.data(),
                           f.row_log_sum.data(), nullptr, g.data(), nullptr,
                           grad_bf16.data());
  int mismatches = 0;
  for (size_t i = 0; i < grad.size(); ++i) {
    mismatches += grad_bf16[i] != ToBf16(grad[i]);
  }
  CHECK(mismatches == 0);
  // No upstream gradient at all: exact zeros.
  std::vector<float> zero(N * V, -1.0f);
  gather_logprobs_backward(logits.data(), LogitsDtype::kFloat32, N, V, V,
                           targets.data(), T, f.row_max.data(),
                           f.row_log_sum.data(), nullptr, nullptr, nullptr,
                           zero.data());
  for (float v : zero) CHECK(v == 0.0f);
}

void TestThreadedMatchesPerRow() {
  // 200 rows x 3001: above the threaded threshold. Each row alone (one row,
  // serial) must give bit-identical results.
  const int64_t N = 200, V = 3001;
  const std::vector<float> logits = PseudoRandom(N * V, 20.0f, 3);
  std::vector<int64_t> targets(N);
  for (int64_t r = 0; r < N; ++r) targets[r] = (r * 131) % V;
  const Forward all = RunForward(logits, N, V, targets, 1.0);
  std::vector<float> g(N, 1.0f), grad(N * V);
  gather_logprobs_backward(logits.data(), LogitsDtype::kFloat32, N, V, V,
                           targets.data(), 1.0, all.row_max.data(),
                           all.row_log_sum.data(), all.entropy.data(), g.data(),
                           g.data(), grad.data());
  int mismatches = 0;
  std::vector<float> one_grad(V);
  for (int64_t r = 0; r < N; ++r) {
    const std::vector<float> row(logits.begin() + r * V,
                                 logits.begin() + (r + 1) * V);
    const Forward one = RunForward(row, 1, V, {targets[r]}, 1.0);
    mismatches += one.logprobs[0] != all.logprobs[r];
    mismatches += one.entropy[0] != all.entropy[r];
    gather_logprobs_backward(row.data(), LogitsDtype::kFloat32, 1, V, V,
                             &targets[r], 1.0, one.row_max.data(),
                             one.row_log_sum.data(), one.entropy.data(),
                             g.data(), g.data(), one_grad.data());
    for (int64_t k = 0; k < V; ++k)
      mismatches += one_grad[k] != grad[r * V + k];
  }
  CHECK(mismatches == 0);
}

void TestEmptyAndOptionalOutputs() {
  gather_logprobs(nullptr, LogitsDtype::kFloat32, 0, 5, 5, nullptr, 1.0,
                  nullptr, nullptr, nullptr, nullptr);
  gather_logprobs_backward(nullptr, LogitsDtype::kBFloat16, 0, 0, 0, nullptr,
                           1.0, nullptr, nullptr, nullptr, nullptr, nullptr,
                           nullptr);
  // Only logprobs requested.
  const std::vector<float> logits = {0.0f, 0.0f};
  const int64_t target = 1;
  float lp = 0.0f;
  gather_logprobs(logits.data(), LogitsDtype::kFloat32, 1, 2, 2, &target, 1.0,
                  &lp, nullptr, nullptr, nullptr);
  EXPECT_NEAR(lp, -std::log(2.0), 1e-7);
}

void TestErrors() {
  const std::vector<float> logits(6, 0.0f);
  std::vector<float> out(2);
  std::vector<float> grad(6);
  const std::vector<float> stats_max(2, 0.0f);
  const std::vector<double> stats_sum(2, 0.0);
  const auto f32 = LogitsDtype::kFloat32;
  const std::vector<int64_t> bad_high = {0, 3};
  EXPECT_THROW_MSG(gather_logprobs(logits.data(), f32, 2, 3, 3, bad_high.data(),
                                   1.0, out.data(), nullptr, nullptr, nullptr),
                   std::out_of_range,
                   "target id 3 at row 1 is out of range [0, 3)");
  const std::vector<int64_t> bad_low = {-1, 0};
  EXPECT_THROW_MSG(
      gather_logprobs_backward(logits.data(), f32, 2, 3, 3, bad_low.data(), 1.0,
                               stats_max.data(), stats_sum.data(), nullptr,
                               out.data(), nullptr, grad.data()),
      std::out_of_range, "gather_logprobs_backward: target id -1 at row 0");
  const std::vector<int64_t> ok = {0, 2};
  for (double t : {0.0, -1.0, kInf, std::nan("")}) {
    EXPECT_THROW_MSG(gather_logprobs(logits.data(), f32, 2, 3, 3, ok.data(), t,
                                     out.data(), nullptr, nullptr, nullptr),
                     std::invalid_argument,
                     "temperature must be finite and > 0");
  }
  EXPECT_THROW_MSG(gather_logprobs(logits.data(), f32, -1, 3, 3, ok.data(), 1.0,
                                   out.data(), nullptr, nullptr, nullptr),
                   std::invalid_argument, "num_rows must be >= 0, got -1");
  EXPECT_THROW_MSG(gather_logprobs(logits.data(), f32, 2, 0, 0, ok.data(), 1.0,
                                   out.data(), nullptr, nullptr, nullptr),
                   std::invalid_argument, "vocab_size is 0");
  EXPECT_THROW_MSG(gather_logprobs(logits.data(), f32, 2, 3, -3, ok.data(), 1.0,
                                   out.data(), nullptr, nullptr, nullptr),
                   std::invalid_argument, "row_stride must be >= 0");
  EXPECT_THROW_MSG(
      gather_logprobs(logits.data(), f32,
                      std::numeric_limits<int64_t>::max() / 2, 3, 3, ok.data(),
                      1.0, out.data(), nullptr, nullptr, nullptr),
      std::invalid_argument, "overflows");
  EXPECT_THROW_MSG(
      gather_logprobs(logits.data(), static_cast<LogitsDtype>(9), 2, 3, 3,
                      ok.data(), 1.0, out.data(), nullptr, nullptr, nullptr),
      std::invalid_argument, "unknown dtype enumerator 9");
  EXPECT_THROW_MSG(gather_logprobs(nullptr, f32, 2, 3, 3, ok.data(), 1.0,
                                   out.data(), nullptr, nullptr, nullptr),
                   std::invalid_argument, "logits is null");
  EXPECT_THROW_MSG(gather_logprobs(logits.data(), f32, 2, 3, 3, ok.data(), 1.0,
                                   nullptr, nullptr, nullptr, nullptr),
                   std::invalid_argument, "logprobs is null");
  EXPECT_THROW_MSG(
      gather_logprobs_backward(logits.data(), f32, 2, 3, 3, ok.data(), 1.0,
                               nullptr, stats_sum.data(), nullptr, out.data(),
                               nullptr, grad.data()),
      std::invalid_argument, "row_max is null");
  EXPECT_THROW_MSG(
      gather_logprobs_backward(logits.data(), f32, 2, 3, 3, ok.data(), 1.0,
                               stats_max.data(), stats_sum.data(), nullptr,
                               out.data(), out.data(), grad.data()),
      std::invalid_argument, "grad_entropy is given but entropy is null");
}

}  // namespace

int main() {
  return dockyard::testing::RunTests(
      "logprobs_test",
      {
          {"HandExamples", TestHandExamples},
          {"Temperature", TestTemperature},
          {"VocabOne", TestVocabOne},
          {"HugeLogits", TestHugeLogits},
          {"MaskedLogits", TestMaskedLogits},
          {"NaNRows", TestNaNRows},
          {"RandomParity", TestRandomParity},
          {"BackwardFiniteDifferences", TestBackwardFiniteDifferences},
          {"BackwardNullGradsAndBf16", TestBackwardNullGradsAndBf16},
          {"ThreadedMatchesPerRow", TestThreadedMatchesPerRow},
          {"EmptyAndOptionalOutputs", TestEmptyAndOptionalOutputs},
          {"Errors", TestErrors},
      });
}
