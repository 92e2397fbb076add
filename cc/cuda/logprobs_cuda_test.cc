// Parity of gather_logprobs_cuda / gather_logprobs_backward_cuda with the CPU
// core on a real GPU. Built and linked (against libcudart) in every build that
// finds a CUDA toolkit, so CI proves the CUDA objects link; it runs the
// comparisons only where a CUDA device is present and otherwise says why it
// skipped.
//
// Covered: float32 and bfloat16; both row layouts of the kernels (a warp per
// row up to 16 KiB, a block per row beyond) on either side of the boundary;
// vocab sizes that are not multiples of the 16-byte vector width (scalar
// tails); row strides and base offsets that put rows off 16-byte boundaries
// (scalar heads; in the backward, rows whose gradient row has another offset
// take the scalar path); masked (-inf) logits and targets, fully masked rows,
// NaN / +inf rows (a NaN hidden in a masked prefix too), huge logits;
// temperatures; a non-default stream; out-of-range ids with and without
// check_targets, and a good call after a bad one.

#include "cc/cuda/logprobs_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/cuda/testing.h"
#include "cc/logprobs.h"
#include "cc/testing.h"

namespace {

using dockyard::testing::FromBf16;
using dockyard::testing::ToBf16;

using dockyard::kernels::LogitsDtype;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " +
                             cudaGetErrorString(err));
  }
}

