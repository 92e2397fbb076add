// Parity of pack_bucket_cuda / unpack_bucket_cuda with the CPU core on a real GPU. Built and
// linked (against libcudart) in every build that finds a CUDA toolkit, so CI proves the CUDA
// objects link; it runs the comparison only where a CUDA device is present and otherwise says why
// it skipped.
//
// Each case builds host tensors (dense, transposed, stepped slices, 0-d, empty, every element
// size), uploads their whole storages, and checks that the GPU bucket equals the CPU bucket byte
// for byte (padding included), and that unpacking on the GPU leaves every destination storage
// byte equal to what the CPU unpack leaves (so bytes between strided elements stay untouched).

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/cuda/refit_packer_cuda.h"
#include "cc/refit_packer.h"

namespace {

using dockyard::kernels::BucketSpan;
using dockyard::kernels::StridedTensor;

int num_failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                    \
      ++num_failures;                                                                \
    }                                                                                \
  } while (0)

void CheckCudaOk(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

void FillPseudoRandom(std::vector<char>* bytes, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (char& b : *bytes) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<char>(x >> 24);
  }
}

// A strided tensor over its own storage, on the host and (after Upload) on the device.
struct Tensor {
  int64_t element_size;
  std::vector<int64_t> shape, strides;
  int64_t storage_elements, element_offset;
  std::vector<char> host;
  char* device = nullptr;

  StridedTensor View(char* base) const {
    StridedTensor t;
    t.data = base + element_offset * element_size;
    t.element_size = element_size;
    t.shape = shape;
    t.strides = strides;
    return t;
  }
};

Tensor Make(int64_t element_size, std::vector<int64_t> shape, std::vector<int64_t> strides,
            int64_t storage_elements, int64_t element_offset, uint64_t seed) {
  Tensor t{element_size, std::move(shape), std::move(strides), storage_elements, element_offset,
           std::vector<char>(static_cast<size_t>(storage_elements * element_size))};
  FillPseudoRandom(&t.host, seed);
  return t;
}

int64_t Bytes(const Tensor& t) {
  int64_t n = t.element_size;
  for (int64_t s : t.shape) n *= s;
  return n;
}

void Upload(Tensor* t) {
  // At least one byte, so that even an empty tensor has a device pointer.
  CheckCudaOk(cudaMalloc(&t->device, t->host.size() + 1), "cudaMalloc");
  if (!t->host.empty()) {
    CheckCudaOk(cudaMemcpy(t->device, t->host.data(), t->host.size(), cudaMemcpyHostToDevice),
                "cudaMemcpy");
  }
}

std::vector<char> Download(const char* d, size_t n) {
  std::vector<char> out(n);
  if (n > 0) CheckCudaOk(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return out;
}

// Packs and unpacks `tensors` on both sides and compares every byte.
void CheckParity(const char* name, std::vector<Tensor> tensors, int64_t alignment) {
  std::vector<int64_t> offsets;
  int64_t pos = 0;
  for (const Tensor& t : tensors) {
    offsets.push_back(pos);
    pos += (Bytes(t) + alignment - 1) / alignment * alignment + alignment;  // Gaps too.
  }
  const int64_t nbytes = pos;
  for (Tensor& t : tensors) Upload(&t);

  std::vector<BucketSpan> host_spans, device_spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    host_spans.push_back({tensors[i].View(tensors[i].host.data()), offsets[i]});
    device_spans.push_back({tensors[i].View(tensors[i].device), offsets[i]});
  }
  std::vector<char> expected(static_cast<size_t>(nbytes), 'x');
  dockyard::kernels::pack_bucket(host_spans, expected.data(), nbytes, 1);

  char* d_bucket = nullptr;
  CheckCudaOk(cudaMalloc(&d_bucket, nbytes), "cudaMalloc");
  CheckCudaOk(cudaMemset(d_bucket, 'x', nbytes), "cudaMemset");  // Padding must be zeroed.
  dockyard::kernels::pack_bucket_cuda(device_spans, d_bucket, nbytes, nullptr);
  CheckCudaOk(cudaDeviceSynchronize(), "pack kernel");
  const bool pack_ok = Download(d_bucket, nbytes) == expected;
  if (!pack_ok) std::printf("FAIL %s: packed bucket differs from the CPU's\n", name);
  num_failures += pack_ok ? 0 : 1;

  // Unpack into destinations holding other bytes (same strides as the sources).
  std::vector<BucketSpan> host_dest, device_dest;
  std::vector<std::vector<char>> host_storage;
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<char> fresh(tensors[i].host.size());
    FillPseudoRandom(&fresh, 500 + i);
    if (!fresh.empty()) {
      CheckCudaOk(cudaMemcpy(tensors[i].device, fresh.data(), fresh.size(),
                             cudaMemcpyHostToDevice),
                  "cudaMemcpy");
    }
    host_storage.push_back(std::move(fresh));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    host_dest.push_back({tensors[i].View(host_storage[i].data()), offsets[i]});
    device_dest.push_back({tensors[i].View(tensors[i].device), offsets[i]});
  }
  dockyard::kernels::unpack_bucket(expected.data(), nbytes, host_dest, 1);
  dockyard::kernels::unpack_bucket_cuda(d_bucket, nbytes, device_dest, nullptr);
  CheckCudaOk(cudaDeviceSynchronize(), "unpack kernel");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (Download(tensors[i].device, host_storage[i].size()) != host_storage[i]) {
      std::printf("FAIL %s: tensor %zu differs after unpack\n", name, i);
      ++num_failures;
    }
  }
  cudaFree(d_bucket);
  for (Tensor& t : tensors) cudaFree(t.device);
}

