#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cc/cuda/refit_packer_cuda.h"
#include "cc/refit_packer.h"

namespace dockyard::kernels {
namespace {

// Threads per block. Every device loop below strides by this constant, so
// kernels must be launched with exactly kThreads threads.
constexpr int kThreads = 256;
// The grid is as many blocks as are resident at once (per SM: what the
// kernel's registers allow, at most 2048 threads), so every SM keeps enough
// 16-byte loads in flight to saturate HBM; more chunks than blocks are
// covered by a grid-stride loop. Chunk sizes aim at kChunksPerBlock chunks
// per block so the last wave's imbalance stays small.
constexpr int kChunksPerBlock = 2;
// Chunk sizes: powers of two (so multiples of 16: a chunk keeps its job's
// base alignment and its bounds fall on element boundaries). Large enough
// that a chunk's job lookup is negligible next to its copy; the minimum
// keeps tiny tensors from costing a block each for nothing.
constexpr int64_t kMinChunkBytes = 8 * 1024;
constexpr int64_t kMaxChunkBytes = 64 * 1024;
// 16-byte words each thread loads before it stores them (memory-level
// parallelism: four independent loads in flight per thread).
constexpr int kUnroll = 4;

// One tensor (or one padding range) to copy. Plain data: copied to the device
// as is.
struct Job {
  char* strided;   // The tensor's element 0; nullptr = write zeros.
  int64_t offset;  // Its bytes' offset in the bucket.
  int64_t nbytes;
  int64_t first_chunk;  // Index of its first chunk among all jobs' chunks.
  int32_t element_size;
  int32_t ndim;  // 0 = dense: copy nbytes straight; else strided dims below.
  int64_t shape[kCudaMaxDims];
  int64_t byte_strides[kCudaMaxDims];
};

// pack_bucket_cuda stages the int32 chunk table right after the jobs.
static_assert(sizeof(Job) % alignof(int32_t) == 0 &&
                  alignof(Job) >= alignof(int32_t),
              "the chunk table after the jobs must be aligned");

void CheckCuda(cudaError_t err, const char* function, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(function) + ": " + what + ": " +
                             cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// The block copies n bytes in words of W (both addresses W-aligned), kUnroll
// words per thread per step (all loads, then all stores), then the remaining
// words one at a time and the tail byte by byte.
template <typename W>
__device__ __forceinline__ void CopyWords(char* __restrict__ dst,
                                          const char* __restrict__ src,
                                          int64_t n) {
  const int64_t num_words = n / static_cast<int64_t>(sizeof(W));
  W* d = reinterpret_cast<W*>(dst);
  const W* s = reinterpret_cast<const W*>(src);
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < num_words; i += kUnroll * kThreads) {
    W v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * kThreads] = v[u];
  }
  for (; i < num_words; i += kThreads) d[i] = s[i];
  for (int64_t b = num_words * static_cast<int64_t>(sizeof(W)) + threadIdx.x;
       b < n; b += kThreads) {
    dst[b] = src[b];
  }
}

__device__ void CopyDense(char* dst, const char* src, int64_t n) {
  const uintptr_t a =
      reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if (a % 16 == 0) {
    CopyWords<uint4>(dst, src, n);
  } else if (a % 8 == 0) {
    CopyWords<unsigned long long>(dst, src, n);
  } else if (a % 4 == 0) {
    CopyWords<unsigned int>(dst, src, n);
  } else if (a % 2 == 0) {
    CopyWords<unsigned short>(dst, src, n);
  } else {
    CopyWords<unsigned char>(dst, src, n);
  }
}

template <typename W>
__device__ __forceinline__ void ZeroWords(char* dst, int64_t n) {
  const int64_t num_words = n / static_cast<int64_t>(sizeof(W));
  W* d = reinterpret_cast<W*>(dst);
  for (int64_t i = threadIdx.x; i < num_words; i += kThreads) d[i] = W{};
  for (int64_t b = num_words * static_cast<int64_t>(sizeof(W)) + threadIdx.x;
       b < n; b += kThreads) {
    dst[b] = 0;
  }
}

__device__ void ZeroFill(char* dst, int64_t n) {
  // Padding starts where a tensor ends: often not 16-byte aligned.
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (a % 16 == 0) {
    ZeroWords<uint4>(dst, n);
  } else if (a % 4 == 0) {
    ZeroWords<unsigned int>(dst, n);
  } else {
    ZeroWords<unsigned char>(dst, n);
  }
}

// Copies one element of N bytes; both addresses are aligned to N (16-byte
// elements only to 8, so they move as two 8-byte words).
template <int N>
__device__ __forceinline__ void CopyElement(char* dst, const char* src) {
  if constexpr (N == 1) {
    *reinterpret_cast<unsigned char*>(dst) =
        *reinterpret_cast<const unsigned char*>(src);
  } else if constexpr (N == 2) {
    *reinterpret_cast<unsigned short*>(dst) =
        *reinterpret_cast<const unsigned short*>(src);
  } else if constexpr (N == 4) {
    *reinterpret_cast<unsigned int*>(dst) =
        *reinterpret_cast<const unsigned int*>(src);
  } else {
    static_assert(N == 8 || N == 16, "element sizes are 1, 2, 4, 8 or 16");
    for (int w = 0; w < N / 8; ++w) {
      reinterpret_cast<unsigned long long*>(dst)[w] =
          reinterpret_cast<const unsigned long long*>(src)[w];
    }
  }
}

// Elements [begin, end) of a strided job, one per thread at a time, from the
// tensor to `contiguous` (the job's first byte in the bucket).
template <int N>
__device__ void CopyStrided(const Job& job, char* contiguous, int64_t begin,
                            int64_t end) {
  for (int64_t e = begin + threadIdx.x; e < end; e += kThreads) {
    int64_t rest = e, offset = 0;
    for (int d = job.ndim - 1; d >= 0; --d) {
      offset += (rest % job.shape[d]) * job.byte_strides[d];
      rest /= job.shape[d];
    }
    CopyElement<N>(contiguous + e * N, job.strided + offset);
  }
}

__device__ void CopyStridedChunk(const Job& job, char* contiguous,
                                 int64_t begin_byte, int64_t end_byte) {
  const int64_t b = begin_byte / job.element_size,
                e = end_byte / job.element_size;
  switch (job.element_size) {
    case 1: CopyStrided<1>(job, contiguous, b, e); break;
    case 2: CopyStrided<2>(job, contiguous, b, e); break;
    case 4: CopyStrided<4>(job, contiguous, b, e); break;
    case 8: CopyStrided<8>(job, contiguous, b, e); break;
    default: CopyStrided<16>(job, contiguous, b, e); break;
  }
}

// Grid-stride over the bucket's chunks; a block copies one chunk at a time
// (tensors -> bucket, zeros for the padding jobs).
__global__ void __launch_bounds__(kThreads)
    BucketPackKernel(const Job* __restrict__ jobs,
                     const int32_t* __restrict__ chunk_job, char* bucket,
                     int64_t num_chunks, int64_t chunk_bytes) {
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    const Job& job = jobs[chunk_job[chunk]];
    const int64_t begin = (chunk - job.first_chunk) * chunk_bytes;
    const int64_t n = min(chunk_bytes, job.nbytes - begin);
    char* contiguous = bucket + job.offset;
    if (job.strided == nullptr) {
      ZeroFill(contiguous + begin, n);
    } else if (job.ndim == 0) {
      CopyDense(contiguous + begin, job.strided + begin, n);
    } else {
      CopyStridedChunk(job, contiguous, begin, begin + n);
    }
  }
}

