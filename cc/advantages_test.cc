// Tests of the core group_advantages (cc/advantages.h), on the harness of
// cc/testing.h: it prints each failure with its line, then
// "advantages_test: N passed, M failed", and exits nonzero on any failure.

#include "cc/advantages.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/testing.h"

namespace {

using dockyard::kernels::Baseline;
using dockyard::kernels::group_advantages;

// Runs the core function on a (num_groups, group_size) array and returns out.
std::vector<float> Run(const std::vector<float>& rewards, int64_t num_groups,
                       int64_t group_size, Baseline baseline,
                       bool normalize_std, float epsilon = 0.0f) {
  std::vector<float> out(rewards.size(), -999.0f);
  group_advantages(rewards.data(), num_groups, group_size, baseline,
                   normalize_std, epsilon, out.data());
  return out;
}

void ExpectAllNear(const std::vector<float>& actual,
                   const std::vector<double>& expected, double tol) {
  CHECK(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    if (!(std::fabs(actual[i] - expected[i]) <= tol)) {
      std::fprintf(stderr, "  at element %zu:\n", i);
    }
    EXPECT_NEAR(actual[i], expected[i], tol);
  }
}

// Exact zeros (and so no NaN): the contract for degenerate groups.
void ExpectAllExactlyZero(const std::vector<float>& actual) {
  for (float v : actual) CHECK(v == 0.0f);
}

// Hand-computed example, rewards {1, 2, 3, 6}:
//   leave-one-out baselines: 11/3, 10/3, 9/3, 6/3
//   advantages:              -8/3, -4/3, 0, 4
void TestLeaveOneOutHandExample() {
  ExpectAllNear(Run({1, 2, 3, 6}, 1, 4, Baseline::kLeaveOneOut, false),
                {-8.0 / 3, -4.0 / 3, 0.0, 4.0}, 1e-6);
}

void TestGroupMean() {
  // mean = 3.
  ExpectAllNear(Run({1, 2, 3, 6}, 1, 4, Baseline::kGroupMean, false),
                {-2.0, -1.0, 0.0, 3.0}, 1e-6);
}

void TestStdNormalisation() {
  // Unbiased std of {1, 2, 3, 6}: sqrt((4 + 1 + 0 + 9) / 3) = sqrt(14 / 3).
  const double std_dev = std::sqrt(14.0 / 3.0);
  const double eps = 0.25;
  ExpectAllNear(Run({1, 2, 3, 6}, 1, 4, Baseline::kGroupMean, true, 0.0f),
                {-2 / std_dev, -1 / std_dev, 0.0, 3 / std_dev}, 1e-6);
  ExpectAllNear(
      Run({1, 2, 3, 6}, 1, 4, Baseline::kGroupMean, true, eps),
      {-2 / (std_dev + eps), -1 / (std_dev + eps), 0.0, 3 / (std_dev + eps)},
      1e-6);
  ExpectAllNear(Run({1, 2, 3, 6}, 1, 4, Baseline::kLeaveOneOut, true, eps),
                {-8.0 / 3 / (std_dev + eps), -4.0 / 3 / (std_dev + eps), 0.0,
                 4 / (std_dev + eps)},
                1e-6);
}

void TestGroupsAreIndependent() {
  // Row 0 as above; row 1 = {10, 20, 30, 60} with negatives mixed in row 2.
  ExpectAllNear(Run({1, 2, 3, 6, 10, 20, 30, 60, -1, -2, -3, -6}, 3, 4,
                    Baseline::kGroupMean, false),
                {-2, -1, 0, 3, -20, -10, 0, 30, 2, 1, 0, -3}, 1e-5);
}

void TestNegativeRewards() {
  // Leave-one-out of {-1, -3}: -1 - (-3) = 2 and -3 - (-1) = -2.
  ExpectAllNear(Run({-1, -3}, 1, 2, Baseline::kLeaveOneOut, false), {2, -2},
                1e-6);
}

void TestGroupSizeOne() {
  // No other samples, no std: always exactly 0, whatever the reward.
  const std::vector<float> rewards = {5.0f, -2.0f, 0.0f, 1e30f};
  for (Baseline b : {Baseline::kLeaveOneOut, Baseline::kGroupMean}) {
    for (bool norm : {false, true}) {
      ExpectAllExactlyZero(Run(rewards, 4, 1, b, norm, 0.0f));
    }
  }
}

void TestGroupSizeTwo() {
  // {0, 1}: mean 0.5, unbiased std sqrt(0.5).
  const double s = std::sqrt(0.5);
  ExpectAllNear(Run({0, 1}, 1, 2, Baseline::kLeaveOneOut, false), {-1, 1},
                1e-7);
  ExpectAllNear(Run({0, 1}, 1, 2, Baseline::kGroupMean, false), {-0.5, 0.5},
                1e-7);
  ExpectAllNear(Run({0, 1}, 1, 2, Baseline::kGroupMean, true),
                {-0.5 / s, 0.5 / s}, 1e-6);
  ExpectAllNear(Run({0, 1}, 1, 2, Baseline::kLeaveOneOut, true),
                {-1 / s, 1 / s}, 1e-6);
}

void TestEqualRewardsGiveExactZeros() {
  // 0.1f is not exactly representable, so a float mean could round away from
  // it; the contract is still exact zeros, with epsilon 0 too (no 0 / 0).
  for (float v : {0.0f, 1.0f, 0.1f, -7.25f, 1e30f, -3e38f}) {
    const std::vector<float> rewards(7, v);
    for (Baseline b : {Baseline::kLeaveOneOut, Baseline::kGroupMean}) {
      for (bool norm : {false, true}) {
        ExpectAllExactlyZero(Run(rewards, 1, 7, b, norm, 0.0f));
      }
    }
  }
}

void TestLargeValues() {
  // 1e30 squared overflows float but not double.
  ExpectAllNear(Run({1e30f, -1e30f, 0.0f}, 1, 3, Baseline::kGroupMean, true),
                {1.0, -1.0, 0.0}, 1e-6);
  const std::vector<float> loo =
      Run({1e30f, -1e30f, 0.0f}, 1, 3, Baseline::kLeaveOneOut, false);
  ExpectAllNear(loo, {1.5e30, -1.5e30, 0.0}, 1e24);
  for (float v : loo) CHECK(std::isfinite(v));

  // 1e7 + small integer deltas (float's spacing at 1e7 is 1): a float sum
  // (4e7, spacing 4) would lose the deltas; double keeps them exactly.
  ExpectAllNear(Run({1e7f, 1e7f + 1, 1e7f + 2, 1e7f + 3}, 1, 4,
                    Baseline::kGroupMean, false),
                {-1.5, -0.5, 0.5, 1.5}, 1e-6);
  // Same with fractional deltas at 1e6 (spacing 0.0625).
  ExpectAllNear(Run({1e6f, 1e6f + 0.125f, 1e6f + 0.25f}, 1, 3,
                    Baseline::kLeaveOneOut, true),
                // mean 1e6 + 0.125, std 0.125, scale 3/2/0.125 = 12.
                {-1.5, 0.0, 1.5}, 1e-6);
}

void TestInPlace() {
  std::vector<float> r = {1, 2, 3, 6};
  group_advantages(r.data(), 1, 4, Baseline::kLeaveOneOut, false, 0.0f,
                   r.data());
  ExpectAllNear(r, {-8.0 / 3, -4.0 / 3, 0.0, 4.0}, 1e-6);
}

void TestEmptyInputs() {
  // Zero-size inputs write nothing and accept null pointers.
  group_advantages(nullptr, 0, 8, Baseline::kGroupMean, true, 1e-6f, nullptr);
  group_advantages(nullptr, 8, 0, Baseline::kGroupMean, true, 1e-6f, nullptr);
}

// Deterministic pseudo-random rewards (no <random> distribution, whose output
// differs across standard libraries).
std::vector<float> PseudoRandomRewards(size_t n) {
  std::vector<float> v(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<float>(static_cast<int64_t>(x % 2001) - 1000) / 100.0f;
  }
  return v;
}

void TestThreadedPathMatchesPerGroupCalls() {
  // Enough groups to take the threaded path; each group computed alone (one
  // group per call, serial path) must give bit-identical results.
  const int64_t num_groups = 20000, group_size = 5;
  const std::vector<float> rewards =
      PseudoRandomRewards(num_groups * group_size);
  for (Baseline b : {Baseline::kLeaveOneOut, Baseline::kGroupMean}) {
    const std::vector<float> all =
        Run(rewards, num_groups, group_size, b, true, 1e-6f);
    std::vector<float> one(group_size);
    int mismatches = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
      group_advantages(rewards.data() + g * group_size, 1, group_size, b, true,
                       1e-6f, one.data());
      for (int64_t i = 0; i < group_size; ++i) {
        if (one[i] != all[g * group_size + i]) ++mismatches;
      }
    }
    CHECK(mismatches == 0);
  }
}

