// The nanobind layer of the refit packer (registered into _dockyard_kernels
// by cc/dockyard_kernels_binding.cc).
//
// Only argument plumbing lives here: tensors arrive through DLPack (no
// copies) with their strides, and calls dispatch on the bucket's device. The
// planning, copies and their validation are in cc/refit_packer.cc and
// cc/cuda/refit_packer_cuda.cu. nanobind turns std::invalid_argument into
// ValueError, std::out_of_range into IndexError and std::runtime_error into
// RuntimeError.
//
// The copies are byte copies, so dtypes only matter through their size; the
// Python module passes every tensor as a same-size integer view (uint8, int16,
// int32, int64), which DLPack exports whatever the original dtype (bfloat16,
// bool, float8 ...).
//
// Two ways in:
// - refit_pack_bucket / refit_unpack_bucket: one bucket per call, every tensor
//   converted and validated per call (the functional API).
// - RefitCopyPlan: the refit hot path. Built once from every tensor of every
//   bucket (converted and validated once; on CUDA the job descriptors are
//   uploaded once); each run() then takes only the buckets' addresses as
//   ints, so a call costs a few microseconds of host work whatever the number
//   of tensors. The Python module validates the bucket tensors (device, size,
//   dtype, alignment) and keeps every tensor alive for the plan's lifetime;
//   the C++ plan checks that the addresses are usable (non-null, on the right
//   device, not overlapping any tensor).
//
// Build with -DDOCKYARD_WITH_CUDA (and link cc/cuda/refit_packer_cuda) for the
// CUDA path; without it CUDA buckets raise a RuntimeError saying so.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cc/bindings.h"
#include "cc/refit_packer.h"
#ifdef DOCKYARD_WITH_CUDA
#include "cc/cuda/refit_packer_cuda.h"
#endif

namespace nb = nanobind;

namespace dockyard::kernels {
namespace {

// A bucket: 1-D, C-contiguous bytes on any device.
using BucketBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>;
// A tensor of any dtype, shape, strides and device.
using AnyArray = nb::ndarray<>;

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>
PlanBuckets(const std::vector<int64_t>& tensor_nbytes,
            int64_t bucket_size_bytes, int64_t alignment) {
  BucketPlan plan = plan_buckets(tensor_nbytes, bucket_size_bytes, alignment);
  return {std::move(plan.bucket_of), std::move(plan.offset_of),
          std::move(plan.bucket_sizes)};
}

// Tensor `i`'s memory as the core library describes it.
StridedTensor ToStrided(const char* function, const AnyArray& t, size_t i) {
  const nb::dlpack::dtype dt = t.dtype();
  if (dt.lanes != 1 || dt.bits % 8 != 0) {
    throw std::invalid_argument(std::string(function) + ": tensor " +
                                std::to_string(i) +
                                " has a dtype that is not whole bytes");
  }
  StridedTensor s;
  s.data = t.data();
  s.element_size = dt.bits / 8;
  s.shape.resize(t.ndim());
  s.strides.resize(t.ndim());
  for (size_t d = 0; d < t.ndim(); ++d) {
    s.shape[d] = static_cast<int64_t>(t.shape(d));
    s.strides[d] = t.stride(d);
  }
  return s;
}

// The spans of `tensors` at `offsets`, after checking that every tensor is on
// the bucket's device.
std::vector<BucketSpan> ToSpans(const char* function, const BucketBytes& bucket,
                                const std::vector<AnyArray>& tensors,
                                const std::vector<int64_t>& offsets) {
  if (tensors.size() != offsets.size()) {
    throw std::invalid_argument(
        std::string(function) + ": got " + std::to_string(tensors.size()) +
        " tensors but " + std::to_string(offsets.size()) + " offsets");
  }
  std::vector<BucketSpan> spans(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AnyArray& t = tensors[i];
    if (t.device_type() != bucket.device_type() ||
        t.device_id() != bucket.device_id()) {
      throw std::invalid_argument(std::string(function) + ": tensor " +
                                  std::to_string(i) +
                                  " is not on the bucket's device");
    }
    spans[i].tensor = ToStrided(function, t, i);
    spans[i].offset = offsets[i];
  }
  return spans;
}

// The copies of a fixed set of tensors to and from a fixed set of buckets.
class RefitCopyPlan {
 public:
  // cuda_device: -1 = every tensor is CPU memory; else the GPU index that
  // holds every tensor (and, per run, every bucket).
  RefitCopyPlan(const std::vector<AnyArray>& tensors,
                const std::vector<int64_t>& buckets,
                const std::vector<int64_t>& offsets,
                std::vector<int64_t> bucket_sizes, bool unpack, int cuda_device)
      : cuda_device_(cuda_device) {
    constexpr const char* kFn = "RefitCopyPlan";
    if (tensors.size() != buckets.size() || tensors.size() != offsets.size()) {
      throw std::invalid_argument(
          std::string(kFn) + ": got " + std::to_string(tensors.size()) +
          " tensors, " + std::to_string(buckets.size()) +
          " bucket indices and " + std::to_string(offsets.size()) + " offsets");
    }
    const int32_t device_type =
        cuda_device < 0 ? nb::device::cpu::value : nb::device::cuda::value;
    std::vector<PlanSpan> spans(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const AnyArray& t = tensors[i];
      if (t.device_type() != device_type ||
          (cuda_device >= 0 && t.device_id() != cuda_device)) {
        throw std::invalid_argument(std::string(kFn) + ": tensor " +
                                    std::to_string(i) +
                                    " is not on the plan's device");
      }
      spans[i].tensor = ToStrided(kFn, t, i);
      spans[i].bucket = buckets[i];
      spans[i].offset = offsets[i];
    }
    const CopyDirection direction =
        unpack ? CopyDirection::kUnpack : CopyDirection::kPack;
    if (cuda_device < 0) {
      cpu_ = std::make_unique<CopyPlan>(kFn, direction, spans,
                                        std::move(bucket_sizes));
      return;
    }
#ifdef DOCKYARD_WITH_CUDA
    cuda_ = std::make_unique<CudaCopyPlan>(
        kFn, direction, spans, std::move(bucket_sizes), cuda_device);
#else
    throw std::runtime_error(std::string(kFn) +
                             ": _dockyard_kernels was built without CUDA; "
                             "rebuild with --config=cuda");
#endif
  }