// Switches to `device` for this scope and restores the caller's device after.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* function) {
    CheckCuda(cudaGetDevice(&previous_), function, "cudaGetDevice");
    if (device != previous_) {
      CheckCuda(cudaSetDevice(device), function, "cudaSetDevice");
    }
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }  // Best effort: no throw here.
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// The GPU that holds `ptr`; throws std::invalid_argument for host memory.
int DeviceOf(const void* ptr, const char* function, const std::string& name) {
  cudaPointerAttributes attr{};
  CheckCuda(cudaPointerGetAttributes(&attr, ptr), function,
            "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    throw std::invalid_argument(std::string(function) + ": " + name +
                                " is not device memory");
  }
  return attr.device;
}

// Every tensor with bytes must be on `device`, the bucket's.
void CheckTensorDevices(const char* function,
                        const std::vector<internal::CollapsedSpan>& spans,
                        int device) {
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].nbytes == 0) continue;
    const std::string name = "span " + std::to_string(i) + "'s tensor";
    if (DeviceOf(spans[i].data, function, name) != device) {
      throw std::invalid_argument(std::string(function) + ": " + name +
                                  " is not on the bucket's GPU");
    }
  }
}

// The number of blocks of the copy kernel resident at once on `device`.
int NumBlocksCap(int device, const char* function) {
  DeviceGuard device_guard(device, function);
  int num_sms = 0;
  CheckCuda(
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
      function, "cudaDeviceGetAttribute");
  int blocks_per_sm = 0;
  CheckCuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &blocks_per_sm, BucketPackKernel, kThreads, 0),
            function, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(1, num_sms) * std::max(1, blocks_per_sm);
}

