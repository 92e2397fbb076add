// Parity of pack_bucket_cuda with the CPU core's pack_bucket on a real GPU.
// Built and linked (against libcudart) in every build that finds a CUDA
// toolkit, so CI proves the CUDA objects link; it runs the comparison only
// where a CUDA device is present and otherwise says why it skipped.
//
// Each case builds host tensors (dense, transposed, stepped slices, 0-d,
// empty, every element size), uploads their whole storages, and checks that
// the GPU bucket equals the CPU bucket byte for byte (padding included): many
// tensors in one bucket, several chunks per tensor, and every word width of
// the dense copy (addresses aligned to 16, 8, 4, 2 and 1 bytes, sizes with
// tails).

#include "cc/cuda/refit_packer_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/cuda/testing.h"
#include "cc/refit_packer.h"
#include "cc/testing.h"

namespace {

using dockyard::testing::FillPseudoRandom;

using dockyard::kernels::BucketSpan;
using dockyard::kernels::StridedTensor;

// Expects `call()` to throw std::invalid_argument whose message contains
// `substr`.
template <typename Fn>
void ExpectInvalid(Fn&& call, const char* substr) {
  EXPECT_INVALID_ARGUMENT(call(), substr);
}

void CheckCudaOk(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " +
                             cudaGetErrorString(err));
  }
}

// A strided tensor over its own storage, on the host and (after Upload) on the
// device.
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

Tensor Make(int64_t element_size, std::vector<int64_t> shape,
            std::vector<int64_t> strides, int64_t storage_elements,
            int64_t element_offset, uint64_t seed) {
  Tensor t{
      element_size,
      std::move(shape),
      std::move(strides),
      storage_elements,
      element_offset,
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
    CheckCudaOk(cudaMemcpy(t->device, t->host.data(), t->host.size(),
                           cudaMemcpyHostToDevice),
                "cudaMemcpy");
  }
}

std::vector<char> Download(const void* d, size_t n) {
  std::vector<char> out(n);
  if (n > 0)
    CheckCudaOk(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost),
                "cudaMemcpy");
  return out;
}

// Packs `tensors` on both sides and compares every byte.
void CheckParity(const char* name, std::vector<Tensor> tensors,
                 int64_t alignment) {
  std::vector<int64_t> offsets;
  int64_t pos = 0;
  for (const Tensor& t : tensors) {
    offsets.push_back(pos);
    pos += (Bytes(t) + alignment - 1) / alignment * alignment +
           alignment;  // Gaps too.
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
  CheckCudaOk(cudaMemset(d_bucket, 'x', nbytes),
              "cudaMemset");  // Padding must be zeroed.
  dockyard::kernels::pack_bucket_cuda(device_spans, d_bucket, nbytes, nullptr);
  CheckCudaOk(cudaDeviceSynchronize(), "pack kernel");
  const bool pack_ok = Download(d_bucket, nbytes) == expected;
  if (!pack_ok) ADD_FAILURE("%s: packed bucket differs from the CPU's", name);
  cudaFree(d_bucket);
  for (Tensor& t : tensors) cudaFree(t.device);
}

void TestErrors() {
  Tensor t = Make(4, {4}, {1}, 4, 0, 9);
  Upload(&t);
  char* d_bucket = nullptr;
  CheckCudaOk(cudaMalloc(&d_bucket, 64), "cudaMalloc");
  std::vector<char> host_bucket(64);
  ExpectInvalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{t.View(t.device), 0}},
                                            host_bucket.data(), 64, nullptr);
      },
      "pack_bucket_cuda: the bucket is not device memory");
  ExpectInvalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{t.View(t.host.data()), 0}},
                                            d_bucket, 64, nullptr);
      },
      "span 0's tensor is not device memory");
  ExpectInvalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda(
            {{t.View(t.device), 0}, {t.View(t.device), 8}}, d_bucket, 64,
            nullptr);
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
  ExpectInvalid(
      [&] {
        dockyard::kernels::pack_bucket_cuda({{deep.View(deep.device), 0}},
                                            d_bucket, 512, nullptr);
      },
      "has 9 dims after merging");
  // An empty bucket without tensors queues nothing.
  dockyard::kernels::pack_bucket_cuda({}, nullptr, 0, nullptr);
  CheckCudaOk(cudaDeviceSynchronize(), "empty pack");
  cudaFree(d_bucket);
  cudaFree(t.device);
  cudaFree(deep.device);
}

}  // namespace