  const CopyPlan& host_plan() const {
#ifdef DOCKYARD_WITH_CUDA
    if (cuda_) return cuda_->host_plan();
#endif
    return *cpu_;
  }

  int64_t num_buckets() const { return host_plan().num_buckets(); }
  int cuda_device() const { return cuda_device_; }

  void Run(const std::vector<uintptr_t>& bucket_addresses, int64_t first_bucket,
           int num_threads, uintptr_t stream) const {
    internal::validate_num_threads("RefitCopyPlan.run", num_threads);
    std::vector<void*> buckets(bucket_addresses.size());
    for (size_t k = 0; k < buckets.size(); ++k) {
      buckets[k] = reinterpret_cast<void*>(bucket_addresses[k]);
    }
    nb::gil_scoped_release release;
    if (cpu_) {
      cpu_->run(buckets, first_bucket, num_threads);
      return;
    }
#ifdef DOCKYARD_WITH_CUDA
    cuda_->run(buckets, first_bucket, reinterpret_cast<cudaStream_t>(stream));
#else
    (void)stream;
#endif
  }

 private:
  int cuda_device_;
  std::unique_ptr<CopyPlan> cpu_;
#ifdef DOCKYARD_WITH_CUDA
  std::unique_ptr<CudaCopyPlan> cuda_;
#endif
};

[[noreturn]] void ThrowDevice(const char* function, const BucketBytes& bucket) {
  if (bucket.device_type() == nb::device::cuda::value) {
    throw std::runtime_error(std::string(function) +
                             ": _dockyard_kernels was built without CUDA; "
                             "rebuild with --config=cuda");
  }
  throw std::invalid_argument(std::string(function) +
                              ": unsupported device type " +
                              std::to_string(bucket.device_type()) +
                              " (DLPack code); CPU and CUDA are supported");
}

void PackBucket(const BucketBytes& bucket, const std::vector<AnyArray>& tensors,
                const std::vector<int64_t>& offsets, int num_threads,
                uintptr_t stream) {
  constexpr const char* kFn = "pack_bucket";
  const std::vector<BucketSpan> spans = ToSpans(kFn, bucket, tensors, offsets);
  const auto nbytes = static_cast<int64_t>(bucket.shape(0));
  if (bucket.device_type() == nb::device::cpu::value) {
    // The arrays stay referenced by the caller's frame while other Python
    // threads run.
    nb::gil_scoped_release release;
    pack_bucket(spans, bucket.data(), nbytes, num_threads);
    return;
  }
#ifdef DOCKYARD_WITH_CUDA
  if (bucket.device_type() == nb::device::cuda::value) {
    internal::validate_num_threads(kFn, num_threads);  // Unused on CUDA.
    nb::gil_scoped_release release;
    pack_bucket_cuda(spans, bucket.data(), nbytes,
                     reinterpret_cast<cudaStream_t>(stream));
    return;
  }
#endif
  (void)stream;
  ThrowDevice(kFn, bucket);
}

void UnpackBucket(const BucketBytes& bucket,
                  const std::vector<AnyArray>& tensors,
                  const std::vector<int64_t>& offsets, int num_threads,
                  uintptr_t stream) {
  constexpr const char* kFn = "unpack_bucket";
  const std::vector<BucketSpan> spans = ToSpans(kFn, bucket, tensors, offsets);
  const auto nbytes = static_cast<int64_t>(bucket.shape(0));
  if (bucket.device_type() == nb::device::cpu::value) {
    nb::gil_scoped_release release;
    unpack_bucket(bucket.data(), nbytes, spans, num_threads);
    return;
  }
#ifdef DOCKYARD_WITH_CUDA
  if (bucket.device_type() == nb::device::cuda::value) {
    internal::validate_num_threads(kFn, num_threads);
    nb::gil_scoped_release release;
    unpack_bucket_cuda(bucket.data(), nbytes, spans,
                       reinterpret_cast<cudaStream_t>(stream));
    return;
  }
#endif
  (void)stream;
  ThrowDevice(kFn, bucket);
}

}  // namespace

void bind_refit_packer(nb::module_& m) {
  m.def("refit_plan_buckets", &PlanBuckets, nb::arg("tensor_nbytes"),
        nb::arg("bucket_size_bytes"), nb::arg("alignment"),
        "Places tensors of the given byte sizes, in order, into buckets of at "
        "most bucket_size_bytes (a tensor larger than that gets its own). "
        "Returns (bucket_of, offset_of, bucket_sizes). Raises ValueError for "
        "a bad alignment or bucket size, or a negative size.");
  m.def("refit_pack_bucket", &PackBucket, nb::arg("bucket").noconvert(),
        nb::arg("tensors"), nb::arg("offsets"), nb::arg("num_threads") = 0,
        nb::arg("stream") = 0,
        "Copies each tensor's row-major bytes into bucket (1-D uint8, "
        "C-contiguous, same device) at its offset and zeroes the other bytes. "
        "Tensors may have any strides. num_threads: CPU workers, 0 = "
        "automatic. stream: a cudaStream_t as int for CUDA buckets (0 = "
        "default stream); CUDA copies are asynchronous on it. Raises "
        "ValueError for bad spans (overlap, bad sizes) and IndexError for a "
        "span past the bucket's end, before writing anything.");
  nb::class_<RefitCopyPlan>(
      m, "RefitCopyPlan",
      "The copies between a fixed set of tensors and a fixed set of buckets, "
      "validated once (on CUDA: job descriptors uploaded once), for repeated "
      "run() calls that take only the buckets' addresses. The caller keeps "
      "every tensor alive and unchanged (same memory, shape and strides) for "
      "the plan's lifetime; dockyard_rl.kernels.refit_packer.PackPlan / "
      "UnpackPlan do that.")
      .def(nb::init<const std::vector<AnyArray>&, const std::vector<int64_t>&,
                    const std::vector<int64_t>&, std::vector<int64_t>, bool,
                    int>(),
           nb::arg("tensors"), nb::arg("buckets"), nb::arg("offsets"),
           nb::arg("bucket_sizes"), nb::arg("unpack"),
           nb::arg("cuda_device") = -1,
           "tensors[i] (any strides; same-size integer views) lies at "
           "offsets[i] of bucket buckets[i]; bucket b has bucket_sizes[b] "
           "bytes. unpack: copy buckets -> tensors (else tensors -> buckets, "
           "padding zeroed). cuda_device: -1 = CPU tensors, else the GPU "
           "holding them. Raises ValueError / IndexError as "
           "refit_pack_bucket, before anything is kept.")
      .def("run", &RefitCopyPlan::Run, nb::arg("buckets"),
           nb::arg("first_bucket") = 0, nb::arg("num_threads") = 0,
           nb::arg("stream") = 0,
           "Copies buckets [first_bucket, first_bucket + len(buckets)); "
           "buckets[i] is the address (int) of bucket first_bucket + i, with "
           "at least its size in bytes, 16-byte aligned, on the plan's device. "
           "num_threads: CPU workers, 0 = automatic. stream: a cudaStream_t as "
           "int (0 = default stream); CUDA copies are one kernel launch per 32 "
           "buckets, asynchronous on it. Raises ValueError for a bad range, a "
           "null bucket, a bucket on another device or overlapping a tensor, "
           "before copying.")
      .def_prop_ro("num_buckets", &RefitCopyPlan::num_buckets)
      .def_prop_ro("cuda_device", &RefitCopyPlan::cuda_device);
  m.def("refit_unpack_bucket", &UnpackBucket, nb::arg("bucket").noconvert(),
        nb::arg("tensors"), nb::arg("offsets"), nb::arg("num_threads") = 0,
        nb::arg("stream") = 0,
        "Copies bytes of bucket at each offset into each tensor (any strides, "
        "but no element may share an address with another). Same arguments "
        "and errors as refit_pack_bucket.");
}

}  // namespace dockyard::kernels
