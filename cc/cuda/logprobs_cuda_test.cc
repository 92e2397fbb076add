// Parity of gather_logprobs_cuda / gather_logprobs_backward_cuda with the CPU
// core on a real GPU. Built and linked (against libcudart) in every build that
// finds a CUDA toolkit, so CI proves the CUDA objects link; it runs the
// comparisons only where a CUDA device is present and otherwise says why it
// skipped.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/cuda/logprobs_cuda.h"
#include "cc/logprobs.h"

namespace {

using dockyard::kernels::LogitsDtype;

int num_failures = 0;  // Failed comparisons.
int num_cases = 0;
int num_failed_cases = 0;

void Fail(const std::string& what) {
  std::printf("FAIL: %s\n", what.c_str());
  ++num_failures;
}

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// A device copy of a host vector, freed at scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : size_(host.size()) {
    Check(cudaMalloc(&ptr_, std::max<size_t>(1, size_) * sizeof(T)), "cudaMalloc");
    if (size_ > 0) {
      Check(cudaMemcpy(ptr_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice),
            "cudaMemcpy");
    }
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  std::vector<T> ToHost() const {
    std::vector<T> host(size_);
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (size_ > 0) {
      Check(cudaMemcpy(host.data(), ptr_, size_ * sizeof(T), cudaMemcpyDeviceToHost),
            "cudaMemcpy");
    }
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t size_;
};

// Same NaN-ness and, for numbers, |a - b| <= tol * (1 + |b|).
bool Close(double a, double b, double tol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= tol * (1.0 + std::fabs(b));
}

template <typename T>
void CompareAll(const std::vector<T>& got, const std::vector<T>& want, double tol,
                const std::string& what) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (!Close(got[i], want[i], tol)) {
      Fail(what + " index " + std::to_string(i) + ": cuda " + std::to_string(got[i]) +
           " cpu " + std::to_string(want[i]));
      return;
    }
  }
}

// Runs forward and backward (with and without entropy) on both devices.
void CheckParity(int64_t num_rows, int64_t vocab_size, int64_t row_stride, double temperature,
                 LogitsDtype dtype, const std::string& kind) {
  ++num_cases;
  const std::string name = kind + " N=" + std::to_string(num_rows) + " V=" +
                           std::to_string(vocab_size) + " T=" + std::to_string(temperature) +
                           (dtype == LogitsDtype::kBFloat16 ? " bf16" : " f32");
  std::mt19937 rng(static_cast<unsigned>(num_rows * 131 + vocab_size));
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> logits(num_rows * row_stride);
  for (float& x : logits) x = normal(rng);
  if (kind == "masked") {
    for (size_t i = 0; i < logits.size(); i += 3) {
      logits[i] = -std::numeric_limits<float>::infinity();
    }
  } else if (kind == "huge") {
    for (float& x : logits) x *= 1e29f;
  }
  std::vector<int64_t> targets(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) targets[r] = (r * 7919 + 3) % vocab_size;
  if (kind == "masked" && num_rows > 1) {  // A masked target and a fully masked row.
    targets[0] = 0;
    logits[0] = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < vocab_size; ++k) {
      logits[row_stride + k] = -std::numeric_limits<float>::infinity();
    }
  }
  std::vector<uint16_t> logits_bf16(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) logits_bf16[i] = ToBf16(logits[i]);
  const void* host_logits = dtype == LogitsDtype::kFloat32
                                ? static_cast<const void*>(logits.data())
                                : static_cast<const void*>(logits_bf16.data());

  std::vector<float> lp(num_rows), ent(num_rows), mx(num_rows);
  std::vector<double> ls(num_rows);
  dockyard::kernels::gather_logprobs(host_logits, dtype, num_rows, vocab_size, row_stride,
                                     targets.data(), temperature, lp.data(), ent.data(),
                                     mx.data(), ls.data());
  std::vector<float> g(num_rows), g_h(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    g[r] = normal(rng);
    g_h[r] = normal(rng);
  }
  const size_t grad_size = num_rows * vocab_size;

  DeviceArray<float> d_logits_f(logits);
  DeviceArray<uint16_t> d_logits_b(logits_bf16);
  const void* d_logits = dtype == LogitsDtype::kFloat32
                             ? static_cast<const void*>(d_logits_f.get())
                             : static_cast<const void*>(d_logits_b.get());
  DeviceArray<int64_t> d_targets(targets);
  DeviceArray<float> d_lp(lp), d_ent(ent), d_mx(mx), d_g(g), d_gh(g_h);
  DeviceArray<double> d_ls(ls);
  dockyard::kernels::gather_logprobs_cuda(d_logits, dtype, num_rows, vocab_size, row_stride,
                                          d_targets.get(), temperature, d_lp.get(),
                                          d_ent.get(), d_mx.get(), d_ls.get(), nullptr);
  CompareAll(d_lp.ToHost(), lp, 2e-6, name + " logprobs");
  CompareAll(d_ent.ToHost(), ent, 2e-6, name + " entropy");
  CompareAll(d_mx.ToHost(), mx, 0.0, name + " row_max");
  CompareAll(d_ls.ToHost(), ls, 2e-6, name + " row_log_sum");

  for (bool with_entropy : {false, true}) {
    const float* h_ent = with_entropy ? ent.data() : nullptr;
    const float* h_gh = with_entropy ? g_h.data() : nullptr;
    if (dtype == LogitsDtype::kFloat32) {
      std::vector<float> want(grad_size), zeros(grad_size, 0.0f);
      dockyard::kernels::gather_logprobs_backward(
          host_logits, dtype, num_rows, vocab_size, row_stride, targets.data(), temperature,
          mx.data(), ls.data(), h_ent, g.data(), h_gh, want.data());
      DeviceArray<float> d_grad(zeros);
      dockyard::kernels::gather_logprobs_backward_cuda(
          d_logits, dtype, num_rows, vocab_size, row_stride, d_targets.get(), temperature,
          d_mx.get(), d_ls.get(), with_entropy ? d_ent.get() : nullptr, d_g.get(),
          with_entropy ? d_gh.get() : nullptr, d_grad.get(), nullptr);
      CompareAll(d_grad.ToHost(), want, 1e-5, name + " grad (entropy " +
                                                  std::to_string(with_entropy) + ")");
    } else {
      std::vector<uint16_t> want(grad_size), zeros(grad_size, 0);
      dockyard::kernels::gather_logprobs_backward(
          host_logits, dtype, num_rows, vocab_size, row_stride, targets.data(), temperature,
          mx.data(), ls.data(), h_ent, g.data(), h_gh, want.data());
      DeviceArray<uint16_t> d_grad(zeros);
      dockyard::kernels::gather_logprobs_backward_cuda(
          d_logits, dtype, num_rows, vocab_size, row_stride, d_targets.get(), temperature,
          d_mx.get(), d_ls.get(), with_entropy ? d_ent.get() : nullptr, d_g.get(),
          with_entropy ? d_gh.get() : nullptr, d_grad.get(), nullptr);
      // Compare as floats: one bf16 ulp (2^-8 relative) of rounding slack.
      const std::vector<uint16_t> got = d_grad.ToHost();
      std::vector<float> got_f(grad_size), want_f(grad_size);
      for (size_t i = 0; i < grad_size; ++i) {
        got_f[i] = FromBf16(got[i]);
        want_f[i] = FromBf16(want[i]);
      }
      CompareAll(got_f, want_f, 1.0 / 128, name + " bf16 grad (entropy " +
                                               std::to_string(with_entropy) + ")");
    }
  }
}

