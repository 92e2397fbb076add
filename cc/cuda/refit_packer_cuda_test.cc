// Parity of pack_bucket_cuda / unpack_bucket_cuda with the CPU core on a real
// GPU. Built and linked (against libcudart) in every build that finds a CUDA
// toolkit, so CI proves the CUDA objects link; it runs the comparison only
// where a CUDA device is present and otherwise says why it skipped.
//
// Each case builds host tensors (dense, transposed, stepped slices, 0-d, empty,
// every element size), uploads their whole storages, and checks that the GPU
// bucket equals the CPU bucket byte for byte (padding included), and that
// unpacking on the GPU leaves every destination storage byte equal to what the
// CPU unpack leaves (so bytes between strided elements stay untouched). The
// same for plans (CudaCopyPlan against the CPU CopyPlan): many buckets (more
// than one launch takes), all buckets in one run and one bucket per run, reused
// over rounds with new values in the same device memory, and every word width
// of the dense copy (addresses aligned to 16, 8, 4, 2 and 1 bytes, sizes with
// tails).

#include "cc/cuda/refit_packer_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/cuda/testing.h"
#include "cc/refit_packer.h"
#include "cc/testing.h"

namespace {

using dockyard::testing::FillPseudoRandom;

using dockyard::kernels::BucketSpan;
using dockyard::kernels::CopyDirection;
using dockyard::kernels::CopyPlan;
using dockyard::kernels::CudaCopyPlan;
using dockyard::kernels::PlanSpan;
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

// Packs and unpacks `tensors` on both sides and compares every byte.
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
    if (Download(tensors[i].device, host_storage[i].size()) !=
        host_storage[i]) {
      ADD_FAILURE("%s: tensor %zu differs after unpack", name, i);
    }
  }
  cudaFree(d_bucket);
  for (Tensor& t : tensors) cudaFree(t.device);
}

// Device memory freed at scope exit, so that a failing check leaks nothing.
struct DeviceBuffer {
  char* ptr = nullptr;
  explicit DeviceBuffer(size_t n) {
    CheckCudaOk(cudaMalloc(&ptr, n > 0 ? n : 1), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Tensor i goes to bucket i % num_buckets, at aligned offsets with a gap of
// `alignment` after each. Three rounds reuse the same plans with new values
// uploaded into the same memory.
void CheckPlanParity(const char* name, std::vector<Tensor> tensors,
                     int64_t num_buckets, int64_t alignment) {
  std::vector<int64_t> bucket_of, offsets,
      sizes(static_cast<size_t>(num_buckets), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t b = static_cast<int64_t>(i) % num_buckets;
    bucket_of.push_back(b);
    offsets.push_back(sizes[b]);
    sizes[b] +=
        (Bytes(tensors[i]) + alignment - 1) / alignment * alignment + alignment;
  }
  for (Tensor& t : tensors) Upload(&t);
  // Destinations: their own storages with the sources' strides, on both sides.
  std::vector<std::vector<char>> host_dest(tensors.size());
  std::vector<char*> device_dest(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    host_dest[i].resize(tensors[i].host.size());
    CheckCudaOk(cudaMalloc(&device_dest[i], tensors[i].host.size() + 1),
                "cudaMalloc");
  }
  std::vector<PlanSpan> host_src, device_src, host_dst, device_dst;
  for (size_t i = 0; i < tensors.size(); ++i) {
    host_src.push_back(
        {tensors[i].View(tensors[i].host.data()), bucket_of[i], offsets[i]});
    device_src.push_back(
        {tensors[i].View(tensors[i].device), bucket_of[i], offsets[i]});
    host_dst.push_back(
        {tensors[i].View(host_dest[i].data()), bucket_of[i], offsets[i]});
    device_dst.push_back(
        {tensors[i].View(device_dest[i]), bucket_of[i], offsets[i]});
  }
  const CopyPlan host_pack("host", CopyDirection::kPack, host_src, sizes);
  const CopyPlan host_unpack("host", CopyDirection::kUnpack, host_dst, sizes);
  const CudaCopyPlan device_pack("cuda", CopyDirection::kPack, device_src,
                                 sizes, 0);
  const CudaCopyPlan device_unpack("cuda", CopyDirection::kUnpack, device_dst,
                                   sizes, 0);
  CHECK(device_pack.num_chunks() > 0);

  std::vector<std::vector<char>> host_buckets;
  std::vector<std::unique_ptr<DeviceBuffer>> device_buckets;
  std::vector<void*> host_ptrs, device_ptrs;
  for (int64_t size : sizes) {
    host_buckets.emplace_back(static_cast<size_t>(size));
    device_buckets.push_back(
        std::make_unique<DeviceBuffer>(static_cast<size_t>(size)));
    host_ptrs.push_back(host_buckets.back().data());
    device_ptrs.push_back(device_buckets.back()->ptr);
  }
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      FillPseudoRandom(&tensors[i].host, 1000 * round + i);
      if (!tensors[i].host.empty()) {
        CheckCudaOk(cudaMemcpy(tensors[i].device, tensors[i].host.data(),
                               tensors[i].host.size(), cudaMemcpyHostToDevice),
                    "cudaMemcpy");
      }
    }
    host_pack.run(host_ptrs, 0, 1);
    for (size_t b = 0; b < sizes.size(); ++b) {
      CheckCudaOk(cudaMemset(device_ptrs[b], 'x', sizes[b]),
                  "cudaMemset");  // Padding too.
    }
    device_pack.run(device_ptrs, 0,
                    nullptr);  // All buckets: ceil(n / 32) launches.
    CheckCudaOk(cudaDeviceSynchronize(), "plan pack kernel");
    for (size_t b = 0; b < sizes.size(); ++b) {
      if (Download(device_ptrs[b], sizes[b]) != host_buckets[b]) {
        ADD_FAILURE("%s round %d: bucket %zu differs (all-bucket run)", name,
                    round, b);
      }
    }
    // One bucket per run, into one reused buffer (the double-buffering sender).
    DeviceBuffer scratch(
        static_cast<size_t>(*std::max_element(sizes.begin(), sizes.end())));
    for (size_t b = 0; b < sizes.size(); ++b) {
      CheckCudaOk(cudaMemset(scratch.ptr, 'z', sizes[b]), "cudaMemset");
      device_pack.run({scratch.ptr}, static_cast<int64_t>(b), nullptr);
      CheckCudaOk(cudaDeviceSynchronize(), "plan pack kernel");
      if (Download(scratch.ptr, sizes[b]) != host_buckets[b]) {
        ADD_FAILURE("%s round %d: bucket %zu differs (one-bucket run)", name,
                    round, b);
      }
    }
    // Unpack the CPU's buckets (uploaded) into destinations holding other
    // bytes.
    for (size_t b = 0; b < sizes.size(); ++b) {
      CheckCudaOk(cudaMemcpy(device_ptrs[b], host_buckets[b].data(), sizes[b],
                             cudaMemcpyHostToDevice),
                  "cudaMemcpy");
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      FillPseudoRandom(&host_dest[i], 7000 + 1000 * round + i);
      if (!host_dest[i].empty()) {
        CheckCudaOk(cudaMemcpy(device_dest[i], host_dest[i].data(),
                               host_dest[i].size(), cudaMemcpyHostToDevice),
                    "cudaMemcpy");
      }
    }
    host_unpack.run(host_ptrs, 0, 1);
    device_unpack.run(device_ptrs, 0, nullptr);
    CheckCudaOk(cudaDeviceSynchronize(), "plan unpack kernel");
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (Download(device_dest[i], host_dest[i].size()) != host_dest[i]) {
        ADD_FAILURE("%s round %d: destination %zu differs after unpack", name,
                    round, i);
      }
    }
  }
  for (char* d : device_dest) cudaFree(d);
  for (Tensor& t : tensors) cudaFree(t.device);
}