int main() {
  std::vector<dockyard::testing::TestCase> cases;
  for (int64_t alignment : {16, 256}) {
    const char* name =
        alignment == 16 ? "MixedLayoutsAlign16" : "MixedLayoutsAlign256";
    cases.push_back(
        {name, [alignment] {
           std::vector<Tensor> mixed;
           mixed.push_back(Make(4, {3, 5}, {5, 1}, 15, 0, 1));  // Dense.
           mixed.push_back(Make(2, {5, 3}, {1, 5}, 15, 0, 2));  // Transposed.
           mixed.push_back(
               Make(8, {3, 3, 3}, {42, 14, 3}, 168, 42, 3));   // Stepped slice.
           mixed.push_back(Make(1, {}, {}, 1, 0, 4));          // 0-d.
           mixed.push_back(Make(4, {0, 9}, {9, 1}, 0, 0, 5));  // Empty.
           mixed.push_back(Make(16, {6}, {4}, 24, 1, 6));  // 16-byte elements.
           mixed.push_back(
               Make(1, {7, 3}, {3, 1}, 21, 0, 7));  // Odd byte count.
           mixed.push_back(
               Make(2, {2, 1, 8}, {8, 1000, 1}, 16, 0, 8));  // Size-1 dim.
           mixed.push_back(
               Make(4, {9}, {1}, 10, 1, 9));  // Base not 16-aligned.
           CheckParity("mixed", std::move(mixed), alignment);
         }});
  }
  cases.push_back(
      {"LargeMultiChunk", [] {
         // Several chunks per tensor: dense 1 MiB + 3 bytes, a transposed
         // matrix, a column slice.
         std::vector<Tensor> large;
         large.push_back(Make(1, {(1 << 20) + 3}, {1}, (1 << 20) + 3, 0, 11));
         large.push_back(Make(4, {300, 700}, {1, 300}, 300 * 700, 0, 12));
         large.push_back(Make(2, {4096, 33}, {66, 2}, 4096 * 66, 0, 13));
         CheckParity("large", std::move(large), 256);
       }});
  cases.push_back({"Errors", TestErrors});
  cases.push_back(
      {"ManyTensors", [] {
         // 76 tensors of every layout in one bucket: many jobs in one launch.
         std::vector<Tensor> many;
         for (int i = 0; i < 75; ++i) {
           const uint64_t seed = 100 + i;
           switch (i % 5) {
             case 0:
               many.push_back(
                   Make(4, {3 + i, 5}, {5, 1}, (3 + i) * 5, 0, seed));
               break;
             case 1:
               many.push_back(
                   Make(2, {5, 3 + i}, {1, 5}, (3 + i) * 5, 0, seed));
               break;
             case 2:
               many.push_back(Make(8, {3, 3, 3}, {42, 14, 3}, 168, 42, seed));
               break;
             case 3: many.push_back(Make(1, {}, {}, 1, 0, seed)); break;
             default: many.push_back(Make(16, {6}, {4}, 24, 1, seed)); break;
           }
         }
         many.push_back(Make(4, {0, 9}, {9, 1}, 0, 0, 99));  // Empty.
         CheckParity("many tensors", std::move(many), 256);
       }});
  cases.push_back(
      {"WordWidthsAndLarge", [] {
         // Dense tensors whose base is aligned to 16, 8, 4, 2 and 1 bytes
         // (bucket offsets are 16-byte aligned, so the copy takes each word
         // width), over several chunks, with odd tails; plus large strided
         // ones.
         std::vector<Tensor> t;
         t.push_back(Make(1, {(4 << 20) + 3}, {1}, (4 << 20) + 3, 0,
                          201));                               // 16-aligned.
         t.push_back(Make(8, {100003}, {1}, 100004, 1, 202));  // 8-aligned.
         t.push_back(Make(4, {100001}, {1}, 100002, 1, 203));  // 4-aligned.
         t.push_back(Make(2, {100001}, {1}, 100002, 1, 204));  // 2-aligned.
         t.push_back(Make(1, {300007}, {1}, 300008, 1, 205));  // Odd address.
         t.push_back(
             Make(4, {300, 700}, {1, 300}, 300 * 700, 0, 206));  // Transposed.
         t.push_back(
             Make(2, {4096, 33}, {66, 2}, 4096 * 66, 0, 207));  // Column steps.
         CheckParity("word widths", std::move(t), 256);
       }});
  return dockyard::testing::RunCudaTests("refit_packer_cuda_test", cases);
}