void CheckOutOfRangeTarget() {
  ++num_cases;
  const std::vector<float> logits(3 * 5, 0.0f);
  const std::vector<int64_t> targets = {0, 4, 5};
  std::vector<float> out(3);
  DeviceArray<float> d_logits(logits), d_out(out);
  DeviceArray<int64_t> d_targets(targets);
  try {
    dockyard::kernels::gather_logprobs_cuda(d_logits.get(), LogitsDtype::kFloat32, 3, 5, 5,
                                            d_targets.get(), 1.0, d_out.get(), nullptr,
                                            nullptr, nullptr, nullptr);
    Fail("out-of-range target: no exception");
  } catch (const std::out_of_range& e) {
    if (std::string(e.what()).find("target id 5 at row 2 is out of range [0, 5)") ==
        std::string::npos) {
      Fail(std::string("out-of-range target: message ") + e.what());
    }
  }
}

}  // namespace

int main() {
  int num_devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&num_devices);
  if (status != cudaSuccess || num_devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s); the CUDA kernel was compiled and linked only.\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 0;
  }
  // Runs one case and counts it as failed when it added failures.
  auto run = [](auto&& fn) {
    const int before = num_failures;
    try {
      fn();
    } catch (const std::exception& e) {
      Fail(std::string("exception: ") + e.what());
    }
    if (num_failures > before) ++num_failed_cases;
  };
  {
    for (LogitsDtype dtype : {LogitsDtype::kFloat32, LogitsDtype::kBFloat16}) {
      for (int64_t vocab_size : {1, 2, 31, 33, 1000, 49152}) {
        for (const char* kind : {"normal", "masked", "huge"}) {
          const int64_t num_rows = vocab_size > 10000 ? 9 : 37;
          run([&] { CheckParity(num_rows, vocab_size, vocab_size, 1.0, dtype, kind); });
        }
        run([&] { CheckParity(5, vocab_size, vocab_size + 5, 0.7, dtype, "normal"); });  // Gaps.
      }
    }
    run(CheckOutOfRangeTarget);
  }
  std::printf("logprobs_cuda_test: %d passed, %d failed\n", num_cases - num_failed_cases,
              num_failed_cases);
  return num_failures == 0 ? 0 : 1;
}
