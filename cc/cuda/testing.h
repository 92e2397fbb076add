// The entry point the CUDA parity tests share (cc/cuda/*_cuda_test.cc), on top
// of the harness of cc/testing.h.
//
//   int main() {
//     std::vector<dockyard::testing::TestCase> cases = ...;
//     return dockyard::testing::RunCudaTests("logprobs_cuda_test", cases);
//   }
//
// RunCudaTests runs the cases (RunTests) when the process sees a CUDA device.
// Without one (no GPU, no driver) it prints "SKIPPED: no CUDA device (<why>);
// ..." and returns 0: the tests are built and linked against libcudart in every
// build that finds a CUDA toolkit, so machines without a GPU prove that the
// CUDA objects link, and say why nothing ran.
//
// Not covered: choosing among several devices (the cases use the current one,
// device 0).

#ifndef DOCKYARD_CC_CUDA_TESTING_H_
#define DOCKYARD_CC_CUDA_TESTING_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cc/testing.h"

namespace dockyard::testing {

// Runs `tests` where a CUDA device is present, else prints why they were
// skipped and returns 0; returns main()'s exit code (see the file comment).
// Building the cases makes no CUDA call, so they may be built before this
// checks for a device.
inline int RunCudaTests(const char* suite, const std::vector<TestCase>& tests) {
  int num_devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&num_devices);
  if (status != cudaSuccess || num_devices == 0) {
    std::printf(
        "SKIPPED: no CUDA device (%s); the CUDA kernel was compiled and linked "
        "only.\n",
        status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 0;
  }
  return RunTests(suite, tests);
}

}  // namespace dockyard::testing

#endif  // DOCKYARD_CC_CUDA_TESTING_H_