void TestInvalidArguments() {
  const std::vector<float> r = {1, 2, 3, 4};
  std::vector<float> out(4);
  const float* rp = r.data();
  float* op = out.data();
  const Baseline loo = Baseline::kLeaveOneOut;
  EXPECT_INVALID_ARGUMENT(group_advantages(rp, -1, 4, loo, false, 0, op),
                          "num_groups must be >= 0, got -1");
  EXPECT_INVALID_ARGUMENT(group_advantages(rp, 1, -4, loo, false, 0, op),
                          "group_size must be >= 0, got -4");
  EXPECT_INVALID_ARGUMENT(
      group_advantages(rp, std::numeric_limits<int64_t>::max() / 2, 4, loo,
                       false, 0, op),
      "overflows");
  EXPECT_INVALID_ARGUMENT(group_advantages(rp, 1, 4, loo, true, -1e-9f, op),
                          "epsilon must be finite and >= 0, got -1e-09");
  EXPECT_INVALID_ARGUMENT(
      group_advantages(rp, 1, 4, loo, true,
                       std::numeric_limits<float>::quiet_NaN(), op),
      "epsilon");
  EXPECT_INVALID_ARGUMENT(
      group_advantages(rp, 1, 4, loo, true,
                       std::numeric_limits<float>::infinity(), op),
      "epsilon");
  EXPECT_INVALID_ARGUMENT(group_advantages(nullptr, 1, 4, loo, false, 0, op),
                          "rewards is null");
  EXPECT_INVALID_ARGUMENT(group_advantages(rp, 1, 4, loo, false, 0, nullptr),
                          "out is null");
  EXPECT_INVALID_ARGUMENT(
      group_advantages(rp, 1, 4, static_cast<Baseline>(7), false, 0, op),
      "unknown baseline enumerator 7");

  // Non-finite rewards name the group and index, in both paths.
  std::vector<float> bad = {1, 2, 3, 4, 5, 6, 7, 8};
  bad[6] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> bad_out(bad.size());
  EXPECT_INVALID_ARGUMENT(
      group_advantages(bad.data(), 2, 4, loo, false, 0, bad_out.data()),
      "reward at group 1, index 2 is not finite (nan)");
  bad[6] = -std::numeric_limits<float>::infinity();
  EXPECT_INVALID_ARGUMENT(
      group_advantages(bad.data(), 2, 4, Baseline::kGroupMean, true, 0,
                       bad_out.data()),
      "reward at group 1, index 2 is not finite (-inf)");

  // Threaded path: two bad rewards in different chunks; the first in
  // row-major order is the one reported.
  const int64_t num_groups = 20000, group_size = 3;
  std::vector<float> many = PseudoRandomRewards(num_groups * group_size);
  many[15000 * group_size + 1] = std::numeric_limits<float>::infinity();
  many[12345 * group_size + 2] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> many_out(many.size());
  EXPECT_INVALID_ARGUMENT(group_advantages(many.data(), num_groups, group_size,
                                           loo, false, 0, many_out.data()),
                          "reward at group 12345, index 2 is not finite");
}

}  // namespace

int main() {
  return dockyard::testing::RunTests(
      "advantages_test",
      {
          {"LeaveOneOutHandExample", TestLeaveOneOutHandExample},
          {"GroupMean", TestGroupMean},
          {"StdNormalisation", TestStdNormalisation},
          {"GroupsAreIndependent", TestGroupsAreIndependent},
          {"NegativeRewards", TestNegativeRewards},
          {"GroupSizeOne", TestGroupSizeOne},
          {"GroupSizeTwo", TestGroupSizeTwo},
          {"EqualRewardsGiveExactZeros", TestEqualRewardsGiveExactZeros},
          {"LargeValues", TestLargeValues},
          {"InPlace", TestInPlace},
          {"EmptyInputs", TestEmptyInputs},
          {"ThreadedPathMatchesPerGroupCalls",
           TestThreadedPathMatchesPerGroupCalls},
          {"InvalidArguments", TestInvalidArguments},
      });
}