// The largest chunk size that still gives a bucket of `bucket_nbytes` at
// least kChunksPerBlock chunks per block of a full grid (all SMs busy),
// within [kMinChunkBytes, kMaxChunkBytes].
int64_t ChooseChunkBytes(int64_t bucket_nbytes, int num_blocks) {
  int64_t chunk = kMaxChunkBytes;
  while (chunk > kMinChunkBytes &&
         bucket_nbytes / chunk < int64_t{kChunksPerBlock} * num_blocks) {
    chunk /= 2;
  }
  return chunk;
}

// The device-side description of one bucket's copies.
struct JobTable {
  std::vector<Job> jobs;
  std::vector<int32_t> chunk_job;  // Per chunk: its job's index.
  int64_t num_chunks = 0;
};

// Jobs for the spans with bytes (in the caller's order), then for the
// padding ranges `gaps`; each job's chunks follow the previous job's.
JobTable BuildJobs(const char* function,
                   const std::vector<internal::CollapsedSpan>& spans,
                   const std::vector<std::pair<int64_t, int64_t>>& gaps,
                   int64_t chunk_bytes) {
  JobTable table;
  auto add_job = [&](Job job) {
    if (table.jobs.size() >= static_cast<size_t>(INT32_MAX)) {
      throw std::invalid_argument(std::string(function) + ": too many tensors");
    }
    job.first_chunk = table.num_chunks;
    const int64_t n = (job.nbytes + chunk_bytes - 1) / chunk_bytes;
    table.num_chunks += n;
    table.chunk_job.insert(table.chunk_job.end(), static_cast<size_t>(n),
                           static_cast<int32_t>(table.jobs.size()));
    table.jobs.push_back(job);
  };
  for (size_t i = 0; i < spans.size(); ++i) {
    const internal::CollapsedSpan& c = spans[i];
    if (c.nbytes == 0) continue;
    const auto ndim = static_cast<int64_t>(c.shape.size());
    if (ndim > kCudaMaxDims) {
      throw std::invalid_argument(
          std::string(function) + ": span " + std::to_string(i) + " has " +
          std::to_string(ndim) + " dims after merging, more than the " +
          std::to_string(kCudaMaxDims) +
          " supported on CUDA; make it "
          "contiguous first");
    }
    Job job{};
    job.strided = c.data;
    job.offset = c.offset;
    job.nbytes = c.nbytes;
    job.element_size = static_cast<int32_t>(c.element_size);
    const bool dense =
        ndim == 0 || (ndim == 1 && c.byte_strides[0] == c.element_size);
    job.ndim = dense ? 0 : static_cast<int32_t>(ndim);
    for (int64_t d = 0; d < ndim && !dense; ++d) {
      job.shape[d] = c.shape[d];
      job.byte_strides[d] = c.byte_strides[d];
    }
    add_job(job);
  }
  for (const auto& [begin, end] : gaps) {
    Job job{};
    job.strided = nullptr;
    job.offset = begin;
    job.nbytes = end - begin;
    job.element_size = 1;
    add_job(job);
  }
  return table;
}

