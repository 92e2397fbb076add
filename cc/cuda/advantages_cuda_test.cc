// Parity of group_advantages_cuda with the CPU core on a real GPU. Built and
// linked (against libcudart) in every build that finds a CUDA toolkit, so CI
// proves the CUDA objects link; it runs the comparison only where a CUDA device
// is present and otherwise says why it skipped.

#include "cc/cuda/advantages_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cc/advantages.h"
#include "cc/cuda/testing.h"
#include "cc/testing.h"

namespace {

using dockyard::kernels::Baseline;

void check_parity(int64_t num_groups, int64_t group_size, Baseline baseline,
                  bool normalize_std) {
  std::mt19937 rng(static_cast<unsigned>(num_groups * 131 + group_size));
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> rewards(num_groups * group_size);
  for (float& r : rewards) r = normal(rng);
  if (num_groups >
      1) {  // one degenerate group: equal rewards must give exact zeros
    for (int64_t i = 0; i < group_size; ++i) rewards[i] = 1.0f;
  }
  std::vector<float> expected(rewards.size()), got(rewards.size());
  dockyard::kernels::group_advantages(rewards.data(), num_groups, group_size,
                                      baseline, normalize_std, 1e-6f,
                                      expected.data());

  const size_t bytes = rewards.size() * sizeof(float);
  float *d_rewards = nullptr, *d_out = nullptr;
  cudaMalloc(&d_rewards, bytes);
  cudaMalloc(&d_out, bytes);
  cudaMemcpy(d_rewards, rewards.data(), bytes, cudaMemcpyHostToDevice);
  dockyard::kernels::group_advantages_cuda(d_rewards, num_groups, group_size,
                                           baseline, normalize_std, 1e-6f,
                                           d_out, nullptr);
  cudaMemcpy(got.data(), d_out, bytes, cudaMemcpyDeviceToHost);
  cudaFree(d_rewards);
  cudaFree(d_out);

  for (size_t i = 0; i < got.size(); ++i) {
    const float tolerance = 1e-5f * (1.0f + std::fabs(expected[i]));
    if (!(std::fabs(got[i] - expected[i]) <= tolerance)) {
      ADD_FAILURE("groups=%lld size=%lld index=%zu cuda=%g cpu=%g",
                  static_cast<long long>(num_groups),
                  static_cast<long long>(group_size), i, got[i], expected[i]);
      return;
    }
  }
}

}  // namespace

int main() {
  std::vector<dockyard::testing::TestCase> cases;
  for (int64_t group_size : {1, 2, 5, 16, 64}) {
    for (int64_t num_groups : {1, 7, 5000}) {
      for (Baseline baseline : {Baseline::kLeaveOneOut, Baseline::kGroupMean}) {
        for (bool normalize_std : {false, true}) {
          cases.push_back(
              {"groups=" + std::to_string(num_groups) +
                   " size=" + std::to_string(group_size) +
                   (baseline == Baseline::kLeaveOneOut ? " leave_one_out"
                                                       : " group_mean") +
                   (normalize_std ? " normalize_std" : ""),
               [=] {
                 check_parity(num_groups, group_size, baseline, normalize_std);
               }});
        }
      }
    }
  }
  return dockyard::testing::RunCudaTests("advantages_cuda_test", cases);
}