void TestPlanErrors() {
  Tensor t = Make(4, {4}, {1}, 4, 0, 9);
  Upload(&t);
  DeviceBuffer bucket(64);
  std::vector<char> host_bucket(64);
  ExpectInvalid(
      [&] {
        CudaCopyPlan("plan", CopyDirection::kPack,
                     {{t.View(t.host.data()), 0, 0}}, {64}, 0);
      },
      "plan: span 0's tensor is not device memory");
  ExpectInvalid(
      [&] {
        CudaCopyPlan("plan", CopyDirection::kPack,
                     {{t.View(t.device), 0, 0}, {t.View(t.device), 0, 8}}, {64},
                     0);
      },
      "plan: span 0 and span 1 overlap in the bucket");
  const CudaCopyPlan plan("plan", CopyDirection::kPack,
                          {{t.View(t.device), 0, 0}}, {64}, 0);
  // One chunk for the tensor, one for the padding after it.
  CHECK(plan.device() == 0 && plan.chunk_bytes() >= 8192 &&
        plan.num_chunks() == 2);
  ExpectInvalid([&] { plan.run({host_bucket.data()}, 0, nullptr); },
                "CudaCopyPlan::run: bucket 0 is not device memory");
  ExpectInvalid([&] { plan.run({nullptr}, 0, nullptr); },
                "bucket 0 is null but has 64 bytes");
  ExpectInvalid([&] { plan.run({bucket.ptr, bucket.ptr}, 0, nullptr); },
                "buckets [0, 0 + 2) are not all in the plan's 1 buckets");
  ExpectInvalid([&] { plan.run({t.device - 32}, 0, nullptr); },
                "span 0: the tensor's memory overlaps bucket 0");
  // Nine dims of size 2 with strides that never merge (each 3x the next).
  std::vector<int64_t> shape(9, 2), strides(9);
  int64_t s = 1;
  for (int d = 8; d >= 0; --d, s *= 3) strides[d] = s;
  Tensor deep = Make(1, shape, strides, s, 0, 10);
  Upload(&deep);
  ExpectInvalid(
      [&] {
        CudaCopyPlan("plan", CopyDirection::kPack,
                     {{deep.View(deep.device), 0, 0}}, {512}, 0);
      },
      "plan: span 0 has 9 dims after merging");
  // An empty plan, and a run over no buckets, queue nothing.
  CudaCopyPlan("plan", CopyDirection::kUnpack, {}, {}, 0).run({}, 0, nullptr);
  plan.run({}, 1, nullptr);
  CheckCudaOk(cudaDeviceSynchronize(), "empty runs");
  cudaFree(t.device);
  cudaFree(deep.device);
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
      {"PlanManyBuckets", [] {
         // 75 tensors of every layout over 37 buckets: two launches per
         // all-bucket run.
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
         CheckPlanParity("many buckets", std::move(many), 37, 256);
       }});
  cases.push_back(
      {"PlanWordWidthsAndLarge", [] {
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
         CheckPlanParity("word widths", std::move(t), 2, 256);
       }});
  cases.push_back({"PlanErrors", TestPlanErrors});
  return dockyard::testing::RunCudaTests("refit_packer_cuda_test", cases);
}