// A device copy of a host vector, freed at scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : size_(host.size()) {
    Check(cudaMalloc(&ptr_, std::max<size_t>(1, size_) * sizeof(T)),
          "cudaMalloc");
    if (size_ > 0) {
      Check(cudaMemcpy(ptr_, host.data(), size_ * sizeof(T),
                       cudaMemcpyHostToDevice),
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
      Check(cudaMemcpy(host.data(), ptr_, size_ * sizeof(T),
                       cudaMemcpyDeviceToHost),
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
void CompareAll(const std::vector<T>& got, const std::vector<T>& want,
                double tol, const std::string& what) {
  if (got.size() != want.size()) {
    ADD_FAILURE("%s: sizes differ", what.c_str());
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!Close(got[i], want[i], tol)) {
      ADD_FAILURE("%s index %zu: cuda %s cpu %s", what.c_str(), i,
                  std::to_string(got[i]).c_str(),
                  std::to_string(want[i]).c_str());
      return;
    }
  }
}

std::vector<float> Bf16ToFloats(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = FromBf16(bits[i]);
  return out;
}

struct Case {
  int64_t num_rows;
  int64_t vocab_size;
  int64_t row_stride;
  int64_t offset;  // Elements between the allocation and row 0.
  double temperature;
  LogitsDtype dtype;
  std::string kind;  // normal, masked, huge, nonfinite.
};

std::string Name(const Case& c) {
  return c.kind + " N=" + std::to_string(c.num_rows) +
         " V=" + std::to_string(c.vocab_size) +
         " stride=" + std::to_string(c.row_stride) +
         " offset=" + std::to_string(c.offset) +
         " T=" + std::to_string(c.temperature) +
         (c.dtype == LogitsDtype::kBFloat16 ? " bf16" : " f32");
}

// Logits (offset + num_rows * row_stride floats; the gaps hold values too) and
// targets for a case. Kinds: masked: every third logit -inf, row 0's target
// masked, row 1 all -inf; huge: logits ~1e30; nonfinite: row 0 holds a NaN, row
// 1 a +inf, row 2 -inf for its first 3/4 with NaNs among them (read while a
// thread's running max is still -inf), row 3 a NaN first and -inf after.
void MakeInputs(const Case& c, std::vector<float>* logits,
                std::vector<int64_t>* targets) {
  std::mt19937 rng(
      static_cast<unsigned>(c.num_rows * 131 + c.vocab_size * 7 + c.offset));
  std::normal_distribution<float> normal(0.0f, 4.0f);
  logits->assign(c.offset + c.num_rows * c.row_stride, 0.0f);
  for (float& x : *logits) x = normal(rng);
  float* row0 = logits->data() + c.offset;
  auto at = [&](int64_t r, int64_t k) -> float& {
    return row0[r * c.row_stride + k];
  };
  targets->resize(c.num_rows);
  for (int64_t r = 0; r < c.num_rows; ++r)
    (*targets)[r] = (r * 7919 + 3) % c.vocab_size;
  const int64_t V = c.vocab_size;
  if (c.kind == "masked") {
    for (int64_t r = 0; r < c.num_rows; ++r) {
      for (int64_t k = r % 3; k < V; k += 3) at(r, k) = -kInf;
    }
    if (c.num_rows > 1) {
      (*targets)[0] = 0;
      at(0, 0) = -kInf;
      for (int64_t k = 0; k < V; ++k) at(1, k) = -kInf;
    }
  } else if (c.kind == "huge") {
    for (float& x : *logits) x *= 1e29f;
  } else if (c.kind == "nonfinite" && c.num_rows >= 4) {
    at(0, V / 2) = kNaN;
    at(1, V / 3) = kInf;
    for (int64_t k = 0; k < 3 * V / 4; ++k) at(2, k) = -kInf;
    for (int64_t k = 5; k < 3 * V / 4; k += 97) at(2, k) = kNaN;
    at(3, 0) = kNaN;
    for (int64_t k = 1; k < V; ++k) at(3, k) = -kInf;
  }
}

// Runs forward and backward (with and without entropy) on both devices and
// compares.
void CheckParity(const Case& c, cudaStream_t stream = nullptr) {
  const std::string name = Name(c);
  const int64_t N = c.num_rows;
  const int64_t V = c.vocab_size;
  std::vector<float> logits;
  std::vector<int64_t> targets;
  MakeInputs(c, &logits, &targets);
  std::vector<uint16_t> logits_bf16(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) logits_bf16[i] = ToBf16(logits[i]);
  const bool f32 = c.dtype == LogitsDtype::kFloat32;
  const void* host_logits =
      f32 ? static_cast<const void*>(logits.data() + c.offset)
          : static_cast<const void*>(logits_bf16.data() + c.offset);

  std::vector<float> lp(N), ent(N), mx(N);
  std::vector<double> ls(N);
  dockyard::kernels::gather_logprobs(host_logits, c.dtype, N, V, c.row_stride,
                                     targets.data(), c.temperature, lp.data(),
                                     ent.data(), mx.data(), ls.data());
  std::mt19937 rng(static_cast<unsigned>(V));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(N), g_h(N);
  for (int64_t r = 0; r < N; ++r) {
    g[r] = normal(rng);
    g_h[r] = normal(rng);
  }

  DeviceArray<float> d_logits_f(logits);
  DeviceArray<uint16_t> d_logits_b(logits_bf16);
  const void* d_logits =
      f32 ? static_cast<const void*>(d_logits_f.get() + c.offset)
          : static_cast<const void*>(d_logits_b.get() + c.offset);
  DeviceArray<int64_t> d_targets(targets);
  const std::vector<float> nans(N, kNaN);
  const std::vector<double> nans_d(N, kNaN);
  DeviceArray<float> d_lp(nans), d_ent(nans), d_mx(nans), d_g(g), d_gh(g_h);
  DeviceArray<double> d_ls(nans_d);
  // cudaMemcpy from pageable memory may return before its DMA lands, and a
  // non-blocking stream does not wait for the legacy stream: wait here.
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  dockyard::kernels::gather_logprobs_cuda(
      d_logits, c.dtype, N, V, c.row_stride, d_targets.get(), c.temperature,
      d_lp.get(), d_ent.get(), d_mx.get(), d_ls.get(), stream, true);
  CompareAll(d_lp.ToHost(), lp, 2e-6, name + " logprobs");
  CompareAll(d_ent.ToHost(), ent, 2e-6, name + " entropy");
  CompareAll(d_mx.ToHost(), mx, 0.0, name + " row_max");
  CompareAll(d_ls.ToHost(), ls, 2e-6, name + " row_log_sum");

  // Without entropy and statistics (the other instantiation) and unchecked:
  // same logprobs.
  DeviceArray<float> d_lp2(nans);
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  dockyard::kernels::gather_logprobs_cuda(
      d_logits, c.dtype, N, V, c.row_stride, d_targets.get(), c.temperature,
      d_lp2.get(), nullptr, nullptr, nullptr, stream, false);
  CompareAll(d_lp2.ToHost(), lp, 2e-6, name + " logprobs (no entropy)");

  // The backward reads the CPU's statistics, so both compute from the same
  // inputs.
  DeviceArray<float> d_mx_cpu(mx), d_ent_cpu(ent);
  DeviceArray<double> d_ls_cpu(ls);
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const size_t grad_size = N * V;
  for (bool with_entropy : {false, true}) {
    const std::string what =
        name + " grad (entropy " + std::to_string(with_entropy) + ")";
    const float* h_ent = with_entropy ? ent.data() : nullptr;
    const float* h_gh = with_entropy ? g_h.data() : nullptr;
    const float* dev_ent = with_entropy ? d_ent_cpu.get() : nullptr;
    const float* dev_gh = with_entropy ? d_gh.get() : nullptr;
    // Checked when with_entropy, unchecked otherwise: both paths of the flag.
    if (f32) {
      std::vector<float> want(grad_size);
      dockyard::kernels::gather_logprobs_backward(
          host_logits, c.dtype, N, V, c.row_stride, targets.data(),
          c.temperature, mx.data(), ls.data(), h_ent, g.data(), h_gh,
          want.data());
      DeviceArray<float> d_grad(std::vector<float>(grad_size, kNaN));
      Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      dockyard::kernels::gather_logprobs_backward_cuda(
          d_logits, c.dtype, N, V, c.row_stride, d_targets.get(), c.temperature,
          d_mx_cpu.get(), d_ls_cpu.get(), dev_ent, d_g.get(), dev_gh,
          d_grad.get(), stream, with_entropy);
      CompareAll(d_grad.ToHost(), want, 1e-5, what);
    } else {
      std::vector<uint16_t> want(grad_size);
      dockyard::kernels::gather_logprobs_backward(
          host_logits, c.dtype, N, V, c.row_stride, targets.data(),
          c.temperature, mx.data(), ls.data(), h_ent, g.data(), h_gh,
          want.data());
      DeviceArray<uint16_t> d_grad(std::vector<uint16_t>(grad_size, 0x7FC0));
      Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      dockyard::kernels::gather_logprobs_backward_cuda(
          d_logits, c.dtype, N, V, c.row_stride, d_targets.get(), c.temperature,
          d_mx_cpu.get(), d_ls_cpu.get(), dev_ent, d_g.get(), dev_gh,
          d_grad.get(), stream, with_entropy);
      // Compare as floats: one bf16 ulp (2^-8 relative) of rounding slack.
      CompareAll(Bf16ToFloats(d_grad.ToHost()), Bf16ToFloats(want), 1.0 / 128,
                 "bf16 " + what);
    }
  }
  // Without grad_logprobs (all zeros) and without entropy: a zero gradient, not
  // NaN.
  if (f32) {
    std::vector<float> want(grad_size);
    dockyard::kernels::gather_logprobs_backward(
        host_logits, c.dtype, N, V, c.row_stride, targets.data(), c.temperature,
        mx.data(), ls.data(), nullptr, nullptr, nullptr, want.data());
    DeviceArray<float> d_grad(std::vector<float>(grad_size, kNaN));
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    dockyard::kernels::gather_logprobs_backward_cuda(
        d_logits, c.dtype, N, V, c.row_stride, d_targets.get(), c.temperature,
        d_mx_cpu.get(), d_ls_cpu.get(), nullptr, nullptr, nullptr, d_grad.get(),
        stream, true);
    CompareAll(d_grad.ToHost(), want, 1e-5, name + " grad (no upstream)");
  }
}

// Expects `fn` to throw std::out_of_range whose message contains `want`.
template <typename Fn>
void ExpectOutOfRange(const std::string& what, const std::string& want,
                      Fn&& fn) {
  try {
    fn();
    ADD_FAILURE("%s: no exception", what.c_str());
  } catch (const std::out_of_range& e) {
    if (std::string(e.what()).find(want) == std::string::npos) {
      ADD_FAILURE("%s: message %s", what.c_str(), e.what());
    }
  }
}

void CheckOutOfRangeTargets(LogitsDtype dtype, int64_t vocab_size) {
  const std::string name =
      std::string(dtype == LogitsDtype::kFloat32 ? "f32" : "bf16") +
      " V=" + std::to_string(vocab_size) + " out-of-range: ";
  const int64_t N = 11;
  const int64_t V = vocab_size;
  const Case c{N, V, V, 0, 1.0, dtype, "normal"};
  std::vector<float> logits;
  std::vector<int64_t> good;
  MakeInputs(c, &logits, &good);
  std::vector<uint16_t> logits_bf16(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) logits_bf16[i] = ToBf16(logits[i]);
  const bool f32 = dtype == LogitsDtype::kFloat32;
  const void* host_logits = f32 ? static_cast<const void*>(logits.data())
                                : static_cast<const void*>(logits_bf16.data());
  std::vector<int64_t> bad = good;
  bad[4] = V;  // The first bad row.
  bad[9] = -1;
  std::vector<float> lp(N), mx(N);
  std::vector<double> ls(N);
  dockyard::kernels::gather_logprobs(host_logits, dtype, N, V, V, good.data(),
                                     1.0, lp.data(), nullptr, mx.data(),
                                     ls.data());

  DeviceArray<float> d_logits_f(logits);
  DeviceArray<uint16_t> d_logits_b(logits_bf16);
  const void* d_logits = f32 ? static_cast<const void*>(d_logits_f.get())
                             : static_cast<const void*>(d_logits_b.get());
  DeviceArray<int64_t> d_good(good), d_bad(bad);
  const std::vector<float> zeros(N, 0.0f), ones(N, 1.0f);
  DeviceArray<float> d_lp(zeros), d_mx(mx), d_g(ones);
  DeviceArray<double> d_ls(ls);
  const std::string want = "target id " + std::to_string(V) +
                           " at row 4 is out of range [0, " +
                           std::to_string(V) + ")";
  ExpectOutOfRange(name + "forward", "gather_logprobs_cuda: " + want, [&] {
    dockyard::kernels::gather_logprobs_cuda(
        d_logits, dtype, N, V, V, d_bad.get(), 1.0, d_lp.get(), nullptr,
        nullptr, nullptr, nullptr, true);
  });
  const size_t grad_size = N * V;
  const std::vector<float> grad_zeros_f(f32 ? grad_size : 1, 0.0f);
  const std::vector<uint16_t> grad_zeros_b(f32 ? 1 : grad_size, 0);
  DeviceArray<float> d_grad_f(grad_zeros_f);
  DeviceArray<uint16_t> d_grad_b(grad_zeros_b);
  void* d_grad = f32 ? static_cast<void*>(d_grad_f.get())
                     : static_cast<void*>(d_grad_b.get());
  ExpectOutOfRange(
      name + "backward", "gather_logprobs_backward_cuda: " + want, [&] {
        dockyard::kernels::gather_logprobs_backward_cuda(
            d_logits, dtype, N, V, V, d_bad.get(), 1.0, d_mx.get(), d_ls.get(),
            nullptr, d_g.get(), nullptr, d_grad, nullptr, true);
      });
  // A negative id alone.
  std::vector<int64_t> negative = good;
  negative[7] = -3;
  DeviceArray<int64_t> d_negative(negative);
  ExpectOutOfRange(
      name + "negative id",
      "target id -3 at row 7 is out of range [0, " + std::to_string(V) + ")",
      [&] {
        dockyard::kernels::gather_logprobs_cuda(
            d_logits, dtype, N, V, V, d_negative.get(), 1.0, d_lp.get(),
            nullptr, nullptr, nullptr, nullptr, true);
      });

  // A good call after the bad ones: the flag was cleared, results are right.
  try {
    dockyard::kernels::gather_logprobs_cuda(
        d_logits, dtype, N, V, V, d_good.get(), 1.0, d_lp.get(), nullptr,
        nullptr, nullptr, nullptr, true);
    CompareAll(d_lp.ToHost(), lp, 2e-6, name + "good call after bad ones");
  } catch (const std::exception& e) {
    ADD_FAILURE("%sgood call after bad ones threw %s", name.c_str(), e.what());
  }

  // Unchecked: no exception; NaN in the bad rows (4 and 9), the others as the
  // CPU's.
  std::vector<float> want_lp = lp;
  want_lp[4] = want_lp[9] = kNaN;
  dockyard::kernels::gather_logprobs_cuda(d_logits, dtype, N, V, V, d_bad.get(),
                                          1.0, d_lp.get(), nullptr, nullptr,
                                          nullptr, nullptr, false);
  CompareAll(d_lp.ToHost(), want_lp, 2e-6, name + "unchecked forward");
  dockyard::kernels::gather_logprobs_backward_cuda(
      d_logits, dtype, N, V, V, d_bad.get(), 1.0, d_mx.get(), d_ls.get(),
      nullptr, d_g.get(), nullptr, d_grad, nullptr, false);
  std::vector<float> got_grad;
  if (f32) {
    got_grad = d_grad_f.ToHost();
  } else {
    got_grad = Bf16ToFloats(d_grad_b.ToHost());
  }
  for (int64_t r = 0; r < N; ++r) {
    const bool bad_row = r == 4 || r == 9;
    for (int64_t k = 0; k < V; ++k) {
      if (std::isnan(got_grad[r * V + k]) != bad_row) {
        ADD_FAILURE("%sunchecked backward row %lld element %lld %s",
                    name.c_str(), static_cast<long long>(r),
                    static_cast<long long>(k),
                    bad_row ? "is not NaN" : "is NaN");
        return;
      }
    }
  }
}

}  // namespace

int main() {
  std::vector<dockyard::testing::TestCase> cases;
  auto parity = [&cases](const Case& c) {
    cases.push_back({"parity " + Name(c), [c] { CheckParity(c); }});
  };
  for (LogitsDtype dtype : {LogitsDtype::kFloat32, LogitsDtype::kBFloat16}) {
    const int64_t bytes = dtype == LogitsDtype::kFloat32 ? 4 : 2;
    // The warp-per-row / block-per-row boundary (16 KiB) and one element past
    // it.
    const int64_t boundary = 16 * 1024 / bytes;
    for (int64_t V :
         {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{7},
          int64_t{9}, int64_t{31}, int64_t{33}, int64_t{1000}, int64_t{1001},
          boundary, boundary + 1, int64_t{49152}, int64_t{49155}}) {
      const int64_t N = V > 10000 ? 9 : 37;
      for (const char* kind : {"normal", "masked", "huge", "nonfinite"}) {
        parity({N, V, V, 0, 1.0, dtype, kind});
      }
      // Rows off 16-byte boundaries: strides with every offset, and a shifted
      // base. With stride V + 4 (f32) or V + 8 (bf16) each logits row has its
      // gradient row's offset.
      for (int64_t extra : {int64_t{1}, int64_t{3}, int64_t{5}, 16 / bytes}) {
        parity({5, V, V + extra, 0, 0.7, dtype, "normal"});
      }
      for (int64_t offset : {int64_t{1}, int64_t{2}, int64_t{3}}) {
        parity({7, V, V, offset, 1.3, dtype, "masked"});
      }
    }
    parity({64, 4099, 4103, 2, 2.5, dtype, "normal"});
    for (int64_t vocab_size : {int64_t{33}, int64_t{20000}}) {
      cases.push_back({std::string("out-of-range targets ") +
                           (dtype == LogitsDtype::kFloat32 ? "f32" : "bf16") +
                           " V=" + std::to_string(vocab_size),
                       [=] { CheckOutOfRangeTargets(dtype, vocab_size); }});
    }
  }
  cases.push_back(
      {"non-default stream", [] {
         cudaStream_t stream = nullptr;
         Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
               "cudaStreamCreate");
         try {
           CheckParity(
               {33, 20001, 20001, 0, 1.0, LogitsDtype::kFloat32, "masked"},
               stream);
         } catch (...) {
           cudaStreamDestroy(stream);
           throw;
         }
         Check(cudaStreamDestroy(stream), "cudaStreamDestroy");
       }});
  return dockyard::testing::RunCudaTests("logprobs_cuda_test", cases);
}