void TestErrors() {
  Tensor t = Make(4, {4}, {1}, 4, 0, 9);
  Upload(&t);
  char* d_bucket = nullptr;
  CheckCudaOk(cudaMalloc(&d_bucket, 64), "cudaMalloc");
  std::vector<char> host_bucket(64);
  auto expect_invalid = [&](auto&& call, const char* substr) {
    try {
      call();
      std::printf("FAIL: expected std::invalid_argument containing \"%s\"\n", substr);
      ++num_failures;
    } catch (const std::invalid_argument& e) {
      if (std::string(e.what()).find(substr) == std::string::npos) {
        std::printf("FAIL: message \"%s\" lacks \"%s\"\n", e.what(), substr);
        ++num_failures;
      }
    }
  };
  expect_invalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{t.View(t.device), 0}}, host_bucket.data(), 64,
                                            nullptr);
      },
      "pack_bucket_cuda: the bucket is not device memory");
  expect_invalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{t.View(t.host.data()), 0}}, d_bucket, 64, nullptr);
      },
      "span 0's tensor is not device memory");
  expect_invalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{t.View(t.device), 0}, {t.View(t.device), 8}},
                                            d_bucket, 64, nullptr);
      },
      "span 0 and span 1 overlap in the bucket");
  // Nine dims of size 2 with strides that never merge (each 3x the next).
  std::vector<int64_t> shape(9, 2), strides(9);
  int64_t s = 1;
  for (int d = 8; d >= 0; --d, s *= 3) strides[d] = s;
  Tensor deep = Make(1, shape, strides, s, 0, 10);
  Upload(&deep);
  CheckCudaOk(cudaFree(d_bucket), "cudaFree");
  CheckCudaOk(cudaMalloc(&d_bucket, 512), "cudaMalloc");
  expect_invalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{deep.View(deep.device), 0}}, d_bucket, 512,
                                            nullptr);
      },
      "has 9 dims after merging");
  cudaFree(d_bucket);
  cudaFree(t.device);
  cudaFree(deep.device);
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
  // Each case counts as failed when it adds a failure or throws.
  int passed = 0, failed = 0;
  auto run_case = [&](const char* name, auto&& body) {
    const int before = num_failures;
    try {
      body();
    } catch (const std::exception& e) {
      std::printf("FAIL %s: unexpected exception: %s\n", name, e.what());
      ++num_failures;
    }
    std::printf("[%s] %s\n", num_failures == before ? "PASS" : "FAIL", name);
    (num_failures == before ? passed : failed)++;
  };
  for (int64_t alignment : {16, 256}) {
    run_case(alignment == 16 ? "MixedLayoutsAlign16" : "MixedLayoutsAlign256", [&] {
      std::vector<Tensor> mixed;
      mixed.push_back(Make(4, {3, 5}, {5, 1}, 15, 0, 1));            // Dense.
      mixed.push_back(Make(2, {5, 3}, {1, 5}, 15, 0, 2));            // Transposed.
      mixed.push_back(Make(8, {3, 3, 3}, {42, 14, 3}, 168, 42, 3));  // Stepped slice.
      mixed.push_back(Make(1, {}, {}, 1, 0, 4));                     // 0-d.
      mixed.push_back(Make(4, {0, 9}, {9, 1}, 0, 0, 5));             // Empty.
      mixed.push_back(Make(16, {6}, {4}, 24, 1, 6));                 // 16-byte elements.
      mixed.push_back(Make(1, {7, 3}, {3, 1}, 21, 0, 7));            // Odd byte count.
      mixed.push_back(Make(2, {2, 1, 8}, {8, 1000, 1}, 16, 0, 8));   // Size-1 dim.
      mixed.push_back(Make(4, {9}, {1}, 10, 1, 9));                  // Base not 16-aligned.
      CheckParity("mixed", std::move(mixed), alignment);
    });
  }
  run_case("LargeMultiChunk", [&] {
    // Several chunks per tensor: dense 1 MiB + 3 bytes, a transposed matrix, a column slice.
    std::vector<Tensor> large;
    large.push_back(Make(1, {(1 << 20) + 3}, {1}, (1 << 20) + 3, 0, 11));
    large.push_back(Make(4, {300, 700}, {1, 300}, 300 * 700, 0, 12));
    large.push_back(Make(2, {4096, 33}, {66, 2}, 4096 * 66, 0, 13));
    CheckParity("large", std::move(large), 256);
  });
  run_case("Errors", TestErrors);
  std::printf("refit_packer_cuda_test: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
