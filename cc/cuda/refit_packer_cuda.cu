#include "cc/cuda/refit_packer_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/refit_packer.h"

namespace dockyard::kernels {
namespace {

constexpr int kThreads = 256;
// Bucket bytes per block: large enough that a block's index search and setup
// are negligible, small enough that a bucket gives thousands of blocks.
// A multiple of 16, so every chunk of a dense job keeps its base alignment.
constexpr int64_t kChunkBytes = 64 * 1024;

// One tensor (or, for pack, one padding range) to copy. Plain data: copied to
// the device as is.
struct Job {
  char* strided;        // The tensor's element 0; nullptr = write zeros.
  char* contiguous;     // Its bytes in the bucket.
  int64_t nbytes;
  int64_t first_chunk;  // Index of its first chunk among all jobs' chunks.
  int32_t element_size;
  int32_t ndim;  // 0 = dense: copy nbytes straight; else strided dims below.
  int64_t shape[kCudaMaxDims];
  int64_t byte_strides[kCudaMaxDims];
};

void CheckCuda(cudaError_t err, const char* function, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(function) + ": " + what + ": " +
                             cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// The block copies n bytes in words of W (both addresses W-aligned), then
// the tail byte by byte.
template <typename W>
__device__ void CopyWords(char* dst, const char* src, int64_t n) {
  const int64_t num_words = n / static_cast<int64_t>(sizeof(W));
  W* d = reinterpret_cast<W*>(dst);
  const W* s = reinterpret_cast<const W*>(src);
  for (int64_t i = threadIdx.x; i < num_words; i += blockDim.x) d[i] = s[i];
  for (int64_t i = num_words * static_cast<int64_t>(sizeof(W)) + threadIdx.x;
       i < n; i += blockDim.x) {
    dst[i] = src[i];
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
__device__ void ZeroWords(char* dst, int64_t n) {
  const int64_t num_words = n / static_cast<int64_t>(sizeof(W));
  W* d = reinterpret_cast<W*>(dst);
  for (int64_t i = threadIdx.x; i < num_words; i += blockDim.x) d[i] = W{};
  for (int64_t i = num_words * static_cast<int64_t>(sizeof(W)) + threadIdx.x;
       i < n; i += blockDim.x) {
    dst[i] = 0;
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
__device__ void CopyElement(char* dst, const char* src) {
  if constexpr (N == 1) {
    *reinterpret_cast<unsigned char*>(dst) = *reinterpret_cast<const unsigned char*>(src);
  } else if constexpr (N == 2) {
    *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
  } else if constexpr (N == 4) {
    *reinterpret_cast<unsigned int*>(dst) = *reinterpret_cast<const unsigned int*>(src);
  } else {
    static_assert(N == 8 || N == 16, "element sizes are 1, 2, 4, 8 or 16");
    for (int w = 0; w < N / 8; ++w) {
      reinterpret_cast<unsigned long long*>(dst)[w] =
          reinterpret_cast<const unsigned long long*>(src)[w];
    }
  }
}

// Elements [begin, end) of a strided job, one per thread at a time.
template <int N, bool kPack>
__device__ void CopyStrided(const Job& job, int64_t begin, int64_t end) {
  for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    int64_t rest = e, offset = 0;
    for (int d = job.ndim - 1; d >= 0; --d) {
      offset += (rest % job.shape[d]) * job.byte_strides[d];
      rest /= job.shape[d];
    }
    char* element = job.strided + offset;
    char* packed = job.contiguous + e * N;
    if (kPack) {
      CopyElement<N>(packed, element);
    } else {
      CopyElement<N>(element, packed);
    }
  }
}

template <bool kPack>
__device__ void CopyStridedChunk(const Job& job, int64_t begin_byte, int64_t end_byte) {
  const int64_t b = begin_byte / job.element_size, e = end_byte / job.element_size;
  switch (job.element_size) {
    case 1: CopyStrided<1, kPack>(job, b, e); break;
    case 2: CopyStrided<2, kPack>(job, b, e); break;
    case 4: CopyStrided<4, kPack>(job, b, e); break;
    case 8: CopyStrided<8, kPack>(job, b, e); break;
    default: CopyStrided<16, kPack>(job, b, e); break;
  }
}

// One block per chunk (grid-stride over chunks). kPack: tensors -> bucket and
// zero jobs; otherwise bucket -> tensors.
template <bool kPack>
__global__ void BucketCopyKernel(const Job* __restrict__ jobs, int num_jobs,
                                 int64_t num_chunks) {
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    // The job holding this chunk: the last one with first_chunk <= chunk
    // (every job has at least one chunk, so first_chunk increases strictly).
    int lo = 0, hi = num_jobs - 1;
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      if (jobs[mid].first_chunk <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const Job& job = jobs[lo];
    const int64_t begin = (chunk - job.first_chunk) * kChunkBytes;
    const int64_t n = min(kChunkBytes, job.nbytes - begin);
    if (job.strided == nullptr) {
      ZeroFill(job.contiguous + begin, n);
    } else if (job.ndim == 0) {
      if (kPack) {
        CopyDense(job.contiguous + begin, job.strided + begin, n);
      } else {
        CopyDense(job.strided + begin, job.contiguous + begin, n);
      }
    } else {
      // Chunk bounds are multiples of 16, hence of the element size.
      CopyStridedChunk<kPack>(job, begin, begin + n);
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

// Device memory freed in stream order (no device-wide sync as with cudaFree,
// which would also wait for other streams, e.g. NCCL's).
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream, const char* function)
      : stream_(stream) {
    CheckCuda(cudaMallocAsync(&ptr_, bytes, stream), function, "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(ptr_, stream_); }  // Best effort.
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

void RunBucketCopy(const char* function, const std::vector<BucketSpan>& spans,
                   const void* d_bucket, int64_t bucket_nbytes, bool pack,
                   cudaStream_t stream) {
  const std::vector<internal::CollapsedSpan> collapsed = internal::validate_spans(
      function, spans, d_bucket, bucket_nbytes, /*check_self_overlap=*/!pack);
  char* bucket = const_cast<char*>(static_cast<const char*>(d_bucket));

  std::vector<Job> jobs;
  int64_t num_chunks = 0;
  auto add_job = [&](Job job) {
    job.first_chunk = num_chunks;
    num_chunks += (job.nbytes + kChunkBytes - 1) / kChunkBytes;
    jobs.push_back(job);
  };
  for (size_t i = 0; i < collapsed.size(); ++i) {
    const internal::CollapsedSpan& c = collapsed[i];
    if (c.nbytes == 0) continue;
    const auto ndim = static_cast<int64_t>(c.shape.size());
    if (ndim > kCudaMaxDims) {
      throw std::invalid_argument(
          std::string(function) + ": span " + std::to_string(i) + " has " +
          std::to_string(ndim) + " dims after merging, more than the " +
          std::to_string(kCudaMaxDims) + " supported on CUDA; make it "
          "contiguous first");
    }
    Job job{};
    job.strided = c.data;
    job.contiguous = bucket + c.offset;
    job.nbytes = c.nbytes;
    job.element_size = static_cast<int32_t>(c.element_size);
    const bool dense = ndim == 0 || (ndim == 1 && c.byte_strides[0] == c.element_size);
    job.ndim = dense ? 0 : static_cast<int32_t>(ndim);
    for (int64_t d = 0; d < ndim && !dense; ++d) {
      job.shape[d] = c.shape[d];
      job.byte_strides[d] = c.byte_strides[d];
    }
    add_job(job);
  }
  if (pack) {
    for (const auto& [begin, end] : internal::uncovered_ranges(collapsed, bucket_nbytes)) {
      Job job{};
      job.strided = nullptr;
      job.contiguous = bucket + begin;
      job.nbytes = end - begin;
      job.element_size = 1;
      add_job(job);
    }
  }
  if (jobs.empty()) return;  // Nothing to read or write.
  // Jobs are in first_chunk order already (added with increasing counts).

  // jobs is non-empty, so the bucket has bytes.
  const int device = DeviceOf(d_bucket, function, "the bucket");
  for (size_t i = 0; i < collapsed.size(); ++i) {
    if (collapsed[i].nbytes == 0) continue;
    const std::string name = "span " + std::to_string(i) + "'s tensor";
    if (DeviceOf(collapsed[i].data, function, name) != device) {
      throw std::invalid_argument(std::string(function) + ": " + name +
                                  " is not on the bucket's GPU");
    }
  }
  DeviceGuard device_guard(device, function);
  StreamBuffer d_jobs(jobs.size() * sizeof(Job), stream, function);
  // From pageable memory: the call returns once the descriptors are staged,
  // so `jobs` may be freed when this function returns.
  CheckCuda(cudaMemcpyAsync(d_jobs.get(), jobs.data(), jobs.size() * sizeof(Job),
                            cudaMemcpyHostToDevice, stream),
            function, "cudaMemcpyAsync");
  const auto* jobs_ptr = static_cast<const Job*>(d_jobs.get());
  const int blocks = static_cast<int>(std::min<int64_t>(num_chunks, INT_MAX));
  const int num_jobs = static_cast<int>(jobs.size());
  if (pack) {
    BucketCopyKernel<true><<<blocks, kThreads, 0, stream>>>(jobs_ptr, num_jobs, num_chunks);
  } else {
    BucketCopyKernel<false><<<blocks, kThreads, 0, stream>>>(jobs_ptr, num_jobs, num_chunks);
  }
  CheckCuda(cudaGetLastError(), function, "kernel launch");
}  // d_jobs is freed here, in stream order after the kernel.

}  // namespace

void pack_bucket_cuda(const std::vector<BucketSpan>& spans, void* d_bucket,
                      int64_t bucket_nbytes, cudaStream_t stream) {
  RunBucketCopy("pack_bucket_cuda", spans, d_bucket, bucket_nbytes, true, stream);
}

void unpack_bucket_cuda(const void* d_bucket, int64_t bucket_nbytes,
                        const std::vector<BucketSpan>& spans,
                        cudaStream_t stream) {
  RunBucketCopy("unpack_bucket_cuda", spans, d_bucket, bucket_nbytes, false, stream);
}

}  // namespace dockyard::kernels