// Device memory freed in stream order (no device-wide sync as with cudaFree,
// which would also wait for other streams, e.g. NCCL's).
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream, const char* function)
      : stream_(stream) {
    CheckCuda(cudaMallocAsync(&ptr_, bytes, stream), function,
              "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(ptr_, stream_); }  // Best effort.
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

void pack_bucket_cuda(const std::vector<BucketSpan>& spans, void* d_bucket,
                      int64_t bucket_nbytes, cudaStream_t stream) {
  constexpr const char* kFn = "pack_bucket_cuda";
  const std::vector<internal::CollapsedSpan> collapsed =
      internal::validate_spans(kFn, spans, d_bucket, bucket_nbytes);
  const std::vector<std::pair<int64_t, int64_t>> gaps =
      internal::uncovered_ranges(collapsed, bucket_nbytes);
  const bool has_tensor_bytes = std::any_of(
      collapsed.begin(), collapsed.end(),
      [](const internal::CollapsedSpan& c) { return c.nbytes > 0; });
  if (!has_tensor_bytes && gaps.empty()) return;

  // There are jobs, so the bucket has bytes.
  const int device = DeviceOf(d_bucket, kFn, "the bucket");
  CheckTensorDevices(kFn, collapsed, device);
  const int num_blocks_cap = NumBlocksCap(device, kFn);
  const int64_t chunk_bytes = ChooseChunkBytes(bucket_nbytes, num_blocks_cap);
  const JobTable table = BuildJobs(kFn, collapsed, gaps, chunk_bytes);

  DeviceGuard device_guard(device, kFn);
  // Jobs then the chunk table in one buffer (aligned: see the static_assert
  // after Job).
  const size_t jobs_bytes = table.jobs.size() * sizeof(Job);
  const size_t table_bytes = table.chunk_job.size() * sizeof(int32_t);
  std::vector<char> staging(jobs_bytes + table_bytes);
  std::memcpy(staging.data(), table.jobs.data(), jobs_bytes);
  std::memcpy(staging.data() + jobs_bytes, table.chunk_job.data(), table_bytes);
  StreamBuffer d_staging(staging.size(), stream, kFn);
  // From pageable memory: the call returns once the descriptors are staged,
  // so `staging` may be freed when this function returns.
  CheckCuda(cudaMemcpyAsync(d_staging.get(), staging.data(), staging.size(),
                            cudaMemcpyHostToDevice, stream),
            kFn, "cudaMemcpyAsync");
  const char* base = static_cast<const char*>(d_staging.get());
  const int blocks =
      static_cast<int>(std::min<int64_t>(table.num_chunks, num_blocks_cap));
  BucketPackKernel<<<blocks, kThreads, 0, stream>>>(
      reinterpret_cast<const Job*>(base),
      reinterpret_cast<const int32_t*>(base + jobs_bytes),
      static_cast<char*>(d_bucket), table.num_chunks, chunk_bytes);
  CheckCuda(cudaGetLastError(), kFn, "kernel launch");
}  // d_staging is freed here, in stream order after the kernel.

}  // namespace dockyard::kernels
